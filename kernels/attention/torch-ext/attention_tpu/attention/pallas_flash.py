"""Flash attention forward for TPU in Pallas: online softmax, f32 accumulation.

Layout. ``q [B, Hq, Sq, D]``, ``k [B, Hkv, Skv, D]``, ``v [B, Hkv, Skv, Dv]``
with ``Hq = G * Hkv`` (GQA / MQA; K and V are never repeated). The wrapper
views q as ``[B, Hkv, G * Sq, D]`` (a free reshape: the G query heads of a KV
head are adjacent in memory), so one grid step multiplies the queries of a
whole head group by one K/V block: K and V are read once per group, and one
decode token of G heads is a G-row block, not a padded 128-row one. Row ``r``
is head ``r // Sq`` of the group at query index ``i = r % Sq``.

Which keys a row sees. Per batch row ``b`` the valid keys are ``[kv_start[b],
kv_end[b])`` (scalar-prefetched: left padding, the filled part of a static
cache). Queries are aligned to the end of the valid keys: query ``i`` sits at
position ``p = kv_end[b] - Sq + i``. Then ``causal`` keeps keys ``<= p`` and a
sliding ``window`` keeps keys ``> p - window``.

Skipped work. For each (batch, query block) the kernel computes the range of
KV blocks any of its rows can see; grid steps outside it do no MXU work
(``pl.when``), and their K/V index maps are clamped into the range, so the
block already in VMEM is reused and no DMA starts: a causal prefill does about
half of the dense work, a windowed one ``~window / Skv`` of it, and decode
against a static cache reads only the filled part.

Features: an arbitrary ``scale`` (applied before soft-capping), logit
soft-capping ``cap * tanh(s / cap)``, attention sinks (one logit per query
head that joins the softmax denominator only: applied after the kernel from
the log-sum-exp it returns), ``Dv != D``, lengths that are not multiples of
the blocks (tails masked; padded K/V rows zeroed, since ``0 * NaN`` is NaN).
Rows that see no key at all come out as zeros.

Backward (``flash_attention_backward``): two kernels from the forward's
log-sum-exp, one walking key blocks (dk, dv accumulated over the query
blocks), one walking query blocks (dq), with the same visibility rule and
skipped tiles; the sinks' gradient is a reduction outside the kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import typing

import jax
import numpy as np
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common.pallas_helpers import compiler_params, dot_f32, out_struct
from ..common.tile_math import cdiv
from . import blocks as blocks_lib


def _rem(a, b):
    """``a % b`` for non-negative ints: lax's truncating remainder (Mosaic lowers
    Python's ``%`` through ``sign``, which needs the chip at trace time)."""
    return lax.rem(a, jnp.int32(b) if isinstance(b, int) else b)


# Columns of the per-(batch, query block) visit table, derived once per call
# on the host side of the kernel (XLA) and scalar-prefetched into SMEM.
FIRST, LAST, FULL_FIRST, FULL_LAST = range(4)
LOG2_E = 1.4426950408889634
TABLE_COLUMNS = 4


def _query_index_bounds(num_q_blocks: int, *, block_q: int, rows: int, sq: int):
    """Smallest and largest query index ``i`` among the real rows of each query block."""
    r0 = np.arange(num_q_blocks) * block_q
    r1 = np.minimum(r0 + block_q, rows) - 1
    spans_heads = r1 // sq != r0 // sq
    return np.where(spans_heads, 0, r0 % sq), np.where(spans_heads, sq - 1, r1 % sq)


def visit_table(kv_start, kv_end, *, num_q_blocks: int, block_q: int, block_k: int, rows: int, sq: int,
                skv: int, causal: bool, window: int):
    """int32 ``[B * num_q_blocks * 4]``: per (batch, query block) the KV blocks
    ``[FIRST, LAST]`` any of its rows sees (``LAST < FIRST``: none) and the
    blocks ``[FULL_FIRST, FULL_LAST]`` every row sees whole (no mask needed).

    Rows see ``[lo(p), hi(p))`` with ``lo(p) = max(start, p - window + 1)`` and
    ``hi(p) = min(end, Skv, p + 1)`` at query position ``p``; both grow with p,
    so the union over a block is ``[lo(p_min), hi(p_max))`` and the
    intersection ``[lo(p_max), hi(p_min))``."""
    first_i, last_i = _query_index_bounds(num_q_blocks, block_q=block_q, rows=rows, sq=sq)
    start = kv_start.astype(jnp.int32)[:, None]
    end = kv_end.astype(jnp.int32)[:, None]
    p_min, p_max = end - sq + jnp.asarray(first_i, jnp.int32), end - sq + jnp.asarray(last_i, jnp.int32)

    def lo(p):
        return jnp.maximum(start, p - window + 1) if window else jnp.broadcast_to(start, p.shape)

    def hi(p):
        h = jnp.minimum(end, skv)
        return jnp.minimum(h, p + 1) if causal else jnp.broadcast_to(h, p.shape)

    any_lo, any_hi = lo(p_min), hi(p_max)
    all_lo, all_hi = lo(p_max), hi(p_min)
    first = any_lo // block_k
    last = jnp.where(any_hi > any_lo, (any_hi + block_k - 1) // block_k - 1, first - 1)
    full_first = (all_lo + block_k - 1) // block_k
    full_last = jnp.where(all_hi > all_lo, all_hi // block_k - 1, -1)
    return jnp.stack([first, last, full_first, full_last], axis=-1).astype(jnp.int32).reshape(-1)


def query_block_ranges(table, *, num_q_blocks: int, num_kv_blocks: int):
    """int32 ``[B * num_kv_blocks * 2]``: per (batch, KV block) the first and
    last query block that sees it (``last < first``: none), from the visit
    table; what the backward's dk/dv kernel clamps its query-side reads to."""
    entries = table.reshape(-1, num_q_blocks, TABLE_COLUMNS)
    kv_block = jnp.arange(num_kv_blocks, dtype=jnp.int32)[None, :, None]
    sees = (entries[:, None, :, FIRST] <= kv_block) & (kv_block <= entries[:, None, :, LAST])  # [B, Kb, Qb]
    q_block = jnp.arange(num_q_blocks, dtype=jnp.int32)
    first = jnp.min(jnp.where(sees, q_block, num_q_blocks), axis=-1)
    last = jnp.max(jnp.where(sees, q_block, -1), axis=-1)
    return jnp.stack([first, last], axis=-1).astype(jnp.int32).reshape(-1)


def _table_entry(table_ref, b, q_block, column, num_q_blocks):
    return table_ref[(b * num_q_blocks + q_block) * TABLE_COLUMNS + column]


STAT_LANES = 128  # row statistics are kept replicated over one vreg's lanes


def _lanes(stat, width: int):
    """A ``[rows, STAT_LANES]`` lane-replicated statistic as ``[rows, width]``.
    Whole-vreg copies (concatenation) for multiples of 128 lanes and a lane
    slice below: neither needs the cross-lane unit, unlike broadcasting a
    ``[rows, 1]`` column, which costs one XLU broadcast per vreg row and was
    what bounded a tile's schedule."""
    if width == STAT_LANES:
        return stat
    if width % STAT_LANES == 0:
        return jnp.concatenate([stat] * (width // STAT_LANES), axis=1)
    if width < STAT_LANES:
        return stat[:, :width]
    return jnp.broadcast_to(stat[:, :1], (stat.shape[0], width))


def _online_softmax_step(s, v, m_ref, l_ref, acc_ref, *, masked: bool, exp):
    """Fold one tile of scores ``s [block_q, block_k]`` into the running max,
    denominator and accumulator (``exp``: ``jnp.exp``, or ``jnp.exp2`` when the
    scores are in base 2). ``masked``: ``s`` may hold ``-inf`` (a row may have
    seen no key yet), so the max is made safe before ``exp``."""
    m_prev = m_ref[...]  # [block_q, STAT_LANES]
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
    p = exp(s - _lanes(shift, s.shape[1]))
    alpha = exp(m_prev - shift)
    l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
    acc_ref[...] = _lanes(alpha, acc_ref.shape[1]) * acc_ref[...] + dot_f32(p.astype(v.dtype), v, 1, 0)
    m_ref[...] = m_new


def _flash_kernel(table_ref, steps_ref, kv_start_ref, kv_end_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_ref,
                  l_ref, acc_ref, *, block_q: int, block_k: int, sq: int, skv: int, causal: bool, window: int,
                  softcap: float, scale: float, num_q_blocks: int):
    b, split, q_block, step = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    entry = functools.partial(_table_entry, table_ref, b, q_block, num_q_blocks=num_q_blocks)
    kv_block = _kv_block_of_step(entry, split, step, pl.num_programs(4))
    live = (kv_block >= entry(FIRST)) & (kv_block <= entry(LAST))
    whole = (kv_block >= entry(FULL_FIRST)) & (kv_block <= entry(FULL_LAST))

    @pl.when(step == 0)
    def _init():
        m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    # Without soft-capping the scores are kept in base 2: log2(e) joins the
    # scale on q (a [block_q, D] product, not a [block_q, block_k] one) and
    # exp2 needs no multiply of its own.
    base2 = not softcap
    exp = jnp.exp2 if base2 else jnp.exp

    def scores():
        q = q_ref[...]
        if base2:
            q = (q.astype(jnp.float32) * (scale * LOG2_E)).astype(q.dtype)
            return dot_f32(q, k_ref[...], 1, 1)  # [block_q, block_k]
        s = dot_f32(q, k_ref[...], 1, 1) * scale
        return softcap * jnp.tanh(s / softcap)

    @pl.when(live & whole)
    def _interior():  # every row sees every key of the block: no mask at all
        _online_softmax_step(scores(), v_ref[...], m_ref, l_ref, acc_ref, masked=False, exp=exp)

    @pl.when(live & jnp.logical_not(whole))
    def _edge():
        # Per-row bounds as [block_q, 1] columns: the [block_q, block_k] tile
        # pays two compares and a select, not the integer arithmetic.
        lo, hi = _row_key_bounds(b, q_block, kv_start_ref, kv_end_ref, block_q=block_q, sq=sq, skv=skv,
                                 causal=causal, window=window)
        keys = kv_block * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        s = jnp.where((keys >= lo) & (keys < hi), scores(), -jnp.inf)
        v = v_ref[...]
        if skv % block_k:  # the tail block holds rows past Skv: garbage, zeroed (0 * NaN is NaN)
            key_rows = kv_block * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
            v = jnp.where(key_rows < skv, v.astype(jnp.float32), 0.0).astype(v.dtype)
        _online_softmax_step(s, v, m_ref, l_ref, acc_ref, masked=True, exp=exp)

    @pl.when(step == pl.num_programs(4) - 1)
    def _finish():
        l = l_ref[...]
        seen = l > 0
        inv = _lanes(jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0), acc_ref.shape[1])
        o_ref[...] = (acc_ref[...] * inv).astype(o_ref.dtype)
        m = m_ref[...][:, :1] / LOG2_E if base2 else m_ref[...][:, :1]  # lse is natural-log
        lse_ref[...] = jnp.where(seen[:, :1], m + jnp.log(jnp.where(seen[:, :1], l[:, :1], 1.0)), -jnp.inf)


def _kv_block_of_step(entry, split, step, steps_per_split):
    """The KV block a grid step works on, counted from the query block's first
    visible block: the grid's KV axis spans only the most blocks any query
    block sees (a window's, a static cache's filled part), not every block."""
    return entry(FIRST) + split * steps_per_split + step


def _clamped_kv_index(table_ref, b, q_block, kv_block, *, num_q_blocks, num_kv_blocks):
    """The KV block a step reads: ``kv_block`` clamped into ``[FIRST, LAST]``, so
    a step with nothing to do stays on a neighbouring block and starts no DMA."""
    entry = functools.partial(_table_entry, table_ref, b, q_block, num_q_blocks=num_q_blocks)
    lo = jnp.clip(entry(FIRST), 0, num_kv_blocks - 1)
    return jnp.clip(kv_block, lo, jnp.clip(entry(LAST), lo, num_kv_blocks - 1))


def _shapes_and_blocks(rule, q, v, block_sizes, causal, window, generation):
    """``(batch, hq, hkv, sq, skv, d, dv, rows, (block_q, block_k))``: the blocks
    given, or those of ``rule`` (a ``blocks.choose_*blocks``)."""
    batch, hq, sq, d = q.shape
    _, hkv, skv, dv = v.shape
    rows = hq // hkv * sq
    chosen = block_sizes or rule(rows, skv, head_dim=d, v_dim=dv, itemsize=q.dtype.itemsize,
                                 window=window if causal else 0, generation=generation)
    return batch, hq, hkv, sq, skv, d, dv, rows, tuple(chosen)


def _forward_plan(q, k, v, block_sizes, kv_splits, generation, causal, window):
    batch, _, hkv, sq, skv, _, _, rows, (block_q, block_k) = _shapes_and_blocks(
        blocks_lib.choose_blocks, q, v, block_sizes, causal, window, generation)
    num_q_blocks, num_kv_blocks = cdiv(rows, block_q), cdiv(skv, block_k)
    kv_steps = _max_kv_steps(num_kv_blocks, block_q=block_q, block_k=block_k, sq=sq, causal=causal, window=window)
    splits = kv_splits or blocks_lib.choose_kv_splits(batch * hkv, num_q_blocks, kv_steps, generation)
    return _Plan(rows, block_q, block_k, num_q_blocks, num_kv_blocks, max(1, min(splits, kv_steps)), kv_steps)


def _max_kv_steps(num_kv_blocks: int, *, block_q: int, block_k: int, sq: int, causal: bool, window: int) -> int:
    """Static bound on the KV blocks one query block sees: every block, or for
    a causal sliding window ``span - 1 + window`` keys (``span``: the query
    positions of one block, ``block_q`` when blocks do not straddle heads, else
    ``Sq``). The grid's KV axis is the data's own maximum (``kv_steps``), at
    most this."""
    if not (causal and window):
        return num_kv_blocks
    span = block_q if sq % block_q == 0 else sq
    return min(num_kv_blocks, cdiv(span - 1 + window, block_k) + 1)  # +1: the span may start mid-block


def kv_steps(table, *, max_steps: int, splits: int):
    """KV grid steps per split: the most blocks any (batch, query block) sees,
    at least one (the first and last steps initialise and store)."""
    entries = table.reshape(-1, TABLE_COLUMNS)
    most = jnp.clip(jnp.max(entries[:, LAST] - entries[:, FIRST] + 1), 1, max_steps)
    return (most + splits - 1) // splits


@dataclasses.dataclass(frozen=True)
class _Plan:
    rows: int
    block_q: int
    block_k: int
    num_q_blocks: int
    num_kv_blocks: int
    splits: int
    max_steps: int  # static bound of the KV grid axis (before splitting)


def kv_block_plan(kv_start, kv_end, *, rows: int, sq: int, skv: int, causal: bool, window: int,
                  block_sizes=None, kv_splits=None, head_dim: int = 128, generation=None):
    """The forward kernel's own visit plan, for tests and benchmarks, per KV
    head: a ``VisitPlan`` of the KV block steps that compute, the K/V block
    fetches (a fetch happens when the clamped block index changes between
    consecutive steps), the grid's steps, and the dense count (every query
    block against every KV block)."""
    shape = jax.ShapeDtypeStruct((1, rows // sq, sq, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1, skv, head_dim), jnp.bfloat16)
    plan = _forward_plan(shape, kv, kv, block_sizes, kv_splits, generation, causal, window)
    starts, ends = np.asarray(kv_start, np.int32), np.asarray(kv_end, np.int32)
    table = np.asarray(visit_table(jnp.asarray(starts), jnp.asarray(ends), num_q_blocks=plan.num_q_blocks,
                                   block_q=plan.block_q, block_k=plan.block_k, rows=rows, sq=sq, skv=skv,
                                   causal=causal, window=window)).reshape(len(starts), plan.num_q_blocks,
                                                                          TABLE_COLUMNS)
    per_split = int(kv_steps(jnp.asarray(table), max_steps=plan.max_steps, splits=plan.splits))
    live = fetched = 0
    for b in range(len(starts)):
        previous = None
        for split in range(plan.splits):
            for qb in range(plan.num_q_blocks):
                entry = lambda column: int(table[b, qb, column])  # noqa: E731
                lo = min(max(entry(FIRST), 0), plan.num_kv_blocks - 1)
                hi = min(max(entry(LAST), lo), plan.num_kv_blocks - 1)
                for step in range(per_split):
                    kb = _kv_block_of_step(entry, split, step, per_split)
                    live += bool(entry(FIRST) <= kb <= entry(LAST))
                    index = min(max(kb, lo), hi)
                    fetched += index != previous
                    previous = index
    return VisitPlan(live, fetched, len(starts) * plan.num_q_blocks * plan.splits * per_split,
                     len(starts) * plan.num_q_blocks * plan.num_kv_blocks)


class VisitPlan(typing.NamedTuple):
    live: int
    fetched: int
    grid_steps: int
    dense: int


def _prepare(q, k, v, block_sizes, causal, window, generation):
    """Backward shapes and blocks."""
    batch, hq, hkv, sq, skv, d, dv, rows, (block_q, block_k) = _shapes_and_blocks(
        blocks_lib.choose_backward_blocks, q, v, block_sizes, causal, window, generation)
    static = dict(block_q=block_q, block_k=block_k, sq=sq, causal=causal, window=window)
    return batch, hq, hkv, sq, skv, d, dv, rows, static


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


def flash_attention_with_lse(q, k, v, kv_start, kv_end, sinks=None, *, causal: bool = True, window: int = 0,
                             softcap: float = 0.0, scale: float | None = None, block_sizes=None,
                             kv_splits: int | None = None, generation: str | None = None, interpret=False):
    """``(out [B, Hq, Sq, Dv], lse [B, Hkv, G * Sq, 1])``: the attention and the
    log-sum-exp of each row's softmax, sinks included (what the backward needs).

    ``kv_splits``: split the keys into that many parallel parts whose partial
    softmaxes are merged afterwards (``blocks.choose_kv_splits`` when None)."""
    batch, hq, sq, d = q.shape
    _, hkv, skv, dv = v.shape
    scale = d ** -0.5 if scale is None else scale
    rows = hq // hkv * sq
    if 0 in (batch, hq, sq, dv) or skv == 0:
        lse = jnp.full((batch, hkv, rows, 1), -jnp.inf, jnp.float32)
        if sinks is not None:  # no key: the sink alone
            lse = _per_row(sinks.astype(jnp.float32), batch, hkv, hq // hkv, sq)
        return jnp.zeros((batch, hq, sq, dv), q.dtype), lse
    plan = _forward_plan(q, k, v, block_sizes, kv_splits, generation, causal, window)
    table = visit_table(kv_start, kv_end, num_q_blocks=plan.num_q_blocks, block_q=plan.block_q,
                        block_k=plan.block_k, rows=rows, sq=sq, skv=skv, causal=causal, window=window)
    block_q, block_k, splits = plan.block_q, plan.block_k, plan.splits
    per_split = kv_steps(table, max_steps=plan.max_steps, splits=splits)  # traced: a dynamic grid axis
    where = dict(num_q_blocks=plan.num_q_blocks, num_kv_blocks=plan.num_kv_blocks)

    def kv_at(b, h, split, qb, step, table_ref, steps_ref, *_):
        entry = functools.partial(_table_entry, table_ref, b, qb, num_q_blocks=plan.num_q_blocks)
        kv_block = _kv_block_of_step(entry, split, step, steps_ref[0])
        return b, h, _clamped_kv_index(table_ref, b, qb, kv_block, **where), 0

    def rows_at(b, h, split, qb, step, *_):
        return b, h, qb, 0

    def split_rows_at(b, h, split, qb, step, *_):
        return b, h, split, qb, 0

    kernel = functools.partial(_flash_kernel, block_q=block_q, block_k=block_k, sq=sq, skv=skv, causal=causal,
                               window=window, softcap=float(softcap), scale=float(scale),
                               num_q_blocks=plan.num_q_blocks)
    # One split: the final output in q's dtype; several: f32 partials to merge.
    out_dtype = q.dtype if splits == 1 else jnp.float32
    operands = (q, k, v, kv_start, kv_end)
    out, lse = pl.pallas_call(
        kernel,
        out_shape=(out_struct((batch, hkv, splits, rows, dv), out_dtype, *operands),
                   out_struct((batch, hkv, splits, rows, 1), jnp.float32, *operands)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(batch, hkv, splits, plan.num_q_blocks, per_split),
            in_specs=[pl.BlockSpec((None, None, block_q, d), rows_at),
                      pl.BlockSpec((None, None, block_k, d), kv_at),
                      pl.BlockSpec((None, None, block_k, dv), kv_at)],
            out_specs=[pl.BlockSpec((None, None, None, block_q, dv), split_rows_at),
                       pl.BlockSpec((None, None, None, block_q, 1), split_rows_at)],
            scratch_shapes=[pltpu.VMEM((block_q, STAT_LANES), jnp.float32),
                            pltpu.VMEM((block_q, STAT_LANES), jnp.float32),
                            pltpu.VMEM((block_q, dv), jnp.float32)],
        ),
        compiler_params=compiler_params(generation, ("parallel",) * 4 + ("arbitrary",)),
        interpret=interpret,
        name="flash_attention_fwd",
    )(table, per_split.reshape(1), kv_start.astype(jnp.int32), kv_end.astype(jnp.int32),
      q.reshape(batch, hkv, rows, d), k, v)
    if splits == 1:
        out, lse = out[:, :, 0], lse[:, :, 0]
    else:
        out, lse = merge_splits(out, lse)
    if sinks is not None:
        # softmax over [scores, sink] = softmax(scores) * 1 / (1 + exp(sink - lse))
        sink_rows = _per_row(sinks.astype(jnp.float32), batch, hkv, hq // hkv, sq)
        out = out.astype(jnp.float32) * jax.nn.sigmoid(lse - sink_rows)
        lse = jnp.logaddexp(lse, sink_rows)
    return out.astype(q.dtype).reshape(batch, hq, sq, dv), lse


def _per_row(per_head, batch, hkv, group, sq):
    """``[Hq]`` values as ``[B, Hkv, G * Sq, 1]``, the kernel's row layout."""
    return jnp.broadcast_to(per_head.reshape(1, hkv, group, 1, 1), (batch, hkv, group, sq, 1)).reshape(
        batch, hkv, group * sq, 1)


def flash_attention(q, k, v, kv_start, kv_end, sinks=None, **kwargs):
    """``softmax(mask(cap(scale * q k^T))) v`` per head; see the module docstring.

    ``kv_start``, ``kv_end``: int32 ``[B]``. ``sinks``: ``[Hq]`` logits or None.
    Returns ``[B, Hq, Sq, Dv]`` in q's dtype. Inputs are assumed valid.
    """
    return flash_attention_with_lse(q, k, v, kv_start, kv_end, sinks, **kwargs)[0]


# ----------------------------------------------------------------------------
# Backward: dq, dk, dv (and the sinks' gradient) from the forward's lse
# ----------------------------------------------------------------------------


def _row_key_bounds(b, q_block, kv_start_ref, kv_end_ref, *, block_q, sq, skv, causal, window):
    """``(lo, hi)`` as ``[block_q, 1]`` columns: the keys ``[lo, hi)`` each row of
    the query block sees (the same rule as ``visit_table``)."""
    start, end = kv_start_ref[b], kv_end_ref[b]
    rows = q_block * block_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
    pos = end - sq + (_rem(rows, sq) if sq > 1 else 0)
    hi = jnp.broadcast_to(jnp.minimum(end, skv), rows.shape)
    hi = jnp.minimum(hi, pos + 1) if causal else hi
    lo = jnp.maximum(start, pos - window + 1) if window else jnp.broadcast_to(start, rows.shape)
    return lo, hi


def _recompute(q, k, lse, *, masked, bounds, kv_block, block_k, softcap, scale):
    """Probabilities ``p`` of one (query block, key block) tile and ``tanh`` of
    the capped logits (None without soft-capping). ``masked``: apply ``bounds``
    (per-row ``(lo, hi)`` columns) and guard rows that saw no key (lse -inf)."""
    if softcap:
        t = jnp.tanh(dot_f32(q, k, 1, 1) * (scale / softcap))
        x, lse_, exp = softcap * t, lse, jnp.exp
    else:
        # Base 2, log2(e) and the scale on q ([block_q, D]), as in the forward.
        q2 = (q.astype(jnp.float32) * (scale * LOG2_E)).astype(q.dtype)
        x, t, lse_, exp = dot_f32(q2, k, 1, 1), None, lse * LOG2_E, jnp.exp2
    if not masked:
        return exp(x - lse_), t
    lo, hi = bounds
    keys = kv_block * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    visible = (keys >= lo) & (keys < hi)
    safe_lse = jnp.where(lse_ == -jnp.inf, 0.0, lse_)
    return jnp.where(visible, exp(jnp.where(visible, x, 0.0) - safe_lse), 0.0), t


def _zero_rows_past(x, first_row, limit):
    """Rows of a block at or past ``limit`` are padding (garbage): zeroed, as
    ``0 * NaN`` would otherwise poison the products."""
    row = first_row + lax.broadcasted_iota(jnp.int32, (x.shape[0], 1), 0)
    return jnp.where(row < limit, x.astype(jnp.float32), 0.0).astype(x.dtype)


def _logit_grads(do, v, delta, p, t):
    """Gradient of the pre-cap logits of one tile, ``p * (dO v^T - delta)``
    through the cap's ``tanh``; without the scale, applied once to the
    accumulated dq / dk. Invisible entries have ``p = 0``, so ``ds = 0``."""
    ds = p * (dot_f32(do, v, 1, 1) - delta)
    return ds * (1.0 - t * t) if t is not None else ds


@dataclasses.dataclass(frozen=True)
class _QueryWalk:
    """How the dk/dv kernel walks query blocks for one KV block. ``heads`` x
    ``steps`` grid steps; per head ``g`` the blocks ``g * blocks_per_head +
    first + j`` (``first``: the first query block of head 0 that sees the KV
    block). A causal window with blocks aligned to heads walks only the
    window's blocks of each head (``relative``); otherwise every block in turn."""
    heads: int
    steps: int
    blocks_per_head: int
    relative: bool


def _query_walk(num_q_blocks, *, group, block_q, block_k, sq, causal, window) -> _QueryWalk:
    if causal and window and sq % block_q == 0:
        per_head = sq // block_q
        # Queries at positions [j, j + window - 1] see key j: a block of keys is
        # seen by block_k - 1 + window positions, from a block boundary or not.
        steps = min(per_head, cdiv(block_k - 1 + window, block_q) + 1)
        if steps < per_head:
            return _QueryWalk(group, steps, per_head, True)
    return _QueryWalk(1, num_q_blocks, num_q_blocks, False)


def _dkv_query_block(q_range_ref, b, kv_block, head, step, *, num_kv_blocks, walk: _QueryWalk, for_dma: bool):
    """``(q_block, in_walk)`` of a dk/dv grid step. ``for_dma``: the block to
    read, clamped into the range that sees the KV block so that skipped steps
    keep the resident one; else the block the step computes (``in_walk``:
    a real one, not a step past the end of a head's window walk)."""
    first = q_range_ref[2 * (b * num_kv_blocks + kv_block)]
    last = q_range_ref[2 * (b * num_kv_blocks + kv_block) + 1]
    if walk.relative:
        within = first + step  # ``first`` is head 0's: heads see the same positions
        in_walk = within < walk.blocks_per_head
        return head * walk.blocks_per_head + jnp.clip(within, 0, walk.blocks_per_head - 1), in_walk
    if not for_dma:
        return step, True
    lo = jnp.clip(first, 0, walk.blocks_per_head - 1)
    return jnp.clip(step, lo, jnp.clip(last, lo, walk.blocks_per_head - 1)), True


def _tile_kinds(table_ref, b, q_block, kv_block, *, num_q_blocks, whole_q_blocks):
    """``(live, whole)`` of one tile from the visit table; a query block with
    padding rows (past ``whole_q_blocks``) always takes the masked path."""
    entry = functools.partial(_table_entry, table_ref, b, q_block, num_q_blocks=num_q_blocks)
    live = (kv_block >= entry(FIRST)) & (kv_block <= entry(LAST))
    whole = (kv_block >= entry(FULL_FIRST)) & (kv_block <= entry(FULL_LAST)) & (q_block < whole_q_blocks)
    return live, whole


def _dkv_kernel(table_ref, q_range_ref, kv_start_ref, kv_end_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref, dk_acc, dv_acc, *, block_q, block_k, sq, rows, skv, causal, window, softcap, scale,
                num_q_blocks, num_kv_blocks, walk):
    b, kv_block, head, step = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    q_block, in_walk = _dkv_query_block(q_range_ref, b, kv_block, head, step, num_kv_blocks=num_kv_blocks, walk=walk,
                                        for_dma=False)
    live, whole = _tile_kinds(table_ref, b, q_block, kv_block, num_q_blocks=num_q_blocks,
                              whole_q_blocks=rows // block_q)
    live &= in_walk
    first_step = (head == 0) & (step == 0)
    last_step = (head == pl.num_programs(3) - 1) & (step == pl.num_programs(4) - 1)

    @pl.when(first_step)
    def _init():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    def accumulate(masked):
        q, do, delta, bounds = q_ref[...], do_ref[...], delta_ref[...], None
        if masked:
            if rows % block_q:  # padding rows: garbage in q, dO and delta would reach dk through 0 * NaN
                q, do, delta = (_zero_rows_past(x, q_block * block_q, rows) for x in (q, do, delta))
            lo, hi = _row_key_bounds(b, q_block, kv_start_ref, kv_end_ref, block_q=block_q, sq=sq, skv=skv,
                                     causal=causal, window=window)
            row = q_block * block_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
            bounds = lo, jnp.where(row < rows, hi, lo)  # padding rows see nothing
        p, t = _recompute(q, k_ref[...], lse_ref[...], masked=masked, bounds=bounds, kv_block=kv_block,
                          block_k=block_k, softcap=softcap, scale=scale)
        dv_acc[...] += dot_f32(p.astype(do.dtype), do, 0, 0)
        ds = _logit_grads(do, v_ref[...], delta, p, t)
        dk_acc[...] += dot_f32(ds.astype(q.dtype), q, 0, 0)

    pl.when(live & whole)(lambda: accumulate(False))
    pl.when(live & jnp.logical_not(whole))(lambda: accumulate(True))

    @pl.when(last_step)
    def _store():
        dk_ref[...] = (dk_acc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _dq_kernel(table_ref, kv_start_ref, kv_end_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_acc,
               *, block_q, block_k, sq, rows, skv, causal, window, softcap, scale, num_q_blocks):
    b, q_block, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    kv_block = _table_entry(table_ref, b, q_block, FIRST, num_q_blocks) + step  # walks from the first visible
    live, whole = _tile_kinds(table_ref, b, q_block, kv_block, num_q_blocks=num_q_blocks,
                              whole_q_blocks=rows // block_q)

    @pl.when(step == 0)
    def _init():
        dq_acc[...] = jnp.zeros_like(dq_acc)

    def accumulate(masked):
        k, v, bounds = k_ref[...], v_ref[...], None
        if masked:
            if skv % block_k:
                k, v = _zero_rows_past(k, kv_block * block_k, skv), _zero_rows_past(v, kv_block * block_k, skv)
            bounds = _row_key_bounds(b, q_block, kv_start_ref, kv_end_ref, block_q=block_q, sq=sq, skv=skv,
                                     causal=causal, window=window)
        p, t = _recompute(q_ref[...], k, lse_ref[...], masked=masked, bounds=bounds, kv_block=kv_block,
                          block_k=block_k, softcap=softcap, scale=scale)
        ds = _logit_grads(do_ref[...], v, delta_ref[...], p, t)
        dq_acc[...] += dot_f32(ds.astype(k.dtype), k, 1, 0)

    pl.when(live & whole)(lambda: accumulate(False))
    pl.when(live & jnp.logical_not(whole))(lambda: accumulate(True))

    @pl.when(step == pl.num_programs(3) - 1)
    def _store():
        dq_ref[...] = (dq_acc[...] * scale).astype(dq_ref.dtype)


def flash_attention_backward(q, k, v, out, lse, dout, kv_start, kv_end, sinks=None, *, causal: bool = True,
                             window: int = 0, softcap: float = 0.0, scale: float | None = None, block_sizes=None,
                             generation: str | None = None, interpret=False):
    """``(dq, dk, dv, d_sinks)`` of ``flash_attention`` (``d_sinks`` is ``[Hq]`` f32,
    zeros without sinks), from its output and the ``lse`` it returned."""
    batch, hq, hkv, sq, skv, d, dv, rows, static = _prepare(q, k, v, block_sizes, causal, window, generation)
    group = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    d_sinks = jnp.zeros((hq,), jnp.float32)
    if 0 in (batch, hq, sq, dv) or skv == 0:
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), d_sinks
    block_q, block_k = static["block_q"], static["block_k"]
    num_q_blocks, num_kv_blocks = cdiv(rows, block_q), cdiv(skv, block_k)
    q_rows, do_rows = q.reshape(batch, hkv, rows, d), dout.reshape(batch, hkv, rows, dv)
    # delta = rowsum(dO * O): the softmax's own term of the logits' gradient.
    delta = jnp.sum(do_rows.astype(jnp.float32) * out.reshape(batch, hkv, rows, dv).astype(jnp.float32),
                    axis=-1, keepdims=True)
    if sinks is not None:  # d sink_h = -sum over h's rows of p_sink * delta
        p_sink = jnp.exp(_per_row(sinks.astype(jnp.float32), batch, hkv, group, sq) - lse)
        d_sinks = -(p_sink * delta).reshape(batch, hkv, group, sq).sum(axis=(0, 3)).reshape(hq)
    table = visit_table(kv_start, kv_end, num_q_blocks=num_q_blocks, block_q=block_q, block_k=block_k, rows=rows,
                        sq=sq, skv=skv, causal=causal, window=window)
    q_range = query_block_ranges(table, num_q_blocks=num_q_blocks, num_kv_blocks=num_kv_blocks)
    common = dict(skv=skv, rows=rows, softcap=float(softcap), scale=float(scale), num_q_blocks=num_q_blocks,
                  block_q=block_q, block_k=block_k, sq=sq, causal=causal, window=window)
    prefetch = (kv_start.astype(jnp.int32), kv_end.astype(jnp.int32))
    semantics = ("parallel", "parallel", "parallel", "arbitrary")
    kv_walk = kv_steps(table, max_steps=_max_kv_steps(num_kv_blocks, block_q=block_q, block_k=block_k, sq=sq,
                                                      causal=causal, window=window), splits=1)

    # dk, dv: each key block walks the query blocks; those that do not see it
    # keep the resident query-side blocks (no DMA).
    walk = _query_walk(num_q_blocks, group=group, block_q=block_q, block_k=block_k, sq=sq, causal=causal,
                       window=window)

    def q_at(b, h, kb, head, step, table_ref, q_range_ref, *_):
        q_block, _ = _dkv_query_block(q_range_ref, b, kb, head, step, num_kv_blocks=num_kv_blocks, walk=walk,
                                      for_dma=True)
        return b, h, q_block, 0

    kv_at = lambda b, h, kb, head, step, *_: (b, h, kb, 0)  # noqa: E731
    dk, dv_ = pl.pallas_call(
        functools.partial(_dkv_kernel, num_kv_blocks=num_kv_blocks, walk=walk, **common),
        out_shape=(out_struct(k.shape, k.dtype, q, k, v, dout), out_struct(v.shape, v.dtype, q, k, v, dout)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(batch, hkv, num_kv_blocks, walk.heads, walk.steps),
            in_specs=[pl.BlockSpec((None, None, block_q, d), q_at), pl.BlockSpec((None, None, block_k, d), kv_at),
                      pl.BlockSpec((None, None, block_k, dv), kv_at), pl.BlockSpec((None, None, block_q, dv), q_at),
                      pl.BlockSpec((None, None, block_q, 1), q_at), pl.BlockSpec((None, None, block_q, 1), q_at)],
            out_specs=[pl.BlockSpec((None, None, block_k, d), kv_at), pl.BlockSpec((None, None, block_k, dv), kv_at)],
            scratch_shapes=[pltpu.VMEM((block_k, d), jnp.float32), pltpu.VMEM((block_k, dv), jnp.float32)],
        ),
        compiler_params=compiler_params(generation, semantics + ("arbitrary",)),
        interpret=interpret,
        name="flash_attention_bwd_dkv",
    )(table, q_range, *prefetch, q_rows, k, v, do_rows, lse, delta)

    # dq: each query block walks the key blocks it sees (skipped ones re-use the resident block).
    where = dict(num_q_blocks=num_q_blocks, num_kv_blocks=num_kv_blocks)

    def kv_index(b, h, qb, step, table_ref, *_):
        kv_block = _table_entry(table_ref, b, qb, FIRST, num_q_blocks) + step
        return b, h, _clamped_kv_index(table_ref, b, qb, kv_block, **where), 0

    row_block = lambda b, h, qb, step, *_: (b, h, qb, 0)  # noqa: E731
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **common),
        out_shape=out_struct(q_rows.shape, q.dtype, q, k, v, dout),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(batch, hkv, num_q_blocks, kv_walk),
            in_specs=[pl.BlockSpec((None, None, block_q, d), row_block),
                      pl.BlockSpec((None, None, block_k, d), kv_index),
                      pl.BlockSpec((None, None, block_k, dv), kv_index),
                      pl.BlockSpec((None, None, block_q, dv), row_block),
                      pl.BlockSpec((None, None, block_q, 1), row_block),
                      pl.BlockSpec((None, None, block_q, 1), row_block)],
            out_specs=pl.BlockSpec((None, None, block_q, d), row_block),
            scratch_shapes=[pltpu.VMEM((block_q, d), jnp.float32)],
        ),
        compiler_params=compiler_params(generation, semantics),
        interpret=interpret,
        name="flash_attention_bwd_dq",
    )(table, *prefetch, q_rows, k, v, do_rows, lse, delta)
    return dq.reshape(q.shape), dk, dv_, d_sinks
