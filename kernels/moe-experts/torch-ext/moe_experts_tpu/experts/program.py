"""The whole MoE experts forward as one JAX program (the TPU inference path).

routing (sort by expert, rows per expert by counting) -> grouped matmul
(gate_up or up) -> gate / activation -> grouped matmul (down) -> routing
weights -> combine. Every shape is static: one compiled program per
(tokens, top_k, weights) shape, no host sync, decode steps never recompile.

Two ways through the matmuls, chosen by ``fused_kernel_row_tile``: the
fused Pallas kernel (``pallas_fused_experts``: gate_up -> gate -> down per
row tile, the intermediate never written to HBM, each active expert read
once) when the gate is a GLU on concatenated "nk" weights without biases
and a whole expert fits the generation's VMEM budget with some row tile
(Qwen3-30B-A3B, Mixtral-size experts of a few MB); otherwise two grouped
matmuls with the gate between them (gpt-oss: interleaved, biased, 33 MB
experts). There the first grouped matmul applies the gate (and the up bias)
at its store (``gmm(glu=)``: every gate of ``gates.py`` but the ungated
activations and exact GELU, on concatenated "nk" halves or gpt-oss's
interleaved ones) and writes the activation in the weights' dtype: its f32
``[rows, 2I]`` output and an XLA pass over it are not written and read back
(gpt-oss's interleaved gate in XLA reads its halves with strided lane slices,
at about four times the pass's HBM time). Estimated (TPU estimator, v6e,
``bench_tpu_estimates`` layer): Mixtral-8x7B 4096 tokens 6197 -> 5282 us, 512
tokens 2072 -> 1952. Where both apply the fused kernel never moves more bytes and does
the same MXU work, so it is always the one taken (the roofline model in
bench/bench_experts.py: equal at decode, 1.1x at 1024 tokens, 1.4x at 4096).

Quantized weights (``weight_format`` "int8" | "fp8" | "mxfp4", values in
``up_weight`` / ``down_weight`` stored "nk", scales in ``up_scales`` /
``down_scales``: ``common.quant_formats``) always take the two grouped
matmuls (int8 in ``pallas_gmm``'s kernel as it is, fp8 / mxfp4 decoded in
VMEM by ``pallas_qgmm``), the gate at the up projection's store where
``gated_store_applies`` (int8 always; fp8 / mxfp4 where both halves of a
column tile are in one step: gpt-oss, Qwen3-30B-A3B, not Mixtral-8x7B); the
fused kernel reads bf16 / f32 weights only. Activations stay in the
hidden states' dtype (bf16, or f32 for f32 hidden states).

The gate is named, not traced from the module, because a JAX program cannot
call the module's torch code: ``module_layout.gate_of_module`` maps the module
to a name of ``gates.py`` or raises NotImplementedError, so nothing silently
differs.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..gmm import pallas_gmm, pallas_qgmm
from . import pallas_fused_experts
from .gates import apply_gate, gate_halves, kernel_gate

def experts_forward(
    hidden_states,  # [T, H]
    top_k_index,  # [T, K], ids >= E mark remote experts
    top_k_weights,  # [T, K]
    up_weight,  # [E, N1, H] ("nk") or [E, H, N1] ("kn")
    down_weight,  # [E, H, I] ("nk") or [E, I, H] ("kn")
    up_bias=None,  # [E, N1]
    down_bias=None,  # [E, H]
    *,
    up_scales=None,
    down_scales=None,
    weight_format: str | None = None,
    gate: str = "glu_silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    rhs_layout: str = "nk",
    fused: bool | None = None,
    generation: str | None = None,
    out_dtype=None,
    interpret=False,
):
    """``[T, H]`` in ``out_dtype`` (default: hidden_states' dtype; expert
    parallelism asks for f32 partial sums)."""
    num_tokens, hidden = hidden_states.shape
    out_dtype = hidden_states.dtype if out_dtype is None else out_dtype
    top_k = top_k_index.shape[1]
    num_experts = up_weight.shape[0]
    ids = top_k_index.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(ids, stable=True)
    sorted_ids = ids[order]
    group_sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[jnp.clip(ids, 0, num_experts)].add(1)
    group_sizes = group_sizes[:num_experts]
    remote = (sorted_ids >= num_experts)[:, None]
    safe_ids = jnp.minimum(sorted_ids, num_experts - 1)

    if weight_format is not None:
        return _quantized_experts(hidden_states, order, sorted_ids, group_sizes, top_k_weights, top_k,
                                  up_weight, down_weight, up_bias, down_bias, up_scales, down_scales,
                                  weight_format=weight_format, gate=gate, alpha=alpha, limit=limit,
                                  rhs_layout=rhs_layout, fused=fused, generation=generation,
                                  out_dtype=out_dtype, interpret=interpret)
    if up_scales is not None or down_scales is not None:
        raise ValueError("up_scales / down_scales given without weight_format ('int8', 'fp8' or 'mxfp4')")
    x = hidden_states[order // top_k].astype(up_weight.dtype)
    fused_tm = fused_kernel_row_tile(x.shape[0], up_weight, down_weight, up_bias, down_bias,
                                     gate, rhs_layout, generation)
    if fused is None:
        fused = fused_tm is not None
    if fused:
        out = pallas_fused_experts.fused_glu_experts(
            x, up_weight, down_weight, group_sizes, gate=gate, out_dtype=jnp.float32,
            tm=fused_tm, generation=generation, interpret=interpret)
        return _combine(out, order, remote, top_k_weights, num_tokens, top_k, hidden, out_dtype)
    out = two_matmuls(x, up_weight, down_weight, group_sizes, up_bias=up_bias, down_bias=down_bias,
                      safe_ids=safe_ids, gate=gate, alpha=alpha, limit=limit, rhs_layout=rhs_layout,
                      generation=generation, interpret=interpret)
    return _combine(out, order, remote, top_k_weights, num_tokens, top_k, hidden, out_dtype)


def two_matmuls(x, up_weight, down_weight, group_sizes, *, up_bias=None, down_bias=None, safe_ids=None,
                gate: str, alpha: float, limit: float, rhs_layout: str, generation=None, interpret=False,
                up_scales=None, down_scales=None, weight_format: str | None = None):
    """The unfused way through the matmuls, on rows sorted by expert: ``[M,
    H]`` f32. Biases are gathered per row by ``safe_ids`` (the rows' experts).
    Both matmuls get the chip's tiles and VMEM limit (without generation=, a
    v4 would be given v6e's and overflow its 16 MiB). Quantized weights
    (``weight_format``) come with their scales; the activations then stay in
    ``x``'s dtype."""
    glu, halves = kernel_gate(gate, alpha, limit), gate_halves(gate)
    act_dtype = down_weight.dtype if weight_format is None else x.dtype

    def matmul(lhs, weights, scales, **kw):
        return pallas_gmm.gmm(lhs, weights, group_sizes, rhs_layout=rhs_layout, generation=generation,
                              interpret=interpret, rhs_scales=scales, weight_format=weight_format, **kw)

    if glu is not None and gated_store_applies(x, up_weight, halves, rhs_layout, weight_format, generation):
        # The gate (and the up bias) at the up projection's store: its f32
        # [rows, 2I] output and the gate's pass over it never reach HBM.
        act = matmul(x, up_weight, up_scales, out_dtype=act_dtype, glu=glu, glu_halves=halves, glu_bias=up_bias)
    else:
        h = matmul(x, up_weight, up_scales, out_dtype=jnp.float32)
        if up_bias is not None:
            h = h + up_bias[safe_ids].astype(jnp.float32)
        act = apply_gate(h, gate, alpha, limit).astype(act_dtype)
    out = matmul(act, down_weight, down_scales, out_dtype=jnp.float32)
    if down_bias is not None:
        out = out + down_bias[safe_ids].astype(jnp.float32)
    return out


def gated_store_applies(x, up_weight, halves, rhs_layout, weight_format, generation) -> bool:
    """Whether the up projection can apply the gate at its store (``gmm(glu=)``):
    halves it can split, and for quantized weights a values tile holding both
    halves of its columns (``pallas_qgmm.gated_store_tiling``; Mixtral-8x7B's
    concatenated 2 x 14336 columns do not fit one)."""
    if not pallas_gmm.glu_supported(up_weight.shape, rhs_layout, halves):
        return False
    return weight_format in (None, *pallas_gmm.DIRECT_FORMATS) or pallas_qgmm.gated_store_tiling(
        weight_format, halves, x.shape[0], x.shape[1], up_weight.shape[1], up_weight.shape[0],
        lhs_itemsize=x.dtype.itemsize, out_itemsize=x.dtype.itemsize, generation=generation) is not None


def _quantized_experts(hidden_states, order, sorted_ids, group_sizes, top_k_weights, top_k, up_weight,
                       down_weight, up_bias, down_bias, up_scales, down_scales, *, weight_format, gate, alpha,
                       limit, rhs_layout, fused, generation, out_dtype, interpret):
    """The two grouped matmuls on quantized weights (see the module docstring)."""
    if fused:
        raise ValueError(f"fused=True: the fused experts kernel does not read quantized weights "
                         f"(weight_format={weight_format!r}); leave fused=None")
    if rhs_layout != "nk":
        raise ValueError(f"quantized weights (weight_format={weight_format!r}) are stored \"nk\"; "
                         f"rhs_layout={rhs_layout!r} is not supported")
    num_tokens, hidden = hidden_states.shape
    num_experts = up_weight.shape[0]
    remote = (sorted_ids >= num_experts)[:, None]
    safe_ids = jnp.minimum(sorted_ids, num_experts - 1)
    act_dtype = jnp.float32 if hidden_states.dtype == jnp.float32 else jnp.bfloat16
    x = hidden_states[order // top_k].astype(act_dtype)
    out = two_matmuls(x, up_weight, down_weight, group_sizes, up_bias=up_bias, down_bias=down_bias,
                      safe_ids=safe_ids, gate=gate, alpha=alpha, limit=limit, rhs_layout=rhs_layout,
                      generation=generation, interpret=interpret, up_scales=up_scales, down_scales=down_scales,
                      weight_format=weight_format)
    return _combine(out, order, remote, top_k_weights, num_tokens, top_k, hidden, out_dtype)


def fused_kernel_row_tile(m, up_weight, down_weight, up_bias, down_bias, gate, rhs_layout, generation):
    """The documented rule of the module docstring: the fused kernel's row
    tile, or None when the two grouped matmuls must be used."""
    if up_bias is not None or down_bias is not None or up_weight.dtype != down_weight.dtype:
        return None
    num_experts, two_inter, hidden = up_weight.shape
    return pallas_fused_experts.fused_row_tile(gate, rhs_layout, m, hidden, two_inter // 2, num_experts,
                                               up_weight.dtype.itemsize, generation)


def _combine(out, order, remote, top_k_weights, num_tokens, top_k, hidden, dtype):
    """Routing weights, sentinel rows to zero, un-sort, sum over top_k."""
    weights = top_k_weights.reshape(-1)[order].astype(jnp.float32)[:, None]
    out = jnp.where(remote, 0.0, out.astype(jnp.float32) * weights)
    combined = jnp.zeros((num_tokens * top_k, hidden), jnp.float32).at[order].set(out)
    return combined.reshape(num_tokens, top_k, hidden).sum(axis=1).astype(dtype)
