"""Which keys each query row sees, and how the kernels walk them: the visibility
rule (once, for the torch side, XLA and the kernels' iotas), the visit table
and the walk plans of the flash attention kernels.

Ranges. Every query index ``i`` of batch row ``b`` sees one contiguous key
range ``key_bounds[b, i] = [lo, hi)`` (int32 ``[B, Sq, 2]``), shared by all
heads. The rule (``rule_range``): valid keys ``[kv_start[b], kv_end[b])``
(left padding, the filled part of a static cache), queries aligned to the end
of that range (query ``i`` at position ``p = kv_end[b] - Sq + i``), ``causal``
keeping keys ``<= p`` and a sliding ``window`` keys ``> p - window``. A caller
with a mask passes the mask's own ranges instead: padding on either side,
packed sequences (each query sees the keys of its own document), a static
cache, windows, all are a range per row. ``causal`` and ``window`` then only
choose blocks and how the grids walk (performance), never which keys a row
sees.

Kernel rows. The kernels view q as ``[B, Hkv, G * Sq, D]``: row ``r`` is head
``r // Sq`` of a KV head's group at query index ``r % Sq``; the G heads of a
group share the ranges (``row_bounds``).

Skipped work. For each (batch, query block) a visit table (XLA, once per
call, from the ranges; scalar-prefetched into SMEM) holds the KV blocks any
of its rows can see and those every row sees whole. The forward's and the
backward dq kernel's grids of a causal prefill walk only the (query block,
KV block) pairs of the first (``compact_walk``), the backward dk/dv kernel's
the same pairs KV block by KV block (``compact_key_walk``); where a grid
does take steps outside them (windows, the rectangular grid past
``COMPACT_WALK_MAX_PAIRS`` or with KV splits) they do no MXU work
(``pl.when``) and their index maps are clamped into them, so the block
already in VMEM is reused and no DMA starts. Whole blocks
skip the mask; masked blocks whose rows all follow the rule rebuild their
ranges from iotas (``rule_row_bounds``) instead of reading them. The decode
kernel needs only the first and last chunk per batch row
(``decode_chunk_spans``).

jax is imported at first use (``_Lazy``): the torch side (``masks``) takes the
rule from here, and the CPU path runs without jax.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

from ..common.tile_math import cdiv


class _Lazy:
    """A module imported at its first attribute access."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        return getattr(importlib.import_module(self._name), attr)


jax, jnp, lax, pl = _Lazy("jax"), _Lazy("jax.numpy"), _Lazy("jax.lax"), _Lazy("jax.experimental.pallas")


# ----------------------------------------------------------------------------
# The rule, for every side
# ----------------------------------------------------------------------------


def rule_range(start, end, pos, *, skv: int, causal: bool, window: int, clip):
    """``(lo, hi)`` of the rule for queries at positions ``pos``: keys
    ``[start, min(end, Skv))``, causal ``hi <= pos + 1``, a window ``lo > pos -
    window``. The one definition of the rule: ``clip`` is ``torch.clamp`` on the
    torch side (``masks``), ``jnp.clip`` in XLA and in the kernels (on iotas).
    ``lo`` / ``hi`` broadcast against ``pos`` (callers broadcast them to it);
    ``hi <= lo`` means the query sees no key."""
    hi = clip(end, max=skv)
    if causal:
        hi = clip(hi, max=pos + 1)
    lo = clip(start, min=pos - window + 1) if window else start
    return lo, hi


def rule_key_bounds(kv_start, kv_end, *, sq: int, skv: int, causal: bool, window: int):
    """int32 ``[B, Sq, 2]``: the rule's key range of every query index (XLA)."""
    start = jnp.asarray(kv_start, jnp.int32)[:, None]
    end = jnp.asarray(kv_end, jnp.int32)[:, None]
    pos = end - sq + jnp.arange(sq, dtype=jnp.int32)[None, :]
    lo, hi = rule_range(start, end, pos, skv=skv, causal=causal, window=window, clip=jnp.clip)
    return jnp.stack([jnp.broadcast_to(lo, pos.shape), jnp.broadcast_to(hi, pos.shape)], axis=-1)


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


# ----------------------------------------------------------------------------
# The visit table (XLA, once per call)
# ----------------------------------------------------------------------------

# Columns of the per-(batch, query block) visit table.
FIRST, LAST, FULL_FIRST, FULL_LAST, RULE = range(5)
TABLE_COLUMNS = 5


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


def ranges_and_table(key_bounds, group: int, *, sq: int, skv: int, causal: bool, window: int, num_q_blocks: int,
                     block_q: int, block_k: int, compute_blocks: tuple[int, int] | None = None):
    """What every kernel takes: the ranges per row, the rule's ``kv_start`` /
    ``kv_end`` (scalar-prefetched) and the visit table; with ``compute_blocks``
    ``(sub_q, sub_k)`` (dividing the blocks) also the visit table of those
    sub-tiles, whose kinds a kernel computing a block in sub-tiles reads."""
    # Keys outside [0, Skv) do not exist: clipped, so that no caller's ranges
    # can reach a block index below 0 or unmasked tail rows.
    key_bounds = jnp.clip(jnp.asarray(key_bounds, jnp.int32), 0, skv)
    start, end, fits = rule_fit(key_bounds, sq=sq, skv=skv, causal=causal, window=window)
    bounds = row_bounds(key_bounds, group)
    table = visit_table(bounds, num_q_blocks=num_q_blocks, block_q=block_q, block_k=block_k, rows=group * sq,
                        fits=jnp.tile(fits, (1, group)))
    if compute_blocks is None:
        return bounds, start, end, table
    # The table of the compute sub-tiles: the same rows, cut finer (the padded
    # DMA blocks' rows, so every sub-tile of a block has an entry).
    sub_q, sub_k = compute_blocks
    if (sub_q, sub_k) == (block_q, block_k):
        return bounds, start, end, table, table
    sub_table = visit_table(bounds, num_q_blocks=num_q_blocks * (block_q // sub_q), block_q=sub_q, block_k=sub_k,
                            rows=group * sq, fits=jnp.tile(fits, (1, group)))
    return bounds, start, end, table, sub_table


# Columns of the decode kernel's per-batch-row table (``decode_chunk_spans``).
SPAN_FIRST, SPAN_LAST, SPAN_END = range(3)
SPAN_COLUMNS = 3


def decode_chunk_spans(key_bounds, *, skv: int, chunk: int):
    """int32 ``[B * 3]``: per batch row the first and last ``chunk``-key chunk
    any of its queries sees (``last < first``: none) and the end of the keys
    any sees (exclusive; the decode kernel copies no further), from the ranges
    ``key_bounds [B, Sq, 2]`` (the G heads of a group share them): what the
    decode kernel walks, without the rule fit and the whole-block columns of
    ``visit_table`` (fewer XLA ops around a kernel of a few microseconds)."""
    key_bounds = jnp.clip(jnp.asarray(key_bounds, jnp.int32), 0, skv)
    lo, hi = key_bounds[..., 0], key_bounds[..., 1]
    sees = hi > lo
    any_lo = jnp.min(jnp.where(sees, lo, skv), axis=1)
    any_hi = jnp.max(jnp.where(sees, hi, 0), axis=1)
    some = any_hi > any_lo
    first = jnp.where(some, any_lo // chunk, 0)
    last = jnp.where(some, (any_hi - 1) // chunk, -1)
    end = jnp.where(some, any_hi, 0)
    return jnp.stack([first, last, end], axis=-1).astype(jnp.int32).reshape(-1)


def _query_blocks_seeing(table, kv_blocks, *, num_q_blocks: int):
    """bool ``[B, len(kv_blocks), num_q_blocks]``: which query blocks see each
    of ``kv_blocks`` (the visit table's first..last KV block of each)."""
    entries = table.reshape(-1, num_q_blocks, TABLE_COLUMNS)[:, None, :, :]
    kv = kv_blocks[None, :, None]
    return (entries[..., FIRST] <= kv) & (kv <= entries[..., LAST])


def query_block_ranges(table, *, num_q_blocks: int, num_kv_blocks: int):
    """int32 ``[B * num_kv_blocks * 2]``: per (batch, KV block) the first and
    last query block that sees it (``last < first``: none), from the visit
    table; what the backward's dk/dv kernel clamps its query-side reads to."""
    sees = _query_blocks_seeing(table, jnp.arange(num_kv_blocks, dtype=jnp.int32), num_q_blocks=num_q_blocks)
    q_block = jnp.arange(num_q_blocks, dtype=jnp.int32)
    first = jnp.min(jnp.where(sees, q_block, num_q_blocks), axis=-1)
    last = jnp.max(jnp.where(sees, q_block, -1), axis=-1)
    return jnp.stack([first, last], axis=-1).astype(jnp.int32).reshape(-1)


def kv_steps(table, *, num_kv_blocks: int, splits: int):
    """KV grid steps per split: the most blocks any (batch, query block) sees,
    at least one (the first and last steps initialise and store)."""
    entries = table.reshape(-1, TABLE_COLUMNS)
    most = jnp.clip(jnp.max(entries[:, LAST] - entries[:, FIRST] + 1), 1, num_kv_blocks)
    return (most + splits - 1) // splits


def call_kv_steps(table, *, first: int, count: int):
    """The most of key blocks ``[first, first + count)`` any (batch, query
    block) sees, at least one: the steps of a walk over one call's key blocks
    that starts at each query block's first visible one."""
    entries = table.reshape(-1, TABLE_COLUMNS)
    lo, hi = jnp.maximum(entries[:, FIRST], first), jnp.minimum(entries[:, LAST], first + count - 1)
    return jnp.clip(jnp.max(hi - lo + 1), 1, count)


# A forward walk of the live (query block, KV block) pairs keeps two int32
# scalars per pair in SMEM: at most this many pairs (batch x query blocks x KV
# blocks); past it the grid stays rectangular.
COMPACT_WALK_MAX_PAIRS = 16384


def query_block_steps(first, last, *, num_kv_blocks: int):
    """The KV steps a query block takes in a compacted walk: the blocks
    ``[first, last]`` it sees (its visit table entries), at least one (its
    first step initialises, its last stores: a block that sees no key still
    writes its zeros)."""
    return jnp.clip(last - first + 1, 1, num_kv_blocks)


def compact_walk(table, *, num_q_blocks: int, num_kv_blocks: int):
    """``(q_blocks, steps, length)``: the forward grid's walk over only the live
    (query block, KV block) pairs of each batch row, query block by query block,
    as ``[B * num_q_blocks * num_kv_blocks]`` int32 each (pair ``f`` of row
    ``b`` at ``b * num_q_blocks * num_kv_blocks + f``) and the grid's length,
    the most pairs of any row. A row's padding pairs stay on its last query
    block at step ``num_kv_blocks``, past the last KV block any query block
    sees from its first (no DMA, nothing computed, stored or initialised).
    The rectangular grid instead gives every query block the most steps any
    has: a causal prefill's query blocks see 1 to all KV blocks, so about half
    of its steps were empty (Llama-3-8B 8k at 2048 x 2048 blocks: 192 of 512)."""
    entries = table.reshape(-1, num_q_blocks, TABLE_COLUMNS)
    steps = query_block_steps(entries[..., FIRST], entries[..., LAST], num_kv_blocks=num_kv_blocks)  # [B, Qb]
    ends = jnp.cumsum(steps, axis=1)
    totals = ends[:, -1]
    pairs = jnp.arange(num_q_blocks * num_kv_blocks, dtype=jnp.int32)
    q_block = jax.vmap(lambda e: jnp.searchsorted(e, pairs, side="right"))(ends)
    q_block = jnp.minimum(q_block, num_q_blocks - 1).astype(jnp.int32)
    step = pairs[None, :] - (jnp.take_along_axis(ends, q_block, axis=1) - jnp.take_along_axis(steps, q_block, axis=1))
    step = jnp.where(pairs[None, :] < totals[:, None], step, num_kv_blocks).astype(jnp.int32)
    return q_block.reshape(-1), step.reshape(-1), jnp.max(totals).astype(jnp.int32)


def walk_position(b, q_axis, kv_axis, walk_q_ref, walk_step_ref, *, num_q_blocks, num_kv_blocks, compact):
    """``(query block, KV step)`` of a forward (or dq) grid step: the grid's own
    axes, or in a compacted walk (``compact_walk``) the pair the KV axis counts."""
    if not compact:
        return q_axis, kv_axis
    pair = b * (num_q_blocks * num_kv_blocks) + kv_axis
    return walk_q_ref[pair], walk_step_ref[pair]


def is_last_step(entry, step, grid_steps, *, num_kv_blocks: int, compact: bool):
    """Whether ``step`` is its query block's last KV step (where the forward
    and the dq kernel store): in a compacted walk the block's own last pair
    (``query_block_steps``; ``entry`` reads its visit table entry), else the
    grid's last of ``grid_steps``."""
    if compact:
        return step == query_block_steps(entry(FIRST), entry(LAST), num_kv_blocks=num_kv_blocks) - 1
    return step == grid_steps - 1


def compact_key_walk(table, *, num_q_blocks: int, first_kv_block: int, count: int):
    """``(kv_blocks, q_blocks, length)``: the backward dk/dv grid's walk over only
    the live (KV block, query block) pairs of KV blocks ``[first_kv_block,
    first_kv_block + count)``, KV block by KV block, as ``[B * count *
    num_q_blocks]`` int32 each (pair ``f`` of row ``b`` at ``b * count *
    num_q_blocks + f``; KV blocks counted from ``first_kv_block``) and the
    grid's length, the most pairs of any row. A KV block no query block sees
    takes one pair on the last query block (its zero dk / dv still stored).
    A row's padding pairs name KV block ``count`` (past the call's blocks:
    nothing computed or stored) and the row's last query block (no DMA).
    The rectangular walk gives every KV block every query block: under a
    causal mask with query blocks of several heads (Llama-3-8B 8k at 2048 x
    2048 blocks) 24 of each (batch, KV head)'s 64 steps saw nothing, 18 of
    them still fetching their query block."""
    sees = _query_blocks_seeing(table, first_kv_block + jnp.arange(count, dtype=jnp.int32),
                                num_q_blocks=num_q_blocks)  # [B, count, Qb]
    last_q = jnp.arange(num_q_blocks) == num_q_blocks - 1
    live = (sees | (~jnp.any(sees, axis=-1, keepdims=True) & last_q)).reshape(sees.shape[0], -1)
    order = jnp.argsort(~live, axis=1, stable=True).astype(jnp.int32)  # live pairs first, in (KV, query) order
    totals = jnp.sum(live, axis=1)
    within = jnp.arange(live.shape[1], dtype=jnp.int32)[None, :] < totals[:, None]
    last_pair = jnp.take_along_axis(order, (totals - 1)[:, None], axis=1)
    kv_blocks = jnp.where(within, order // num_q_blocks, count)
    q_blocks = jnp.where(within, order, last_pair) % num_q_blocks
    return (kv_blocks.astype(jnp.int32).reshape(-1), q_blocks.astype(jnp.int32).reshape(-1),
            jnp.max(totals).astype(jnp.int32))


def key_walk_position(walk_kv_ref, walk_q_ref, b, f, length, *, pairs: int, count: int):
    """``(KV block within the call, query block, live, first, last)`` of pair
    ``f`` of a compacted dk/dv walk (``compact_key_walk``: ``pairs`` per batch
    row, a grid of ``length``): ``live`` false on a row's padding pairs,
    ``first`` / ``last`` the KV block's first / last pair (its accumulators
    initialise / store)."""
    at = b * pairs + f
    kv_rel = walk_kv_ref[at]
    live = kv_rel < count
    before = walk_kv_ref[jnp.maximum(at - 1, 0)]
    # The grid's last pair has no next one in the row; any other's is within it.
    after = walk_kv_ref[jnp.minimum(at + 1, b * pairs + pairs - 1)]
    first = live & ((f == 0) | (before != kv_rel))
    last = live & ((f == length - 1) | (after != kv_rel))
    return jnp.minimum(kv_rel, count - 1), walk_q_ref[at], live, first, last


def expected_kv_steps(num_kv_blocks: int, *, block_q: int, block_k: int, sq: int, causal: bool,
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


# ----------------------------------------------------------------------------
# In the kernels: the table, the ranges of a masked tile
# ----------------------------------------------------------------------------


def table_entry(table_ref, b, q_block, column, num_q_blocks):
    return table_ref[(b * num_q_blocks + q_block) * TABLE_COLUMNS + column]


def kv_block_of_step(entry, split, step, steps_per_split):
    """The KV block a forward (or dq) grid step works on, counted from the query
    block's first visible block: the grid's KV axis spans only the most blocks
    any query block sees (a window's, a static cache's filled part)."""
    return entry(FIRST) + split * steps_per_split + step


def clamped_kv_index(table_ref, b, q_block, kv_block, *, num_q_blocks, num_kv_blocks):
    """The KV block a step reads: ``kv_block`` clamped into ``[FIRST, LAST]``, so
    a step with nothing to do stays on a neighbouring block and starts no DMA."""
    entry = functools.partial(table_entry, table_ref, b, q_block, num_q_blocks=num_q_blocks)
    lo = jnp.clip(entry(FIRST), 0, num_kv_blocks - 1)
    return jnp.clip(kv_block, lo, jnp.clip(entry(LAST), lo, num_kv_blocks - 1))


def tile_kinds(table_ref, b, q_block, kv_block, *, num_q_blocks, whole_q_blocks=None):
    """``(live, whole)`` of one tile from the visit table: some row sees a key of
    it / every row sees all of it. A query block with padding rows (at or past
    ``whole_q_blocks``, when given) always takes the masked path."""
    entry = functools.partial(table_entry, table_ref, b, q_block, num_q_blocks=num_q_blocks)
    live = (kv_block >= entry(FIRST)) & (kv_block <= entry(LAST))
    whole = (kv_block >= entry(FULL_FIRST)) & (kv_block <= entry(FULL_LAST))
    if whole_q_blocks is not None:
        whole &= q_block < whole_q_blocks
    return live, whole


@dataclasses.dataclass(frozen=True)
class KernelRule:
    """The statics a kernel rebuilds a rule row's range from (``rule_fit``)."""
    block_q: int
    sq: int
    skv: int
    causal: bool
    window: int


def _rem(a, b):
    """``a % b`` for non-negative ints: lax's truncating remainder (Mosaic lowers
    Python's ``%`` through ``sign``, which needs the chip at trace time)."""
    return lax.rem(a, jnp.int32(b) if isinstance(b, int) else b)


def rule_row_bounds(rule: KernelRule, start, end, q_block, *, lanes: bool = False, rows: tuple | None = None):
    """``(lo, hi)`` as ``[block_q, 1]`` columns from the rule on iotas:
    broadcasting them over a tile costs no cross-lane work. ``lanes``: as
    ``[1, block_q]`` rows, for a tile with the queries along its lanes.
    ``rows``: ``(first, count)`` rows instead of block ``q_block``'s."""
    first, count = (q_block * rule.block_q, rule.block_q) if rows is None else rows
    shape, axis = ((1, count), 1) if lanes else ((count, 1), 0)
    rows = first + lax.broadcasted_iota(jnp.int32, shape, axis)
    pos = end - rule.sq + (_rem(rows, rule.sq) if rule.sq > 1 else 0)
    lo, hi = rule_range(start, end, pos, skv=rule.skv, causal=rule.causal, window=rule.window, clip=jnp.clip)
    return jnp.broadcast_to(lo, rows.shape), jnp.broadcast_to(hi, rows.shape)


def static_sub_tiles(per_q: int, per_k: int, offset: int, size: int, window: int):
    """``(i, j, masked)`` of the sub-tiles a tile at ``offset`` computes
    (``aligned_tile``), row sub-block by row sub-block: the rows of sub-block
    ``i`` sit at positions ``[(offset + i) * size, (offset + i + 1) * size)``
    relative to the tile's first key, and see the keys at or before their
    position and, under a ``window``, after ``position - window``. A sub-tile
    no row sees is left out; one every row sees whole is not masked."""
    for i in range(per_q):
        first_pos, last_pos = (offset + i) * size, (offset + i + 1) * size - 1
        for j in range(per_k):
            first_key, last_key = j * size, (j + 1) * size - 1
            if first_key > last_pos or (window and last_key <= first_pos - window):
                continue
            whole = last_key <= first_pos and not (window and first_key <= last_pos - window)
            yield i, j, not whole


def static_offsets(block_q: int, block_k: int, size: int, *, sq: int, causal: bool, window: int) -> tuple[int, ...]:
    """The offsets (in ``size`` sub-tiles) at which a tile's sub-tiles have
    static kinds worth their own region (``aligned_tile``): causal attention
    whose query blocks never straddle two heads' rows, the tile cut in more
    than one sub-tile, offsets of whole query blocks (a prefill, or one after a
    cache of whole blocks) at which some sub-tile is masked; none otherwise."""
    per_q, per_k = block_q // size, block_k // size
    if not causal or sq % block_q or block_q % size or block_k % size or per_q * per_k == 1:
        return ()
    reach = per_k + -(-window // size) if window else per_k
    return tuple(d for d in range(0, reach + 1, per_q)
                 if any(masked for *_, masked in static_sub_tiles(per_q, per_k, d, size, window)))


def aligned_tile(by_rule, start, end, q_block, kv_block, offset: int, *, block_q: int, block_k: int, size: int,
                 sq: int, skv: int):
    """Does this tile sit at ``offset`` sub-tiles of ``size`` (``static_sub_tiles``
    then gives its sub-tiles' kinds, whatever the data): its rows follow the
    rule (``by_rule``), the first row's position is the tile's key ``offset *
    size``, the batch row's keys start at or before the tile and end within
    ``skv`` (so only the causal and window bounds cut it)."""
    first_key = kv_block * block_k
    first_pos = end - sq + _rem(q_block * block_q, sq)
    return by_rule & (first_pos == first_key + offset * size) & (start <= first_key) & (end <= skv)


def read_row_bounds(bounds_ref, rows=slice(None)):
    """``(lo, hi)`` as ``[block_q, 1]`` columns read from the block's ranges
    (``rows``: a static slice of them, a sub-tile's)."""
    bounds = bounds_ref[rows, :]
    return bounds[:, 0:1], bounds[:, 1:2]


def read_lane_bounds(bounds_ref, rows=slice(None)):
    """``(lo, hi)`` as ``[1, block_q]`` rows read from the block's ranges laid
    out ``[2, block_q]`` (``lane_major_bounds``)."""
    return bounds_ref[0:1, rows], bounds_ref[1:2, rows]


def lane_major_bounds(bounds, *, num_q_blocks: int, block_q: int):
    """``[B, rows, 2]`` ranges as ``[B, num_q_blocks, 2, block_q]`` (padding rows
    ``[0, 0)``: they see nothing), for tiles with the queries along their lanes."""
    batch, rows, _ = bounds.shape
    padded = jnp.pad(bounds, ((0, 0), (0, num_q_blocks * block_q - rows), (0, 0)))
    return padded.reshape(batch, num_q_blocks, block_q, 2).transpose(0, 1, 3, 2)


def masked_regions(when, by_rule, body, *, rule: KernelRule, start_ref, end_ref, bounds_ref, b, q_block,
                   bounds_rows=slice(None), lanes: bool = False):
    """``body(lo, hi)`` for a masked tile in two regions: the rows' ranges from
    the rule's iotas where the visit table says they fit it, else read
    (``q_block`` counts blocks of ``rule.block_q`` rows; ``bounds_rows``: the
    tile's rows within the ``bounds_ref`` block). ``lanes``: the ranges as
    ``[1, block_q]`` rows, ``bounds_ref`` laid out by ``lane_major_bounds``."""
    read = read_lane_bounds if lanes else read_row_bounds
    pl.when(when & by_rule)(lambda: body(*rule_row_bounds(rule, start_ref[b], end_ref[b], q_block, lanes=lanes)))
    pl.when(when & jnp.logical_not(by_rule))(lambda: body(*read(bounds_ref, bounds_rows)))


# ----------------------------------------------------------------------------
# The backward's dk/dv walk over query blocks
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QueryWalk:
    """How the dk/dv kernel walks query blocks for one KV block: ``heads`` x
    ``walk_steps`` grid steps. ``relative`` (a causal window with blocks aligned
    to heads, where the window is shorter than a head's blocks): per head
    ``g`` the blocks ``g * blocks_per_head + first + j``, ``first`` the first
    query block of head 0 that sees the KV block and the step count the data's
    longest run of such blocks; otherwise every query block in turn."""
    heads: int
    blocks_per_head: int
    relative: bool


def query_walk(num_q_blocks, *, group, block_q, block_k, sq, causal, window) -> QueryWalk:
    if causal and window and sq % block_q == 0:
        per_head = sq // block_q
        # Under the rule, queries at positions [j, j + window - 1] see key j: a
        # block of keys is seen by block_k - 1 + window positions.
        if cdiv(block_k - 1 + window, block_q) + 1 < per_head:
            return QueryWalk(group, per_head, True)
    return QueryWalk(1, num_q_blocks, False)


def walk_plan(table, walk: QueryWalk, *, num_q_blocks: int, num_kv_blocks: int):
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


def walk_query_block(q_range_ref, b, kv_block, head, step, *, num_kv_blocks, walk: QueryWalk, for_dma: bool):
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
