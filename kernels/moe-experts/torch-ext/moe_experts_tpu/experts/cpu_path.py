"""The CPU inference path of ``experts_forward``: the sorted rows in chunks.

Each chunk goes through gate_up -> gate -> down -> routing weight and is added
into an f32 ``[T, H]`` output, so the intermediates stay small enough to live
in cache instead of being written as ``[T*K, 2I]`` tensors, and no row past
``sum(group_sizes)`` (remote experts) is touched at all.

The chunk rule (``cpu_chunk_rows``): one chunk's activations within about an
L3 cache (32 MiB on the benchmark host), and a floor under which BLAS
matmuls lose their efficiency. Measured with ``python
bench/bench_experts.py --chunk-sweep`` (4096 tokens, 128 to 4096 rows per
chunk): chunks far below an expert's rows (gpt-oss: 128 vs ~512) or far
above the cache (4096 rows) cost 15-50% more; between them the times are
within this host's +-10% noise, and the rule's size was the fastest in two
of three sweeps (bench/results/experts.md has the last one).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..gmm import cpu_native, layouts
from . import module_layout, quantize, routing

CPU_CHUNK_BYTES = 32 << 20
CPU_MIN_CHUNK_ROWS = 128


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


def cpu_chunk_rows(module) -> int:
    """Rows per chunk: as many as keep one chunk's activations (input, up, gate
    output, down, f32 copy for the sum) within ``CPU_CHUNK_BYTES``, and at least
    ``CPU_MIN_CHUNK_ROWS`` so each matmul stays large enough for BLAS."""
    up = module_layout.up_weight(module)
    hidden = module_layout.hidden_size(module)
    up_features = layouts.out_features(up.shape, module_layout.rhs_layout(module))
    per_row = module_layout.compute_dtype(module).itemsize * (2 * hidden + 2 * up_features) + 4 * hidden
    return max(CPU_MIN_CHUNK_ROWS, CPU_CHUNK_BYTES // per_row)


def chunk_weight(weight, experts: slice) -> torch.Tensor:
    """The chunk's experts of ``weight``; a quantized weight dequantized for
    those experts only (never the whole float stack at once)."""
    if isinstance(weight, quantize.QuantizedWeight):
        return quantize.dequantize(weight, experts)
    return weight[experts]


def cpu_inference_forward(module, hidden_states, top_k_index, top_k_weights, *, chunk_rows=None):
    """The experts layer without autograd, chunk by chunk (``plan_row_chunks``)."""
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    layout = module_layout.rhs_layout(module)
    sorted_ids, order, group_sizes = routing.route(top_k_index, module.num_experts)
    token_of_row = order // top_k
    row_weights = top_k_weights.reshape(-1)[order].to(torch.float32).unsqueeze(-1)
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=hidden_states.device)
    chunk_rows = chunk_rows or cpu_chunk_rows(module)
    for chunk in plan_row_chunks(group_sizes.tolist(), chunk_rows):
        rows = slice(chunk.row_start, chunk.row_end)
        experts = slice(chunk.first_expert, chunk.first_expert + len(chunk.sizes))

        def project(x, weight, bias, rows=rows, chunk=chunk, experts=experts):
            w = chunk_weight(weight, experts)
            y = cpu_native.grouped_matmul(x.to(w.dtype), w, chunk.sizes, layout, w.dtype)
            return y if bias is None else y + bias[sorted_ids[rows]].to(y.dtype)

        tokens = token_of_row[rows]
        y = module_layout.expert_mlp(module, hidden_states[tokens], project)
        out.index_add_(0, tokens, y * row_weights[rows])  # f32 product: one pass, no bf16 rounding
    return out.to(hidden_states.dtype)
