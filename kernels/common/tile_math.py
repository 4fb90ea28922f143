"""Tile arithmetic (pure Python: usable where jax is not installed)."""

from __future__ import annotations

LANES = 128  # last-dim tile of every TPU vector register and VMEM block


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(x: int, multiple: int) -> int:
    return cdiv(x, multiple) * multiple


def next_pow2(x: int) -> int:
    return 1 << max(0, (max(1, x) - 1).bit_length())


def sublane(itemsize: int) -> int:
    """Rows of one native tile: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit values."""
    return 8 * max(1, 4 // itemsize)


def halve_lane_aligned(x: int) -> int:
    """About half of ``x``, a multiple of 128, at least 128."""
    return max(LANES, round_up(x // 2, LANES))
