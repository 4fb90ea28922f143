"""The experts layer as one SPMD program over a mesh axis: expert parallelism.

The experts (and their biases) are split along the expert dimension over the
mesh axis ``axis``, ``W`` ways: rank ``r`` holds experts ``[r * E / W, (r + 1) *
E / W)``. Per rank, the ordinary layer program (``program.experts_forward``)
runs on the local experts, with every pick of a remote expert turned into the
sentinel id (``num_local``): the grouped matmuls skip those rows and never
fetch a weight for them (the idle-visit rule of ``gmm``), and their routing
weight counts zero. The partial sums are combined in f32 over the axis:

* ``tokens="replicated"`` (decode, small batches): every rank sees every token,
  the result is ``psum`` over the axis, replicated;
* ``tokens="sharded"``: tokens arrive split over the axis (``T`` a multiple of
  ``W``), are gathered (``all_gather``), and the result is reduce-scattered
  back (``psum_scatter``): each rank ends with the full sum for its own tokens,
  and the collectives move ``(W - 1) / W`` of the activations each way.

Bytes per rank (``collective_bytes``): the reduce moves ``2 (W - 1) / W`` times
the ``[T, H]`` f32 partials (ring all-reduce) for replicated tokens; for sharded
ones ``(W - 1) / W`` of the gathered activations and routing, and as much of
the partials (reduce-scatter). Weights never move. An all-to-all dispatch (sending each token only to
the ranks of its experts, ``jax.lax.ragged_all_to_all``) would move ``K / W``
of the activations instead of all of them; it is not built.

From torch: ``torch.tpu.pallas.jax_op(fn, mesh=..., input_partition_specs=...,
output_partition_specs=...)`` with ``partition_specs`` below.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from . import program

TOKEN_MODES = ("replicated", "sharded")


def local_expert_ids(top_k_index, rank, num_local: int):
    """Global expert ids -> ids of this rank's experts, ``num_local`` (the
    sentinel) for experts of other ranks and for ids that were remote already."""
    local = top_k_index.astype(jnp.int32) - rank * num_local
    return jnp.where((local >= 0) & (local < num_local), local, num_local)


def partition_specs(axis: str, tokens: str, with_biases: bool):
    """``(in_specs, out_spec)`` of ``expert_parallel_forward``'s arguments
    ``(hidden_states, top_k_index, top_k_weights, up_weight, down_weight[,
    up_bias, down_bias])`` and of its output."""
    if tokens not in TOKEN_MODES:
        raise ValueError(f"expert_parallel_forward: tokens must be one of {TOKEN_MODES}, got {tokens!r}")
    rows = P(axis) if tokens == "sharded" else P()
    experts = P(axis)
    return (rows, rows, rows, experts, experts) + ((experts, experts) if with_biases else ()), rows


def collective_bytes(num_tokens: int, hidden: int, top_k: int, world: int, tokens: str,
                     act_itemsize: int = 2) -> int:
    """Bytes one rank sends over the interconnect per layer (see the module
    docstring): f32 partial sums, and for sharded tokens the gathered
    activations, expert ids (int32) and routing weights (``act_itemsize``)."""
    share = (world - 1) / world
    partials = num_tokens * hidden * 4
    if tokens == "replicated":
        return int(2 * share * partials)
    gathered = num_tokens * (hidden * act_itemsize + top_k * (4 + act_itemsize))
    return int(share * (gathered + partials))


def expert_parallel_forward(hidden_states, top_k_index, top_k_weights, up_weight, down_weight, up_bias=None,
                            down_bias=None, *, mesh, axis: str, tokens: str = "replicated", check_vma: bool = True,
                            **program_kwargs):
    """``[T, H]`` experts output over ``mesh``'s ``axis`` (see the module docstring).

    Global shapes as for ``program.experts_forward``; ``up_weight.shape[0]``
    (all experts) must divide by the axis size. ``program_kwargs``: the
    program's gate / layout / generation / interpret keywords."""
    world = mesh.shape[axis]
    num_experts = up_weight.shape[0]
    if num_experts % world:
        raise ValueError(f"expert_parallel_forward: {num_experts} experts do not split over {world} ranks of "
                         f"mesh axis {axis!r}")
    if tokens == "sharded" and hidden_states.shape[0] % world:
        raise ValueError(f"expert_parallel_forward: tokens='sharded' needs a token count that divides by {world}, "
                         f"got {hidden_states.shape[0]}")
    biases = (up_bias, down_bias)
    with_biases = up_bias is not None or down_bias is not None
    if with_biases and (up_bias is None or down_bias is None):
        raise ValueError("expert_parallel_forward: pass both biases or neither")
    in_specs, out_spec = partition_specs(axis, tokens, with_biases)
    body = functools.partial(_rank_forward, axis=axis, num_local=num_experts // world, tokens=tokens,
                             program_kwargs=program_kwargs)
    args = (hidden_states, top_k_index, top_k_weights, up_weight, down_weight) + (biases if with_biases else ())
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=check_vma)(*args)


def _rank_forward(x, top_k_index, top_k_weights, up_weight, down_weight, *biases, axis, num_local, tokens,
                  program_kwargs):
    if tokens == "sharded":
        x, top_k_index, top_k_weights = (lax.all_gather(a, axis, tiled=True) for a in (x, top_k_index, top_k_weights))
    ids = local_expert_ids(top_k_index, lax.axis_index(axis), num_local)
    # group_align=1: the program's rule takes every pick for a local one (here about 1 / W of them
    # are, so it would align groups a W-th of the size it assumes; not estimated on a slice).
    partial = program.experts_forward(x, ids, top_k_weights, up_weight, down_weight, *(biases or (None, None)),
                                      out_dtype=jnp.float32, group_align=1, **program_kwargs)
    if tokens == "sharded":
        total = lax.psum_scatter(partial, axis, scatter_dimension=0, tiled=True)
    else:
        total = lax.psum(partial, axis)
    return total.astype(x.dtype)
