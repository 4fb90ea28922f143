"""Flash attention forward for TPU in Pallas: online softmax, f32 accumulation.

Layout. ``q [B, Hq, Sq, D]``, ``k [B, Hkv, Skv, D]``, ``v [B, Hkv, Skv, Dv]``
with ``Hq = G * Hkv`` (GQA / MQA; K and V are never repeated). The wrapper
views q as ``[B, Hkv, G * Sq, D]`` (a free reshape: the G query heads of a KV
head are adjacent in memory), so one grid step multiplies the queries of a
whole head group by one K/V block: K and V are read once per group, and one
decode token of G heads is a G-row block, not a padded 128-row one.

Which keys a row sees and which tiles are skipped: ``key_ranges`` (a key
range per query, the visit table). A causal prefill does about half of the
dense work, a windowed one ``~window / Skv`` of it, and decode against a
static cache reads only the filled part. With one KV split the grid walks
only the live (query block, KV block) pairs (``key_ranges.compact_walk``: a
flat grid axis whose step reads its pair from SMEM; the query block's first
pair initialises the softmax, its last stores), not a rectangle of query
blocks x the most KV blocks any sees, whose empty steps each paid the
pipeline's per-step cost. Within a grid step the tile is
computed in pieces (``blocks``): an interior tile in key folds
(``compute_block_k``); a tile whose sub-tiles' kinds are static (a causal
diagonal, a short window's tiles: ``key_ranges.aligned_tile``) all its live
sub-tiles in one region (``static_sub_tile``); any other masked tile sub-tile
by sub-tile (``forward_compute_blocks``), each skipped, unmasked or masked
from the sub-tiles' own visit table.

Features: an arbitrary ``scale`` (applied before soft-capping), logit
soft-capping ``cap * tanh(s / cap)``, attention sinks (one logit per query
head that joins the softmax denominator only: applied after the kernel from
the log-sum-exp it returns), ``Dv != D``, lengths that are not multiples of
the blocks (tails masked; padded K/V rows zeroed, since ``0 * NaN`` is NaN).
Rows that see no key at all come out as zeros.

Dtypes: float32, bfloat16 and float16, accumulated in f32, results in the
input dtype. float16 enters the kernels as its uint16 bits (Mosaic loads no
float16 vector) and is decoded to f32 in VMEM (``pallas_helpers.load``): its
tiles then compute and store as the f32 kernel does (full-precision dots, f32
blocks sized by the rule), cast back to float16 in XLA.

The backward is ``flash_backward``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common.pallas_helpers import as_kernel_operand, compiler_params, kernel_dtype, load, out_struct
from ..common.tile_math import cdiv
from . import blocks as blocks_lib
from . import flash_decode
from . import key_ranges as kr
from .softmax_tiles import LOG2_E, STAT_LANES, finished_rows, online_softmax_step, tile_scores  # noqa: F401


def _flash_kernel(table_ref, sub_table_ref, steps_ref, start_ref, end_ref, walk_q_ref, walk_step_ref, q_ref, k_ref,
                  v_ref, bounds_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref, *, block_q: int, block_k: int, sub_q: int,
                  sub_k: int, fold_k: int, static_tile_size: int, skv: int, softcap: float, scale: float,
                  num_q_blocks: int, num_kv_blocks: int, compact: bool, rule: kr.KernelRule, sum_on_mxu: bool):
    b, split = pl.program_id(0), pl.program_id(2)
    q_block, step = kr.walk_position(b, pl.program_id(3), pl.program_id(4), walk_q_ref, walk_step_ref,
                                   num_q_blocks=num_q_blocks, num_kv_blocks=num_kv_blocks, compact=compact)
    entry = functools.partial(kr.table_entry, table_ref, b, q_block, num_q_blocks=num_q_blocks)
    kv_block = kr.kv_block_of_step(entry, split, step, pl.num_programs(4))
    live, whole = kr.tile_kinds(table_ref, b, q_block, kv_block, num_q_blocks=num_q_blocks)
    last_step = kr.is_last_step(entry, step, pl.num_programs(4), num_kv_blocks=num_kv_blocks, compact=compact)

    @pl.when(step == 0)
    def _init():
        m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    base2 = not softcap  # scores in base 2 (softmax_tiles)
    exp = jnp.exp2 if base2 else jnp.exp
    per_q, per_k = block_q // sub_q, block_k // sub_k

    def fold(q, rows, j, masked_by, width=sub_k):
        """Fold the ``j``-th ``width`` keys of the block into the running softmax
        of ``rows`` (queries ``q``); ``masked_by``: their ``(lo, hi)`` columns."""
        keys = pl.ds(j * width, width)
        s = tile_scores(q, load(k_ref.at[keys]), softcap=softcap, scale=scale)  # [rows, width]
        v = load(v_ref.at[keys])
        if masked_by is not None:
            lo, hi = masked_by
            first = kv_block * block_k + j * width
            key_ids = first + lax.broadcasted_iota(jnp.int32, (1, width), 1)
            s = jnp.where((key_ids >= lo) & (key_ids < hi), s, -jnp.inf)
            if skv % block_k:  # the tail block holds rows past Skv: garbage, zeroed (0 * NaN is NaN)
                key_rows = first + lax.broadcasted_iota(jnp.int32, (width, 1), 0)
                v = jnp.where(key_rows < skv, v.astype(jnp.float32), 0.0).astype(v.dtype)
        online_softmax_step(s, v, m_ref.at[rows], l_ref.at[rows], acc_ref.at[rows], masked=masked_by is not None,
                            exp=exp, sum_on_mxu=sum_on_mxu)

    # Every row sees every key of the block: all rows at once, in key folds of
    # fold_k ([block_q, fold_k] f32 temporaries instead of [block_q, block_k]).
    @pl.when(live & whole)
    def _interior():
        q = load(q_ref)
        for j in range(block_k // fold_k):
            fold(q, slice(None), j, None, fold_k)

    # Any other masked block, sub-tile by sub-tile: each skipped where no row
    # sees its keys, unmasked where every row sees them all (the sub-tiles'
    # visit table), each in a region of its own.
    def sub_tile(bounds, rows, j):
        fold(load(q_ref.at[rows]), rows, j, bounds)

    def edge():
        num_q_subs = num_q_blocks * per_q
        for i, j, rs, _ in blocks_lib.sub_tiles(block_q, block_k, sub_q, sub_k):
            q_sub, kv_sub = q_block * per_q + i, kv_block * per_k + j
            sub_live, sub_whole = kr.tile_kinds(sub_table_ref, b, q_sub, kv_sub, num_q_blocks=num_q_subs)
            body = functools.partial(sub_tile, rows=rs, j=j)
            pl.when(sub_live & sub_whole)(lambda body=body: body(None))
            kr.masked_regions(sub_live & jnp.logical_not(sub_whole),
                              kr.table_entry(sub_table_ref, b, q_sub, kr.RULE, num_q_subs) == 1,
                              lambda lo, hi, body=body: body((lo, hi)), rule=rule, start_ref=start_ref,
                              end_ref=end_ref, bounds_ref=bounds_ref, b=b, q_block=q_sub, bounds_rows=rs)

    # A tile whose sub-tiles' kinds are static (a causal diagonal, a window's
    # tiles: key_ranges.aligned_tile): all of them in one region, where the
    # compiler overlaps one sub-tile's matmuls with another's softmax; region
    # by region each sub-tile waited on its own.
    def static_tile(offset):
        size, q = static_tile_size, None
        for i, j, masked_sub in kr.static_sub_tiles(block_q // size, block_k // size, offset, size, rule.window):
            rows = pl.ds(i * size, size)
            if q is None or q[0] != i:
                q = i, load(q_ref.at[rows])
            bounds = kr.rule_row_bounds(rule, start_ref[b], end_ref[b], None,
                                        rows=(q_block * block_q + i * size, size)) if masked_sub else None
            fold(q[1], rows, j, bounds, size)

    masked = live & jnp.logical_not(whole)
    by_sub_tile = masked
    offsets = kr.static_offsets(block_q, block_k, static_tile_size, sq=rule.sq, causal=rule.causal,
                                window=rule.window) if static_tile_size else ()
    for offset in offsets:
        on_static = masked & kr.aligned_tile(entry(kr.RULE) == 1, start_ref[b], end_ref[b], q_block, kv_block, offset,
                                             block_q=block_q, block_k=block_k, size=static_tile_size, sq=rule.sq,
                                             skv=skv)
        pl.when(on_static)(functools.partial(static_tile, offset))
        by_sub_tile &= jnp.logical_not(on_static)
    if per_q == per_k == 1:  # the block is its one sub-tile (window and decode tiles): no second table check
        kr.masked_regions(by_sub_tile, entry(kr.RULE) == 1,
                          lambda lo, hi: fold(load(q_ref), slice(None), 0, (lo, hi)), rule=rule, start_ref=start_ref,
                          end_ref=end_ref, bounds_ref=bounds_ref, b=b, q_block=q_block)
    else:
        pl.when(by_sub_tile)(edge)

    @pl.when(last_step)
    def _finish():
        out, lse = finished_rows(m_ref[...], l_ref[...], acc_ref[...], base2=base2)
        o_ref[...] = out.astype(o_ref.dtype)
        lse_ref[...] = lse


def shapes_and_blocks(rule, q, v, block_sizes, causal, window, generation):
    """``(batch, hq, hkv, sq, skv, d, dv, rows, BlockSizes)``: the blocks given,
    or those of ``rule`` (a ``blocks.choose_*blocks``), checked against the
    call's rows and keys (every path into the kernels passes here)."""
    batch, hq, sq, d = q.shape
    _, hkv, skv, dv = v.shape
    rows = hq // hkv * sq
    chosen = block_sizes or rule(rows, skv, head_dim=d, v_dim=dv, itemsize=kernel_dtype(q.dtype).itemsize,
                                 window=window if causal else 0, generation=generation)
    return batch, hq, hkv, sq, skv, d, dv, rows, blocks_lib.BlockSizes.of(chosen).check_fits(rows, skv)


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
    """Which kernel runs and how: ``decode_chunk`` set, the decode kernel
    (``flash_decode``) with ``block_q`` = all rows and ``block_k`` = the chunk;
    else the grid kernel below at ``(block_q, block_k)``."""
    rows: int
    block_q: int
    block_k: int
    num_q_blocks: int
    num_kv_blocks: int
    splits: int
    decode_chunk: int | None = None
    compact: bool = False  # the grid walks only the live pairs (``compacts_walk``)


def forward_plan(q, k, v, block_sizes, kv_splits, generation, causal, window) -> ForwardPlan:
    """The forward's kernel, blocks, block counts and KV splits for these operands."""
    batch, hq, sq, d = q.shape
    _, hkv, skv, dv = v.shape
    rows = hq // hkv * sq
    # float16 (its bits decoded per tile) stays on the grid kernel: decoding in the decode kernel's
    # unrolled head loop costs more (v6e, Llama-3-8B batch 8 against 32k keys: 2.96 vs 2.1 ms).
    chunk = None if block_sizes or q.dtype == jnp.float16 else blocks_lib.choose_decode_chunk(
        rows, skv, kv_heads=hkv, head_dim=d, v_dim=dv, itemsize=k.dtype.itemsize, generation=generation)
    if chunk:
        num_chunks = cdiv(skv, chunk)
        # The decode kernel walks every KV head inside one grid step: its parallel work is the batch.
        splits = kv_splits or blocks_lib.choose_kv_splits(batch, 1, num_chunks, generation)
        return ForwardPlan(rows, rows, chunk, 1, num_chunks, max(1, min(splits, num_chunks)), chunk)
    *_, (block_q, block_k) = shapes_and_blocks(blocks_lib.choose_blocks, q, v, block_sizes, causal, window,
                                              generation)
    num_q_blocks, num_kv_blocks = cdiv(rows, block_q), cdiv(skv, block_k)
    expected = kr.expected_kv_steps(num_kv_blocks, block_q=block_q, block_k=block_k, sq=sq, causal=causal,
                                    window=window)
    splits = max(1, min(kv_splits or blocks_lib.choose_kv_splits(batch * hkv, num_q_blocks, expected, generation),
                        expected))
    compact = compacts_walk(splits, batch * num_q_blocks * num_kv_blocks, causal=causal, window=window)
    return ForwardPlan(rows, block_q, block_k, num_q_blocks, num_kv_blocks, splits, compact=compact)


def merge_splits(out_splits, lse_splits):
    """One softmax from per-split partial ones: ``out [.., S, rows, Dv]`` (each
    normalised over its split's keys) and ``lse [.., S, rows, 1]`` -> the
    attention over all keys and its log-sum-exp (splits that saw no key have
    ``lse = -inf`` and weigh nothing)."""
    top = lse_splits.max(axis=-3, keepdims=True)
    shift = jnp.where(top == -jnp.inf, 0.0, top)
    weight = jnp.exp(lse_splits - shift)
    total = weight.sum(axis=-3)
    seen = total > 0
    out = (weight * out_splits).sum(axis=-3) / jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, shift[..., 0, :, :] + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    return out, lse


def flash_attention_with_lse(q, k, v, key_bounds, sinks=None, *, causal: bool = True, window: int = 0,
                             softcap: float = 0.0, scale: float | None = None, block_sizes=None,
                             kv_splits: int | None = None, generation: str | None = None, interpret=False):
    """``(out [B, Hq, Sq, Dv], lse [B, Hkv, G * Sq, 1])``: the attention and the
    log-sum-exp of each row's softmax, sinks included (what the backward needs).

    ``key_bounds``: int32 ``[B, Sq, 2]``, the keys ``[lo, hi)`` of each query
    (``key_ranges.rule_key_bounds``, or a mask's ranges); ``causal`` /
    ``window`` choose the blocks. ``block_sizes``: ``(block_q, block_k)`` or a
    ``blocks.BlockSizes`` (checked here), None for the rule. ``kv_splits``:
    split the keys into that many parallel parts whose partial softmaxes are
    merged afterwards (``blocks.choose_kv_splits`` when None)."""
    batch, hq, sq, d = q.shape
    _, hkv, skv, dv = v.shape
    scale = d ** -0.5 if scale is None else scale
    rows = hq // hkv * sq
    if 0 in (batch, hq, sq, dv) or skv == 0:
        lse = jnp.full((batch, hkv, rows, 1), -jnp.inf, jnp.float32)
        if sinks is not None:  # no key: the sink alone
            lse = per_row(sinks.astype(jnp.float32), batch, hkv, hq // hkv, sq)
        return jnp.zeros((batch, hq, sq, dv), q.dtype), lse
    plan = forward_plan(q, k, v, block_sizes, kv_splits, generation, causal, window)
    if plan.decode_chunk:
        bounds = kr.row_bounds(jnp.clip(jnp.asarray(key_bounds, jnp.int32), 0, skv), hq // hkv)
        spans = kr.decode_chunk_spans(key_bounds, skv=skv, chunk=plan.decode_chunk)
        out, lse = flash_decode.decode_attention_with_lse(
            q.reshape(batch, hkv, rows, d), k, v, bounds, spans, chunk=plan.decode_chunk, splits=plan.splits,
            softcap=softcap, scale=scale, generation=generation, interpret=interpret)
    else:
        compute_blocks = blocks_lib.forward_compute_blocks(plan.block_q, plan.block_k)
        bounds, start, end, table, *sub_table = kr.ranges_and_table(
            key_bounds, hq // hkv, sq=sq, skv=skv, causal=causal, window=window, num_q_blocks=plan.num_q_blocks,
            block_q=plan.block_q, block_k=plan.block_k, compute_blocks=compute_blocks)
        out, lse = _grid_forward(q, k, v, key_bounds, bounds, start, end, table, *sub_table, plan, causal=causal,
                                 window=window, softcap=softcap, scale=scale, generation=generation,
                                 interpret=interpret)
    if plan.splits == 1:
        out, lse = out[:, :, 0], lse[:, :, 0]
    else:
        out, lse = merge_splits(out, lse)
    if sinks is not None:
        # softmax over [scores, sink] = softmax(scores) * 1 / (1 + exp(sink - lse))
        sink_rows = per_row(sinks.astype(jnp.float32), batch, hkv, hq // hkv, sq)
        out = out.astype(jnp.float32) * jax.nn.sigmoid(lse - sink_rows)
        lse = jnp.logaddexp(lse, sink_rows)
    return out.astype(q.dtype).reshape(batch, hq, sq, dv), lse


def compacts_walk(splits: int, pairs: int, *, causal: bool, window: int) -> bool:
    """Whether the grid walks only the live (query block, KV block) pairs
    (``key_ranges.compact_walk``): a causal prefill without a window (its query
    blocks see 1 to all KV blocks), one KV split, the ``pairs`` (batch x
    query blocks x KV blocks) within SMEM. A window's rectangular grid already
    spans only the window's blocks, where the walk's per-step lookups cost
    more than the few empty steps (estimated v6e: gpt-oss 8k 2112 -> 2185 us,
    Gemma-4 sliding-512 327 -> 336)."""
    return splits == 1 and causal and not window and pairs <= kr.COMPACT_WALK_MAX_PAIRS


def grid_walk(table, plan: ForwardPlan):
    """``(steps per split, walk q blocks, walk steps, grid axes after (batch,
    head))``: the compacted walk's arrays and ``(1, 1, pairs)``, or the
    rectangular grid's ``(splits, query blocks, steps per split)`` (the walk
    arrays then unused placeholders)."""
    per_split = kr.kv_steps(table, num_kv_blocks=plan.num_kv_blocks, splits=plan.splits)  # traced: dynamic axis
    if plan.compact:
        walk_q, walk_step, length = kr.compact_walk(table, num_q_blocks=plan.num_q_blocks,
                                                    num_kv_blocks=plan.num_kv_blocks)
        return per_split, walk_q, walk_step, (1, 1, length)
    placeholder = jnp.zeros((1,), jnp.int32)
    return per_split, placeholder, placeholder, (plan.splits, plan.num_q_blocks, per_split)


def _grid_forward(q, k, v, key_bounds, bounds, start, end, table, sub_table, plan: ForwardPlan, *, causal, window, softcap,
                  scale, generation, interpret):
    """The grid kernel: ``(out, lse)`` per KV split, as ``[B, Hkv, splits, rows, .]``
    (``sub_table``: the visit table of ``blocks.forward_compute_blocks``' sub-tiles)."""
    batch, hq, sq, d = q.shape
    _, hkv, skv, dv = v.shape
    rows = plan.rows
    block_q, block_k, splits = plan.block_q, plan.block_k, plan.splits
    per_split, walk_q, walk_step, grid_tail = grid_walk(table, plan)
    grid, compact = (batch, hkv, *grid_tail), plan.compact
    where = dict(num_q_blocks=plan.num_q_blocks, num_kv_blocks=plan.num_kv_blocks)

    def position(b, qb, step, walk_q_ref, walk_step_ref):
        return kr.walk_position(b, qb, step, walk_q_ref, walk_step_ref, compact=compact, **where)

    def kv_at(b, h, split, qb, step, table_ref, sub_table_ref, steps_ref, start_ref, end_ref, *walk):
        qb, step = position(b, qb, step, *walk)
        entry = functools.partial(kr.table_entry, table_ref, b, qb, num_q_blocks=plan.num_q_blocks)
        kv_block = kr.kv_block_of_step(entry, split, step, steps_ref[0])
        return b, h, kr.clamped_kv_index(table_ref, b, qb, kv_block, **where), 0

    def rows_at(b, h, split, qb, step, *refs):
        return b, h, position(b, qb, step, *refs[-2:])[0], 0

    def bounds_at(b, h, split, qb, step, *refs):
        return b, position(b, qb, step, *refs[-2:])[0], 0

    def split_rows_at(b, h, split, qb, step, *refs):
        return b, h, split, position(b, qb, step, *refs[-2:])[0], 0

    sub_q, sub_k = blocks_lib.forward_compute_blocks(block_q, block_k)
    kernel = functools.partial(_flash_kernel, block_q=block_q, block_k=block_k, sub_q=sub_q, sub_k=sub_k, skv=skv,
                               softcap=float(softcap), scale=float(scale), compact=compact,
                               rule=kr.KernelRule(sub_q, sq, skv, causal, window), **where,
                               sum_on_mxu=blocks_lib.row_sums_on_mxu(generation, dv),
                               fold_k=blocks_lib.compute_block_k(block_q, block_k, dv),
                               static_tile_size=blocks_lib.static_sub_tile(block_q, block_k, window if causal else 0,
                                                                           dv))
    # One split: the final output in the kernel's dtype of q; several: f32 partials to merge.
    out_dtype = kernel_dtype(q.dtype) if splits == 1 else jnp.float32
    operands = (q, k, v, key_bounds)
    out, lse = pl.pallas_call(
        kernel,
        out_shape=(out_struct((batch, hkv, splits, rows, dv), out_dtype, *operands),
                   out_struct((batch, hkv, splits, rows, 1), jnp.float32, *operands)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            grid=grid,
            in_specs=[pl.BlockSpec((None, None, block_q, d), rows_at),
                      pl.BlockSpec((None, None, block_k, d), kv_at),
                      pl.BlockSpec((None, None, block_k, dv), kv_at),
                      pl.BlockSpec((None, block_q, 2), bounds_at)],
            out_specs=[pl.BlockSpec((None, None, None, block_q, dv), split_rows_at),
                       pl.BlockSpec((None, None, None, block_q, 1), split_rows_at)],
            scratch_shapes=[pltpu.VMEM((block_q, STAT_LANES), jnp.float32),
                            pltpu.VMEM((block_q, STAT_LANES), jnp.float32),
                            pltpu.VMEM((block_q, dv), jnp.float32)],
        ),
        compiler_params=compiler_params(generation, ("parallel",) * 4 + ("arbitrary",)),
        interpret=interpret,
        name="flash_attention_fwd",
    )(table, sub_table, per_split.reshape(1), start, end, walk_q, walk_step,
      *map(as_kernel_operand, (q.reshape(batch, hkv, rows, d), k, v)), bounds)
    return out, lse


def per_row(per_head, batch, hkv, group, sq):
    """``[Hq]`` values as ``[B, Hkv, G * Sq, 1]``, the kernel's row layout."""
    return jnp.broadcast_to(per_head.reshape(1, hkv, group, 1, 1), (batch, hkv, group, sq, 1)).reshape(
        batch, hkv, group * sq, 1)


def flash_attention(q, k, v, key_bounds, sinks=None, **kwargs):
    """``softmax(mask(cap(scale * q k^T))) v`` per head; see the module docstring.

    ``key_bounds``: int32 ``[B, Sq, 2]``. ``sinks``: ``[Hq]`` logits or None.
    Returns ``[B, Hq, Sq, Dv]`` in q's dtype. Inputs are assumed valid.
    """
    return flash_attention_with_lse(q, k, v, key_bounds, sinks, **kwargs)[0]
