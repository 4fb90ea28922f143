"""The grouped matmul forward with quantized weights that need decoding (fp8, mxfp4).

``gmm_quantized(lhs, values, scales, group_sizes, weight_format=...)`` is
``pallas_gmm.gmm`` on ``dequantize(values, scales)``: the same visits (row
segments of the local groups, zeros outside the window, empty groups cost
nothing), but the weights stay in their format in HBM and a grid step reads
``tn x tk`` values (1 byte, mxfp4 half a byte) plus their scales.

In VMEM a step dequantizes its tile into a scratch tile of the lhs dtype,
``QUANT_CHUNK`` columns at a time (bounded f32 temporaries), then runs the
MXU dot with f32 accumulation. With a whole-K tile the scratch tile is kept
across the consecutive visits of one group (a group of 2048 rows in 512-row
tiles is dequantized once, not four times; ``dequantizing_visits``). Per
format:

* int8 is not read here: its tile goes into the dot as it is (Mosaic
  converts it, exactly, on its way into the MXU) and its per-output-column
  scale multiplies the f32 product, so ``pallas_gmm``'s forward reads it
  (``pallas_gmm.DIRECT_FORMATS``) with all of that kernel's store paths
  (no accumulator at whole K, the gate on both halves' layouts). Estimated
  v6e, the layer at 4096 tokens, this kernel -> that one: Qwen3-30B-A3B
  1106 -> 1024 us, gpt-oss-20b 2056 -> 1793, Mixtral-8x7B 5019 -> 4072.
* fp8 sliced (``tiling.fp8_sliced``: groups averaging up to 128 rows on
  v6e, 8 on tpu7x where the stream below applies, else 256 / 128, any on
  v5e): no dequantized copy. Per 128-wide
  K slice the e4m3 tile goes into the MXU dot as it is (Mosaic pushes the
  bytes as e4m3b11 on v5e / v5p / v6e / tpu7x, ``FP8_MXU_GENERATIONS``; v4
  gets an exact ``astype(bf16)`` first) and the block scale multiplies the
  f32 partial product ``[rows, tn]`` (``_fp8_sliced_dot``): ``rows x tn``
  products a slice instead of ``128 x tn`` weights scaled and rounded. The
  scale rows (``[K/128, tn]``) come from the expert's transposed scales by
  one small one-hot matmul per column tile (``_fp8_slice_scales``). More
  exact than the tile path (no bf16 rounding of value x scale). Estimated
  v6e Qwen3-30B-A3B 8 tokens, up projection alone: 290 us (tile) -> 220
  (slices, astype) -> 102.5 (slices, e4m3 into the MXU; HBM roofline 96).
* fp8 otherwise (larger groups): e4m3 values times their 128 x 128 block
  scale, in f32, rounded once to the lhs dtype (the weight
  ``dequantize(.., dtype)`` produces). Streamed
  (``tiling.streamed_dequantization``: v6e from 1024-row tiles, tpu7x; K
  whole): a step dequantizes its tile ``STREAMED_PIECE`` weight rows at a
  time and pushes each piece straight into the dot against every live row
  of the visit (``_fp8_streamed_dot``), so the VPU's decode runs under the
  MXU's work; the live row chunks of a visit, one contiguous run, each run one
  branch-free body (``chunk_runs``). Otherwise into a scratch tile kept
  across the visits of a group (the slices would cost per visit and per live
  row), decoded and stored before the dot. A step reads its expert's whole
  ``[N/128, K/128]`` scale block (a few KB, fetched once per expert) and
  expands its rows along K by one small one-hot matmul
  (``_expand_fp8_scales``).
* mxfp4 at decode (``tiling.mxfp4_stacked``: bf16 lhs, at most 16 rows a
  group, row tiles of 16 computed 8 rows at a time, on the generations of
  ``FP8_MXU_GENERATIONS``): no dequantized copy. Each e2m1 nibble becomes an
  e4m3 byte by bit operations on uint32 words (4 packed bytes, 8 nibbles:
  ``_e2m1_to_e4m3_bits``, 9 word operations for 8 weights): ``sign << 7 |
  magnitude << 2``, whose value is the e2m1 value times 2**-6 exactly; the
  lhs is multiplied by 2**6 instead (exact in bf16 for |x| < 2**121). The low nibbles' tile
  (even k) and the high nibbles' (odd k) go into one 256-deep MXU push per
  128 packed lanes, against the lhs stacked 8 times, copy j keeping the
  lanes of 32-wide K block j: row block j of the product is block j's f32
  partial product, multiplied by its e8m0 scale row (``_mxfp4_stacked_dot``;
  the scale rows ``[K/32, tn]`` are the ``[tn, K/32]`` codes transposed,
  once per column tile and group, ``_mxfp4_scale_rows``). Exact
  products, f32 sums. Assumption, unverified without a TPU: e2m1 0.5 lands
  on the e4m3 subnormal 2**-7 (all other codes on normals), and the MXU is
  taken to multiply e4m3 subnormals exactly as the format defines them (a
  subnormal-free mapping, ``(q << 2) + 0x30`` with 0 and 0.5 special-cased,
  costs about 18 word operations a nibble half instead of 5: estimated
  4459 cycles instead of 1876 for a 1536 x 2048 tile, VPU-bound). Partial
  products times scales below 2**-126 flush to zero (the VPU), as the
  dequantized tile's products do. A scale code 255 (NaN in the OCP format)
  reads inf. A chunk with 1, 2 or 3-4 live rows stacks only those rows
  (``_mxfp4_few_rows_dot``, ``MXFP4_FEW_ROWS``). Estimated v6e, the layer
  (bench_quantized_estimates), dequantized tile -> this path: Qwen3-30B-A3B
  8 tokens 609 -> 126 us (bf16 293, roofline 77: the MXU's e4m3 push, not
  HBM, sets the floor), gpt-oss-20b 8 tokens 656 -> 229, Mixtral-8x7B 8
  tokens 3303 -> 553 (bf16 1731); the threshold's figures at
  ``tiling.MXFP4_STACKED_ROWS_PER_GROUP``.
* mxfp4 otherwise (prefill, f32 lhs, v4): streamed where
  ``tiling.streamed_dequantization`` says (bf16 lhs, as the fp8 stream:
  each 256 weight rows decoded through e4m3 bytes straight into the dot,
  ``_mxfp4_streamed_dot``), else a dequantized tile. For a bf16
  tile (rows in whole 32-row byte tiles) the nibbles become e4m3 bytes by
  the decode path's bit operations (``_e4m3_tile``), then bf16
  (``astype``), times 2**6, times the e8m0 scale in bf16: every step exact
  (a power of two times a 2-bit significand; below 2**-126 flushed, as in
  f32), taking, as the fp8 tile on v4 does, the e4m3 subnormal (e2m1 0.5)
  to convert exactly. Estimated v6e Qwen3-30B-A3B 4096 tokens, up
  projection 1514 -> 1370 us against each nibble decoded through f32 (int32
  codes, a float built from bits, times the f32 scale: what an f32 tile and
  the tails still do; a zero tile would take 704, the bf16 kernel 606). The
  e8m0 scale of 16 bytes is repeated along lanes by one in-vreg lane gather
  per 128 columns.

Both mxfp4 paths: the two nibbles of a byte are k = 2j and 2j + 1; rather
than interleave lanes in VMEM, the wrapper reorders lhs per K tile into
[even k | odd k] (each half padded to whole lanes) and the kernel contracts
it with [low nibbles | high nibbles]: the same sum.

Weight tiles: with K whole on a one-TensorCore chip (v5e, v6e, tpu7x) the
kernel moves its value tiles itself, a run of visits ahead
(``pallas_gmm.WeightPrefetch``, as the bf16 forward does); the scales stay
on the grid's pipeline. Estimated v6e, Qwen3-30B-A3B 4096 tokens, int8 (when
this kernel read it) down projection 491 -> 415 us (the grid's
one-step-ahead fetch of a new group's tile stalled the MXU), up 671 -> 610.

The gated up projection (``gmm(glu=)``, as for bf16 weights): the gate (and
the up bias) applied at the store to the f32 product of the step's values
tile, ``[tm, tn / 2]`` activations written in the lhs dtype. A step gates
only its own columns, so the halves must lie in one tile
(``gated_store_tiling``): gpt-oss's interleaved halves in any tile of whole
256-column pairs, concatenated halves when one tile spans all 2I columns
(Qwen3-30B-A3B's 1536; not Mixtral-8x7B's 28672, whose gate stays an XLA
pass). Estimated v6e, gpt-oss-20b 4096 tokens, the layer: fp8 4380 -> 3106
us (the XLA gate over the f32 [16384, 5760] product, its interleaved halves
read by strided lane slices, cost 1460 us; the store's gate ~200). At 512
tokens the XLA gate is cheap (57 us) and the store's costs more (fp8 1708 ->
1739 us): not worth a rule of its own yet.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common import quant_formats
from ..common.pallas_helpers import compiler_params, dot_f32, out_struct, zero_past
from ..common.tile_math import cdiv
from . import quantized, tiling as tiling_lib
from .pallas_gmm import (WeightBlock, WeightPrefetch, gate_interleaved, check_glu_args, column_tiles_in_place,
                         column_vector_block, expert_column, forward_visits, prefetches_weights, store_chunk_rows,
                         store_visit_rows, weight_runs)

DECODED_FORMATS = ("fp8", "mxfp4")
FP8_BLOCK = quant_formats.FORMATS["fp8"].block_k  # 128 (both dims)
MXFP4_BLOCK = quant_formats.FORMATS["mxfp4"].block_k  # 32 values, 16 packed bytes
# Weight rows dequantized at a time (a multiple of the 32-row native tile of
# 8-bit values, dividing fp8's 128-row scale blocks). A block costs a fixed
# ~150 cycles besides its elements: estimated v6e Qwen3-30B-A3B 8 tokens,
# 32 rows (x 2048 columns) mxfp4 783 us, fp8 485 us; 128 rows (x 1024)
# 609 / 447 us; 256 rows (x 512) 608 / 441 us.
ROW_BLOCK = 128
# fp8 runs per 128-wide K slice with the scale on the partial products where
# ``tiling.fp8_sliced`` says (groups averaging at most 128 rows on v6e, 8 on
# tpu7x where the stream applies, else 256 / 128, any on v5e): the slices
# cost per visit and per live row, the dequantized tile once per group, the
# stream once per visit under the MXU's work (the estimates in tiling.py).
# Generations whose matmul takes an e4m3 operand (v4 refuses it).
FP8_MXU_GENERATIONS = tiling_lib.E4M3_MXU_GENERATIONS
STREAMED_PIECE = tiling_lib.STREAMED_PIECE


def _mask_cols(w, first_col, valid):
    """Zeros the columns of chunk ``w`` (starting at tile column ``first_col``)
    at or past ``valid``: the garbage past K of a split K's last tile."""
    cols = first_col + lax.broadcasted_iota(jnp.int32, w.shape, 1)
    return jnp.where(cols < valid, w, jnp.zeros_like(w))


def _for_row_blocks(tn: int, body):
    """``body(rows)`` over the tile's rows, ``ROW_BLOCK`` at a time (a loop, so
    that the f32 temporaries of one block are all that is live), then the
    static tail of ``tn % ROW_BLOCK`` rows."""
    full = tn // ROW_BLOCK
    if full:
        def step(i, carry):
            body(pl.ds(pl.multiple_of(i * ROW_BLOCK, ROW_BLOCK), ROW_BLOCK))
            return carry

        lax.fori_loop(0, full, step, 0)
    if tn % ROW_BLOCK:
        body(pl.ds(full * ROW_BLOCK, tn % ROW_BLOCK))


def _column_chunks(width: int):
    return [(c0, min(tiling_lib.QUANT_CHUNK, width - c0)) for c0 in range(0, width, tiling_lib.QUANT_CHUNK)]


def _expand_fp8_scales(scales_ref, expanded_ref, n_i, k_i, *, tn, tk, tiles_n):
    """``expanded_ref[r, c]``: the scale of the tile's 128-row group ``r`` at
    tile column ``c``, by one small matmul with a one-hot ``[K/128, tk]``
    matrix (exact at HIGHEST precision: each output is one scale times 1).
    A lane broadcast per 128 columns and 32 rows cost twice the dequantization
    itself (estimated, v6e)."""
    blocks_n = cdiv(tn, FP8_BLOCK)
    first = pl.ds(pl.multiple_of(n_i * blocks_n, blocks_n), blocks_n) if tiles_n > 1 else pl.ds(0, blocks_n)
    s = scales_ref[first, :]  # [blocks_n, K / 128]
    blocks_k = -(-s.shape[1] // 128) * 128
    if blocks_k != s.shape[1]:
        s = jnp.concatenate([s, jnp.zeros((blocks_n, blocks_k - s.shape[1]), s.dtype)], axis=1)
    column = k_i * tk + lax.broadcasted_iota(jnp.int32, (blocks_k, tk), 1)
    one_hot = (lax.shift_right_logical(column, 7) == lax.broadcasted_iota(jnp.int32, (blocks_k, tk), 0))
    expanded_ref[:blocks_n, :] = lax.dot_general(
        s, one_hot.astype(jnp.float32), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
        precision=lax.Precision.HIGHEST)


# Rows of a call up to which fp8's sliced path reads the expert's block
# scales in their own ``[N/128, K/128]`` layout and contracts them over N in
# the kernel, rather than transposed by XLA before the call (~0.7 us per
# projection). Estimated v6e, the layer, transposed -> own layout:
# Qwen3-30B-A3B 1 / 8 tokens (8 / 64 rows) 27.6 -> 25.2, 148.9 -> 147.3 us,
# gpt-oss-20b 1 / 8 64.0 -> 63.0, 322.4 -> 321.5; but Qwen3 64 tokens (512
# rows) 369.0 -> 375.1, gpt-oss-20b 64 493.1 -> 496.7: the transposed
# contraction costs each dequantizing visit.
FP8_SCALES_IN_PLACE_MAX_ROWS = 64


def _fp8_slice_scales(scales_ref, n_i, *, tn, rows: int, transposed: bool):
    """``[rows, tn]`` (K/128 rows, then zeros to ``rows``): row j holds, at
    tile column c, the scale of K block j and the 128-row block of output
    column ``n_i * tn + c``; one small one-hot matmul over the expert's N
    blocks of scales, ``[N/128, K/128]`` or (``transposed``) ``[K/128,
    N/128]`` padded to whole tiles (exact at HIGHEST precision: each output
    is one scale times 1)."""
    s = scales_ref[...]
    blocks_n = s.shape[1] if transposed else s.shape[0]
    column = n_i * tn + lax.broadcasted_iota(jnp.int32, (blocks_n, tn), 1)
    one_hot = lax.shift_right_logical(column, 7) == lax.broadcasted_iota(jnp.int32, (blocks_n, tn), 0)
    out = lax.dot_general(s, one_hot.astype(jnp.float32), (((1 if transposed else 0,), (0,)), ((), ())),
                          preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    if rows > out.shape[0]:
        out = jnp.concatenate([out, jnp.zeros((rows - out.shape[0], tn), out.dtype)], axis=0)
    return out


def _fp8_sliced_dot(x, values_ref, slice_scales, k_i, *, tk, k, e4m3_into_mxu):
    """``x @ dequantize(tile)^T`` with the block scale on the f32 partial
    products: per 128-wide K slice, the e4m3 values go into the MXU (as they
    are, or as bf16 where the MXU does not take them: exact either way, every
    e4m3 value is a bf16 value) and the ``[rows, tn]`` partial
    product is multiplied by its slice's scale row, ``rows x tn`` products a
    slice instead of ``128 x tn``."""
    total = None
    tail = k % tk  # the last K tile's columns inside K (0: every tile is whole)
    for j in range(cdiv(tk, FP8_BLOCK)):
        c0, width = j * FP8_BLOCK, min(FP8_BLOCK, tk - j * FP8_BLOCK)
        # e4m3 straight into the dot where the MXU takes it (FP8_MXU_GENERATIONS):
        # Mosaic pushes the bits to the MXU as e4m3b11 (-0 fixed, the result
        # times 2**4), decoded there; astype(bf16) costs ~0.9 VPU cycles per
        # 1000 weights (v6e).
        w = values_ref[:, c0:c0 + width]
        if not e4m3_into_mxu:
            w = w.astype(jnp.bfloat16)
        if tail and c0 + width > tail:  # garbage (maybe NaN codes) past K on the last tile
            w = _mask_cols(w.astype(jnp.float32), c0, k - k_i * tk).astype(jnp.bfloat16)
        if x.dtype == jnp.float32:
            w = w.astype(jnp.float32)
        part = dot_f32(x[:, c0:c0 + width], w, 1, 1)
        row = k_i * cdiv(tk, FP8_BLOCK) + j
        part = part * slice_scales[pl.ds(row, 1), :]
        total = part if total is None else total + part
    return total


def _fp8_streamed_dot(x, values_ref, expanded_ref, acc_ref, rows, *, tn):
    """``acc[rows] += x @ dequantize(tile)^T`` (K whole), the tile dequantized
    ``STREAMED_PIECE`` weight rows at a time straight into the dot: the same
    weights as ``_dequantize_fp8`` (value x scale in f32, rounded once to
    the lhs dtype), never stored."""
    for p0 in range(0, tn, STREAMED_PIECE):
        p1 = min(p0 + STREAMED_PIECE, tn)
        blocks = []
        for r0 in range(p0, p1, FP8_BLOCK):  # one scale row per 128 weight rows
            block = values_ref[r0:min(r0 + FP8_BLOCK, p1), :].astype(jnp.float32)
            blocks.append(block * expanded_ref[pl.ds(r0 // FP8_BLOCK, 1), :])
        w = blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=0)
        acc_ref[rows, p0:p1] += dot_f32(x, w.astype(x.dtype), 1, 1)


def _mxfp4_streamed_dot(x, values_ref, scales_ref, acc_ref, rows, *, tn, tk, half):
    """``acc[rows] += x @ dequantize(tile)^T`` for a bf16 lhs split into
    [even k | odd k] halves (K whole), the tile decoded ``STREAMED_PIECE``
    weight rows at a time straight into the dot: the same bf16 weights as
    ``_dequantize_mxfp4`` (through e4m3 bytes, exact), never stored."""
    packed_cols = tk // 2
    for p0 in range(0, tn, STREAMED_PIECE):
        piece = slice(p0, min(p0 + STREAMED_PIECE, tn))
        halves = ([], [])
        for c0, width in _column_chunks(packed_cols):
            s = _e8m0_scales_per_byte(scales_ref, piece, c0, width)
            for out, w in zip(halves, _mxfp4_bf16_halves(values_ref, piece, c0, width, s)):
                out.append(w)
        if half > packed_cols:  # each half's lane padding: zero weights (the lhs pads with zeros too)
            for out in halves:
                out.append(jnp.zeros((piece.stop - piece.start, half - packed_cols), jnp.bfloat16))
        w = jnp.concatenate(halves[0] + halves[1], axis=1)
        acc_ref[rows, piece] += dot_f32(x, w, 1, 1)


def chunk_runs(chunks):
    """``(rows, live)`` per contiguous run of a tile's row chunks, ``live``
    when the visit's live chunks are exactly that run (a visit's rows are one
    range, so its live chunks are one run: exactly one body runs)."""
    runs = []
    for a in range(len(chunks)):
        for b in range(a + 1, len(chunks) + 1):
            live = chunks[a][1] & chunks[b - 1][1]
            if a > 0:
                live = live & jnp.logical_not(chunks[a - 1][1])
            if b < len(chunks):
                live = live & jnp.logical_not(chunks[b][1])
            runs.append((slice(chunks[a][0].start, chunks[b - 1][0].stop), live))
    return runs


def _dequantize_fp8(values_ref, expanded_ref, wq_ref, *, tn, tk, valid):
    def block(rows):
        # ROW_BLOCK divides 128: the rows share one 128-row group's scales.
        # (lax.div: a traced // lowers through sign, which Mosaic cannot lower off a TPU host)
        s_row = expanded_ref[pl.ds(lax.div(rows.start, FP8_BLOCK), 1), :]  # [1, tk]
        for c0, width in _column_chunks(tk):
            w = values_ref[rows, c0:c0 + width].astype(jnp.float32) * s_row[:, c0:c0 + width]
            if valid is not None:
                w = _mask_cols(w, c0, valid)
            wq_ref[rows, c0:c0 + width] = w.astype(wq_ref.dtype)

    _for_row_blocks(tn, block)


def fp8_expanded_scales_shape(n: int, k: int) -> tuple[int, int]:
    """The f32 scratch ``dequantize_fp8_operand`` expands an ``[N, K]``
    operand's block scales into: one row per 128 weight rows (padded to whole
    8-row tiles), one column per K column."""
    return (-(-cdiv(n, FP8_BLOCK) // 8) * 8, k)


def dequantize_fp8_operand(values_ref, scales_ref, expanded_ref, wq_ref):
    """A whole ``[N, K]`` fp8 operand (one expert's weights, ``scales_ref``
    its ``[N/128, K/128]`` block scales) into ``wq_ref`` in its dtype: the
    weights of the dequantized tile (value x scale in f32, rounded once).
    The fused experts kernel decodes each expert this way once."""
    n, k = values_ref.shape
    _expand_fp8_scales(scales_ref, expanded_ref, 0, 0, tn=n, tk=k, tiles_n=1)
    _dequantize_fp8(values_ref, expanded_ref, wq_ref, tn=n, tk=k, valid=None)


def _e8m0_scales_per_byte(scales_ref, rows, first_byte: int, width: int):
    """float32 scales of packed columns ``[first_byte, first_byte + width)``
    (one e8m0 code per 16 bytes), repeated along lanes with one in-vreg lane
    gather per 128 columns: a vreg of scale codes holds the scales of 16
    vregs of bytes. (A broadcast-reshape repeat cost about 1000 cycles a step
    more on v6e, estimated at Qwen3-30B-A3B decode.)"""
    s = quantized.e8m0_to_f32(scales_ref[rows, :].astype(jnp.int32))  # [rows, K / 32]
    padded = -(-s.shape[1] // 128) * 128
    if padded != s.shape[1]:
        s = jnp.concatenate([s, jnp.zeros((s.shape[0], padded - s.shape[1]), s.dtype)], axis=1)
    group_of_lane = lax.shift_right_logical(lax.broadcasted_iota(jnp.int32, (s.shape[0], 128), 1), 4)
    pieces = []
    for j in range(first_byte // 128, -(-(first_byte + width) // 128)):
        source = s[:, (j // 16) * 128:(j // 16 + 1) * 128]
        pieces.append(jnp.take_along_axis(source, group_of_lane + 8 * (j % 16), axis=1,
                                          mode="promise_in_bounds"))
    out = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)
    return out[:, :width]


def _mxfp4_bf16_halves(values_ref, rows, c0: int, width: int, scales):
    """The bf16 weights of packed columns ``[c0, c0 + width)`` of ``rows``
    (whole 32-row byte tiles), low nibbles (even k) then high (odd k),
    decoded through e4m3 bytes: exact. ``scales``: their f32 e8m0 scales per
    byte (``_e8m0_scales_per_byte``)."""
    words = pltpu.bitcast(values_ref[rows, c0:c0 + width], jnp.uint32)
    scales = scales.astype(jnp.bfloat16)  # exact: a power of two (code 0 reads 0, 255 inf)
    factor = jnp.asarray(E2M1_TO_E4M3_FACTOR, jnp.bfloat16)
    return [(_e4m3_tile(words, high).astype(jnp.bfloat16) * factor) * scales for high in (False, True)]


def _dequantize_mxfp4(values_ref, scales_ref, wq_ref, *, tn, tk, half, valid):
    packed_cols = tk // 2

    def block(rows):
        # A bf16 tile of whole 32-row byte tiles decodes through e4m3 bytes,
        # otherwise each nibble through f32 (module docstring).
        through_e4m3 = wq_ref.dtype == jnp.bfloat16 and rows.size % 32 == 0
        for c0, width in _column_chunks(packed_cols):
            s = _e8m0_scales_per_byte(scales_ref, rows, c0, width)
            if through_e4m3:
                halves = _mxfp4_bf16_halves(values_ref, rows, c0, width, s)
            else:
                halves = [quantized.e2m1_to_f32(nibbles) * s
                          for nibbles in quantized.unpack_e2m1(values_ref[rows, c0:c0 + width])]
            for offset, w in zip((0, half), halves):
                if valid is not None:
                    w = _mask_cols(w, c0, lax.div(valid, 2))
                wq_ref[rows, offset + c0:offset + c0 + width] = w.astype(wq_ref.dtype)
        if half > packed_cols:  # lane padding of each half: zeros, never stale VMEM
            pad = jnp.zeros((rows.size, half - packed_cols), wq_ref.dtype)
            wq_ref[rows, packed_cols:half] = pad
            wq_ref[rows, half + packed_cols:] = pad

    _for_row_blocks(tn, block)


# mxfp4 at decode (``tiling.mxfp4_stacked``): e2m1 nibbles become e4m3 bytes
# by bit operations on uint32 words (4 packed bytes, 8 nibbles a word):
# byte = sign << 7 | magnitude << 2 has the value e2m1 * 2**-6 exactly
# (magnitudes >= 2 land on e4m3 normals; magnitude 1, e2m1 0.5, on the e4m3
# subnormal 2**-7, see the module docstring for that assumption). The lhs is
# multiplied by 2**6 instead (exact in bf16).
E4M3_SIGNS = 0x80808080
E4M3_MAGNITUDES = 0x1C1C1C1C
E2M1_TO_E4M3_FACTOR = 64.0  # 2**6
# Packed bytes (lanes) sharing one e8m0 scale, and scale blocks per 128 lanes.
MXFP4_BLOCK_BYTES = MXFP4_BLOCK // 2
MXFP4_BLOCKS_PER_LANE_GROUP = 128 // MXFP4_BLOCK_BYTES  # 8
# Rows the stacked decode path computes at once (the f32 sublane tile): its
# cost grows with the rows, 8 x rows of lhs per MXU push (see below).
MXFP4_STACKED_ROW_CHUNK = 8
# Live rows of a chunk -> rows the few-rows dot computes (``_mxfp4_few_rows_dot``).
MXFP4_FEW_ROWS = ((1, 1), (2, 2), (3, 4))


def _e2m1_to_e4m3_bits(words, high: bool):
    """e4m3 bits of the low (``high``: high) nibbles of the 4 bytes of each
    uint32 word: 5 (4) word operations for 4 weights."""
    u = jnp.uint32
    if high:
        return (words & u(E4M3_SIGNS)) | ((words >> u(2)) & u(E4M3_MAGNITUDES))
    return ((words << u(4)) & u(E4M3_SIGNS)) | ((words << u(2)) & u(E4M3_MAGNITUDES))


def _e4m3_tile(words, high: bool):
    """The e4m3 tile (value: e2m1 x 2**-6) of the low (``high``: high)
    nibbles of ``words``, the uint32 view of a packed tile."""
    return lax.bitcast_convert_type(pltpu.bitcast(_e2m1_to_e4m3_bits(words, high), jnp.uint8), jnp.float8_e4m3fn)


def _mxfp4_scale_rows(scales_ref, k_i, *, tk, k):
    """``[tk/32, tn]`` float32: row j holds the e8m0 scale of the tile's K
    block j for every output column: the ``[tn, tk/32]`` code block
    transposed as bytes (4 rows a sublane: estimated v6e Qwen3-30B-A3B 8
    tokens 147 -> 140 us against an identity matmul of the codes in bf16),
    then decoded; codes past K (a split K's last tile: stale VMEM) read 0."""
    codes = scales_ref[...].T.astype(jnp.int32)  # [tk/32, tn]
    if k % tk:
        # (lax.div: a traced // lowers through sign, which Mosaic cannot lower off a TPU host)
        first_past = lax.div(k - k_i * tk + MXFP4_BLOCK - 1, MXFP4_BLOCK)
        codes = jnp.where(lax.broadcasted_iota(jnp.int32, codes.shape, 0) < first_past, codes, 0)
    return quantized.e8m0_to_f32(codes)


def _mxfp4_stacked_dot(x, values_ref, scale_rows_ref, *, packed_cols: int, half: int):
    """``x @ dequantize(tile)^T`` (``x``: [rows, 2 * half] bf16, even k |
    odd k) with each e8m0 scale on the f32 partial product of its 32-wide K
    block. Per 128 packed lanes (8 blocks): the e4m3 tiles of the low and the
    high nibbles side by side ([tn, 256], the same 8 blocks), pushed into the
    MXU once against the lhs stacked 8 times, copy j keeping block j's lanes
    only ([8 rows, 256]): the product's row block j is block j's partial
    product, times its scale row. ``rows x tn`` products a block instead of
    ``32 x tn`` weights scaled, rounded and stored."""
    rows = x.shape[0]
    x = x * jnp.asarray(E2M1_TO_E4M3_FACTOR, x.dtype)  # exact: a power of two
    total = None
    for c0 in range(0, packed_cols, 128):
        width = min(128, packed_cols - c0)
        words = pltpu.bitcast(values_ref[:, c0:c0 + width], jnp.uint32)  # [tn / 4, width]
        tiles = [_e4m3_tile(words, high) for high in (False, True)]
        xs = [x[:, c0:c0 + width], x[:, half + c0:half + c0 + width]]
        blocks = width // MXFP4_BLOCK_BYTES

        def stacked(xh):  # [blocks * rows, width]: copy j keeps block j's lanes
            # (lax.div: a traced // lowers through sign, which Mosaic cannot lower off a TPU host)
            lane_block = lax.div(lax.broadcasted_iota(jnp.int32, (blocks * rows, width), 1), MXFP4_BLOCK_BYTES)
            row_block = lax.div(lax.broadcasted_iota(jnp.int32, (blocks * rows, width), 0), rows)
            return jnp.where(lane_block == row_block, jnp.tile(xh, (blocks, 1)), jnp.zeros((), xh.dtype))

        if width == 128:  # one 256-deep push: the MXU adds the two halves' products
            part = dot_f32(jnp.concatenate([stacked(xh) for xh in xs], axis=1),
                           jnp.concatenate(tiles, axis=1), 1, 1)
        else:  # a whole K's partial last lane group
            part = dot_f32(stacked(xs[0]), tiles[0], 1, 1) + dot_f32(stacked(xs[1]), tiles[1], 1, 1)
        for j in range(blocks):
            row = c0 // MXFP4_BLOCK_BYTES + j
            term = part[j * rows:(j + 1) * rows] * scale_rows_ref[pl.ds(row, 1), :]
            total = term if total is None else total + term
    return total


def _mxfp4_few_rows_dot(x, first, count: int, values_ref, scale_rows_ref, *, packed_cols: int, half: int):
    """``_mxfp4_stacked_dot`` for ``count`` rows of the chunk ``x`` from row
    ``first`` (traced) on: each row stacked 8 times (copy j keeping block
    j's lanes), so that the product's 8 rows of a lhs row are its 8 partial
    products of a lane group, scaled by the 8 scale rows at once and summed
    over sublanes once at the end: ``8 x count`` result rows a lane group
    instead of 64. Returns ``[rows of x, tn]`` with the results on rows
    ``first .. first + count - 1`` (rows past the chunk or the group are
    computed and never stored), zeros elsewhere."""
    rows = x.shape[0]
    blocks_per_group = MXFP4_BLOCKS_PER_LANE_GROUP
    row_ids = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    x32 = x.astype(jnp.float32)
    # each picked row repeated on 8 sublanes, exactly (a sum of one value and zeros)
    picked = jnp.concatenate(
        [jnp.broadcast_to(jnp.sum(jnp.where(row_ids == first + i, x32, 0.0), axis=0, keepdims=True),
                          (blocks_per_group, x.shape[1])) for i in range(count)], axis=0)
    picked = (picked * E2M1_TO_E4M3_FACTOR).astype(x.dtype)  # exact: a power of two
    total = None
    for c0 in range(0, packed_cols, 128):
        width = min(128, packed_cols - c0)
        words = pltpu.bitcast(values_ref[:, c0:c0 + width], jnp.uint32)
        tiles = [_e4m3_tile(words, high) for high in (False, True)]

        def stacked(xh):  # [8 x count, width]: row 8 i + j keeps block j's lanes
            shape = xh.shape
            keep = lax.div(lax.broadcasted_iota(jnp.int32, shape, 1), MXFP4_BLOCK_BYTES) == \
                lax.rem(lax.broadcasted_iota(jnp.int32, shape, 0), blocks_per_group)
            return jnp.where(keep, xh, jnp.zeros((), xh.dtype))

        xs = [picked[:, c0:c0 + width], picked[:, half + c0:half + c0 + width]]
        if width == 128:
            part = dot_f32(jnp.concatenate([stacked(xh) for xh in xs], axis=1),
                           jnp.concatenate(tiles, axis=1), 1, 1)
        else:
            part = dot_f32(stacked(xs[0]), tiles[0], 1, 1) + dot_f32(stacked(xs[1]), tiles[1], 1, 1)
        first_block = c0 // MXFP4_BLOCK_BYTES  # a multiple of 8: an aligned [8, tn] slice of scale rows
        scale = scale_rows_ref[first_block:first_block + blocks_per_group, :]
        term = part * (scale if count == 1 else jnp.concatenate([scale] * count, axis=0))
        total = term if total is None else total + term
    tn = total.shape[1]
    out_rows = lax.broadcasted_iota(jnp.int32, (rows, tn), 0)
    out = None
    for i in range(count):
        value = jnp.sum(total[i * blocks_per_group:(i + 1) * blocks_per_group], axis=0, keepdims=True)
        placed = jnp.where(out_rows == first + i, jnp.broadcast_to(value, (rows, tn)), 0.0)
        out = placed if out is None else out + placed
    return out


def dequantizing_visits(seg, num_local: int, tiles_k: int):
    """1 for the visits that dequantize their weight tile, 0 for those that
    reuse the one in VMEM: a local visit following a visit of the same group
    (the local visits are one contiguous run), with a whole-K tile. A table
    of the wrapper rather than a key in scratch, so that the TPU estimator
    knows which steps dequantize."""
    local = (seg > 0) & (seg <= num_local)
    if tiles_k > 1:
        return local.astype(jnp.int32)
    previous = jnp.concatenate([jnp.full((1,), -1, seg.dtype), seg[:-1]])
    return (local & (previous != seg)).astype(jnp.int32)


def _qgmm_kernel(
    *refs,  # scalar prefetch (SMEM): the visit arrays, dequantizing visits (+ weight runs); lhs, values (in HBM
    # when prefetched), scales; out; scratch: f32 accumulator, dequantized tile, expanded scales (fp8, mxfp4
    # stacked), the prefetched weight buffers and their semaphores
    weight_format: str, tm: int, tn: int, tk: int, k: int, tiles_n: int, tiles_k: int,
    num_segments: int, row_chunk: int, half: int, fp8_sliced: bool, fp8_scales_transposed: bool,
    e4m3_into_mxu: bool, streamed: bool,
    mxfp4_stacked: bool, prefetch: WeightPrefetch | None = None, glu=None, glu_halves: str | None = None,
    has_bias: bool = False, bias_experts: int = 0, valid_cols: int = 0, masked_store: bool = True,
):
    num_scalars = 6 + (3 if prefetch else 0)
    seg_ref, tile_ref, seg_start_ref, seg_end_ref, group_ref, dequantize_ref = refs[:6]
    run_refs = refs[6:num_scalars]
    lhs_ref, values_ref, scales_ref = refs[num_scalars:num_scalars + 3]
    refs = refs[num_scalars + 3:]
    bias_ref, refs = (refs[0], refs[1:]) if has_bias else (None, refs)
    out_ref, acc_ref, wq_ref = refs[:3]
    expanded_ref = refs[3:len(refs) - (2 if prefetch else 0)]
    if prefetch:
        buf, sems = refs[-2:]
        values_ref = buf.at[prefetch.fetch([values_ref], [buf], sems, *run_refs)]
    n_i, v, k_i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seg = seg_ref[v]
    is_local = (seg > 0) & (seg < num_segments - 1)
    start, end = seg_start_ref[seg], seg_end_ref[seg]
    valid = (k - k_i * tk) if k % tk else None  # columns of this K tile inside K

    @pl.when(k_i == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    chunks = []
    for c in range(tm // row_chunk):
        first_row = tile_ref[v] * tm + c * row_chunk
        chunks.append((slice(c * row_chunk, (c + 1) * row_chunk),
                       is_local & (first_row < end) & (first_row + row_chunk > start)))

    # Visit 0 starts a column tile (and a core's share of them under
    # megacore): the table marks it whenever it is local.
    def _dequantize():
        if fp8_sliced:
            expanded_ref[0][...] = _fp8_slice_scales(scales_ref, n_i, tn=tn, rows=expanded_ref[0].shape[0],
                                                     transposed=fp8_scales_transposed)
        elif mxfp4_stacked:
            scale_rows = _mxfp4_scale_rows(scales_ref, k_i, tk=tk, k=k)
            pad = expanded_ref[0].shape[0] - scale_rows.shape[0]
            if pad:  # zeros, never stale VMEM (NaN times the one-row path's zero products)
                scale_rows = jnp.concatenate([scale_rows, jnp.zeros((pad, tn), jnp.float32)], axis=0)
            expanded_ref[0][...] = scale_rows
        elif weight_format == "mxfp4":  # streamed: reads its scales per piece, nothing to prepare
            if not streamed:
                _dequantize_mxfp4(values_ref, scales_ref, wq_ref, tn=tn, tk=tk, half=half, valid=valid)
        else:
            _expand_fp8_scales(scales_ref, expanded_ref[0], n_i, k_i, tn=tn, tk=tk, tiles_n=tiles_n)
            if not streamed:
                _dequantize_fp8(values_ref, expanded_ref[0], wq_ref, tn=tn, tk=tk, valid=valid)

    pl.when(dequantize_ref[v] == 1)(_dequantize)

    def accumulate(rows):
        x = lhs_ref[rows, :]
        if valid is not None and weight_format != "mxfp4":  # mxfp4's lhs is zero-padded
            x = zero_past(x, 1, valid)
        if fp8_sliced:
            acc_ref[rows, :] += _fp8_sliced_dot(x, values_ref, expanded_ref[0], k_i, tk=tk, k=k,
                                                  e4m3_into_mxu=e4m3_into_mxu)
            return
        if mxfp4_stacked:
            acc_ref[rows, :] += _mxfp4_stacked_dot(x, values_ref, expanded_ref[0], packed_cols=tk // 2,
                                                   half=half)
            return
        if streamed and weight_format == "fp8":
            _fp8_streamed_dot(x, values_ref, expanded_ref[0], acc_ref, rows, tn=tn)
            return
        if streamed:
            _mxfp4_streamed_dot(x, values_ref, scales_ref, acc_ref, rows, tn=tn, tk=tk, half=half)
            return
        acc_ref[rows, :] += dot_f32(x, wq_ref[...], 1, 1)

    def accumulate_few_rows(rows, first, count):
        acc_ref[rows, :] += _mxfp4_few_rows_dot(lhs_ref[rows, :], first, count, values_ref, expanded_ref[0],
                                                packed_cols=tk // 2, half=half)

    few_rows = [(low, high) for low, high in MXFP4_FEW_ROWS if high < row_chunk] if mxfp4_stacked else []
    for c, (rows, live) in enumerate([] if streamed else chunks):
        if few_rows:  # a chunk holding 1, 2 or 3-4 rows of the visit's group: the few-rows dot
            first_row = tile_ref[v] * tm + c * row_chunk
            live_rows = jnp.minimum(end, first_row + row_chunk) - jnp.maximum(start, first_row)
            first = jnp.maximum(start, first_row) - first_row
            for low, high in few_rows:
                pl.when(live & (live_rows >= low) & (live_rows <= high))(functools.partial(
                    accumulate_few_rows, rows, first, high))
            live = live & (live_rows > few_rows[-1][1])
        pl.when(live)(functools.partial(accumulate, rows))
    if streamed:  # one dot over the visit's live chunks: the decode is paid once per step
        for rows, live in chunk_runs(chunks):
            pl.when(live)(functools.partial(accumulate, rows))

    if glu is None:
        pl.when(k_i == tiles_k - 1)(lambda: store_visit_rows(out_ref, acc_ref[...], v, tile_ref, tm, start, end))
        return

    # The visit's expert's bias: picked from a block of experts once per step,
    # a view's row read per chunk (as pallas_gmm's per-column vectors).
    step_bias = expert_column(bias_ref, bias_experts, group_ref[v]) if bias_ref is not None and bias_experts else None

    def store_gated_chunk(c, rows):
        value = acc_ref[rows, :]
        if bias_ref is not None:
            value = value + (step_bias if step_bias is not None else expert_column(bias_ref, 0, group_ref[v]))
        if glu_halves == "concatenated":  # the step's tile holds both whole halves
            half_width = value.shape[1] // 2
            gated = glu(value[:, :half_width], value[:, half_width:])
        else:
            gated = gate_interleaved(value, glu, out_ref.dtype, n_i, valid_cols)
        store_chunk_rows(out_ref, pl.ds(rows.start, row_chunk), gated, tile_ref[v] * tm + c * row_chunk, start, end,
                         masked_store)

    # Only the chunks holding the visit's rows are gated and stored (a boundary
    # visit gates its own rows, not the whole tile); the other rows belong to
    # other visits of the tile, which write them.
    for c, (rows, live) in enumerate(chunks):
        pl.when((k_i == tiles_k - 1) & live)(functools.partial(store_gated_chunk, c, rows))

    # Rows outside the local groups are zeros (not a gate of zero products, which a bias makes nonzero).
    @pl.when((k_i == tiles_k - 1) & jnp.logical_not(is_local))
    def _store_idle():
        store_visit_rows(out_ref, jnp.zeros(out_ref.shape, jnp.float32), v, tile_ref, tm, start, end)


def gated_store_tiling(weight_format: str, glu_halves: str, m: int, k: int, n: int, num_local: int, *,
                       lhs_itemsize: int, out_itemsize: int, generation=None, tiling=None):
    """The tiles of the gated up projection (``gmm(glu=)``) on quantized
    weights, ``tn`` the width of the values tile a step reads (``2I = n``
    columns in all; a given ``tiling``'s ``tn`` is the output tile, as for
    bf16 weights), or None where the store cannot apply the gate. A step
    gates the columns of its own tile: interleaved halves (gpt-oss) pair
    neighbouring columns, so any tile of whole 128-column output tiles works
    (a multiple of 256 values columns, or all 2I); concatenated halves are
    both in a step only when the tile spans all 2I columns, with I a
    multiple of 128 (lane-aligned halves): Qwen3-30B-A3B, not Mixtral-8x7B's
    28672 columns (its gate stays an XLA pass over the f32 product)."""
    if tiling is not None:
        t = tiling if isinstance(tiling, tiling_lib.Tiling) else tiling_lib.Tiling(*tiling)
        t = tiling_lib.Tiling(t.tm, t.tk, min(2 * t.tn, n))
    else:
        t = tiling_lib.choose_quantized_tiling(weight_format, m, k, n, num_local, lhs_itemsize=lhs_itemsize,
                                               out_itemsize=out_itemsize, generation=generation)
    if t.tn >= n:
        t = tiling_lib.Tiling(t.tm, t.tk, n)
        return t if glu_halves == "interleaved" or (n // 2) % 128 == 0 else None
    if glu_halves != "interleaved":
        return None
    return tiling_lib.Tiling(t.tm, t.tk, max(256, t.tn // 256 * 256))


def gmm_quantized(lhs, values, scales, group_sizes, *, weight_format: str, rhs_layout: str = "nk",
                  group_offset=0, out_dtype=None, tiling=None, generation=None, interpret=False,
                  glu=None, glu_halves: str = "concatenated", glu_bias=None):
    """``lhs @ dequantize(values, scales)^T`` per group (see the module
    docstring); with ``glu``, the gated up projection of ``pallas_gmm.gmm``
    (``[M, n / 2]`` activations), where ``gated_store_tiling`` allows it."""
    quantized.check_quantized_gmm_args(lhs, values, scales, weight_format, rhs_layout)
    if weight_format not in DECODED_FORMATS:
        raise ValueError(f"weight_format: this kernel decodes {DECODED_FORMATS}, got {weight_format!r} "
                         "(int8: pallas_gmm.gmm reads it as it is)")
    m, k = lhs.shape
    num_local, n = values.shape[:2]
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if glu is not None:
        check_glu_args(values.shape, rhs_layout, glu_halves, glu_bias)
    elif glu_bias is not None:
        raise ValueError("glu_bias given without glu (the gated up projection's bias)")
    n_out = n if glu is None else n // 2
    if 0 in (m, k, n):
        return jnp.zeros((m, n_out), out_dtype)
    # the device's own generation when none is given (the tiles and the paths
    # agree; on a v4 the e4m3 dot would not compile)
    device_generation = generation or tiling_lib.tpu_generations.current_generation()
    if glu is not None:
        t = gated_store_tiling(weight_format, glu_halves, m, k, n, num_local, lhs_itemsize=lhs.dtype.itemsize,
                               out_itemsize=out_dtype.itemsize, generation=device_generation, tiling=tiling)
        if t is None:
            raise ValueError(f"glu: the gated store of {weight_format} weights needs {glu_halves} halves in one "
                             f"step's tile (gated_store_tiling): not for values of shape {tuple(values.shape)} "
                             f"at tiling={tiling}")
        tiling_lib.validate_quantized_tiling(weight_format, t, m, k, n)
    elif tiling is None:
        t = tiling_lib.choose_quantized_tiling(weight_format, m, k, n, num_local,
                                               lhs_itemsize=lhs.dtype.itemsize,
                                               out_itemsize=out_dtype.itemsize, generation=device_generation)
    else:
        t = tiling if isinstance(tiling, tiling_lib.Tiling) else tiling_lib.Tiling(*tiling)
        tiling_lib.validate_quantized_tiling(weight_format, t, m, k, n)
    tm, tk, tn = t.as_tuple()
    tn_out = tn if glu is None else tn // 2
    tiles_k, tiles_n = cdiv(k, tk), cdiv(n, tn)
    tkw = tiling_lib.quantized_k_width(weight_format, tk)
    half = tkw // 2

    seg, tile, num_visits, seg_starts, seg_ends, weight_group = forward_visits(
        group_sizes, group_offset, num_local, m=m, tm=tm)
    dequantize = dequantizing_visits(seg, num_local, tiles_k)
    fp8_sliced = weight_format == "fp8" and tiling_lib.fp8_sliced(
        m, num_local, device_generation,
        tiling_lib.stream_applies("fp8", device_generation, t, k, lhs.dtype.itemsize, out_dtype.itemsize))
    fp8_scales_transposed = fp8_sliced and m > FP8_SCALES_IN_PLACE_MAX_ROWS
    e4m3_into_mxu = device_generation in FP8_MXU_GENERATIONS
    mxfp4_stacked = (weight_format == "mxfp4" and e4m3_into_mxu and lhs.dtype == jnp.bfloat16
                     and tiling_lib.mxfp4_stacked(m, num_local, tm, tn))
    streamed = tiling_lib.streamed_dequantization(weight_format, m, num_local, device_generation, t, k,
                                                  lhs.dtype.itemsize, out_dtype.itemsize)

    if weight_format == "mxfp4":
        lhs = quantized.split_even_odd(lhs, tk, tiles_k, half)
        values_block = (pl.Squeezed(), tn, tk // 2)
        scales_spec = pl.BlockSpec((pl.Squeezed(), tn, tk // MXFP4_BLOCK),
                                   lambda n_i, v, k_i, s, tl, a, b, g, *_: (g[v], n_i, k_i))
    elif fp8_sliced:
        values_block = (pl.Squeezed(), tn, tk)
        # The kernel expands one row of scales per K slice (_fp8_slice_scales), from
        # [E, N/128, K/128] as they are or, past FP8_SCALES_IN_PLACE_MAX_ROWS rows,
        # transposed to [E, K/128, N/128] and padded to whole (8, 128) tiles.
        if fp8_scales_transposed:
            scales = jnp.swapaxes(scales, 1, 2)
            scales = jnp.pad(scales, ((0, 0), (0, -scales.shape[1] % 8), (0, -scales.shape[2] % 128)))
        scales_spec = pl.BlockSpec((pl.Squeezed(), *scales.shape[1:]),
                                   lambda n_i, v, k_i, s, tl, a, b, g, *_: (g[v], 0, 0))
    else:
        values_block = (pl.Squeezed(), tn, tk)
        blocks_n = tiles_n * cdiv(tn, FP8_BLOCK)
        if scales.shape[1] < blocks_n:  # a partial last column tile reads whole blocks of scale rows
            scales = jnp.pad(scales, ((0, 0), (0, blocks_n - scales.shape[1]), (0, 0)))
        scales_spec = pl.BlockSpec((pl.Squeezed(), *scales.shape[1:]),
                                   lambda n_i, v, k_i, s, tl, a, b, g, *_: (g[v], 0, 0))
    lhs_spec = pl.BlockSpec((tm, tkw), lambda n_i, v, k_i, s, tl, *_: (tl[v], k_i))
    values_spec = pl.BlockSpec(values_block, lambda n_i, v, k_i, s, tl, a, b, g, *_: (g[v], n_i, k_i))
    out_spec = pl.BlockSpec((tm, tn_out), lambda n_i, v, k_i, s, tl, *_: (tl[v], n_i))
    bias_specs, biases, bias_experts = [], [], 0
    if glu_bias is not None:  # the values tile's columns of its group's bias
        if column_tiles_in_place(n, tn, tn, False, m, num_local):  # its own layout (pallas_gmm's column vectors)
            spec, bias_experts = column_vector_block(num_local, glu_bias.dtype, tn)
            biases, bias_specs = [glu_bias], [spec]
        else:
            biases = [glu_bias.reshape(num_local, 1, n)]
            bias_specs = [pl.BlockSpec((pl.Squeezed(), 1, tn), lambda n_i, v, k_i, s, tl, a, b, g, *_: (g[v], 0, n_i))]

    # With K whole on a one-TensorCore chip the kernel moves its value tiles
    # itself, a run of visits ahead (``pallas_gmm.WeightPrefetch``); the
    # scales (a few KB a group) stay on the grid's pipeline.
    scalars = [seg, tile, seg_starts, seg_ends, weight_group, dequantize]
    block = WeightBlock("nk", tn, n, values.shape[2])
    prefetch = None
    if prefetches_weights(tiles_k == 1, generation) and block.tiles_align(tiles_n, values.dtype.itemsize):
        prefetch = WeightPrefetch((block,), tiles_n)
        scalars += list(weight_runs(weight_group, num_visits))
        values_spec = pl.BlockSpec(memory_space=pl.ANY)

    kernel = functools.partial(
        _qgmm_kernel, weight_format=weight_format, tm=tm, tn=tn, tk=tk, k=k, tiles_n=tiles_n,
        tiles_k=tiles_k, num_segments=num_local + 2,
        row_chunk=min(MXFP4_STACKED_ROW_CHUNK, tm) if mxfp4_stacked else tiling_lib.row_chunk(tm, generation),
        half=half, fp8_sliced=fp8_sliced, fp8_scales_transposed=fp8_scales_transposed, e4m3_into_mxu=e4m3_into_mxu,
        streamed=streamed, mxfp4_stacked=mxfp4_stacked,
        prefetch=prefetch, glu=glu, glu_halves=glu_halves if glu is not None else None,
        has_bias=glu_bias is not None, bias_experts=bias_experts, valid_cols=n if glu is not None and n % tn else 0,
        masked_store=not interpret)
    fmt = quant_formats.weight_format(weight_format)
    cost = pl.CostEstimate(
        flops=2 * m * k * n, transcendentals=0 if glu is None else m * n_out,
        bytes_accessed=(lhs.size * lhs.dtype.itemsize * tiles_n + fmt.hbm_bytes(min(num_local, m), n, k)
                        + m * n_out * out_dtype.itemsize))
    large_vmem = tiling_lib.quantized_working_set_bytes(
        weight_format, t, lhs.dtype.itemsize, out_dtype.itemsize, streamed) > tiling_lib.tpu_generations.get_generation(
            generation).vmem_budget and generation_allows_large_vmem(generation)
    call = pl.pallas_call(
        kernel,
        out_shape=out_struct((m, n_out), out_dtype, lhs, values, group_sizes),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars), grid=(tiles_n, num_visits, tiles_k),
            in_specs=[lhs_spec, values_spec, scales_spec, *bias_specs], out_specs=out_spec,
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32),
                            pltpu.VMEM((8, 128) if fp8_sliced or mxfp4_stacked or streamed
                                       else (tn, tkw), lhs.dtype)]
            + ([pltpu.VMEM((scales.shape[1] if fp8_scales_transposed else -(-scales.shape[2] // 8) * 8, tn),
                           jnp.float32)] if fp8_sliced else
               [pltpu.VMEM((-(-(tk // MXFP4_BLOCK) // 8) * 8, tn), jnp.float32)] if mxfp4_stacked else
               [pltpu.VMEM((-(-cdiv(tn, FP8_BLOCK) // 8) * 8, tk), jnp.float32)] if weight_format == "fp8" else [])
            + (prefetch.scratch(values.dtype) if prefetch else []),
        ),
        compiler_params=compiler_params(generation, ("arbitrary" if prefetch else "parallel", "arbitrary",
                                                     "arbitrary"),
                                        large_vmem=large_vmem),
        interpret=interpret, cost_estimate=cost, name=f"ragged_dot_gmm_{weight_format}",
    )
    return call(*scalars, lhs, values, scales, *biases)


def generation_allows_large_vmem(generation) -> bool:
    return tiling_lib.tpu_generations.get_generation(generation).name in tiling_lib.TN_KEEP_K
