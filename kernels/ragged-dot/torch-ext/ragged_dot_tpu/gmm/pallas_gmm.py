"""Pallas TPU grouped matmuls: the ragged dot forward and its two backwards.

``gmm(lhs [M, K], rhs, group_sizes [G])`` multiplies the rows of group ``g``
by ``rhs[g]``; ``rhs`` is ``[G, N, K]`` ("nk", Transformers' ``[E, out, in]``)
or ``[G, K, N]`` ("kn"). Both are read in place: the "nk" tile is fed to the
MXU as a transposed operand, never materialised transposed in HBM.

``tgmm(lhs [M, K], dout [M, N], group_sizes)`` is the weight gradient, per
group ``lhs_g^T @ dout_g``, laid out like ``rhs``.

How rows map to grid steps. The rows ``[0, M)`` are cut into *segments*:
a zero prefix (rows of groups before the local window), one segment per
local group, and a zero suffix (groups after the window and the rows past
``sum(group_sizes)``). The kernel walks *visits*: pairs (segment, row tile)
for every row tile a non-empty segment touches, in row order. A tile that
straddles a boundary is visited once per segment and each visit stores only
its own rows, so every output row is written exactly once, rows outside the
local groups are written as zeros, and empty groups cost no step at all. The
number of visits is data dependent and becomes the (dynamic) grid size; its
static bound is ``tiles_m + segments - 1``. Within a visit the forward kernel
computes only the row chunks (``tiling.row_chunk``) that hold rows of its
segment, or only the half of a chunk that does (``visit_row_chunks``), so a
shared tile's visits split its MXU work instead of repeating it.
With K whole on a one-TensorCore chip the forward kernel moves its weights
itself, a run of visits ahead (``WeightPrefetch``).

The gated up projection (``gmm(glu=)``, the experts program's unfused path)
is the same walk with an MLP gate applied at the store: a step reads the
same column tile of the gate and up halves (two weight tiles of a free
``[G, 2, I, K]`` view when the halves are concatenated; one tile twice as
wide when they alternate, as in gpt-oss, where a lane rotation pairs each
gate column with its up column and a 0 / 1 selection matmul gathers the
pairs), adds the group's bias, and writes ``[tm, tn]`` activations in the
weights' dtype instead of an f32 ``[tm, 2 tn]`` product for XLA to gate.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common.pallas_helpers import compiler_params, dot_f32, out_struct, row_mask, zero_past
from ..common import tpu_generations
from ..common.tile_math import cdiv, sublane
from . import layouts, tiling as tiling_lib

RhsLayout = Literal["nk", "kn"]


# ----------------------------------------------------------------------------
# Routing metadata (plain XLA, runs before the kernel)
# ----------------------------------------------------------------------------


def running_sum(x):
    """``cumsum`` of a short 1-D int array as one compare-and-reduce fusion:
    XLA lowers a cumsum to a reduce-window, 300-500 cycles at a few hundred
    entries (TPU estimator, v6e), which every decode step pays per layer."""
    n = x.shape[0]
    if n > SHORT_RUNNING_SUM:
        return jnp.cumsum(x)
    idx = jnp.arange(n, dtype=jnp.int32)
    return jnp.sum(jnp.where(idx[None, :] <= idx[:, None], x[None, :], 0), axis=1).astype(x.dtype)


SHORT_RUNNING_SUM = 512  # [n, n] compares: 256 K at most


def local_window(group_sizes, group_offset, num_local_groups):
    """Row range ``[start, end)`` covered by groups ``offset .. offset+local``."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = running_sum(sizes)
    starts = ends - sizes
    local_starts = lax.dynamic_slice_in_dim(starts, group_offset, num_local_groups)
    local_ends = lax.dynamic_slice_in_dim(ends, group_offset, num_local_groups)
    return local_starts, local_ends


def make_visits(seg_starts, seg_ends, *, tm: int, tiles_m: int, visit_empty: bool):
    """Visit list for segments given by row bounds.

    Returns ``(segment_of_visit, tile_of_visit, num_visits)``. Both arrays have
    the static bound length plus one trailing sentinel (segment -1) so a
    kernel can peek at visit ``v + 1``. ``visit_empty`` gives empty segments
    one (fully masked) visit, which the weight gradient needs to write zeros.
    """
    num_segments = seg_starts.shape[0]
    nonempty = seg_ends > seg_starts
    # Clipping keeps every block index in bounds even for group sizes that
    # were not validated (negative, or summing past M): no DMA leaves the
    # arrays, whatever the data.
    first_tile = jnp.clip(seg_starts // tm, 0, tiles_m - 1)
    last_tile = jnp.where(nonempty, jnp.clip((seg_ends - 1) // tm, first_tile, tiles_m - 1), first_tile)
    tiles = jnp.where(nonempty, last_tile - first_tile + 1, 1 if visit_empty else 0)
    visit_end = running_sum(tiles)
    num_visits = visit_end[-1]
    bound = tiles_m + num_segments - (0 if visit_empty else 1)
    v = jnp.arange(bound + 1, dtype=jnp.int32)
    # The segment of each visit and its tile (the segment's first tile plus
    # the visits before it in the segment) by compares against every segment
    # ([visits, segments], one fusion), not a search and gathers: at decode
    # these XLA ops run on every layer's critical path (TPU estimator, v6e:
    # a gather costs about 650 cycles, a compare-reduce of this size 100-200).
    seg = jnp.minimum(jnp.sum(visit_end[None, :] <= v[:, None], axis=1), num_segments - 1).astype(jnp.int32)
    first_visit_tile = first_tile - (visit_end - tiles)  # tile = visit + this, within a segment
    mine = seg[:, None] == jnp.arange(num_segments, dtype=jnp.int32)[None, :]
    tile = jnp.clip(v + jnp.sum(jnp.where(mine, first_visit_tile[None, :], 0), axis=1), 0, tiles_m - 1)
    live = v < num_visits
    seg = jnp.where(live, seg, -1)
    # Past the last visit: its tile (tiles never decrease along the visits),
    # so the sentinels move no block.
    tile = jnp.where(live, tile, jnp.max(jnp.where(live, tile, 0))).astype(jnp.int32)
    return seg, tile, num_visits.astype(jnp.int32)


def resident_groups(seg, num_local: int):
    """The local group whose weights each forward visit reads.

    A visit of a local group (segments ``1 .. num_local``) reads its own. A
    visit of the zero prefix or suffix computes nothing (rows of other ranks'
    experts under expert parallelism, rows past ``sum(group_sizes)``), so it
    reads the group of the nearest local visit before it, else after it: the
    block index does not change, and no weight DMA starts for an idle visit
    (it is the block in VMEM already, or the next one needed anyway).
    """
    is_local = (seg > 0) & (seg <= num_local)
    # Visits come in segment order (prefix 0, local groups, suffix, then the
    # sentinels -1), so the nearest local visit of a prefix visit is the
    # first local one, and of any later idle visit the last one: the least
    # and the greatest local segment. Two reductions, no gather (a cummax /
    # cummin lowers to a reduce-window, about 2.5 us per call at decode on
    # v6e, estimated; a gather about 0.4 us).
    first = jnp.min(jnp.where(is_local, seg, num_local + 1))
    last = jnp.max(jnp.where(is_local, seg, 0))
    group = jnp.where(is_local, seg, jnp.where(seg == 0, first, last))
    group = jnp.where(jnp.any(is_local), group, 1)  # no local visit: every visit reads group 0
    return jnp.clip(group - 1, 0, num_local - 1).astype(jnp.int32)


def weight_runs(weight_group, num_visits):
    """Runs of consecutive visits that read one weight group, for the kernel
    that fetches weights itself: ``(run_of_visit, run_group, num_runs)``.
    ``run_group[r]`` is the group of run ``r`` (runs in visit order; entries
    past ``num_runs`` are 0). Visits past ``num_visits`` stay in the last run."""
    bound = weight_group.shape[0]
    v = jnp.arange(bound, dtype=jnp.int32)
    before = jnp.concatenate([weight_group[:1] - 1, weight_group[:-1]])  # visit 0 always starts a run
    starts = (v < num_visits) & (weight_group != before)
    run = running_sum(starts.astype(jnp.int32)) - 1
    num_runs = jnp.sum(starts.astype(jnp.int32))
    if bound <= SHORT_RUNNING_SUM:  # [runs, visits] compares, one fusion (see make_visits)
        first = starts[None, :] & (run[None, :] == v[:, None])
        run_group = jnp.sum(jnp.where(first, weight_group[None, :], 0), axis=1)
    else:
        run_group = jnp.zeros((bound,), jnp.int32).at[jnp.where(starts, run, bound)].set(weight_group, mode="drop")
    return run.astype(jnp.int32), run_group.astype(jnp.int32), num_runs.reshape(1)


def forward_visits(group_sizes, group_offset, num_local: int, *, m: int, tm: int):
    """Visits over [zero prefix, local groups..., zero suffix] covering all M rows:
    ``(seg, tile, num_visits, seg_starts, seg_ends, weight_group)``."""
    local_starts, local_ends = local_window(group_sizes, group_offset, num_local)
    zero = jnp.zeros((1,), jnp.int32)
    seg_starts = jnp.concatenate([zero, local_starts, local_ends[-1:]])
    seg_ends = jnp.concatenate([local_starts[:1], local_ends, zero + m])
    seg, tile, num_visits = make_visits(
        seg_starts, seg_ends, tm=tm, tiles_m=cdiv(m, tm), visit_empty=False
    )
    return seg, tile, num_visits, seg_starts, seg_ends, resident_groups(seg, num_local)


def store_visit_rows(out_ref, value, v, tile_ref, tm: int, start, end):
    """Visit ``v``'s epilogue: ``value`` into the rows ``[start, end)`` of its
    row tile. The first visit of a row tile owns the block (other rows zero);
    later visits (next segments in the same tile) merge into what is already
    in VMEM, since the block is written back only when the tile changes."""
    tile = tile_ref[v]
    mine = row_mask(out_ref.shape, tile, tm, start, end)
    continues_tile = (v > 0) & (tile_ref[jnp.maximum(v - 1, 0)] == tile)
    previous = jnp.where(continues_tile, out_ref[...], jnp.zeros_like(out_ref))
    out_ref[...] = jnp.where(mine, value.astype(out_ref.dtype), previous)


def store_chunk_rows(out_ref, rows: pl.ds, value, first_row, start, end, masked_store: bool):
    """``value`` into the rows of ``rows`` (global row ``first_row`` on)
    inside ``[start, end)``; the block's other rows are left as they are. A
    masked store for 32-bit outputs; a packed 16-bit one merges with what the
    block holds (Mosaic masks stores of 32-bit values only). ``masked_store``
    False merges in any dtype: the interpreter (jax 0.10) rejects a masked
    store whose block has fewer columns than rows as out of bounds."""
    mine = row_mask(value.shape, 0, 0, start - first_row, end - first_row)
    value = value.astype(out_ref.dtype)
    if masked_store and jnp.dtype(out_ref.dtype).itemsize == 4:
        pltpu.store(out_ref.at[rows, :], value, mask=mine)
    else:
        out_ref[rows, :] = jnp.where(mine, value, out_ref[rows, :])


# A row tile without row chunks (``tiling.row_chunk``: tpu7x's 256 rows) of
# at least this many rows still runs as halves where a group boundary falls
# inside it (``visit_row_chunks``); smaller tiles (decode) run whole.
MIN_HALVED_TILE = 256


def visit_row_chunks(tm: int, chunk: int, lo, hi):
    """The row chunks a visit computes to cover its rows ``[lo, hi)`` of the
    row tile (tile-relative; they may reach past it): ``(size, first, live)``, ``first`` the chunk's first row
    in the tile (static), ``live`` whether it runs. Per ``chunk`` rows of the
    tile, the whole chunk where both of its halves hold rows of the visit,
    else only the half that does: a group whose boundary falls inside a
    chunk pays half a chunk there, not a whole one (at most one of the three
    runs)."""
    half = chunk // 2
    chunks = []
    for first in range(0, tm, chunk):
        low = (first < hi) & (first + half > lo)  # the chunk's first half holds rows of the visit
        high = (first + half < hi) & (first + chunk > lo)
        chunks += [(chunk, first, low & high), (half, first, low & jnp.logical_not(high)),
                   (half, first + half, high & jnp.logical_not(low))]
    return chunks


# ----------------------------------------------------------------------------
# Forward: out[rows of g] = lhs[rows of g] @ rhs[g]
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WeightBlock:
    """One weight operand of ``WeightPrefetch``: ``layout`` "nk" (``[G, N, K]``,
    or with ``half`` the ``[G, 2, N, K]`` view of concatenated gate / up
    halves) or "kn" (``[G, K, N]``); column tiles ``tn`` wide over ``n``, the
    whole contraction ``k``."""

    layout: str
    tn: int
    n: int
    k: int
    half: int | None = None

    def copy(self, hbm, buf, sem, group, n_i, slot, tiles_n: int, last: bool):
        width = self.n - (tiles_n - 1) * self.tn if last else self.tn
        # Mosaic must see that a tile's first column is tile aligned (a
        # column tile narrower than the operand is a multiple of 128).
        cols = pl.ds(0 if tiles_n == 1 else pl.multiple_of(n_i * self.tn, 128), width)
        if self.layout == "kn":
            src, dst = hbm.at[group, :, cols], buf.at[slot, :, pl.ds(0, width)]
        else:
            src = hbm.at[group, cols, :] if self.half is None else hbm.at[group, self.half, cols, :]
            dst = buf.at[slot, pl.ds(0, width), :]
        return pltpu.make_async_copy(src, dst, sem)

    def tiles_align(self, tiles_n: int, itemsize: int) -> bool:
        """Whether a partial last column tile is a legal DMA: Mosaic slices
        whole (sublane, 128) tiles only. Else the grid's pipeline moves it."""
        last = self.n - (tiles_n - 1) * self.tn
        return tiles_n == 1 or last % (128 if self.layout == "kn" else sublane(itemsize)) == 0

    def buffer(self, dtype):
        return pltpu.VMEM((2, self.k, self.tn) if self.layout == "kn" else (2, self.tn, self.k), dtype)


@dataclasses.dataclass(frozen=True)
class WeightPrefetch:
    """A forward kernel's own weight pipeline (whole-K steps, one
    TensorCore). The grid pipeline fetches a block one step before the step
    that reads it, so a new group's weight tile (16-34 MB at gpt-oss-20b or
    Mixtral-8x7B) must arrive within the one step before, often a boundary
    visit that computes half a tile: the rest of the fetch stalls the MXU.
    Here the weights stay in HBM and two VMEM slots alternate over *runs*
    (consecutive visits of one weight group, ``weight_runs``, in the order
    of the grid: every run of column tile 0, then of tile 1...): the first
    step of a run waits for its tile and starts the next run's, which then
    has the whole run to arrive. The grid's steps run in order on one core,
    so the column axis is "arbitrary" (a megacore would split it and break
    the chain: v4 and v5p keep the grid's pipeline). ``column_axis``: the
    grid axis of the column tiles (None: one tile), ``visit_axis`` the
    visits'.

    Estimated (TPU estimator, one experts layer, grid pipeline -> this):
    v6e Mixtral-8x7B 4096 tokens 4916 -> 4188 us, 512 tokens 1910 -> 1803,
    1 token 444 -> 432; gpt-oss-20b 4096 tokens 1954 -> 1769, 512 tokens
    1140 -> 1016; Qwen3-30B-A3B 4096 tokens 1294 -> 1048 (the fused kernel
    1258 -> 1078, then 989 at 256-row tiles); v5e Mixtral-8x7B 4096 tokens
    18240 -> 16922; tpu7x Mixtral-8x7B 512 tokens 1069 -> 967
    (``bench/results/tpu_estimates_*_weight_prefetch.log``)."""

    blocks: tuple[WeightBlock, ...]
    tiles_n: int = 1
    column_axis: int | None = 0
    visit_axis: int = 1

    def scratch(self, dtype) -> list:
        return [b.buffer(dtype) for b in self.blocks] + [pltpu.SemaphoreType.DMA((len(self.blocks), 2))]

    def each(self, action: str, hbm_refs, bufs, sems, group, n_i, slot):
        """Starts or waits for one tile of every operand; a partial last
        column tile moves only its columns (the buffer's others are stale
        weights or unset: their product columns are never stored)."""
        def run(last: bool):
            for i, (b, hbm, buf) in enumerate(zip(self.blocks, hbm_refs, bufs)):
                getattr(b.copy(hbm, buf, sems.at[i, slot], group, n_i, slot, self.tiles_n, last), action)()

        if all(b.n == self.tiles_n * b.tn for b in self.blocks):
            run(False)
            return
        pl.when(n_i < self.tiles_n - 1)(lambda: run(False))
        pl.when(n_i == self.tiles_n - 1)(lambda: run(True))

    def fetch(self, hbm_refs, bufs, sems, run_ref, run_group_ref, num_runs_ref):
        """This step's slot, after its weights arrived; starts the next run's."""
        n_i = 0 if self.column_axis is None else pl.program_id(self.column_axis)
        v = pl.program_id(self.visit_axis)
        run, num_runs = run_ref[v], num_runs_ref[0]
        slot = (n_i * num_runs + run) % 2

        @pl.when((v == 0) | (run_ref[jnp.maximum(v - 1, 0)] != run))
        def _first_step_of_run():
            @pl.when((n_i == 0) & (v == 0))
            def _very_first():
                self.each("start", hbm_refs, bufs, sems, run_group_ref[run], n_i, slot)

            self.each("wait", hbm_refs, bufs, sems, run_group_ref[run], n_i, slot)
            more = run + 1 < num_runs
            next_n = jnp.where(more, n_i, n_i + 1)

            @pl.when(next_n < self.tiles_n)
            def _next():
                self.each("start", hbm_refs, bufs, sems, run_group_ref[jnp.where(more, run + 1, 0)], next_n,
                          1 - slot)

        return slot


def _rhs_spec(half: int | None, rhs_layout: str, tn_rhs: int, tk: int) -> pl.BlockSpec:
    """The ``tn_rhs``-column weight tile of a visit's expert: of ``rhs``, or of
    half ``half`` of its ``[G, 2, I, K]`` view (concatenated gated halves)."""
    if half is not None:
        return pl.BlockSpec((pl.Squeezed(), pl.Squeezed(), tn_rhs, tk),
                            lambda n_i, v, k_i, seg, tile, starts, ends, group, *_: (group[v], half, n_i, k_i))
    if rhs_layout == "nk":
        return pl.BlockSpec((pl.Squeezed(), tn_rhs, tk),
                            lambda n_i, v, k_i, seg, tile, starts, ends, group, *_: (group[v], n_i, k_i))
    return pl.BlockSpec((pl.Squeezed(), tk, tn_rhs),
                        lambda n_i, v, k_i, seg, tile, starts, ends, group, *_: (group[v], k_i, n_i))


def experts_per_block(num_local: int, dtype) -> int:
    """Experts' rows in one block of a per-column vector (``[G, N]``: int8
    scales, gate biases) read in its own layout: a whole native tile of
    ``dtype`` (``tile_math.sublane``), or every expert when fewer."""
    return min(num_local, sublane(jnp.dtype(dtype).itemsize))


def column_vector_block(num_local: int, dtype, tile_cols: int, column_tile=lambda n_i: n_i):
    """``(spec, experts)``: the block of a ``[G, N]`` per-column vector read in
    its own layout, ``experts_per_block`` experts' rows holding the visit's
    expert, at column tile ``column_tile(n_i)`` (``expert_column`` picks the row)."""
    experts = experts_per_block(num_local, dtype)
    return pl.BlockSpec((experts, tile_cols), lambda n_i, v, k_i, seg, tile, starts, ends, group, *_:
                        (lax.div(group[v], experts), column_tile(n_i))), experts


def expert_column(ref, experts: int, group):
    """``[1, tn]`` f32: expert ``group``'s row of a per-column vector's block,
    ``[1, tn]`` already (``experts`` 0: a ``[G, 1, N]`` view) or the
    ``[experts, tn]`` block of its own layout holding it (``experts_per_block``)."""
    block = ref[...].astype(jnp.float32)
    if not experts:
        return block
    # Selected and summed over the block's sublanes (a load at a dynamic
    # sublane offset estimated no faster: v6e Qwen3-30B-A3B int8, 64 tokens
    # 381.6 -> 383.0 us, and 16-bit rows come packed in pairs).
    mine = lax.broadcasted_iota(jnp.int32, block.shape, 0) == lax.rem(group, experts)
    return jnp.sum(jnp.where(mine, block, 0.0), axis=0, keepdims=True)


# Average rows a group up to which per-column vectors are read in their own
# layout (``column_tiles_in_place``). Estimated v6e, int8, the layer, views
# -> own layout: Qwen3-30B-A3B 1 / 8 / 64 tokens (1 to 4 rows a group) 28.3 ->
# 26.1, 150.3 -> 148.6, 383.0 -> 381.6 us; Mixtral-8x7B 64 tokens (16 rows)
# 870.6 -> 868.9; but Qwen3 512 tokens (32 rows) 438.4 -> 443.6, 4096
# 897.9 -> 913.3: the views' relayout is a fixed ~0.7 us per vector, the
# row picked in the kernel costs every step, which shows once the steps
# compute longer than their weights take to arrive.
COLUMNS_IN_PLACE_MAX_ROWS_PER_GROUP = 16


def column_tiles_in_place(n: int, tn: int, tn_rhs: int, concatenated: bool, m: int, num_local: int) -> bool:
    """Whether ``[G, N]`` per-column vectors are read in their own layout: at
    decode-like sizes (``COLUMNS_IN_PLACE_MAX_ROWS_PER_GROUP``), with column
    tiles lane-aligned (or the whole width) and, with concatenated halves,
    each half a whole number of tiles (half ``h``'s tile ``j`` is column tile
    ``h * I / tn + j``)."""
    if m > COLUMNS_IN_PLACE_MAX_ROWS_PER_GROUP * num_local:
        return False
    if concatenated:
        return tn % 128 == 0 and n % tn == 0
    return tn_rhs % 128 == 0 or tn_rhs == n * (tn_rhs // tn)


def prefetches_weights(whole_k: bool, generation: str | None) -> bool:
    """Whether the forward kernel runs ``WeightPrefetch`` (else the grid's pipeline)."""
    return whole_k and tpu_generations.get_generation(generation).tensorcores == 1


def _gmm_kernel(
    *refs,  # scalar prefetch (SMEM): the visit arrays (+ weight runs); lhs; rhs (gated, concatenated: gate and
    # up; in HBM when prefetched); int8: the column scales of each rhs; gated: biases; out; scratch: an f32
    # accumulator per rhs, or the weight buffers
    tm: int, tk: int, k: int, tiles_k: int, num_segments: int, rhs_layout: str, row_chunk: int, glu=None,
    glu_halves: str | None = None, num_bias: int = 0, valid_cols: int = 0, masked_store: bool = True,
    prefetch: WeightPrefetch | None = None, column_scales: bool = False, column_experts: tuple[int, ...] = (),
):
    num_scalars = 5 + (3 if prefetch else 0)
    seg_ref, tile_ref, seg_start_ref, seg_end_ref, group_ref = refs[:5]
    lhs_ref, refs = refs[num_scalars], (refs[5:num_scalars], refs[num_scalars + 1:])
    run_refs, refs = refs
    num_rhs = 2 if glu_halves == "concatenated" else 1
    rhs_refs, refs = refs[:num_rhs], refs[num_rhs:]
    scale_refs, refs = (refs[:num_rhs], refs[num_rhs:]) if column_scales else ((), refs)
    bias_refs, refs = refs[:num_bias], refs[num_bias:]
    out_ref, acc_refs = refs[0], refs[1:1 + num_rhs]
    k_rem = k % tk
    whole_k = tiles_k == 1 and k_rem == 0
    if prefetch:
        bufs, sems = acc_refs, refs[1 + num_rhs]
        slot = prefetch.fetch(rhs_refs, bufs, sems, *run_refs)
        rhs_refs = [buf.at[slot] for buf in bufs]
    # Split K, interleaved halves: the gate and selection per live row chunk, into act_ref.
    gated_chunks = glu_halves == "interleaved" and row_chunk < tm and not whole_k
    act_ref = refs[-1] if gated_chunks else None
    v, k_i = pl.program_id(1), pl.program_id(2)
    seg = seg_ref[v]
    is_local = (seg > 0) & (seg < num_segments - 1)
    w_contract = 1 if rhs_layout == "nk" else 0
    start, end = seg_start_ref[seg], seg_end_ref[seg]

    def visit_chunks():
        """``visit_row_chunks`` of this visit; a tile of one chunk (no row
        chunks) below ``MIN_HALVED_TILE`` rows runs whole."""
        if row_chunk == tm and tm < MIN_HALVED_TILE:
            return [(tm, 0, True)]
        return visit_row_chunks(tm, row_chunk, start - tile_ref[v] * tm, end - tile_ref[v] * tm)

    column_refs = (*scale_refs, *bias_refs)

    def columns():
        """The visit's expert's per-column vectors (int8 scales, then biases),
        ``[1, tn]`` f32 each. ``step_columns`` picks them from blocks of
        experts once per step (a few vector ops per 128 columns); views are
        read per row chunk instead (``finish`` with ``cols`` None: holding
        them across the chunks cost, estimated v6e, Mixtral-8x7B int8 4096
        tokens 3874 -> 3896 us)."""
        experts = column_experts or (0,) * len(column_refs)
        return [expert_column(r, e, group_ref[v]) for r, e in zip(column_refs, experts)]

    def step_columns():
        return columns() if column_experts else None

    def finish(products, cols):
        """The stored value: the product, or the gate applied to both halves' products."""
        cols = columns() if cols is None else cols
        scales, biases = cols[:len(scale_refs)], cols[len(scale_refs):]
        # int8 weights: the f32 product times each output column's scale (exact products)
        products = [p * sc for p, sc in zip(products, scales)] or products
        if glu is None:
            return products[0]
        products = [p + b for p, b in zip(products, biases)] or products
        if glu_halves == "concatenated":
            return glu(*products)
        return gate_interleaved(products[0], glu, out_ref.dtype, pl.program_id(0), valid_cols)

    if whole_k:
        # One whole-K step: each live row chunk's product (gated, if so) goes
        # straight to its rows of the output block. No accumulator (zeroing,
        # adding and reloading an f32 [tm, tn] tile cost three vector passes
        # per step), and no merge with the rows of the tile's other visits:
        # every row of a tile belongs to exactly one visit's segment, and a
        # visit writes only its own rows (a masked store), so the block is
        # whole when the tile's last visit ends.
        cols = step_columns()
        for size, first, live in visit_chunks():

            @pl.when(is_local & live)
            def _compute(rows=pl.ds(first, size), first_row=tile_ref[v] * tm + first):
                x = lhs_ref[rows, :]
                value = finish([dot_f32(x, r[...], 1, w_contract) for r in rhs_refs], cols)
                store_chunk_rows(out_ref, rows, value, first_row, start, end, masked_store)

        @pl.when(jnp.logical_not(is_local))
        def _idle():
            store_visit_rows(out_ref, jnp.zeros(out_ref.shape, jnp.float32), v, tile_ref, tm, start, end)
        return

    @pl.when(k_i == 0)
    def _init():
        for acc_ref in acc_refs:
            acc_ref[...] = jnp.zeros_like(acc_ref)

    def accumulate(rows: slice, mask_k_tail: bool):
        x = lhs_ref[rows, :]
        if mask_k_tail:  # garbage past K on both sides (0 * NaN is NaN)
            valid = k - k_i * tk
            x = zero_past(x, 1, valid)
        for acc_ref, rhs_ref in zip(acc_refs, rhs_refs):
            w = rhs_ref[...]
            if mask_k_tail:
                w = zero_past(w, w_contract, k - k_i * tk)
            acc_ref[rows, :] += dot_f32(x, w, 1, w_contract)

    # Only the row chunks holding rows of the visit's segment are computed
    # (``visit_row_chunks``): a tile shared by two groups costs each about
    # its own rows, not a whole tile (the rows of skipped chunks stay zero and
    # are masked at the store).
    chunks = []
    for size, first, live in visit_chunks():
        rows = slice(first, first + size)
        chunks.append((rows, is_local & live))
        if k_rem == 0:
            pl.when(is_local & live)(functools.partial(accumulate, rows, False))
        else:
            pl.when(is_local & live & (k_i < tiles_k - 1))(functools.partial(accumulate, rows, False))
            pl.when(is_local & live & (k_i == tiles_k - 1))(functools.partial(accumulate, rows, True))

    def gate_chunk(rows, cols):
        act_ref[rows, :] = finish([acc_ref[rows, :] for acc_ref in acc_refs], cols)

    @pl.when((k_i == tiles_k - 1) & is_local)
    def _store():
        cols = step_columns()
        if not gated_chunks:
            store_visit_rows(out_ref, finish([acc_ref[...] for acc_ref in acc_refs], cols), v, tile_ref, tm, start,
                             end)
            return
        # The gate and selection only on the chunks the visit computed: a
        # 64-row group in a 512-row tile pays for 128 or 256 rows, not 512.
        # Rows of other chunks hold stale values, never selected by the
        # store's row mask. Estimated, gpt-oss-20b 512 tokens: v5e 2783 ->
        # 2636 us, v6e 1195 -> 1189 (4096: 2305 -> 2268); concatenated halves
        # lose (v6e Mixtral-8x7B 4096 tokens 5282 -> 5368: the gate is cheap,
        # the extra pass over act_ref is not).
        for rows, live in chunks:
            pl.when(live)(functools.partial(gate_chunk, rows, cols))
        store_visit_rows(out_ref, act_ref[...], v, tile_ref, tm, start, end)

    # Rows outside the local groups are zeros (not a gate of zero products, which a bias makes nonzero).
    @pl.when((k_i == tiles_k - 1) & jnp.logical_not(is_local))
    def _store_idle():
        store_visit_rows(out_ref, jnp.zeros(out_ref.shape, jnp.float32), v, tile_ref, tm, start, end)


def gate_interleaved(p, glu, dtype, n_i, valid_cols: int):
    """``glu(p[:, 0::2], p[:, 1::2])`` of an f32 ``[rows, 2w]`` product whose
    gate and up columns alternate (gpt-oss), as ``[rows, w]``: the gate on
    every column paired with its right neighbour (a lane rotation), then the
    even columns gathered by a matmul with a 0 / 1 selection matrix (a
    strided lane slice has no cheap TPU lowering; the selection is exact: one
    product by 1 per output, the value rounded to ``dtype`` first as the
    store would). Odd columns and columns past ``valid_cols`` of the whole
    product (garbage of a partial tile; 0: all valid) are zeroed first, as 0
    times a NaN there would poison every output."""
    width = p.shape[1]
    paired = glu(p, pltpu.roll(p, width - 1, 1))  # column c with column c + 1
    col = lax.broadcasted_iota(jnp.int32, p.shape, 1)
    keep = col % 2 == 0
    if valid_cols:
        keep &= n_i * width + col < valid_cols
    paired = jnp.where(keep, paired, 0.0).astype(dtype)
    # Per 256-column slab (128 outputs): the selection matrix is block
    # diagonal, and a whole [2w, w] one would cost w / 128 times the MXU work
    # (at w = 1024 a third of the up projection's own, gpt-oss-20b).
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
    slabs = []
    for c0 in range(0, width, 2 * SELECT_LANES):
        size = min(2 * SELECT_LANES, width - c0)
        rows = lax.broadcasted_iota(jnp.int32, (size, size // 2), 0)
        select = (rows == 2 * lax.broadcasted_iota(jnp.int32, (size, size // 2), 1)).astype(dtype)
        slabs.append(lax.dot_general(paired[:, c0:c0 + size], select, (((1,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32, precision=precision))
    return slabs[0] if len(slabs) == 1 else jnp.concatenate(slabs, axis=1)


SELECT_LANES = 128


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    rhs_layout: RhsLayout = "nk",
    group_offset: int | jax.Array = 0,
    out_dtype=None,
    tiling: tiling_lib.Tiling | tuple[int, int, int] | None = None,
    generation: str | None = None,
    interpret=False,
    rhs_scales: jax.Array | None = None,
    weight_format: str | None = None,
    glu=None,
    glu_halves: str = "concatenated",
    glu_bias: jax.Array | None = None,
) -> jax.Array:
    """Grouped matmul. See the module docstring; inputs are assumed valid.

    ``weight_format`` ("int8", "fp8", "mxfp4": ``common.quant_formats``)
    makes ``rhs`` that format's values ("nk" only) and ``rhs_scales`` its
    scales, checked: int8 runs in this kernel (``DIRECT_FORMATS``: the int8
    tile into the dot, ``rhs_scales [G, N]`` on the f32 product, the
    quantized tile rule ``tiling.choose_quantized_tiling``), fp8 / mxfp4 in
    ``pallas_qgmm``'s (``glu`` there where ``pallas_qgmm.gated_store_tiling``
    allows it; else a ValueError).

    ``glu``: the gated up projection of an MLP. ``rhs`` holds ``2I`` output
    features, a gate half and an up half, ``glu_halves`` "concatenated" (the
    gate's I, then the up's; "nk" only) or "interleaved" (gate, up
    alternating: gpt-oss); the output ``[M, I]`` is ``glu(g, u)`` of the
    halves of ``lhs @ rhs`` (+ ``glu_bias [G, 2I]`` of each row's group),
    applied at the store (``glu`` maps two f32 tiles to one): the f32 ``[M,
    2I]`` product never reaches HBM. Rows outside the local groups are
    zeros. ``tiling``'s ``tn`` is the output tile: a step reads ``tn``
    columns of each half."""
    if weight_format in DIRECT_FORMATS:
        # int8 goes into the dot as it is (Mosaic converts it, exactly, on its way
        # into the MXU), its column scale on the f32 product: this kernel as is.
        from . import quantized

        quantized.check_quantized_gmm_args(lhs, rhs, rhs_scales, weight_format, rhs_layout)
    elif weight_format is not None:
        from . import pallas_qgmm  # imports this module: a late import

        return pallas_qgmm.gmm_quantized(
            lhs, rhs, rhs_scales, group_sizes, weight_format=weight_format, rhs_layout=rhs_layout,
            group_offset=group_offset, out_dtype=out_dtype, tiling=tiling, generation=generation,
            interpret=interpret, glu=glu, glu_halves=glu_halves, glu_bias=glu_bias)
    elif rhs_scales is not None:
        raise ValueError("rhs_scales given without weight_format (one of 'int8', 'fp8', 'mxfp4')")
    m, k = lhs.shape
    num_local = rhs.shape[0]
    n = layouts.out_features(rhs.shape, rhs_layout)
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if glu is not None:
        check_glu_args(rhs.shape, rhs_layout, glu_halves, glu_bias)
        n //= 2
    elif glu_bias is not None:
        raise ValueError("glu_bias given without glu (the gated up projection's bias)")
    concatenated = glu is not None and glu_halves == "concatenated"
    if 0 in (m, k, n):  # nothing to compute: zeros (an empty contraction, or rows outside the groups)
        return jnp.zeros((m, n), out_dtype)
    if tiling is not None:
        t = _given_tiling(tiling, m, k, n)
    elif weight_format is not None:
        # int8: the quantized weights' rule (whole N up to 4096, the row tile of
        # the group size): with half the bytes the steps' compute shows, and the
        # bf16 rule's 512-row tiles lose at 64-512 tokens (estimated v6e,
        # Qwen3-30B-A3B layer, 64 tokens 510 -> 383 us, 512 581 -> 438, 4096
        # 1024 -> 989).
        t = tiling_lib.choose_quantized_tiling(weight_format, m, k, n if glu is None else 2 * n, num_local,
                                               lhs_itemsize=lhs.dtype.itemsize, out_itemsize=out_dtype.itemsize,
                                               generation=generation)
    else:
        # Gated: the rule over both halves' 2n columns, stored in out_dtype (a
        # step stores one column per two weight columns: counted as two).
        t = tiling_lib.choose_tiling(m, k, n if glu is None else 2 * n, num_local, lhs_itemsize=lhs.dtype.itemsize,
                                     rhs_itemsize=rhs.dtype.itemsize, out_itemsize=out_dtype.itemsize,
                                     generation=generation)
    if tiling is None and glu is not None:
        t = gated_tiling(t, n)
    tm, tk, tn = t.as_tuple()
    tiles_m, tiles_k, tiles_n = cdiv(m, tm), cdiv(k, tk), cdiv(n, tn)
    # Columns of rhs a step reads: one tile of each half (interleaved: one tile 2 tn wide).
    tn_rhs = tn if glu is None else 2 * tn

    seg, tile, num_visits, seg_starts, seg_ends, weight_group = forward_visits(
        group_sizes, group_offset, num_local, m=m, tm=tm
    )
    num_segments = num_local + 2

    lhs_spec = pl.BlockSpec((tm, tk), lambda n_i, v, k_i, seg, tile, *_: (tile[v], k_i))
    # Per output column, laid out like rhs's columns: int8 scales, the gate's biases.
    column_vectors = [x for x in ((rhs_scales if weight_format in DIRECT_FORMATS else None), glu_bias) if x is not None]
    halves = range(2) if concatenated else (None,)  # a spec per half of concatenated weights
    tile_cols = tn if concatenated else tn_rhs  # weight columns of one spec's tile
    # [G, 2, I, K]: a free view of [G, 2I, K] (I a multiple of the sublane tile, ``check_glu_args``).
    operands = [rhs.reshape(num_local, 2, n, k)] * 2 if concatenated else [rhs]
    rhs_specs = [_rhs_spec(h, rhs_layout, tile_cols, tk) for h in halves]
    column_specs, column_experts = [], ()
    if column_vectors and column_tiles_in_place(n, tn, tn_rhs, concatenated, m, num_local):
        # In their own [G, N] layout, a block of several experts' rows, the
        # visit's row picked in the kernel: the [G, .., 1, N] views below cost
        # an XLA relayout before every call (COLUMNS_IN_PLACE_MAX_ROWS_PER_GROUP).
        for x in column_vectors:
            for h in halves:
                spec, experts = column_vector_block(  # half h's tile j: column tile h * I / tn + j
                    num_local, x.dtype, tile_cols, lambda n_i, h=h: n_i if h is None else h * (n // tn) + n_i)
                operands.append(x)
                column_specs.append(spec)
                column_experts += (experts,)
    else:
        for x in column_vectors:
            operands += ([x.reshape(num_local, 2, 1, n)] * 2 if concatenated
                         else [x.reshape(num_local, 1, n * (tn_rhs // tn))])
            column_specs += [
                pl.BlockSpec((pl.Squeezed(), 1, tile_cols),
                             lambda n_i, v, k_i, seg, tile, starts, ends, group, *_: (group[v], 0, n_i))
                if h is None else
                pl.BlockSpec((pl.Squeezed(), pl.Squeezed(), 1, tile_cols),
                             lambda n_i, v, k_i, seg, tile, starts, ends, group, *_, h=h: (group[v], h, 0, n_i))
                for h in halves]
    num_bias = len(rhs_specs) if glu_bias is not None else 0  # the last column vectors' specs
    out_spec = pl.BlockSpec((tm, tn), lambda n_i, v, k_i, seg, tile, *_: (tile[v], n_i))

    # A whole-K step stores each row chunk's product directly: no accumulators.
    whole_k = tiles_k == 1 and k % tk == 0
    scalars = [seg, tile, seg_starts, seg_ends, weight_group]
    scratch = []
    prefetch = None
    blocks = ((WeightBlock("nk", tn, n, k, 0), WeightBlock("nk", tn, n, k, 1)) if concatenated
              else (WeightBlock(rhs_layout, tn_rhs, n * (tn_rhs // tn), k),))
    if prefetches_weights(whole_k, generation) and all(b.tiles_align(tiles_n, rhs.dtype.itemsize) for b in blocks):
        prefetch = WeightPrefetch(blocks, tiles_n)
        scalars += list(weight_runs(weight_group, num_visits))
        rhs_specs = [pl.BlockSpec(memory_space=pl.ANY)] * len(rhs_specs)
        scratch = prefetch.scratch(rhs.dtype)
    elif glu is not None and not concatenated and not whole_k and tiling_lib.row_chunk(tm, generation) < tm:
        scratch = [pltpu.VMEM((tm, tn), jnp.float32)]  # the gated chunks' activations
    kernel = functools.partial(
        _gmm_kernel, tm=tm, tk=tk, k=k, tiles_k=tiles_k,
        num_segments=num_segments, rhs_layout=rhs_layout,
        row_chunk=tiling_lib.row_chunk(tm, generation), glu=glu,
        glu_halves=glu_halves if glu is not None else None, num_bias=num_bias,
        valid_cols=2 * n if glu is not None and not concatenated and n % tn else 0,
        masked_store=not interpret, prefetch=prefetch, column_scales=weight_format in DIRECT_FORMATS,
        column_experts=column_experts,
    )
    # What the kernel reads, as XLA schedules around it: M rows touch at most
    # M experts (decode: 8 of 128), not every expert of rhs.
    experts_read = min(num_local, m)
    cost = pl.CostEstimate(
        flops=2 * m * k * n * (1 if glu is None else 2),
        transcendentals=m * n if glu is not None else 0,
        bytes_accessed=(
            lhs.size * lhs.dtype.itemsize * tiles_n
            + experts_read * k * n * (1 if glu is None else 2) * rhs.dtype.itemsize
            + m * n * out_dtype.itemsize
        ),
    )
    # The VMEM limit of the tiles' bytes: a gated step holds both halves' tiles.
    vmem_tiles = tiling_lib.Tiling(tm, tk, tn if glu is None else 2 * tn)
    call = _visits_call(kernel, out_struct((m, n), out_dtype, lhs, rhs, group_sizes),
                        (tiles_n, num_visits, tiles_k), [lhs_spec, *rhs_specs, *column_specs],
                        out_spec, (tm, tn_rhs if glu is not None and not concatenated else tn),
                        ("arbitrary" if prefetch else "parallel", "arbitrary", "arbitrary"), cost,
                        f"ragged_dot_gmm_{'glu' if glu is not None else rhs_layout}", generation, interpret,
                        num_visit_arrays=len(scalars), num_accumulators=0 if whole_k else len(rhs_specs),
                        extra_scratch=scratch,
                        large_vmem=tiling_lib.needs_large_vmem(tiling_lib.forward_working_set_bytes(
                            vmem_tiles, k, lhs.dtype.itemsize, rhs.dtype.itemsize, 4, generation), generation))
    return call(*scalars, lhs, *operands)


# Quantized formats this kernel reads as they are (the others: ``pallas_qgmm``).
DIRECT_FORMATS = ("int8",)
GLU_HALVES = ("concatenated", "interleaved")
# Rows of each concatenated half: a multiple of 16, so that [G, 2, I, K] is a
# free view of [G, 2I, K] in any dtype of at least 16 bits.
GLU_HALF_ROWS = 16


def glu_supported(rhs_shape, rhs_layout: str, glu_halves: str) -> bool:
    """Whether ``gmm(glu=)`` takes these weights (``check_glu_args``'s rule)."""
    n = rhs_shape[1] if rhs_layout == "nk" else rhs_shape[2]
    if glu_halves == "concatenated":
        return rhs_layout == "nk" and n % (2 * GLU_HALF_ROWS) == 0
    return glu_halves == "interleaved" and n % 2 == 0


def check_glu_args(rhs_shape, rhs_layout, glu_halves, glu_bias) -> None:
    if glu_halves not in GLU_HALVES:
        raise ValueError(f"glu_halves must be one of {GLU_HALVES}, got {glu_halves!r}")
    n = layouts.out_features(rhs_shape, rhs_layout)
    if glu_halves == "concatenated" and rhs_layout != "nk":
        raise ValueError(f"glu: concatenated halves are read from rhs \"nk\" ([G, 2I, K]), got "
                         f"rhs_layout={rhs_layout!r}")
    if not glu_supported(rhs_shape, rhs_layout, glu_halves):
        need = f"a multiple of {2 * GLU_HALF_ROWS}" if glu_halves == "concatenated" else "even"
        raise ValueError(f"glu: rhs's out dim holds two halves (gate, up) and must be {need}, got {n} "
                         f"(rhs shape {tuple(rhs_shape)}, {glu_halves})")
    if glu_bias is not None and tuple(glu_bias.shape) != (rhs_shape[0], n):
        raise ValueError(f"glu_bias: expected shape {(rhs_shape[0], n)} (one bias per group and output feature of "
                         f"rhs), got {tuple(glu_bias.shape)}")


def gated_tiling(t: tiling_lib.Tiling, half: int) -> tiling_lib.Tiling:
    """The gated kernel's tiles from the rule's tiles for the whole ``2 *
    half`` output dim: a step holds one column tile of each half, so each is
    half as wide (the same VMEM), lane-aligned, balanced over ``half``."""
    if t.tn >= 2 * half:
        return tiling_lib.Tiling(t.tm, t.tk, half)
    tn = max(128, t.tn // 2 // 128 * 128)
    return tiling_lib.Tiling(t.tm, t.tk, tiling_lib.balanced_tile(half, tn, 128))


# ----------------------------------------------------------------------------
# Weight gradient: d_rhs[g] = lhs_g^T @ dout_g   (laid out like rhs)
# ----------------------------------------------------------------------------


def _tgmm_kernel(
    seg_ref, tile_ref, seg_start_ref, seg_end_ref,
    lhs_ref, dout_ref,
    out_ref,
    acc_ref,
    *, tm: int, rhs_layout: str,
):
    """One visit's ``lhs_tile^T @ dout_tile`` into its group's gradient.

    A group's first visit writes the f32 accumulator (no zeroing pass), its
    last one adds the accumulator to its product and stores the sum straight
    into the output block (no separate pass re-reading the accumulator); a
    group of one visit stores its product. Each case is its own ``pl.when``
    holding the matmul, so a step runs exactly one of them (see "Weight
    gradient" in ``tiling``)."""
    v = pl.program_id(2)
    seg, tile = seg_ref[v], tile_ref[v]
    first = (v == 0) | (seg_ref[jnp.maximum(v - 1, 0)] != seg)
    last = seg_ref[v + 1] != seg  # the sentinel -1 ends the last group
    start, end = seg_start_ref[seg], seg_end_ref[seg]

    def product():
        x = lhs_ref[...]
        dy = dout_ref[...]
        # Rows of other groups and rows past M (garbage) must not contribute.
        x = jnp.where(row_mask(x.shape, tile, tm, start, end), x, jnp.zeros_like(x))
        dy = jnp.where(row_mask(dy.shape, tile, tm, start, end), dy, jnp.zeros_like(dy))
        return dot_f32(x, dy, 0, 0) if rhs_layout == "kn" else dot_f32(dy, x, 0, 0)

    @pl.when(first & last)
    def _only():
        out_ref[...] = product().astype(out_ref.dtype)

    @pl.when(first & ~last)
    def _open():
        acc_ref[...] = product()

    @pl.when(~first & ~last)
    def _add():
        acc_ref[...] += product()

    @pl.when(~first & last)
    def _close():
        out_ref[...] = (acc_ref[...] + product()).astype(out_ref.dtype)


def tgmm(
    lhs: jax.Array,
    dout: jax.Array,
    group_sizes: jax.Array,
    *,
    num_local_groups: int,
    rhs_layout: RhsLayout = "nk",
    group_offset: int | jax.Array = 0,
    out_dtype=None,
    tiling: tiling_lib.Tiling | tuple[int, int, int] | None = None,
    generation: str | None = None,
    interpret=False,
) -> jax.Array:
    """Per-group ``lhs^T @ dout``: ``[G_local, N, K]`` ("nk") or ``[G_local, K, N]``."""
    m, k = lhs.shape
    n = dout.shape[1]
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    out_shape = layouts.weight_shape(num_local_groups, k, n, rhs_layout)
    if 0 in (m, k, n):  # no rows: every group's gradient is zero
        return jnp.zeros(out_shape, out_dtype)
    if tiling is None:
        t = tiling_lib.weight_gradient_tiling(m, k, n, num_local_groups, lhs_itemsize=lhs.dtype.itemsize,
                                              dout_itemsize=dout.dtype.itemsize, out_itemsize=out_dtype.itemsize,
                                              generation=generation)
    else:
        t = _given_tiling(tiling, m, k, n)
    tm, tk, tn = t.as_tuple()
    tiles_m, tiles_k, tiles_n = cdiv(m, tm), cdiv(k, tk), cdiv(n, tn)

    seg_starts, seg_ends = local_window(group_sizes, group_offset, num_local_groups)
    seg, tile, num_visits = make_visits(
        seg_starts, seg_ends, tm=tm, tiles_m=tiles_m, visit_empty=True
    )
    if rhs_layout == "kn":
        grid = (tiles_k, tiles_n, num_visits)
        lhs_spec = pl.BlockSpec((tm, tk), lambda a, b, v, seg, tile, *_: (tile[v], a))
        dout_spec = pl.BlockSpec((tm, tn), lambda a, b, v, seg, tile, *_: (tile[v], b))
        out_spec = pl.BlockSpec(
            (pl.Squeezed(), tk, tn), lambda a, b, v, seg, *_: (seg[v], a, b)
        )
        acc_shape = (tk, tn)
    else:
        grid = (tiles_n, tiles_k, num_visits)
        lhs_spec = pl.BlockSpec((tm, tk), lambda a, b, v, seg, tile, *_: (tile[v], b))
        dout_spec = pl.BlockSpec((tm, tn), lambda a, b, v, seg, tile, *_: (tile[v], a))
        out_spec = pl.BlockSpec(
            (pl.Squeezed(), tn, tk), lambda a, b, v, seg, *_: (seg[v], a, b)
        )
        acc_shape = (tn, tk)

    kernel = functools.partial(_tgmm_kernel, tm=tm, rhs_layout=rhs_layout)
    cost = pl.CostEstimate(
        flops=2 * m * k * n,
        transcendentals=0,
        bytes_accessed=(
            lhs.size * lhs.dtype.itemsize * tiles_n
            + dout.size * dout.dtype.itemsize * tiles_k
            + num_local_groups * k * n * out_dtype.itemsize
        ),
    )
    call = _visits_call(kernel, out_struct(out_shape, out_dtype, lhs, dout, group_sizes), grid,
                        [lhs_spec, dout_spec], out_spec, acc_shape,
                        ("parallel", "parallel", "arbitrary"), cost, f"ragged_dot_tgmm_{rhs_layout}",
                        generation, interpret, num_visit_arrays=4,
                        large_vmem=tiling_lib.needs_large_vmem(tiling_lib.weight_gradient_working_set_bytes(
                            t, lhs.dtype.itemsize, dout.dtype.itemsize, out_dtype.itemsize), generation))
    return call(seg, tile, seg_starts, seg_ends, lhs, dout)


def _visits_call(kernel, out_shape, grid, in_specs, out_spec, acc_shape, semantics, cost, name,
                 generation, interpret, num_visit_arrays, large_vmem=False, num_accumulators=1, extra_scratch=()):
    """The pallas_call both kernels share: scalar-prefetched visit arrays
    (segment and tile of each visit, segment row bounds; the forward adds the
    weight group of each visit), f32 accumulators (the gated forward: two)."""
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=num_visit_arrays, grid=grid, in_specs=in_specs, out_specs=out_spec,
            scratch_shapes=[pltpu.VMEM(acc_shape, jnp.float32)] * num_accumulators + list(extra_scratch),
        ),
        compiler_params=compiler_params(generation, semantics, large_vmem=large_vmem),
        interpret=interpret,
        cost_estimate=cost,
        name=name,
    )


def _given_tiling(tiling, m, k, n) -> tiling_lib.Tiling:
    """A caller's ``(tm, tk, tn)``, checked."""
    t = tiling if isinstance(tiling, tiling_lib.Tiling) else tiling_lib.Tiling(*tiling)
    tiling_lib.validate_tiling(t, m, k, n)
    return t
