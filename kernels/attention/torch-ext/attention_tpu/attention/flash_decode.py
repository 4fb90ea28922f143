"""Flash attention decode for TPU in Pallas: a few query rows against a long,
possibly partly filled KV cache, reading only the keys some row sees.

Why a kernel of its own. Decode is bound by reading K and V. The forward's
grid kernel (``flash_forward``) reads whole key blocks through the pipeline,
and each grid step costs a fixed ~0.5 us of bookkeeping, so its decode blocks
must be long (4096 keys) to hide it; but the last block of a partly filled
static cache is then read whole (2k of a 32k cache: 2.05x the HBM-bound time
on v6e). Here K and V stay in HBM (``pl.ANY``) and the kernel copies them
itself in ``chunk``-key pieces (``blocks.choose_decode_chunk``: v5e, v6e, tpu7x), double
buffered, only the chunks some row sees (per batch row the first and last,
``key_ranges.decode_chunk_spans``), the last one only up to the last key
some row sees (and at most 15 keys past it, in bf16); a loop iteration costs
far less than a grid step. Those spans and the rows' ranges are all the XLA
work around the kernel besides q's and the output's relayouts (estimated 0.3-0.4 us of XLA ops, against 0.8-1.0
with the grid kernel's visit table and rule fit: Llama-3-8B decode, batch
8, 2k of a 32k cache, tpu7x 19.1 -> 18.6 us, v6e 42.0 -> 41.4).

Layout. One grid step per (batch row, KV split): q ``[Hkv, rows, D]`` (rows
= G * Sq, the head group's query rows, as in the forward) and one loop over
the chunks some row sees; each chunk is copied for every KV head at once (one
strided copy each of K and V). All heads of a batch row share its key ranges.

Heads. A chunk computes the scores of a group of ``HEADS_PER_GROUP`` KV heads
first, then each head's softmax step and P V product. A decode tile has a few
rows, so its matmuls cost what pushing K and V into the MXU as weights costs
(tpu7x: a transposed K push every 8 cycles per MXU, a V push every 4); the
MXU takes its ops in program order, so with each head computed whole
(scores, softmax, P V, then the next head) the MXU sat idle through every
head's softmax (60% of the chunk loop's bundles empty). Scores first, head
h + 1's K pushes run while head h's softmax computes. Estimated (llama3-8b,
batch 8, full 32k cache, 8 KV heads; us, the chunk loop's compute alone in
parentheses where the copies hide it; HBM-bound 291.4), tpu7x:

=====================================  ==========  ==========
heads                                  1024 keys   2048 keys
=====================================  ==========  ==========
each whole, unrolled (before)          547         363
scores first, groups of 2              445         298
scores first, groups of 4              296 (295)   292 (219)
scores first, groups of 8              292 (213)   292 (196)
=====================================  ==========  ==========

Not 16: with more KV heads they leave the copies more slack (32 KV heads,
one row each, full 32k cache: tpu7x computes for 877 of 1166 us against 1098
at 8, HBM-bound either way; v6e 1092 / 1337 of 2619), but a group's f32
scores are live at once, and 16 of 128 rows (32 tokens of 4 query heads per
KV head) overflow VMEM on v5e and v6e. At 128 rows tpu7x is compute-bound
(Llama-3-8B, 32 tokens: 424 us against 292 HBM-bound; the grid kernel 601).
v6e and v5e were HBM-bound before and stay so (v6e after: the chunk loop computes
for 265 of its 655 us).

Chunks. Chunk ``c`` covers keys ``[c * chunk, (c + 1) * chunk)``; its copy
starts at ``min(c * chunk, Skv - chunk)`` so that it never reads past the
cache (the last chunk of a cache that is not a multiple of ``chunk`` overlaps
the one before; keys below ``c * chunk`` are masked, so none counts twice).
A copy stops at the end of the keys any row of the batch row sees (the
spans' third column), rounded up to a whole HBM tile (``tile_math.sublane``: 16
keys in bf16): a partly filled cache reads at most 15 keys past its last
(Llama-3-8B decode, batch 8, 3000 of an 8k cache, estimated: v5e 123.7 ->
121.3 us, v6e 61.9 -> 60.7, against ragged paged attention v3's 122.1 / 61.8,
which copies each page's filled keys; whole 128-key tiles read 3072 keys,
this 3008). V's rows past a partial copy keep what the buffer held: the
first grid step clears V's buffers once (``_clear_values``).
Requires ``Skv >= chunk`` and ``Skv`` a multiple of 128 (copies start on
whole tiles): ``blocks.choose_decode_chunk`` returns None otherwise and the
forward's grid kernel runs.

KV splits (``blocks.choose_kv_splits``): on a megacore chip with fewer batch
rows than TensorCores, each split takes a contiguous share of every head's
chunks; the partial softmaxes are merged as the forward's
(``flash_forward.merge_splits``).

Features and dtypes as ``flash_forward`` (scale, soft-capping, sinks applied
after the kernel from the log-sum-exp, ``Dv != D``, float16 as its bits,
rows that see no key come out as zeros with lse ``-inf``).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common.pallas_helpers import as_kernel_operand, compiler_params, kernel_dtype, load, out_struct
from ..common.tile_math import sublane
from . import key_ranges as kr
from .softmax_tiles import STAT_LANES, finished_rows, online_softmax_step, tile_scores

COPY_ALIGN = 128  # chunk copies start on whole (16, 128) / (8, 128) HBM tiles
HEADS_PER_GROUP = 8  # KV heads whose scores a chunk computes before their softmax steps


def _decode_kernel(spans_ref, q_ref, bounds_ref, k_hbm, v_hbm, o_ref, lse_ref, k_buf, v_buf, sems, m_ref, l_ref,
                   acc_ref, *, chunk: int, skv: int, heads: int, splits: int, softcap: float, scale: float,
                   row_tile: int):
    b, split = pl.program_id(0), pl.program_id(1)
    first = spans_ref[b * kr.SPAN_COLUMNS + kr.SPAN_FIRST]
    count = jnp.maximum(spans_ref[b * kr.SPAN_COLUMNS + kr.SPAN_LAST] - first + 1, 0)
    per_split = lax.div(count + splits - 1, jnp.int32(splits))  # lax: Python's // lowers through sign
    own_first = first + split * per_split
    chunks = jnp.clip(count - split * per_split, 0, per_split)  # this split's chunks

    end = spans_ref[b * kr.SPAN_COLUMNS + kr.SPAN_END]  # no row sees a key past it
    m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
    l_ref[...] = jnp.zeros_like(l_ref)
    acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when((b == 0) & (split == 0))
    def _clear_values():
        # A chunk copied in part leaves V's rows past the copy as they were:
        # an earlier chunk's values (finite, masked scores give them p = 0) or,
        # before the grid's first copy, uninitialised VMEM (0 x NaN = NaN in
        # P V). The grid runs in order ("arbitrary"), so this step is the first.
        v_buf[...] = jnp.zeros_like(v_buf)

    def copy_start(c):
        return pl.multiple_of(jnp.minimum(c * chunk, skv - chunk), COPY_ALIGN)

    def copies(i, slot):  # chunk i of this split, every KV head at once, up to the end any row sees
        start = copy_start(own_first + i)
        rows = lax.div(jnp.clip(end - start, 0, chunk) + row_tile - 1, jnp.int32(row_tile)) * row_tile
        rows = pl.multiple_of(rows, row_tile)
        src, dst = pl.ds(start, rows), pl.ds(0, rows)
        return (pltpu.make_async_copy(k_hbm.at[b, :, src], k_buf.at[slot, :, dst], sems.at[0, slot]),
                pltpu.make_async_copy(v_hbm.at[b, :, src], v_buf.at[slot, :, dst], sems.at[1, slot]))

    @pl.when(chunks > 0)
    def _first_copy():
        for copy in copies(0, 0):
            copy.start()

    lo, hi = kr.read_row_bounds(bounds_ref)  # [rows, 1] columns, shared by the heads
    base2 = not softcap
    exp = jnp.exp2 if base2 else jnp.exp

    def step(i, carry):
        slot = lax.rem(i, 2)

        @pl.when(i + 1 < chunks)
        def _next_copy():  # in flight while this chunk computes
            for copy in copies(i + 1, 1 - slot):
                copy.start()

        for copy in copies(i, slot):
            copy.wait()
        c = own_first + i
        keys = copy_start(c) + lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
        visible = (keys >= jnp.maximum(lo, c * chunk)) & (keys < hi)

        def heads_step(first_head, count):
            # Every head's scores before any head's softmax: the MXU takes its
            # ops in program order, so head h + 1's K pushes then run while
            # head h's softmax computes (module docstring, "Heads").
            hs = [first_head + j for j in range(count)]
            scores = [tile_scores(load(q_ref.at[h]), load(k_buf.at[slot, h]), softcap=softcap, scale=scale)
                      for h in hs]
            for h, s in zip(hs, scores):
                online_softmax_step(jnp.where(visible, s, -jnp.inf), load(v_buf.at[slot, h]), m_ref.at[h],
                                    l_ref.at[h], acc_ref.at[h], masked=True, exp=exp)

        group = min(heads, HEADS_PER_GROUP)
        full_groups, tail = divmod(heads, group)

        def group_step(g, carry):
            heads_step(g * group, group)
            return carry

        lax.fori_loop(0, full_groups, group_step, 0)
        if tail:
            heads_step(full_groups * group, tail)
        return carry

    lax.fori_loop(0, chunks, step, 0)

    def store(h, carry):
        out, lse = finished_rows(m_ref[h], l_ref[h], acc_ref[h], base2=base2)
        o_ref[h] = out.astype(o_ref.dtype)
        lse_ref[h] = lse
        return carry

    lax.fori_loop(0, heads, store, 0, unroll=min(heads, HEADS_PER_GROUP))


def decode_attention_with_lse(q, k, v, bounds, spans, *, chunk: int, splits: int, softcap: float, scale: float,
                              generation: str | None, interpret=False):
    """``(out [B, Hkv, splits, rows, Dv], lse [B, Hkv, splits, rows, 1])`` (f32
    partials when ``splits > 1``, else ``out`` in the kernel's dtype of q) of
    q viewed as ``[B, Hkv, rows, D]``. ``bounds [B, rows, 2]``: the rows' key
    ranges (``key_ranges.row_bounds``); ``spans``: the chunks each batch row
    sees (``key_ranges.decode_chunk_spans`` at ``chunk``)."""
    batch, hkv, rows, d = q.shape
    skv, dv = v.shape[2], v.shape[3]
    if skv < chunk or skv % COPY_ALIGN or chunk % COPY_ALIGN:
        raise ValueError(f"attention decode: chunk {chunk} must be a multiple of {COPY_ALIGN} and at most the "
                         f"{skv} keys, themselves a multiple of {COPY_ALIGN}")
    out_dtype = kernel_dtype(q.dtype) if splits == 1 else jnp.float32
    q_bits, k_bits, v_bits = map(as_kernel_operand, (q, k, v))
    row_tile = max(sublane(k_bits.dtype.itemsize), sublane(v_bits.dtype.itemsize))  # a copy's length rounds up to it
    kernel = functools.partial(_decode_kernel, chunk=chunk, skv=skv, heads=hkv, splits=splits,
                               softcap=float(softcap), scale=float(scale), row_tile=row_tile)
    out, lse = pl.pallas_call(
        kernel,
        out_shape=(out_struct((batch, splits, hkv, rows, dv), out_dtype, q, k, v, bounds),
                   out_struct((batch, splits, hkv, rows, 1), jnp.float32, q, k, v, bounds)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(batch, splits),
            in_specs=[pl.BlockSpec((None, hkv, rows, d), lambda b, s, *_: (b, 0, 0, 0)),
                      pl.BlockSpec((None, rows, 2), lambda b, s, *_: (b, 0, 0)),
                      pl.BlockSpec(memory_space=pl.ANY),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=[pl.BlockSpec((None, None, hkv, rows, dv), lambda b, s, *_: (b, s, 0, 0, 0)),
                       pl.BlockSpec((None, None, hkv, rows, 1), lambda b, s, *_: (b, s, 0, 0, 0))],
            scratch_shapes=[pltpu.VMEM((2, hkv, chunk, d), k_bits.dtype),
                            pltpu.VMEM((2, hkv, chunk, dv), v_bits.dtype),
                            pltpu.SemaphoreType.DMA((2, 2)),
                            pltpu.VMEM((hkv, rows, STAT_LANES), jnp.float32),
                            pltpu.VMEM((hkv, rows, STAT_LANES), jnp.float32),
                            pltpu.VMEM((hkv, rows, dv), jnp.float32)],
        ),
        compiler_params=compiler_params(generation, ("arbitrary", "arbitrary")),  # see _clear_values
        interpret=interpret,
        name="flash_attention_decode",
    )(spans, q_bits, bounds, k_bits, v_bits)
    return jnp.swapaxes(out, 1, 2), jnp.swapaxes(lse, 1, 2)
