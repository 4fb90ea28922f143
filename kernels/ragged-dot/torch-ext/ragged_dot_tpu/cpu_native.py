"""Torch-native CPU implementations of the grouped matmuls.

The default CPU path. XLA's CPU lowering of ``jax.lax.ragged_dot`` multiplies
every group against every row (1.47 s for one token at Qwen3-30B-A3B expert
shapes), so on CPU the groups go to the BLAS matmul, reading the ``[G, N, K]``
weights through a transposed view rather than a transposed copy.

Two ways to run a window of groups (``grouped_matmul``), by a measured rule:
one ``torch._grouped_mm`` call, which also pays ~1.3 us for every empty
group, or a Python loop of ``torch.mm`` over the non-empty groups only, which
pays ~10 us of dispatch per group. The loop is taken when fewer than one
group in ``SPARSE_WINDOW_RATIO`` is non-empty (decode: 8 of 128 experts).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import layouts

SPARSE_WINDOW_RATIO = 8


def _group_bounds(sizes: list[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def _as_kn(w: torch.Tensor, rhs_layout: str) -> torch.Tensor:
    """One group's weights as a ``[K, N]`` view."""
    return w.t() if rhs_layout == "nk" else w


def new_output(like: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised output buffer; every row is written before it is read
    (the tests swap this for a NaN-filled buffer to prove it)."""
    return like.new_empty(shape, dtype=dtype)


def _grouped_mm_or_none(x: torch.Tensor, rhs: torch.Tensor, sizes: list[int], rhs_layout: str):
    """One ``torch._grouped_mm`` call, or None where it does not apply."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != rhs.dtype:
        return None
    offsets = torch.tensor(sizes, dtype=torch.int32).cumsum_(0, dtype=torch.int32)
    weights = rhs.transpose(1, 2) if rhs_layout == "nk" else rhs
    try:
        return torch._grouped_mm(x, weights, offs=offsets)
    except RuntimeError as e:  # strides that are not 16-byte multiples: the loop takes those
        if "multiple of 16 bytes" not in str(e):
            raise
        return None


def grouped_matmul(
    x: torch.Tensor, rhs: torch.Tensor, sizes: list[int], rhs_layout: str, out_dtype: torch.dtype
) -> torch.Tensor:
    """``x [sum(sizes), K]`` (rows sorted by group) times ``rhs[g]`` per group -> ``[rows, N]``.

    Every row belongs to a group of ``rhs`` (``len(sizes) == rhs.shape[0]``),
    so every output row is written. Accumulation is f32 (BLAS) on both paths.
    """
    nonempty = sum(1 for s in sizes if s)
    if nonempty * SPARSE_WINDOW_RATIO >= len(sizes) and x.dtype == out_dtype:
        out = _grouped_mm_or_none(x, rhs, sizes, rhs_layout)
        if out is not None:
            return out
    out = new_output(x, (x.shape[0], layouts.out_features(rhs.shape, rhs_layout)), out_dtype)
    for g, (start, end) in enumerate(_group_bounds(sizes)):
        if end <= start:
            continue
        lhs, w = x[start:end], _as_kn(rhs[g], rhs_layout)
        if lhs.dtype != out_dtype:  # e.g. bf16 inputs, f32 output
            lhs, w = lhs.to(out_dtype), w.to(out_dtype)
        torch.mm(lhs, w, out=out[start:end])
    return out


def ragged_dot(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    group_sizes: torch.Tensor,
    rhs_layout: str,
    group_offset: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    m = lhs.shape[0]
    n = layouts.out_features(rhs.shape, rhs_layout)
    sizes = group_sizes.tolist()
    bounds = _group_bounds(sizes)
    num_local = rhs.shape[0]
    window_start, window_end = bounds[group_offset][0], bounds[group_offset + num_local - 1][1]
    if window_end <= window_start:
        return lhs.new_zeros((m, n), dtype=out_dtype)
    window = grouped_matmul(lhs[window_start:window_end], rhs,
                            sizes[group_offset:group_offset + num_local], rhs_layout, out_dtype)
    if window_start == 0 and window_end == m:
        return window
    out = new_output(lhs, (m, n), out_dtype)
    out[:window_start].zero_()
    out[window_end:].zero_()
    out[window_start:window_end] = window
    return out


def ragged_dot_weight_grad(
    lhs: torch.Tensor,
    dout: torch.Tensor,
    group_sizes: torch.Tensor,
    num_local_groups: int,
    rhs_layout: str,
    group_offset: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    k, n = lhs.shape[1], dout.shape[1]
    grad = lhs.new_zeros(layouts.weight_shape(num_local_groups, k, n, rhs_layout), dtype=out_dtype)
    bounds = _group_bounds(group_sizes.tolist())
    for local in range(num_local_groups):
        start, end = bounds[group_offset + local]
        if end <= start:
            continue
        x = lhs[start:end].to(torch.float32)
        dy = dout[start:end].to(torch.float32)
        g = dy.t() @ x if rhs_layout == "nk" else x.t() @ dy
        grad[local] = g.to(out_dtype)
    return grad


# ----------------------------------------------------------------------------
# Row chunks for the CPU experts path
# ----------------------------------------------------------------------------


class RowChunk(NamedTuple):
    """Sorted rows ``[row_start, row_end)`` of experts ``first_expert + i``,
    ``sizes[i]`` rows each (every row of the chunk belongs to one of them)."""

    row_start: int
    row_end: int
    first_expert: int
    sizes: list[int]


def plan_row_chunks(sizes: list[int], max_rows: int) -> list[RowChunk]:
    """Cuts the sorted rows into chunks of at most ``max_rows`` rows.

    Whole experts are packed greedily (so each expert's weights are read once
    per forward); an expert with more than ``max_rows`` rows is split into the
    fewest pieces of at most ``max_rows``, of equal size (+-1), so that no
    piece is a small, inefficient matmul. Empty experts at the edges of a
    chunk are left out.
    """
    if max_rows < 1:
        raise ValueError(f"plan_row_chunks: max_rows must be >= 1, got {max_rows}")
    chunks: list[RowChunk] = []
    open_first, open_sizes, open_start = None, [], 0
    row = 0

    def close():
        nonlocal open_first, open_sizes
        if open_first is not None:
            while open_sizes and open_sizes[-1] == 0:
                open_sizes.pop()
            chunks.append(RowChunk(open_start, open_start + sum(open_sizes), open_first, open_sizes))
        open_first, open_sizes = None, []

    for expert, size in enumerate(sizes):
        if size == 0:
            if open_first is not None:
                open_sizes.append(0)
            continue
        if open_first is not None and sum(open_sizes) + size > max_rows:
            close()
        if size > max_rows:
            pieces = -(-size // max_rows)  # balanced: 560 rows at max 546 -> 280 + 280, not 546 + 14
            piece_start = row
            for p in range(pieces):
                piece = size // pieces + (p < size % pieces)
                chunks.append(RowChunk(piece_start, piece_start + piece, expert, [piece]))
                piece_start += piece
        else:
            if open_first is None:
                open_first, open_start = expert, row
            open_sizes.append(size)
        row += size
    close()
    return chunks
