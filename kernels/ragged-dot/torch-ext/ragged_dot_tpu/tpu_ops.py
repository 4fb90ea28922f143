"""The TPU ops: the Pallas kernels behind ``torch.tpu.pallas.jax_op``.

Imported only by ``ops.register_tpu_ops()``: it needs torch_tpu and jax.
Non-tensor arguments become static JAX arguments, so each (layout, offset,
dtype, tiling) combination compiles once and is cached by torch_tpu.
"""

from typing import Optional

import jax
import jax.numpy as jnp
import torch

from . import pallas_gmm, tiling as tiling_lib
from ._ops import op_name
from .jax_bridge import jax_dtype, tiling_arg


def current_generation() -> str:
    """Tiling table key of the TPU this process runs on."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return tiling_lib.DEFAULT_GENERATION
    kind = device.device_kind if device.platform == "tpu" else None
    return tiling_lib.generation_from_device_kind(kind)


def make_ops():
    jax_op = torch.tpu.pallas.jax_op

    @jax_op(op_name("ragged_dot_tpu"))
    def ragged_dot_tpu(
        lhs: jax.Array,
        rhs: jax.Array,
        group_sizes: jax.Array,
        rhs_layout: str,
        group_offset: int,
        out_dtype: torch.dtype,
        tm: int,
        tk: int,
        tn: int,
    ) -> jax.Array:
        return pallas_gmm.gmm(
            lhs, rhs, group_sizes.astype(jnp.int32), rhs_layout=rhs_layout,
            group_offset=group_offset, out_dtype=jax_dtype(out_dtype),
            tiling=tiling_arg(tm, tk, tn), generation=current_generation(),
        )

    @jax_op(op_name("ragged_dot_weight_grad_tpu"))
    def ragged_dot_weight_grad_tpu(
        lhs: jax.Array,
        dout: jax.Array,
        group_sizes: jax.Array,
        num_local_groups: int,
        rhs_layout: str,
        group_offset: int,
        out_dtype: torch.dtype,
        tm: int,
        tk: int,
        tn: int,
    ) -> jax.Array:
        return pallas_gmm.tgmm(
            lhs, dout, group_sizes.astype(jnp.int32), num_local_groups=num_local_groups,
            rhs_layout=rhs_layout, group_offset=group_offset,
            out_dtype=jax_dtype(out_dtype), tiling=tiling_arg(tm, tk, tn),
            generation=current_generation(),
        )

    return ragged_dot_tpu, ragged_dot_weight_grad_tpu


def make_experts_op():
    """The whole experts forward (inference) as one TPU op."""
    from . import experts_jax

    @torch.tpu.pallas.jax_op(op_name("experts_forward_tpu"))
    def experts_forward_tpu(
        hidden_states: jax.Array,
        top_k_index: jax.Array,
        top_k_weights: jax.Array,
        up_weight: jax.Array,
        down_weight: jax.Array,
        up_bias: Optional[jax.Array],
        down_bias: Optional[jax.Array],
        gate: str,
        alpha: float,
        limit: float,
        rhs_layout: str,
    ) -> jax.Array:
        return experts_jax.experts_forward(
            hidden_states, top_k_index, top_k_weights, up_weight, down_weight, up_bias, down_bias,
            gate=gate, alpha=alpha, limit=limit, rhs_layout=rhs_layout,
            generation=current_generation(),
        )

    return experts_forward_tpu
