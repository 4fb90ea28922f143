"""Ahead-of-time compilation for a TPU generation, on any host with libtpu.

Development only (tests and benchmarks; the Hub builds leave it out):
``compile_for("v6e", fn, (shape, dtype), ...)`` runs the real Mosaic compiler
for that chip without one attached, so tiling, layout, VMEM and lowering
errors surface here instead of on the first TPU run.
"""

from __future__ import annotations

import dataclasses

import jax

from . import tpu_generations

# Topology names libtpu 0.0.52 accepts for one chip of each generation.
TOPOLOGIES = {"v4": "v4:1x1x1", "v5e": "v5e:1x1", "v5p": "v5p:1x1x1", "v6e": "v6e:1x1", "tpu7x": "tpu7x:1x1x1"}
assert set(TOPOLOGIES) == set(tpu_generations.GENERATIONS)


@dataclasses.dataclass(frozen=True)
class CompileReport:
    generation: str
    hbm_temp_bytes: int
    flops: float | None
    compiled: object  # jax.stages.Compiled


def tpu_device(generation: str):
    from jax.experimental import topologies

    if generation not in TOPOLOGIES:
        raise ValueError(f"generation: expected one of {sorted(TOPOLOGIES)}, got {generation!r}")
    return topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[generation]).devices[0]


def abstract_input(generation: str):
    """``spec(shape, dtype)``: an abstract array placed on one chip of ``generation``."""
    sharding = jax.sharding.SingleDeviceSharding(tpu_device(generation))
    return lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def compile_for(generation: str, fn, *inputs) -> CompileReport:
    """Compile ``fn`` for ``generation``; ``inputs`` are ``(shape, dtype)`` pairs."""
    spec = abstract_input(generation)
    compiled = jax.jit(fn).lower(*(spec(shape, dtype) for shape, dtype in inputs)).compile()
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return CompileReport(generation, int(getattr(memory, "temp_size_in_bytes", 0) or 0),
                         (cost or {}).get("flops"), compiled)
