"""Flash attention backward for TPU in Pallas: dq, dk, dv (and the sinks'
gradient) from the forward's log-sum-exp.

With the forward's key ranges and skipped tiles (``key_ranges``), one kernel
walks key blocks (dk, dv accumulated over the query blocks that see each one:
under a causal mask without a window only those, on one grid axis of the live
(KV block, query block) pairs, ``key_ranges.compact_key_walk``; under a causal
window the window's query blocks per head, ``key_ranges.query_walk``; else
every query block). dq comes either from the same kernel, each tile's ``ds^T``
times K written as that key block's f32 part of dq and the parts summed
afterwards over the key blocks each query block sees (``_sum_dq_parts``, a
kernel that reads only those parts), or from a second kernel that walks query
blocks (dq over the key blocks each sees, recomputing the probabilities; the
live pairs only, as the forward does, under a causal mask without a window);
``blocks.fuses_dq`` chooses (long key blocks and a bounded parts buffer:
fused). Probabilities are recomputed from q, k and the lse in the
forward's base (base 2 without soft-capping); the sinks' gradient is a
reduction outside the kernels. Layout, features and dtypes: ``flash_forward``.

A grid step holds ``block_sizes`` blocks and computes them as ``compute_blocks``
sub-tiles (a static loop; ``blocks.py`` gives the rule and the estimates
behind it), each skipped, unmasked or masked on its own from a visit table of
the sub-tiles. The dk/dv kernel's tiles are transposed, keys x queries, so that
dv and dk are plain products (no transpose of a score-sized tile); it takes
lse, delta and the ranges as lane rows.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common.pallas_helpers import (FLOAT16_BITS, as_kernel_operand, compiler_params, dot_f32,
                                     float16_bits_to_float32, kernel_dtype, out_struct)
from ..common.tile_math import cdiv
from . import blocks as blocks_lib
from . import key_ranges as kr
from .flash_forward import LOG2_E, compacts_walk, per_row, shapes_and_blocks


def _recompute(q, k, lse, *, bounds, kv_block, block_k, softcap, scale, transposed=False):
    """Probabilities ``p`` of one (query block, key block) tile and ``tanh`` of
    the capped logits (None without soft-capping). ``bounds``: per-row ``(lo,
    hi)`` columns of a masked tile (rows that saw no key, lse -inf, are
    guarded), None for a tile every row sees whole. ``transposed``: the tile
    as ``[block_k, block_q]`` (keys along the sublanes, queries along the
    lanes), ``lse`` and ``bounds`` as ``[1, block_q]`` rows."""
    def scores(q_):
        return dot_f32(k, q_, 1, 1) if transposed else dot_f32(q_, k, 1, 1)

    if softcap:
        t = jnp.tanh(scores(q) * (scale / softcap))
        x, lse_, exp = softcap * t, lse, jnp.exp
    else:
        # Base 2, log2(e) and the scale on q ([block_q, D]), as in the forward.
        q2 = (q.astype(jnp.float32) * (scale * LOG2_E)).astype(q.dtype)
        x, t, lse_, exp = scores(q2), None, lse * LOG2_E, jnp.exp2
    if bounds is None:
        return exp(x - lse_), t
    lo, hi = bounds
    shape, axis = ((block_k, 1), 0) if transposed else ((1, block_k), 1)
    keys = kv_block * block_k + lax.broadcasted_iota(jnp.int32, shape, axis)
    # One select: invisible entries become exp(-inf) = 0, whatever x or lse
    # hold there (a row that sees a key has a finite lse).
    return exp(jnp.where((keys >= lo) & (keys < hi), x - lse_, -jnp.inf)), t


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


def _load_rows(ref, rows):
    """``ref[rows, :]`` (a static slice: one sub-tile's rows of the block), with
    float16 bits decoded as ``pallas_helpers.load`` does."""
    x = ref[rows, :]
    return float16_bits_to_float32(x) if x.dtype == FLOAT16_BITS else x


def _sub_tiles_by_kind(accumulate, live_step, sub_table_ref, start_ref, end_ref, bounds_ref, *, b, q_block, kv_block,
                       block_q, block_k, sub_q, sub_k, rows, skv, num_q_blocks, rule, lanes):
    """Run ``accumulate(bounds, q_sub, kv_sub, rs, ks)`` on the tile's live
    sub-tiles. A tile of several sub-tiles that every row sees whole, and one whose sub-tiles' kinds are
    static (``key_ranges.aligned_tile``: a causal diagonal), run all their
    sub-tiles in one region: there the compiler overlaps one
    sub-tile's matmuls with another's elementwise work, while a region per
    sub-tile runs each alone. Any other tile: each sub-tile in its own region,
    skipped where no row sees its keys, unmasked where every row sees them
    all (``key_ranges.tile_kinds`` on the sub-tiles' table), masked else."""
    per_q, per_k = block_q // sub_q, block_k // sub_k
    num_q_subs = num_q_blocks * per_q
    tiles = list(blocks_lib.sub_tiles(block_q, block_k, sub_q, sub_k))
    kinds, body = {}, {}
    for i, j, rs, ks in tiles:
        q_sub, kv_sub = q_block * per_q + i, kv_block * per_k + j
        live, whole = kr.tile_kinds(sub_table_ref, b, q_sub, kv_sub, num_q_blocks=num_q_subs,
                                    whole_q_blocks=rows // sub_q)
        kinds[i, j] = (live & live_step, whole)
        body[i, j] = functools.partial(accumulate, q_sub=q_sub, kv_sub=kv_sub, rs=rs, ks=ks)
    # A tile of one sub-tile: the per-sub-tile regions below are already whole-tile regions.
    several = len(tiles) > 1
    by_kind = jnp.bool_(True)
    if several:
        all_whole = functools.reduce(jnp.logical_and, (live & whole for live, whole in kinds.values()))
        by_kind = jnp.logical_not(all_whole)

        @pl.when(all_whole)
        def _whole():
            for i, j, *_ in tiles:
                body[i, j](None)

    offsets = kr.static_offsets(block_q, block_k, sub_q, sq=rule.sq, causal=rule.causal,
                                window=rule.window) if several and sub_q == sub_k else ()
    if offsets:
        by_rule = functools.reduce(jnp.logical_and, (
            kr.table_entry(sub_table_ref, b, q_block * per_q + i, kr.RULE, num_q_subs) == 1 for i in range(per_q)))
    for offset in offsets:
        on_static = live_step & kr.aligned_tile(by_rule, start_ref[b], end_ref[b], q_block, kv_block, offset,
                                                block_q=block_q, block_k=block_k, size=sub_q, sq=rule.sq, skv=skv)
        by_kind &= jnp.logical_not(on_static)

        @pl.when(on_static)
        def _static(offset=offset):
            for i, j, masked in kr.static_sub_tiles(per_q, per_k, offset, sub_q, rule.window):
                body[i, j](kr.rule_row_bounds(rule, start_ref[b], end_ref[b], q_block * per_q + i, lanes=lanes)
                           if masked else None)

    for i, j, rs, _ in tiles:
        live, whole = kinds[i, j]
        pl.when(by_kind & live & whole)(lambda f=body[i, j]: f(None))
        kr.masked_regions(by_kind & live & jnp.logical_not(whole),
                          kr.table_entry(sub_table_ref, b, q_block * per_q + i, kr.RULE, num_q_subs) == 1,
                          lambda lo, hi, f=body[i, j]: f((lo, hi)), rule=rule, start_ref=start_ref, end_ref=end_ref,
                          bounds_ref=bounds_ref, b=b, q_block=q_block * per_q + i, bounds_rows=rs, lanes=lanes)


def _dkv_kernel(sub_table_ref, q_range_ref, start_ref, end_ref, walk_kv_ref, walk_q_ref, q_ref, k_ref, v_ref, do_ref,
                lse_ref, delta_ref, bounds_ref, *refs, block_q, block_k, sub_q, sub_k, rows, skv, softcap, scale,
                num_q_blocks, num_kv_blocks, first_kv_block: int, count: int, walk, compact: bool, rule,
                fused_dq: bool):
    if fused_dq:
        dk_ref, dv_ref, dq_part_ref, dk_acc, dv_acc = refs
    else:
        (dk_ref, dv_ref, dk_acc, dv_acc), dq_part_ref = refs, None
    b = pl.program_id(0)
    if compact:  # one grid axis over the live (KV block, query block) pairs
        kv_in_call, q_block, in_walk, first_step, last_step = kr.key_walk_position(
            walk_kv_ref, walk_q_ref, b, pl.program_id(2), pl.num_programs(2), pairs=count * num_q_blocks, count=count)
        kv_block, dma_block = first_kv_block + kv_in_call, q_block
    else:
        head, step = pl.program_id(3), pl.program_id(4)
        kv_block = first_kv_block + pl.program_id(2)  # a call may cover some of the key blocks
        where = dict(num_kv_blocks=num_kv_blocks, walk=walk)
        q_block, in_walk = kr.walk_query_block(q_range_ref, b, kv_block, head, step, for_dma=False, **where)
        # (Only the fused dq part asks which block is in VMEM.)
        dma_block = kr.walk_query_block(q_range_ref, b, kv_block, head, step, for_dma=True, **where)[0] if fused_dq \
            else q_block
        first_step = (head == 0) & (step == 0)
        last_step = (head == pl.num_programs(3) - 1) & (step == pl.num_programs(4) - 1)

    @pl.when(first_step)
    def _init():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    if fused_dq:
        # This step's query block is the one in VMEM (not a resident block kept
        # over a skipped step): its partial dq over this key block starts here.
        @pl.when(in_walk & (dma_block == q_block))
        def _init_dq():
            dq_part_ref[...] = jnp.zeros_like(dq_part_ref)

    def accumulate(bounds, q_sub, kv_sub, rs, ks):  # bounds: (lo, hi) rows of a masked sub-tile, None: whole
        q, do, delta = _load_rows(q_ref, rs), _load_rows(do_ref, rs), delta_ref[:, rs]
        k, v = _load_rows(k_ref, ks), _load_rows(v_ref, ks)
        if bounds is not None:
            if rows % sub_q:  # padding rows: garbage in q and dO would reach dk through 0 * NaN
                q, do = (_zero_rows_past(x, q_sub * sub_q, rows) for x in (q, do))
            if fused_dq and skv % sub_k:  # and garbage keys past Skv would reach dq
                k, v = _zero_rows_past(k, kv_sub * sub_k, skv), _zero_rows_past(v, kv_sub * sub_k, skv)
            lo, hi = bounds
            row = q_sub * sub_q + lax.broadcasted_iota(jnp.int32, (1, sub_q), 1)
            bounds = lo, jnp.where(row < rows, hi, lo)  # padding rows see nothing
        # Transposed tiles ([keys, queries]): dv and dk are plain products, no
        # transpose of a score-sized tile; lse and delta are lane rows.
        p_t, t = _recompute(q, k, lse_ref[:, rs], bounds=bounds, kv_block=kv_sub, block_k=sub_k, softcap=softcap,
                            scale=scale, transposed=True)
        dv_acc[ks, :] += dot_f32(p_t.astype(do.dtype), do, 1, 0)
        ds_t = p_t * (dot_f32(v, do, 1, 1) - delta)
        if t is not None:
            ds_t = ds_t * (1.0 - t * t)
        dk_acc[ks, :] += dot_f32(ds_t.astype(q.dtype), q, 1, 0)
        if fused_dq:
            dq_part_ref[rs, :] += dot_f32(ds_t.T.astype(k.dtype), k, 1, 0)

    _sub_tiles_by_kind(accumulate, in_walk, sub_table_ref, start_ref, end_ref, bounds_ref, b=b, q_block=q_block,
                       kv_block=kv_block, block_q=block_q, block_k=block_k, sub_q=sub_q, sub_k=sub_k, rows=rows,
                       skv=skv, num_q_blocks=num_q_blocks, rule=rule, lanes=True)

    @pl.when(last_step)
    def _store():
        dk_ref[...] = (dk_acc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _dq_kernel(table_ref, sub_table_ref, start_ref, end_ref, walk_q_ref, walk_step_ref, q_ref, k_ref, v_ref, do_ref,
               lse_ref, delta_ref, bounds_ref, dq_ref, dq_acc, *, block_q, block_k, sub_q, sub_k, rows, skv, softcap,
               scale, num_q_blocks, num_kv_blocks, compact, rule):
    b = pl.program_id(0)
    q_block, step = kr.walk_position(b, pl.program_id(2), pl.program_id(3), walk_q_ref, walk_step_ref,
                                     num_q_blocks=num_q_blocks, num_kv_blocks=num_kv_blocks, compact=compact)
    entry = functools.partial(kr.table_entry, table_ref, b, q_block, num_q_blocks=num_q_blocks)
    kv_block = entry(kr.FIRST) + step  # walks from the first visible
    last_step = kr.is_last_step(entry, step, pl.num_programs(3), num_kv_blocks=num_kv_blocks, compact=compact)

    @pl.when(step == 0)
    def _init():
        dq_acc[...] = jnp.zeros_like(dq_acc)

    def accumulate(bounds, q_sub, kv_sub, rs, ks):  # bounds: (lo, hi) columns of a masked sub-tile, None: whole
        k, v = _load_rows(k_ref, ks), _load_rows(v_ref, ks)
        if bounds is not None and skv % sub_k:
            k, v = _zero_rows_past(k, kv_sub * sub_k, skv), _zero_rows_past(v, kv_sub * sub_k, skv)
        p, t = _recompute(_load_rows(q_ref, rs), k, lse_ref[rs, :], bounds=bounds, kv_block=kv_sub, block_k=sub_k,
                          softcap=softcap, scale=scale)
        ds = _logit_grads(_load_rows(do_ref, rs), v, delta_ref[rs, :], p, t)
        dq_acc[rs, :] += dot_f32(ds.astype(k.dtype), k, 1, 0)

    _sub_tiles_by_kind(accumulate, True, sub_table_ref, start_ref, end_ref, bounds_ref, b=b, q_block=q_block,
                       kv_block=kv_block, block_q=block_q, block_k=block_k, sub_q=sub_q, sub_k=sub_k, rows=rows,
                       skv=skv, num_q_blocks=num_q_blocks, rule=rule, lanes=False)

    @pl.when(last_step)
    def _store():
        dq_ref[...] = (dq_acc[...] * scale).astype(dq_ref.dtype)


def _dkv_call(inputs, table, first: int, count: int, keys: int, *, walk, walk_steps, compact: bool, fused_dq: bool,
              large_vmem: bool, skv: int, num_kv_blocks: int, padded_rows: int, operands, generation, interpret, k, v,
              common):
    """The dk/dv kernel over key blocks ``[first, first + count)``: ``(dk, dv)``
    of their ``keys`` rows and, ``fused_dq``, their f32 parts of dq ``[B, Hkv,
    count, padded rows, D]``. ``compact``: its grid walks only the blocks' live
    (KV block, query block) pairs (``key_ranges.compact_key_walk``), else each
    KV block walks ``walk``'s query blocks."""
    batch, hkv, _, d = k.shape
    dv = v.shape[-1]
    block_q, block_k, num_q_blocks = common["block_q"], common["block_k"], common["num_q_blocks"]
    pairs = count * num_q_blocks
    if compact:
        walk_kv, walk_q, length = kr.compact_key_walk(table, num_q_blocks=num_q_blocks, first_kv_block=first,
                                                      count=count)
        grid, semantics = (batch, hkv, length), ("parallel", "parallel", "arbitrary")
    else:
        walk_kv = walk_q = jnp.zeros((1,), jnp.int32)  # placeholders
        grid = (batch, hkv, count, walk.heads, walk_steps)
        semantics = ("parallel", "parallel", "parallel", "arbitrary", "arbitrary")

    def position(b, h, *axes_and_refs):
        """(KV block within the call, query block to read) of a grid step."""
        if compact:
            f, *refs = axes_and_refs
            at = b * pairs + f
            return jnp.minimum(refs[-2][at], count - 1), refs[-1][at]
        kb, head, step, _, q_range_ref, *_ = axes_and_refs
        return kb, kr.walk_query_block(q_range_ref, b, first + kb, head, step, num_kv_blocks=num_kv_blocks,
                                       walk=walk, for_dma=True)[0]

    def q_at(b, h, *rest):
        return b, h, position(b, h, *rest)[1], 0

    def q_lanes_at(b, h, *rest):
        return b, h, position(b, h, *rest)[1], 0, 0

    def q_bounds_at(b, h, *rest):
        return b, position(b, h, *rest)[1], 0, 0

    def kv_at(b, h, *rest):
        return b, h, first + position(b, h, *rest)[0], 0

    def out_at(b, h, *rest):
        return b, h, position(b, h, *rest)[0], 0

    dq_parts = []
    if fused_dq:

        def dq_part_at(b, h, *rest):
            return (b, h, *position(b, h, *rest), 0)

        dq_parts = [(out_struct((batch, hkv, count, padded_rows, d), jnp.float32, *operands),
                     pl.BlockSpec((None, None, None, block_q, d), dq_part_at))]
    return pl.pallas_call(
        functools.partial(_dkv_kernel, num_kv_blocks=num_kv_blocks, first_kv_block=first, count=count, walk=walk,
                          compact=compact, skv=skv, fused_dq=fused_dq, **common),
        out_shape=(out_struct((batch, hkv, keys, d), kernel_dtype(k.dtype), *operands),
                   out_struct((batch, hkv, keys, dv), kernel_dtype(v.dtype), *operands), *(o for o, _ in dq_parts)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6, grid=grid,
            in_specs=[pl.BlockSpec((None, None, block_q, d), q_at), pl.BlockSpec((None, None, block_k, d), kv_at),
                      pl.BlockSpec((None, None, block_k, dv), kv_at), pl.BlockSpec((None, None, block_q, dv), q_at),
                      pl.BlockSpec((None, None, None, 1, block_q), q_lanes_at),
                      pl.BlockSpec((None, None, None, 1, block_q), q_lanes_at),
                      pl.BlockSpec((None, None, 2, block_q), q_bounds_at)],
            out_specs=[pl.BlockSpec((None, None, block_k, d), out_at), pl.BlockSpec((None, None, block_k, dv), out_at),
                       *(spec for _, spec in dq_parts)],
            scratch_shapes=[pltpu.VMEM((block_k, d), jnp.float32), pltpu.VMEM((block_k, dv), jnp.float32)],
        ),
        compiler_params=compiler_params(generation, semantics, large_vmem=fused_dq or large_vmem),
        interpret=interpret,
        name="flash_attention_bwd_dkv",
    )(*inputs[:4], walk_kv, walk_q, *inputs[4:])


def _first_part(table_ref, b, q_block, *, first: int, count: int, num_q_blocks: int):
    """The first of a call's ``count`` key blocks (from ``first``, counted
    within the call) that the query block sees (clipped into the call)."""
    return jnp.clip(kr.table_entry(table_ref, b, q_block, kr.FIRST, num_q_blocks) - first, 0, count - 1)


def _dq_sum_kernel(table_ref, parts_ref, *refs, first_kv_block: int, count: int, num_q_blocks: int, scale: float,
                   carry: bool, final: bool):
    carry_ref, out_ref, acc = refs if carry else (None, *refs)
    b, q_block, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    kv_block = first_kv_block + _first_part(table_ref, b, q_block, first=first_kv_block, count=count,
                                            num_q_blocks=num_q_blocks) + j
    live, _ = kr.tile_kinds(table_ref, b, q_block, kv_block, num_q_blocks=num_q_blocks)

    @pl.when(j == 0)
    def _init():
        acc[...] = carry_ref[...] if carry else jnp.zeros_like(acc)

    @pl.when(live)  # a part the dk/dv kernel wrote: its key block is seen by this query block
    def _add():
        acc[...] += parts_ref[...]

    @pl.when(j == pl.num_programs(3) - 1)
    def _store():
        out_ref[...] = (acc[...] * scale if final else acc[...]).astype(out_ref.dtype)


def _sum_dq_parts(parts, carry, table, *, first: int, final_dtype, scale: float, num_q_blocks: int, block_q: int,
                  generation, interpret, operands):
    """The fused dk/dv kernel's parts of dq ``[B, Hkv, count, padded rows, D]``
    (key blocks from ``first``) summed over the key blocks each query block
    sees, added to ``carry`` (the earlier calls' f32 sum, or None): f32 for
    the next call, or with ``final_dtype`` set scaled into dq. Steps on a
    part no query row of the block sees keep the resident block (no DMA):
    only the live parts are read (XLA's reduction read them all, then wrote
    an f32 sum that a second pass scaled and cast). Each query block walks
    from its first visible key block, as many steps as any query block sees
    (``call_kv_steps``; gpt-oss's 128-key window at 8k in 2048-key blocks:
    2 steps of 4, a step costing ~600-1000 cycles even when it reads nothing)."""
    batch, hkv, count, padded, d = parts.shape

    def part_at(b, h, qb, j, table_ref):
        lo = _first_part(table_ref, b, qb, first=first, count=count, num_q_blocks=num_q_blocks)
        last = kr.table_entry(table_ref, b, qb, kr.LAST, num_q_blocks) - first
        return b, h, jnp.clip(lo + j, lo, jnp.clip(last, lo, count - 1)), qb, 0

    rows_at = lambda b, h, qb, j, *_: (b, h, qb, 0)  # noqa: E731
    block = pl.BlockSpec((None, None, block_q, d), rows_at)
    final = final_dtype is not None
    return pl.pallas_call(
        functools.partial(_dq_sum_kernel, first_kv_block=first, count=count, num_q_blocks=num_q_blocks, scale=scale,
                          carry=carry is not None, final=final),
        out_shape=out_struct((batch, hkv, padded, d), final_dtype if final else jnp.float32, *operands),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(batch, hkv, num_q_blocks, kr.call_kv_steps(table, first=first, count=count)),
            in_specs=[pl.BlockSpec((None, None, None, block_q, d), part_at), *([block] if carry is not None else [])],
            out_specs=block,
            scratch_shapes=[pltpu.VMEM((block_q, d), jnp.float32)],
        ),
        input_output_aliases={2: 0} if carry is not None and not final else {},
        compiler_params=compiler_params(generation, ("parallel",) * 3 + ("arbitrary",)),
        interpret=interpret,
        name="flash_attention_bwd_sum_dq_parts",
    )(table, parts, *([carry] if carry is not None else []))


def flash_attention_backward(q, k, v, out, lse, dout, key_bounds, sinks=None, *, causal: bool = True,
                             window: int = 0, softcap: float = 0.0, scale: float | None = None, block_sizes=None,
                             compute_blocks=None, generation: str | None = None, interpret=False):
    """``(dq, dk, dv, d_sinks)`` of ``flash_attention`` (``d_sinks`` is ``[Hq]`` f32,
    zeros without sinks), from its output and the ``lse`` it returned.

    ``block_sizes``: the blocks each grid step holds (``blocks.choose_backward_blocks``
    when None); ``compute_blocks``: ``(sub_q, sub_k)``, dividing them, the
    sub-tiles a step computes them in (``blocks.backward_compute_blocks`` when None)."""
    batch, hq, hkv, sq, skv, d, dv, rows, (block_q, block_k) = shapes_and_blocks(
        blocks_lib.choose_backward_blocks, q, v, block_sizes, causal, window, generation)
    sub_q, sub_k = blocks_lib.check_compute_blocks(
        compute_blocks or blocks_lib.backward_compute_blocks(block_q, block_k, window), block_q, block_k)
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
        p_sink = jnp.exp(per_row(sinks.astype(jnp.float32), batch, hkv, group, sq) - lse)
        d_sinks = -(p_sink * delta).reshape(batch, hkv, group, sq).sum(axis=(0, 3)).reshape(hq)
    bounds, start, end, table, sub_table = kr.ranges_and_table(
        key_bounds, group, sq=sq, skv=skv, causal=causal, window=window, num_q_blocks=num_q_blocks, block_q=block_q,
        block_k=block_k, compute_blocks=(sub_q, sub_k))
    common = dict(rows=rows, softcap=float(softcap), scale=float(scale), num_q_blocks=num_q_blocks,
                  block_q=block_q, block_k=block_k, sub_q=sub_q, sub_k=sub_k,
                  rule=kr.KernelRule(sub_q, sq, skv, causal, window))
    operands = (q, k, v, dout, key_bounds)

    # dk, dv: each key block walks the query blocks; those that do not see it
    # keep the resident query-side blocks (no DMA).
    walk = kr.query_walk(num_q_blocks, group=group, block_q=block_q, block_k=block_k, sq=sq, causal=causal,
                       window=window)
    q_range, walk_steps = kr.walk_plan(table, walk, num_q_blocks=num_q_blocks, num_kv_blocks=num_kv_blocks)

    # The dk/dv kernel's tiles are transposed: lse, delta and the ranges as lane rows per query block.
    padded_rows = num_q_blocks * block_q

    def lane_rows(x):  # [B, Hkv, rows, 1] -> [B, Hkv, num_q_blocks, 1, block_q], padding rows 0
        x = jnp.pad(x[..., 0], ((0, 0), (0, 0), (0, padded_rows - rows)))
        return x.reshape(batch, hkv, num_q_blocks, 1, block_q)

    # dq in the dk/dv kernel: each key block's f32 part of dq, at most FUSED_DQ_MAX_BYTES of them per call
    # (more key blocks: several calls, each over its own key blocks, their sums added).
    part_bytes = batch * hkv * padded_rows * d * 4
    large_vmem = blocks_lib.backward_needs_large_vmem(
        blocks_lib.backward_working_set_bytes(block_q, block_k, d, dv, kernel_dtype(q.dtype).itemsize, window=window),
        generation)
    fused_dq = blocks_lib.fuses_dq(
        part_bytes,
        blocks_lib.backward_working_set_bytes(block_q, block_k, d, dv, kernel_dtype(q.dtype).itemsize, fused_dq=True,
                                              window=window),
        block_k=block_k, num_kv_blocks=num_kv_blocks, generation=generation)
    per_call = blocks_lib.fused_dq_blocks_per_call(part_bytes, num_kv_blocks) if fused_dq else num_kv_blocks
    inputs = (sub_table, q_range, start, end, *map(as_kernel_operand, (q_rows, k, v, do_rows)), lane_rows(lse),
              lane_rows(delta), kr.lane_major_bounds(bounds, num_q_blocks=num_q_blocks, block_q=block_q))
    dk_parts, dv_parts, dq = [], [], None
    for first in range(0, num_kv_blocks, per_call):
        count = min(per_call, num_kv_blocks - first)
        keys = min(count * block_k, skv - first * block_k)  # the last call's may end inside its last block
        compact = not walk.relative and compacts_walk(1, batch * count * num_q_blocks, causal=causal, window=window)
        dk_c, dv_c, *dq_part = _dkv_call(
            inputs, table, first, count, keys, walk=walk, walk_steps=walk_steps, compact=compact, fused_dq=fused_dq,
            large_vmem=large_vmem, skv=skv, num_kv_blocks=num_kv_blocks, padded_rows=padded_rows, operands=operands,
            generation=generation, interpret=interpret, k=k, v=v, common=common)
        dk_parts.append(dk_c)
        dv_parts.append(dv_c)
        if fused_dq:  # this call's parts of dq summed (the last call's sum scaled into dq's dtype)
            dq = _sum_dq_parts(dq_part[0], dq, table, first=first, scale=float(scale), num_q_blocks=num_q_blocks,
                               block_q=block_q, generation=generation, interpret=interpret, operands=operands,
                               final_dtype=kernel_dtype(q.dtype) if first + count == num_kv_blocks else None)
    dk, dv_ = (parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=2) for parts in (dk_parts, dv_parts))
    if fused_dq:
        dq = dq[:, :, :rows]
        return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv_.astype(v.dtype), d_sinks

    # dq: each query block walks the key blocks it sees, as the forward does: the live pairs only
    # (compacted), or a rectangle whose skipped steps re-use the resident block.
    where = dict(num_q_blocks=num_q_blocks, num_kv_blocks=num_kv_blocks)
    compact = compacts_walk(1, batch * num_q_blocks * num_kv_blocks, causal=causal, window=window)
    if compact:
        walk_q, walk_step, length = kr.compact_walk(table, **where)
        grid = (batch, hkv, 1, length)
    else:
        walk_q = walk_step = jnp.zeros((1,), jnp.int32)  # placeholders
        grid = (batch, hkv, num_q_blocks, kr.kv_steps(table, num_kv_blocks=num_kv_blocks, splits=1))

    def kv_index(b, h, qb, step, table_ref, _, __, ___, walk_q_ref, walk_step_ref):
        qb, step = kr.walk_position(b, qb, step, walk_q_ref, walk_step_ref, compact=compact, **where)
        kv_block = kr.table_entry(table_ref, b, qb, kr.FIRST, num_q_blocks) + step
        return b, h, kr.clamped_kv_index(table_ref, b, qb, kv_block, **where), 0

    def row_block(b, h, qb, step, *refs):
        return b, h, kr.walk_position(b, qb, step, *refs[-2:], compact=compact, **where)[0], 0

    def bounds_block(b, h, qb, step, *refs):
        return b, kr.walk_position(b, qb, step, *refs[-2:], compact=compact, **where)[0], 0

    dq = pl.pallas_call(
        functools.partial(_dq_kernel, skv=skv, num_kv_blocks=num_kv_blocks, compact=compact, **common),
        out_shape=out_struct(q_rows.shape, kernel_dtype(q.dtype), *operands),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6, grid=grid,
            in_specs=[pl.BlockSpec((None, None, block_q, d), row_block),
                      pl.BlockSpec((None, None, block_k, d), kv_index),
                      pl.BlockSpec((None, None, block_k, dv), kv_index),
                      pl.BlockSpec((None, None, block_q, dv), row_block),
                      pl.BlockSpec((None, None, block_q, 1), row_block),
                      pl.BlockSpec((None, None, block_q, 1), row_block),
                      pl.BlockSpec((None, block_q, 2), bounds_block)],
            out_specs=pl.BlockSpec((None, None, block_q, d), row_block),
            scratch_shapes=[pltpu.VMEM((block_q, d), jnp.float32)],
        ),
        compiler_params=compiler_params(generation, ("parallel",) * 3 + ("arbitrary",), large_vmem=large_vmem),
        interpret=interpret,
        name="flash_attention_bwd_dq",
    )(table, sub_table, start, end, walk_q, walk_step, *map(as_kernel_operand, (q_rows, k, v, do_rows)), lse, delta, bounds)
    # float16 operands: the kernels computed and stored float32 (see pallas_helpers.load).
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv_.astype(v.dtype), d_sinks
