"""Ahead-of-time compilation for a TPU generation, on any host with libtpu.

``compile_gmm("v6e", m, k, n, g)`` runs the real Mosaic compiler for that
chip without one attached: tiling, layout, VMEM and lowering errors surface
here instead of on the first TPU run.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import pallas_gmm, tiling as tiling_lib

TOPOLOGIES = {"v4": "v4:1x1x1", "v5e": "v5e:1x1", "v5p": "v5p:1x1x1", "v6e": "v6e:1x1"}


@dataclasses.dataclass(frozen=True)
class CompileReport:
    generation: str
    kernel: str
    shape: tuple
    tiling: tiling_lib.Tiling
    vmem_working_set: int  # bytes of double-buffered tiles + accumulator
    hbm_temp_bytes: int
    flops: float | None


def _spec(device):
    sharding = jax.sharding.SingleDeviceSharding(device)
    return lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def tpu_device(generation: str):
    from jax.experimental import topologies

    if generation not in TOPOLOGIES:
        raise ValueError(f"generation: expected one of {sorted(TOPOLOGIES)}, got {generation!r}")
    return topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[generation]).devices[0]


def _report(compiled, generation, kernel, shape, t, itemsize):
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return CompileReport(
        generation, kernel, shape, t,
        tiling_lib.working_set_bytes(t, itemsize, itemsize, itemsize),
        int(getattr(memory, "temp_size_in_bytes", 0) or 0),
        (cost or {}).get("flops"),
    )


def _rule_tiling(generation, m, k, n, num_groups, dtype):
    size = dtype.itemsize
    return tiling_lib.choose_tiling(m, k, n, num_groups, lhs_itemsize=size, rhs_itemsize=size,
                                    out_itemsize=size, generation=generation)


def compile_gmm(generation, m, k, n, num_groups, *, rhs_layout="nk", dtype=jnp.bfloat16,
                tiling=None) -> CompileReport:
    spec = _spec(tpu_device(generation))
    dtype = jnp.dtype(dtype)
    t = tiling or _rule_tiling(generation, m, k, n, num_groups, dtype)
    rhs_shape = (num_groups, n, k) if rhs_layout == "nk" else (num_groups, k, n)
    fn = jax.jit(lambda x, w, s: pallas_gmm.gmm(
        x, w, s, rhs_layout=rhs_layout, tiling=t, generation=generation))
    compiled = fn.lower(spec((m, k), dtype), spec(rhs_shape, dtype),
                        spec((num_groups,), jnp.int32)).compile()
    return _report(compiled, generation, f"gmm_{rhs_layout}", (m, k, n, num_groups), t, dtype.itemsize)


def compile_tgmm(generation, m, k, n, num_groups, *, rhs_layout="nk", dtype=jnp.bfloat16,
                 tiling=None) -> CompileReport:
    spec = _spec(tpu_device(generation))
    dtype = jnp.dtype(dtype)
    t = tiling or _rule_tiling(generation, m, k, n, num_groups, dtype)
    fn = jax.jit(lambda x, dy, s: pallas_gmm.tgmm(
        x, dy, s, num_local_groups=num_groups, rhs_layout=rhs_layout, tiling=t,
        generation=generation))
    compiled = fn.lower(spec((m, k), dtype), spec((m, n), dtype),
                        spec((num_groups,), jnp.int32)).compile()
    return _report(compiled, generation, f"tgmm_{rhs_layout}", (m, k, n, num_groups), t, dtype.itemsize)
