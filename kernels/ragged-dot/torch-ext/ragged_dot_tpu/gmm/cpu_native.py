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


def _grouped_mm_strides_ok(t: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` (CPU, torch 2.13) takes ``t`` as it is: of the
    last two dims one has unit stride and the other a stride that spans it and
    is a multiple of 16 bytes; a batch dim (weights) must not be broadcast."""
    rows, cols = t.shape[-2:]
    row_stride, col_stride = t.stride()[-2:]
    if col_stride == 1 or cols == 1:
        lead, span = row_stride, cols
    elif row_stride == 1 or rows == 1:
        lead, span = col_stride, rows
    else:
        return False
    if lead < span or (lead * t.element_size()) % 16:
        return False
    return t.dim() == 2 or t.shape[0] == 1 or t.stride(0) >= rows * cols


def _grouped_mm_or_none(x: torch.Tensor, rhs: torch.Tensor, sizes: list[int], rhs_layout: str):
    """One ``torch._grouped_mm`` call, or None where it does not apply.

    Operands with strides it refuses (broadcast rows or experts, a stepped or
    permuted view, the stride-0 gradient of a ``sum``) are copied contiguous
    first: the copy is no larger than the operand, and the alternative, a loop
    of matmuls, costs more than a copy at the sizes where this path is taken.
    What stays unaligned when contiguous (a row of K * itemsize not a multiple
    of 16 bytes) goes to the loop instead (None).
    """
    if not hasattr(torch, "_grouped_mm") or x.dtype != rhs.dtype:
        return None
    weights = rhs.transpose(1, 2) if rhs_layout == "nk" else rhs  # [G, K, N] view
    if not _grouped_mm_strides_ok(x):
        x = x.contiguous()
    if not _grouped_mm_strides_ok(weights):
        weights = rhs.contiguous().transpose(1, 2) if rhs_layout == "nk" else rhs.contiguous()
    if not (_grouped_mm_strides_ok(x) and _grouped_mm_strides_ok(weights)):
        return None
    offsets = torch.tensor(sizes, dtype=torch.int32).cumsum_(0, dtype=torch.int32)
    return torch._grouped_mm(x, weights, offs=offsets)


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
        if lhs.dtype == out_dtype:
            torch.mm(lhs, w, out=out[start:end])
        else:  # f32 products and sums, rounded once to out_dtype (bf16 in / f32 out, or the reverse)
            out[start:end] = torch.mm(lhs.float(), w.float()).to(out_dtype)
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
