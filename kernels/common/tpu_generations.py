"""Facts about TPU generations that kernels size their tiles by.

Measured on this project's CPU host with an AOT VMEM probe through libtpu
(jax 0.10.2's ``pltpu`` TPU-info tables agree):

=========  =============  ====================  =========  ============
chip       VMEM per core  default scoped limit  MXU width  TensorCores
=========  =============  ====================  =========  ============
v4         16 MiB         16 MiB                128        2 (megacore)
v5e        128 MiB        16 MiB                128        1
v5p        64 MiB         16 MiB                128        2 (megacore)
v6e        128 MiB        32 MiB                256        1
tpu7x      64 MiB         (not probed)          256        1 (a chip is two devices)
=========  =============  ====================  =========  ============

TensorCores per device are the documented chip facts (v4 and v5p pair two
cores as one "megacore" device; v5e and v6e have one). TPU7x (v7x: libtpu's
topology ``tpu7x:1x1x1``, device kind "TPU7x") shows each of a chip's two
TensorCores as its own device, 64 MiB of VMEM each (jax's TPU-info table; a
kernel asking for 100 MiB fails to compile there, 64 MiB compiles); the
scoped default was not probed because every kernel here sets its own limit.
Without an entry a v7x chip would get v6e's facts, whose 96 MiB large limit
does not fit its VMEM.

A kernel whose working set passes the default scoped limit must pass its
own ``vmem_limit_bytes``. The rule here: every kernel asks for
``vmem_limit = min(32 MiB, VMEM)`` and keeps its double-buffered tiles within
``vmem_budget = 3/4`` of that, leaving a quarter for Mosaic's own scratch.
A kernel that keeps a whole weight block resident (the fused experts kernel,
and the grouped matmuls' whole-K tiles on v5e, v6e and tpu7x: ``gmm/tiling.py``)
may ask for ``large_vmem_limit``: 3/4 of VMEM, at most 96 MiB (v5e and v6e:
96 MiB, v5p 48, v4 stays at 16), with ``large_vmem_budget`` its 3/4.

Pure Python: ``current_generation()`` imports jax only when called.
"""

from __future__ import annotations

import dataclasses

MIB = 1 << 20
KERNEL_VMEM_LIMIT = 32 * MIB
LARGE_KERNEL_VMEM_LIMIT = 96 * MIB


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
    name: str
    vmem_bytes: int  # physical VMEM per TensorCore
    default_scoped_vmem: int  # Mosaic's limit when a kernel sets none
    mxu: int  # systolic array width (lanes of an MXU operand tile)
    tensorcores: int = 1  # TensorCores behind one device: "parallel" grid axes are split over them (megacore)

    @property
    def vmem_limit(self) -> int:
        """Scoped VMEM limit every kernel passes to Mosaic."""
        return min(KERNEL_VMEM_LIMIT, self.vmem_bytes)

    @property
    def vmem_budget(self) -> int:
        """Bytes a kernel's double-buffered tiles may use."""
        return self.vmem_limit * 3 // 4

    @property
    def large_vmem_limit(self) -> int:
        """Scoped VMEM limit of a kernel that keeps whole weight blocks resident."""
        return max(self.vmem_limit, min(LARGE_KERNEL_VMEM_LIMIT, self.vmem_bytes * 3 // 4))

    @property
    def large_vmem_budget(self) -> int:
        return self.large_vmem_limit * 3 // 4


GENERATIONS = {
    g.name: g
    for g in (
        TpuGeneration("v4", 16 * MIB, 16 * MIB, 128, tensorcores=2),
        TpuGeneration("v5e", 128 * MIB, 16 * MIB, 128),
        TpuGeneration("v5p", 64 * MIB, 16 * MIB, 128, tensorcores=2),
        TpuGeneration("v6e", 128 * MIB, 32 * MIB, 256),
        TpuGeneration("tpu7x", 64 * MIB, 32 * MIB, 256),
    )
}
# Used when no TPU is attached (CPU interpret mode, tests) and no generation is named.
DEFAULT_GENERATION = "v6e"
# A TPU whose device kind is not known here (a newer chip): the facts of the
# 256-wide-MXU chip with the least VMEM, whose limits fit any such chip with
# at least 64 MiB per core (TPU8i: 192 MiB), rather than v6e's 96 MiB limit.
UNKNOWN_TPU_GENERATION = "tpu7x"


def get_generation(name: str | None) -> TpuGeneration:
    """The facts of generation ``name`` (``None``: the default)."""
    name = name or DEFAULT_GENERATION
    if name not in GENERATIONS:
        raise ValueError(f"generation: expected one of {sorted(GENERATIONS)} or None, got {name!r}")
    return GENERATIONS[name]


def generation_from_device_kind(kind: str | None) -> str:
    """Key of a jax ``device_kind`` string ("TPU v5 lite", "TPU v6e", ...): no
    kind (no TPU) gives the default; a kind not known here the conservative
    ``UNKNOWN_TPU_GENERATION`` (v2 / v3, 16 MiB chips with 128-wide MXUs: v4)."""
    if not kind:
        return DEFAULT_GENERATION
    k = kind.lower().replace(" ", "")
    if k.startswith("tpu7") or "v7" in k:  # "TPU7x" (jax), "TPU v7" (other spellings)
        return "tpu7x"
    if "v6" in k:
        return "v6e"
    if "v5lite" in k or "v5e" in k:
        return "v5e"
    if "v5" in k:
        return "v5p"
    if "v4" in k or "v3" in k or "v2" in k:
        return "v4"
    return UNKNOWN_TPU_GENERATION


def current_generation() -> str:
    """Generation of the TPU this process runs on (the default without one)."""
    import jax

    try:
        device = jax.devices()[0]
    except RuntimeError:
        return DEFAULT_GENERATION
    return generation_from_device_kind(device.device_kind if device.platform == "tpu" else None)
