"""Tile sizes for the grouped matmul kernels, chosen per TPU generation.

The rule (documented here once, used by both forward and backward kernels):

* ``tm`` (rows per tile) follows the average group size, not a fixed 512:
  ``tm = next_pow2(ceil(M / G))`` clamped to ``[sublane, tm_max]``. At decode
  (64 tokens x top-8 over 128 experts, M=512) a group holds ~4 rows, so a
  512-row tile would spend >99% of its MXU work on masked rows; the smallest
  legal tile (8 rows for 32-bit, 16 for 16-bit operands, the sublane packing)
  keeps the wasted work to one tile per group boundary. In prefill the groups
  are large and tm grows to amortise the per-step overhead.
* ``tk`` covers the whole contraction dim when it fits (``K <= tk_max``): the
  kernel then streams each expert's weights exactly once per output column
  tile, consecutive tiles of one group reuse the weight block already in VMEM,
  and no tail masking along K is needed.
* ``tn`` covers the whole output dim up to ``tn_max`` (a multiple of the MXU
  width of the generation).
* If the double-buffered working set exceeds the generation's VMEM budget,
  halve the larger of tk / tn (staying lane-aligned) until it fits.

Callers can override any of the three sizes.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Generation:
    name: str
    mxu: int  # systolic array width
    tm_max: int
    tn_max: int
    tk_max: int
    vmem_budget: int  # bytes the kernel's double-buffered tiles may use
    vmem_limit: int  # scoped VMEM limit passed to Mosaic


_MIB = 1 << 20

GENERATIONS = {
    # v4 / v5p / v5e: 128x128 MXUs. v4 has 32 MiB of VMEM per core, v5e and
    # v6e 128 MiB, v5p 95 MiB; the budgets leave room for Mosaic's own scratch.
    "v4": Generation("v4", 128, 512, 512, 2048, 12 * _MIB, 16 * _MIB),
    "v5e": Generation("v5e", 128, 512, 512, 4096, 24 * _MIB, 32 * _MIB),
    "v5p": Generation("v5p", 128, 512, 512, 4096, 24 * _MIB, 32 * _MIB),
    # v6e: 256x256 MXU, so output tiles are multiples of 256.
    "v6e": Generation("v6e", 256, 512, 1024, 4096, 24 * _MIB, 32 * _MIB),
}
DEFAULT_GENERATION = "v6e"


@dataclasses.dataclass(frozen=True)
class Tiling:
    tm: int
    tk: int
    tn: int

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.tm, self.tk, self.tn)


def generation_from_device_kind(kind: str | None) -> str:
    """Maps a jax ``device_kind`` string ("TPU v5 lite", "TPU v6e", ...) to a key."""
    if not kind:
        return DEFAULT_GENERATION
    k = kind.lower().replace(" ", "")
    if "v6" in k:
        return "v6e"
    if "v5lite" in k or "v5e" in k:
        return "v5e"
    if "v5" in k:
        return "v5p"
    if "v4" in k:
        return "v4"
    return DEFAULT_GENERATION


def get_generation(name: str | None) -> Generation:
    name = name or DEFAULT_GENERATION
    if name not in GENERATIONS:
        raise ValueError(
            f"generation: expected one of {sorted(GENERATIONS)}, got {name!r}"
        )
    return GENERATIONS[name]


def sublane(itemsize: int) -> int:
    """Rows per native tile: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
    return 8 * max(1, 4 // itemsize)


def _next_pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def _lane_tile(dim: int, cap: int) -> int:
    """Whole dim if it fits under ``cap`` (a full-dim block is always legal)."""
    return dim if dim <= cap else cap


def working_set_bytes(t: Tiling, lhs_bytes: int, rhs_bytes: int, out_bytes: int) -> int:
    """Double-buffered lhs, rhs and out tiles plus the f32 accumulator."""
    io = t.tm * t.tk * lhs_bytes + t.tk * t.tn * rhs_bytes + t.tm * t.tn * out_bytes
    return 2 * io + t.tm * t.tn * 4


def choose_tiling(
    m: int,
    k: int,
    n: int,
    num_groups: int,
    *,
    lhs_itemsize: int,
    rhs_itemsize: int,
    out_itemsize: int,
    generation: str | None = None,
    tm: int | None = None,
    tk: int | None = None,
    tn: int | None = None,
) -> Tiling:
    """Applies the rule in the module docstring; explicit sizes win."""
    gen = get_generation(generation)
    sub = sublane(min(lhs_itemsize, out_itemsize))
    if tm is None:
        rows_per_group = -(-max(m, 1) // max(num_groups, 1))
        tm = min(max(_next_pow2(rows_per_group), sub), gen.tm_max)
        # Never larger than M rounded up to the sublane tile; below one native
        # tile, the whole (tiny) M is the block, which is always legal.
        tm = m if m < 8 else min(tm, -(-m // sub) * sub)
    auto_k, auto_n = tk is None, tn is None
    tk = _lane_tile(k, gen.tk_max) if tk is None else tk
    tn = _lane_tile(n, gen.tn_max) if tn is None else tn
    t = Tiling(tm, tk, tn)
    while working_set_bytes(t, lhs_itemsize, rhs_itemsize, out_itemsize) > gen.vmem_budget:
        shrink_k = auto_k and t.tk > 128 and (t.tk >= t.tn or not auto_n or t.tn <= gen.mxu)
        shrink_n = auto_n and t.tn > gen.mxu
        if shrink_k:
            t = Tiling(t.tm, _halve_lane_aligned(t.tk), t.tn)
        elif shrink_n:
            t = Tiling(t.tm, t.tk, _halve_lane_aligned(t.tn))
        else:
            break  # explicit sizes: Mosaic reports the overflow
    return t


def _halve_lane_aligned(x: int) -> int:
    return max(128, ((x // 2) + 127) // 128 * 128)


def validate_tiling(t: Tiling, m: int, k: int, n: int) -> None:
    """Block-shape legality on TPU: (8, 128)-aligned or the full dim."""
    if t.tm <= 0 or (t.tm % 8 and t.tm != m):
        raise ValueError(f"tm: expected a positive multiple of 8 or M={m}, got {t.tm}")
    for name, size, dim in (("tk", t.tk, k), ("tn", t.tn, n)):
        if size <= 0 or (size % 128 and size != dim):
            raise ValueError(
                f"{name}: expected a positive multiple of 128 or the full "
                f"dimension {dim}, got {size}"
            )
