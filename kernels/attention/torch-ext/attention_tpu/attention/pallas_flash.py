"""Flash attention forward for TPU in Pallas: online softmax, f32 accumulation.

Layout. ``q [B, Hq, Sq, D]``, ``k [B, Hkv, Skv, D]``, ``v [B, Hkv, Skv, Dv]``
with ``Hq = G * Hkv`` (GQA / MQA; K and V are never repeated). The wrapper
views q as ``[B, Hkv, G * Sq, D]`` (a free reshape: the G query heads of a KV
head are adjacent in memory), so one grid step multiplies the queries of a
whole head group by one K/V block: K and V are read once per group, and one
decode token of G heads is a G-row block, not a padded 128-row one. Row ``r``
is head ``r // Sq`` of the group at query index ``i = r % Sq``.

Which keys a row sees. Every query index ``i`` of batch row ``b`` sees one
contiguous key range ``key_bounds[b, i] = [lo, hi)`` (int32 ``[B, Sq, 2]``),
shared by all heads. ``rule_key_bounds`` gives the ranges of the rule: valid
keys ``[kv_start[b], kv_end[b])`` (left padding, the filled part of a static
cache), queries aligned to the end of that range (query ``i`` at position
``p = kv_end[b] - Sq + i``), ``causal`` keeping keys ``<= p`` and a sliding
``window`` keys ``> p - window``. A caller with a mask passes the mask's own
ranges instead: padding on either side, packed sequences (each query sees
the keys of its own document), a static cache, windows, all are a range per
row. ``causal`` and ``window`` then only choose blocks and how the grids walk
(performance), never which keys a row sees.

Skipped work. For each (batch, query block) a visit table (XLA, once per
call, from the ranges) holds the KV blocks any of its rows can see and those
every row sees whole; grid steps outside the first do no MXU work
(``pl.when``) and their K/V index maps are clamped into it, so the block
already in VMEM is reused and no DMA starts: a causal prefill does about
half of the dense work, a windowed one ``~window / Skv`` of it, and decode
against a static cache reads only the filled part. Whole blocks skip the mask.

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

from ..common.pallas_helpers import as_kernel_operand, compiler_params, dot_f32, kernel_dtype, load, out_struct
from ..common.tile_math import cdiv
from . import blocks as blocks_lib


def _rem(a, b):
    """``a % b`` for non-negative ints: lax's truncating remainder (Mosaic lowers
    Python's ``%`` through ``sign``, which needs the chip at trace time)."""
    return lax.rem(a, jnp.int32(b) if isinstance(b, int) else b)


# Columns of the per-(batch, query block) visit table, derived once per call
# on the host side of the kernel (XLA) and scalar-prefetched into SMEM.
FIRST, LAST, FULL_FIRST, FULL_LAST, RULE = range(5)
LOG2_E = 1.4426950408889634
TABLE_COLUMNS = 5


def rule_key_bounds(kv_start, kv_end, *, sq: int, skv: int, causal: bool, window: int):
    """int32 ``[B, Sq, 2]``: the key range ``[lo, hi)`` of every query index under
    the rule (see the module docstring): ``lo = max(start, p - window + 1)``,
    ``hi = min(end, Skv, p + 1)`` at position ``p = end - Sq + i``; ``hi <= lo``
    means the query sees no key."""
    start = jnp.asarray(kv_start, jnp.int32)[:, None]
    end = jnp.asarray(kv_end, jnp.int32)[:, None]
    pos = end - sq + jnp.arange(sq, dtype=jnp.int32)[None, :]
    hi = jnp.minimum(end, skv)
    hi = jnp.minimum(hi, pos + 1) if causal else jnp.broadcast_to(hi, pos.shape)
    lo = jnp.maximum(start, pos - window + 1) if window else jnp.broadcast_to(start, pos.shape)
    return jnp.stack([lo, hi], axis=-1)


def rule_fit(key_bounds, *, sq: int, skv: int, causal: bool, window: int):
    """``(kv_start [B], kv_end [B], fits [B, Sq])``: the smallest rule (a key range
    per batch row, queries aligned to its end, ``causal`` / ``window``) covering
    the ranges, and per query whether its range is exactly the rule's (empty
    ranges are equal whatever their ends). Rows that fit get their range from
    iotas in the kernel; the others read it (``[block_q, 2]``), which costs a
    lane broadcast per vreg row of every masked tile."""
    lo, hi = key_bounds[..., 0], key_bounds[..., 1]
    sees = hi > lo
    end = jnp.max(jnp.where(sees, hi, 0), axis=1)
    start = jnp.where(end > 0, jnp.min(jnp.where(sees, lo, skv), axis=1), 0)
    rule = rule_key_bounds(start, end, sq=sq, skv=skv, causal=causal, window=window)
    rule_sees = rule[..., 1] > rule[..., 0]
    fits = (sees == rule_sees) & (~sees | ((lo == rule[..., 0]) & (hi == rule[..., 1])))
    return start.astype(jnp.int32), end.astype(jnp.int32), fits


def row_bounds(key_bounds, group: int):
    """``[B, Sq, 2]`` ranges per query index -> ``[B, G * Sq, 2]`` per kernel row
    (row ``r`` is query index ``r % Sq``: the G heads of a group share them)."""
    return jnp.tile(jnp.asarray(key_bounds, jnp.int32), (1, group, 1))


def visit_table(bounds, *, num_q_blocks: int, block_q: int, block_k: int, rows: int, fits=None):
    """int32 ``[B * num_q_blocks * 5]`` from the per-row ranges ``bounds [B, rows,
    2]``: per (batch, query block) the KV blocks ``[FIRST, LAST]`` any of its
    rows sees (``LAST < FIRST``: none), the blocks ``[FULL_FIRST, FULL_LAST]``
    every row sees whole (no mask needed), and ``RULE``: 1 when every row's
    range is the rule's (``fits [B, rows]`` from ``rule_fit``; None: 0). The
    union of a block's ranges is ``[min lo, max hi)`` over the rows that see a
    key, the intersection ``[max lo, min hi)`` over all its rows (an empty row
    empties it)."""
    batch, padded = bounds.shape[0], num_q_blocks * block_q
    lo, hi = (jnp.pad(bounds[..., c], ((0, 0), (0, padded - rows))).reshape(batch, num_q_blocks, block_q)
              for c in (0, 1))
    real = (jnp.arange(padded) < rows).reshape(num_q_blocks, block_q)  # the last block's padding rows
    sees = real & (hi > lo)
    big = jnp.iinfo(jnp.int32).max
    any_lo = jnp.min(jnp.where(sees, lo, big), axis=-1)
    any_hi = jnp.max(jnp.where(sees, hi, 0), axis=-1)
    all_lo = jnp.max(jnp.where(real, lo, 0), axis=-1)
    all_hi = jnp.min(jnp.where(real, hi, big), axis=-1)
    some = any_hi > any_lo
    # A block that sees nothing still names a block near its rows' keys: its
    # steps stay on a neighbour already in VMEM rather than fetch block 0.
    first = jnp.where(some, any_lo, jnp.maximum(jnp.min(jnp.where(real, lo, big), axis=-1), 0)) // block_k
    last = jnp.where(some, (any_hi - 1) // block_k, first - 1)
    full_first = (all_lo + block_k - 1) // block_k
    full_last = jnp.where(all_hi > all_lo, all_hi // block_k - 1, -1)
    if fits is None:
        by_rule = jnp.zeros_like(first)
    else:
        fits = jnp.pad(fits, ((0, 0), (0, padded - rows))).reshape(batch, num_q_blocks, block_q)
        by_rule = jnp.all(fits | ~real, axis=-1)
    return jnp.stack([first, last, full_first, full_last, by_rule], axis=-1).astype(jnp.int32).reshape(-1)


def _ranges_and_table(key_bounds, group: int, *, sq: int, skv: int, causal: bool, window: int, num_q_blocks: int,
                      block_q: int, block_k: int):
    """What every kernel takes: the ranges per row, the rule's ``kv_start`` /
    ``kv_end`` (scalar-prefetched) and the visit table."""
    # Keys outside [0, Skv) do not exist: clipped, so that no caller's ranges
    # can reach a block index below 0 or unmasked tail rows.
    key_bounds = jnp.clip(jnp.asarray(key_bounds, jnp.int32), 0, skv)
    start, end, fits = rule_fit(key_bounds, sq=sq, skv=skv, causal=causal, window=window)
    bounds = row_bounds(key_bounds, group)
    table = visit_table(bounds, num_q_blocks=num_q_blocks, block_q=block_q, block_k=block_k, rows=group * sq,
                        fits=jnp.tile(fits, (1, group)))
    return bounds, start, end, table


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


def _flash_kernel(table_ref, steps_ref, start_ref, end_ref, q_ref, k_ref, v_ref, bounds_ref, o_ref, lse_ref, m_ref,
                  l_ref, acc_ref, *, block_q: int, block_k: int, skv: int, softcap: float, scale: float,
                  num_q_blocks: int, rule: "_Rule"):
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
        q = load(q_ref)
        if base2:
            q = (q.astype(jnp.float32) * (scale * LOG2_E)).astype(q.dtype)
            return dot_f32(q, load(k_ref), 1, 1)  # [block_q, block_k]
        s = dot_f32(q, load(k_ref), 1, 1) * scale
        return softcap * jnp.tanh(s / softcap)

    @pl.when(live & whole)
    def _interior():  # every row sees every key of the block: no mask at all
        _online_softmax_step(scores(), load(v_ref), m_ref, l_ref, acc_ref, masked=False, exp=exp)

    def edge(lo, hi):
        keys = kv_block * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        s = jnp.where((keys >= lo) & (keys < hi), scores(), -jnp.inf)
        v = load(v_ref)
        if skv % block_k:  # the tail block holds rows past Skv: garbage, zeroed (0 * NaN is NaN)
            key_rows = kv_block * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
            v = jnp.where(key_rows < skv, v.astype(jnp.float32), 0.0).astype(v.dtype)
        _online_softmax_step(s, v, m_ref, l_ref, acc_ref, masked=True, exp=exp)

    _masked_regions(live & jnp.logical_not(whole), entry(RULE) == 1, edge, rule=rule, start_ref=start_ref,
                    end_ref=end_ref, bounds_ref=bounds_ref, b=b, q_block=q_block)

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
    chosen = block_sizes or rule(rows, skv, head_dim=d, v_dim=dv, itemsize=kernel_dtype(q.dtype).itemsize,
                                 window=window if causal else 0, generation=generation)
    return batch, hq, hkv, sq, skv, d, dv, rows, tuple(chosen)


def _forward_plan(q, k, v, block_sizes, kv_splits, generation, causal, window):
    batch, _, hkv, sq, skv, _, _, rows, (block_q, block_k) = _shapes_and_blocks(
        blocks_lib.choose_blocks, q, v, block_sizes, causal, window, generation)
    num_q_blocks, num_kv_blocks = cdiv(rows, block_q), cdiv(skv, block_k)
    expected = _expected_kv_steps(num_kv_blocks, block_q=block_q, block_k=block_k, sq=sq, causal=causal,
                                  window=window)
    splits = kv_splits or blocks_lib.choose_kv_splits(batch * hkv, num_q_blocks, expected, generation)
    return _Plan(rows, block_q, block_k, num_q_blocks, num_kv_blocks, max(1, min(splits, expected)))


def _expected_kv_steps(num_kv_blocks: int, *, block_q: int, block_k: int, sq: int, causal: bool,
                       window: int) -> int:
    """The KV blocks one query block sees under the rule: every block, or for a
    causal sliding window ``span - 1 + window`` keys (``span``: the query
    positions of one block, ``block_q`` when blocks do not straddle heads, else
    ``Sq``). Only a hint for the KV splits: the grid's KV axis is the data's
    own maximum (``kv_steps``), whatever ranges the caller gave."""
    if not (causal and window):
        return num_kv_blocks
    span = block_q if sq % block_q == 0 else sq
    return min(num_kv_blocks, cdiv(span - 1 + window, block_k) + 1)  # +1: the span may start mid-block


def kv_steps(table, *, num_kv_blocks: int, splits: int):
    """KV grid steps per split: the most blocks any (batch, query block) sees,
    at least one (the first and last steps initialise and store)."""
    entries = table.reshape(-1, TABLE_COLUMNS)
    most = jnp.clip(jnp.max(entries[:, LAST] - entries[:, FIRST] + 1), 1, num_kv_blocks)
    return (most + splits - 1) // splits


@dataclasses.dataclass(frozen=True)
class _Plan:
    rows: int
    block_q: int
    block_k: int
    num_q_blocks: int
    num_kv_blocks: int
    splits: int


def kv_block_plan(kv_start, kv_end, *, rows: int, sq: int, skv: int, causal: bool, window: int,
                  block_sizes=None, kv_splits=None, head_dim: int = 128, generation=None):
    """The forward kernel's own visit plan, for tests and benchmarks, per KV
    head: a ``VisitPlan`` of the KV block steps that compute, the K/V block
    fetches (a fetch happens when the clamped block index changes between
    consecutive steps), the grid's steps, and the dense count (every query
    block against every KV block), for the rule's ranges on ``kv_start`` /
    ``kv_end``."""
    shape = jax.ShapeDtypeStruct((1, rows // sq, sq, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1, skv, head_dim), jnp.bfloat16)
    plan = _forward_plan(shape, kv, kv, block_sizes, kv_splits, generation, causal, window)
    key_bounds = rule_key_bounds(kv_start, kv_end, sq=sq, skv=skv, causal=causal, window=window)
    batch = len(key_bounds)
    table = np.asarray(visit_table(row_bounds(key_bounds, rows // sq), num_q_blocks=plan.num_q_blocks,
                                   block_q=plan.block_q, block_k=plan.block_k, rows=rows)).reshape(
        batch, plan.num_q_blocks, TABLE_COLUMNS)
    per_split = int(kv_steps(jnp.asarray(table), num_kv_blocks=plan.num_kv_blocks, splits=plan.splits))
    live = fetched = 0
    for b in range(batch):
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
    return VisitPlan(live, fetched, batch * plan.num_q_blocks * plan.splits * per_split,
                     batch * plan.num_q_blocks * plan.num_kv_blocks)


class VisitPlan(typing.NamedTuple):
    live: int
    fetched: int
    grid_steps: int
    dense: int


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
    (``rule_key_bounds``, or a mask's ranges); ``causal`` / ``window`` choose
    the blocks. ``kv_splits``: split the keys into that many parallel parts whose partial
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
    bounds, start, end, table = _ranges_and_table(key_bounds, hq // hkv, sq=sq, skv=skv, causal=causal,
                                                  window=window, num_q_blocks=plan.num_q_blocks, block_q=plan.block_q,
                                                  block_k=plan.block_k)
    block_q, block_k, splits = plan.block_q, plan.block_k, plan.splits
    per_split = kv_steps(table, num_kv_blocks=plan.num_kv_blocks, splits=splits)  # traced: a dynamic grid axis
    where = dict(num_q_blocks=plan.num_q_blocks, num_kv_blocks=plan.num_kv_blocks)

    def kv_at(b, h, split, qb, step, table_ref, steps_ref, *_):
        entry = functools.partial(_table_entry, table_ref, b, qb, num_q_blocks=plan.num_q_blocks)
        kv_block = _kv_block_of_step(entry, split, step, steps_ref[0])
        return b, h, _clamped_kv_index(table_ref, b, qb, kv_block, **where), 0

    def rows_at(b, h, split, qb, step, *_):
        return b, h, qb, 0

    def bounds_at(b, h, split, qb, step, *_):
        return b, qb, 0

    def split_rows_at(b, h, split, qb, step, *_):
        return b, h, split, qb, 0

    kernel = functools.partial(_flash_kernel, block_q=block_q, block_k=block_k, skv=skv, softcap=float(softcap),
                               scale=float(scale), num_q_blocks=plan.num_q_blocks,
                               rule=_Rule(block_q, sq, skv, causal, window))
    # One split: the final output in the kernel's dtype of q; several: f32 partials to merge.
    out_dtype = kernel_dtype(q.dtype) if splits == 1 else jnp.float32
    operands = (q, k, v, key_bounds)
    out, lse = pl.pallas_call(
        kernel,
        out_shape=(out_struct((batch, hkv, splits, rows, dv), out_dtype, *operands),
                   out_struct((batch, hkv, splits, rows, 1), jnp.float32, *operands)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(batch, hkv, splits, plan.num_q_blocks, per_split),
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
    )(table, per_split.reshape(1), start, end, *map(as_kernel_operand, (q.reshape(batch, hkv, rows, d), k, v)), bounds)
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


def flash_attention(q, k, v, key_bounds, sinks=None, **kwargs):
    """``softmax(mask(cap(scale * q k^T))) v`` per head; see the module docstring.

    ``key_bounds``: int32 ``[B, Sq, 2]``. ``sinks``: ``[Hq]`` logits or None.
    Returns ``[B, Hq, Sq, Dv]`` in q's dtype. Inputs are assumed valid.
    """
    return flash_attention_with_lse(q, k, v, key_bounds, sinks, **kwargs)[0]


# ----------------------------------------------------------------------------
# Backward: dq, dk, dv (and the sinks' gradient) from the forward's lse
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Rule:
    """The statics the kernels rebuild a rule row's range from (``rule_fit``)."""
    block_q: int
    sq: int
    skv: int
    causal: bool
    window: int


def _rule_row_bounds(rule: _Rule, start, end, q_block):
    """``(lo, hi)`` as ``[block_q, 1]`` columns from the rule (``rule_key_bounds``)
    on iotas: broadcasting them over a tile costs no cross-lane work."""
    rows = q_block * rule.block_q + lax.broadcasted_iota(jnp.int32, (rule.block_q, 1), 0)
    pos = end - rule.sq + (_rem(rows, rule.sq) if rule.sq > 1 else 0)
    hi = jnp.broadcast_to(jnp.minimum(end, rule.skv), rows.shape)
    hi = jnp.minimum(hi, pos + 1) if rule.causal else hi
    lo = jnp.maximum(start, pos - rule.window + 1) if rule.window else jnp.broadcast_to(start, rows.shape)
    return lo, hi


def _row_key_bounds(bounds_ref):
    """``(lo, hi)`` as ``[block_q, 1]`` columns read from the block's ranges."""
    bounds = bounds_ref[...]
    return bounds[:, 0:1], bounds[:, 1:2]


def _masked_regions(when, by_rule, body, *, rule: _Rule, start_ref, end_ref, bounds_ref, b, q_block):
    """``body(lo, hi)`` for a masked tile in two regions: the rows' ranges from
    the rule's iotas where the visit table says they fit it, else read."""
    pl.when(when & by_rule)(lambda: body(*_rule_row_bounds(rule, start_ref[b], end_ref[b], q_block)))
    pl.when(when & jnp.logical_not(by_rule))(lambda: body(*_row_key_bounds(bounds_ref)))


def _recompute(q, k, lse, *, bounds, kv_block, block_k, softcap, scale):
    """Probabilities ``p`` of one (query block, key block) tile and ``tanh`` of
    the capped logits (None without soft-capping). ``bounds``: per-row ``(lo,
    hi)`` columns of a masked tile (rows that saw no key, lse -inf, are
    guarded), None for a tile every row sees whole."""
    if softcap:
        t = jnp.tanh(dot_f32(q, k, 1, 1) * (scale / softcap))
        x, lse_, exp = softcap * t, lse, jnp.exp
    else:
        # Base 2, log2(e) and the scale on q ([block_q, D]), as in the forward.
        q2 = (q.astype(jnp.float32) * (scale * LOG2_E)).astype(q.dtype)
        x, t, lse_, exp = dot_f32(q2, k, 1, 1), None, lse * LOG2_E, jnp.exp2
    if bounds is None:
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
    """How the dk/dv kernel walks query blocks for one KV block: ``heads`` x
    ``walk_steps`` grid steps. ``relative`` (a causal window with blocks aligned
    to heads, where the window is shorter than a head's blocks): per head
    ``g`` the blocks ``g * blocks_per_head + first + j``, ``first`` the first
    query block of head 0 that sees the KV block and the step count the data's
    longest run of such blocks; otherwise every query block in turn."""
    heads: int
    blocks_per_head: int
    relative: bool


def _query_walk(num_q_blocks, *, group, block_q, block_k, sq, causal, window) -> _QueryWalk:
    if causal and window and sq % block_q == 0:
        per_head = sq // block_q
        # Under the rule, queries at positions [j, j + window - 1] see key j: a
        # block of keys is seen by block_k - 1 + window positions.
        if cdiv(block_k - 1 + window, block_q) + 1 < per_head:
            return _QueryWalk(group, per_head, True)
    return _QueryWalk(1, num_q_blocks, False)


def _walk_plan(table, walk: _QueryWalk, *, num_q_blocks: int, num_kv_blocks: int):
    """``(q_range, steps)``: per (batch, KV block) the first and last query block
    that sees it (of head 0 for a relative walk: heads repeat its positions)
    and the walk's steps per head (traced for a relative walk: the longest such
    run in the data, so any ranges are walked whole)."""
    if not walk.relative:
        return query_block_ranges(table, num_q_blocks=num_q_blocks, num_kv_blocks=num_kv_blocks), num_q_blocks
    head0 = table.reshape(-1, num_q_blocks, TABLE_COLUMNS)[:, :walk.blocks_per_head].reshape(-1)
    q_range = query_block_ranges(head0, num_q_blocks=walk.blocks_per_head, num_kv_blocks=num_kv_blocks)
    runs = q_range.reshape(-1, 2)
    steps = jnp.clip(jnp.max(runs[:, 1] - runs[:, 0] + 1), 1, walk.blocks_per_head)
    return q_range, steps


def _dkv_query_block(q_range_ref, b, kv_block, head, step, *, num_kv_blocks, walk: _QueryWalk, for_dma: bool):
    """``(q_block, in_walk)`` of a dk/dv grid step. ``for_dma``: the block to
    read, clamped into the range that sees the KV block so that skipped steps
    keep the resident one; else the block the step computes (``in_walk``:
    a real one, not a step past the end of a head's blocks)."""
    first = q_range_ref[2 * (b * num_kv_blocks + kv_block)]
    last = q_range_ref[2 * (b * num_kv_blocks + kv_block) + 1]
    per_head = walk.blocks_per_head
    if walk.relative:
        within = first + step
        in_walk = within < per_head
        top = jnp.clip(last, 0, per_head - 1) if for_dma else per_head - 1
        return head * per_head + jnp.clip(within, 0, top), in_walk
    if not for_dma:
        return step, True
    lo = jnp.clip(first, 0, per_head - 1)
    return jnp.clip(step, lo, jnp.clip(last, lo, per_head - 1)), True


def _tile_kinds(table_ref, b, q_block, kv_block, *, num_q_blocks, whole_q_blocks):
    """``(live, whole)`` of one tile from the visit table; a query block with
    padding rows (past ``whole_q_blocks``) always takes the masked path."""
    entry = functools.partial(_table_entry, table_ref, b, q_block, num_q_blocks=num_q_blocks)
    live = (kv_block >= entry(FIRST)) & (kv_block <= entry(LAST))
    whole = (kv_block >= entry(FULL_FIRST)) & (kv_block <= entry(FULL_LAST)) & (q_block < whole_q_blocks)
    return live, whole


def _dkv_kernel(table_ref, q_range_ref, start_ref, end_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, bounds_ref,
                dk_ref, dv_ref, dk_acc, dv_acc, *, block_q, block_k, rows, softcap, scale, num_q_blocks, num_kv_blocks,
                walk, rule):
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

    def accumulate(bounds):  # bounds: (lo, hi) columns of a masked tile, None for a whole one
        q, do, delta = load(q_ref), load(do_ref), delta_ref[...]
        if bounds is not None:
            if rows % block_q:  # padding rows: garbage in q, dO and delta would reach dk through 0 * NaN
                q, do, delta = (_zero_rows_past(x, q_block * block_q, rows) for x in (q, do, delta))
            lo, hi = bounds
            row = q_block * block_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
            bounds = lo, jnp.where(row < rows, hi, lo)  # padding rows see nothing
        p, t = _recompute(q, load(k_ref), lse_ref[...], bounds=bounds, kv_block=kv_block, block_k=block_k,
                          softcap=softcap, scale=scale)
        dv_acc[...] += dot_f32(p.astype(do.dtype), do, 0, 0)
        ds = _logit_grads(do, load(v_ref), delta, p, t)
        dk_acc[...] += dot_f32(ds.astype(q.dtype), q, 0, 0)

    pl.when(live & whole)(lambda: accumulate(None))
    _masked_regions(live & jnp.logical_not(whole), _table_entry(table_ref, b, q_block, RULE, num_q_blocks) == 1,
                    lambda lo, hi: accumulate((lo, hi)), rule=rule, start_ref=start_ref, end_ref=end_ref,
                    bounds_ref=bounds_ref, b=b, q_block=q_block)

    @pl.when(last_step)
    def _store():
        dk_ref[...] = (dk_acc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _dq_kernel(table_ref, start_ref, end_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, bounds_ref, dq_ref,
               dq_acc, *, block_q, block_k, rows, skv, softcap, scale, num_q_blocks, rule):
    b, q_block, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    kv_block = _table_entry(table_ref, b, q_block, FIRST, num_q_blocks) + step  # walks from the first visible
    live, whole = _tile_kinds(table_ref, b, q_block, kv_block, num_q_blocks=num_q_blocks,
                              whole_q_blocks=rows // block_q)

    @pl.when(step == 0)
    def _init():
        dq_acc[...] = jnp.zeros_like(dq_acc)

    def accumulate(bounds):  # bounds: (lo, hi) columns of a masked tile, None for a whole one
        k, v = load(k_ref), load(v_ref)
        if bounds is not None and skv % block_k:
            k, v = _zero_rows_past(k, kv_block * block_k, skv), _zero_rows_past(v, kv_block * block_k, skv)
        p, t = _recompute(load(q_ref), k, lse_ref[...], bounds=bounds, kv_block=kv_block, block_k=block_k,
                          softcap=softcap, scale=scale)
        ds = _logit_grads(load(do_ref), v, delta_ref[...], p, t)
        dq_acc[...] += dot_f32(ds.astype(k.dtype), k, 1, 0)

    pl.when(live & whole)(lambda: accumulate(None))
    _masked_regions(live & jnp.logical_not(whole), _table_entry(table_ref, b, q_block, RULE, num_q_blocks) == 1,
                    lambda lo, hi: accumulate((lo, hi)), rule=rule, start_ref=start_ref, end_ref=end_ref,
                    bounds_ref=bounds_ref, b=b, q_block=q_block)

    @pl.when(step == pl.num_programs(3) - 1)
    def _store():
        dq_ref[...] = (dq_acc[...] * scale).astype(dq_ref.dtype)


def flash_attention_backward(q, k, v, out, lse, dout, key_bounds, sinks=None, *, causal: bool = True,
                             window: int = 0, softcap: float = 0.0, scale: float | None = None, block_sizes=None,
                             generation: str | None = None, interpret=False):
    """``(dq, dk, dv, d_sinks)`` of ``flash_attention`` (``d_sinks`` is ``[Hq]`` f32,
    zeros without sinks), from its output and the ``lse`` it returned."""
    batch, hq, hkv, sq, skv, d, dv, rows, (block_q, block_k) = _shapes_and_blocks(
        blocks_lib.choose_backward_blocks, q, v, block_sizes, causal, window, generation)
    group = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    d_sinks = jnp.zeros((hq,), jnp.float32)
    if 0 in (batch, hq, sq, dv) or skv == 0:
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), d_sinks
    num_q_blocks, num_kv_blocks = cdiv(rows, block_q), cdiv(skv, block_k)
    q_rows, do_rows = q.reshape(batch, hkv, rows, d), dout.reshape(batch, hkv, rows, dv)
    # delta = rowsum(dO * O): the softmax's own term of the logits' gradient.
    delta = jnp.sum(do_rows.astype(jnp.float32) * out.reshape(batch, hkv, rows, dv).astype(jnp.float32),
                    axis=-1, keepdims=True)
    if sinks is not None:  # d sink_h = -sum over h's rows of p_sink * delta
        p_sink = jnp.exp(_per_row(sinks.astype(jnp.float32), batch, hkv, group, sq) - lse)
        d_sinks = -(p_sink * delta).reshape(batch, hkv, group, sq).sum(axis=(0, 3)).reshape(hq)
    bounds, start, end, table = _ranges_and_table(key_bounds, group, sq=sq, skv=skv, causal=causal, window=window,
                                                  num_q_blocks=num_q_blocks, block_q=block_q, block_k=block_k)
    common = dict(rows=rows, softcap=float(softcap), scale=float(scale), num_q_blocks=num_q_blocks,
                  block_q=block_q, block_k=block_k, rule=_Rule(block_q, sq, skv, causal, window))
    operands = (q, k, v, dout, key_bounds)
    semantics = ("parallel", "parallel", "parallel", "arbitrary")
    kv_walk = kv_steps(table, num_kv_blocks=num_kv_blocks, splits=1)

    # dk, dv: each key block walks the query blocks; those that do not see it
    # keep the resident query-side blocks (no DMA).
    walk = _query_walk(num_q_blocks, group=group, block_q=block_q, block_k=block_k, sq=sq, causal=causal,
                       window=window)
    q_range, walk_steps = _walk_plan(table, walk, num_q_blocks=num_q_blocks, num_kv_blocks=num_kv_blocks)

    def q_at(b, h, kb, head, step, table_ref, q_range_ref, *_):
        q_block, _ = _dkv_query_block(q_range_ref, b, kb, head, step, num_kv_blocks=num_kv_blocks, walk=walk,
                                      for_dma=True)
        return b, h, q_block, 0

    def q_bounds_at(*grid_and_refs):
        b, _, q_block, _ = q_at(*grid_and_refs)
        return b, q_block, 0

    kv_at = lambda b, h, kb, head, step, *_: (b, h, kb, 0)  # noqa: E731
    dk, dv_ = pl.pallas_call(
        functools.partial(_dkv_kernel, num_kv_blocks=num_kv_blocks, walk=walk, **common),
        out_shape=(out_struct(k.shape, kernel_dtype(k.dtype), *operands),
                   out_struct(v.shape, kernel_dtype(v.dtype), *operands)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(batch, hkv, num_kv_blocks, walk.heads, walk_steps),
            in_specs=[pl.BlockSpec((None, None, block_q, d), q_at), pl.BlockSpec((None, None, block_k, d), kv_at),
                      pl.BlockSpec((None, None, block_k, dv), kv_at), pl.BlockSpec((None, None, block_q, dv), q_at),
                      pl.BlockSpec((None, None, block_q, 1), q_at), pl.BlockSpec((None, None, block_q, 1), q_at),
                      pl.BlockSpec((None, block_q, 2), q_bounds_at)],
            out_specs=[pl.BlockSpec((None, None, block_k, d), kv_at), pl.BlockSpec((None, None, block_k, dv), kv_at)],
            scratch_shapes=[pltpu.VMEM((block_k, d), jnp.float32), pltpu.VMEM((block_k, dv), jnp.float32)],
        ),
        compiler_params=compiler_params(generation, semantics + ("arbitrary",)),
        interpret=interpret,
        name="flash_attention_bwd_dkv",
    )(table, q_range, start, end, *map(as_kernel_operand, (q_rows, k, v, do_rows)), lse, delta, bounds)

    # dq: each query block walks the key blocks it sees (skipped ones re-use the resident block).
    where = dict(num_q_blocks=num_q_blocks, num_kv_blocks=num_kv_blocks)

    def kv_index(b, h, qb, step, table_ref, *_):
        kv_block = _table_entry(table_ref, b, qb, FIRST, num_q_blocks) + step
        return b, h, _clamped_kv_index(table_ref, b, qb, kv_block, **where), 0

    row_block = lambda b, h, qb, step, *_: (b, h, qb, 0)  # noqa: E731
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, skv=skv, **common),
        out_shape=out_struct(q_rows.shape, kernel_dtype(q.dtype), *operands),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(batch, hkv, num_q_blocks, kv_walk),
            in_specs=[pl.BlockSpec((None, None, block_q, d), row_block),
                      pl.BlockSpec((None, None, block_k, d), kv_index),
                      pl.BlockSpec((None, None, block_k, dv), kv_index),
                      pl.BlockSpec((None, None, block_q, dv), row_block),
                      pl.BlockSpec((None, None, block_q, 1), row_block),
                      pl.BlockSpec((None, None, block_q, 1), row_block),
                      pl.BlockSpec((None, block_q, 2), lambda b, h, qb, step, *_: (b, qb, 0))],
            out_specs=pl.BlockSpec((None, None, block_q, d), row_block),
            scratch_shapes=[pltpu.VMEM((block_q, d), jnp.float32)],
        ),
        compiler_params=compiler_params(generation, semantics),
        interpret=interpret,
        name="flash_attention_bwd_dq",
    )(table, start, end, *map(as_kernel_operand, (q_rows, k, v, do_rows)), lse, delta, bounds)
    # float16 operands: the kernels computed and stored float32 (see pallas_helpers.load).
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv_.astype(v.dtype), d_sinks
