"""The grouped matmul with quantized weights (int8, fp8, mxfp4) in interpret
mode against dequantize-then-matmul in float64 (tests/reference.py).

Values and scales are drawn over each format's whole range, extremes
included: int8 +-127, fp8 subnormals and +-448, e8m0 codes 20 to 254 in the
matmuls (254 with magnitudes <= 0.5 and a scaled-down lhs, so that f32 sums
stay finite) and 2 to 254 in the decoders (products below 2**-126 are
flushed on a TPU). The interpreter poisons memory, so an unwritten output
element or an unmasked tail reads NaN and fails.

Measured error (the largest of |got - want| / (max|w| of the output column
* max|lhs| * sqrt(K)), 3 seeds x the first two CASES of each format):
f32 int8 3e-7, fp8 8e-8, mxfp4 6e-8 (f32 accumulation only); bf16 (lhs and
output bf16) int8 1.7e-3, fp8 6.7e-4, mxfp4 7.1e-4 (the bf16 rounding of the
output; the weights are exact in bf16 but for fp8's value * scale). fp8's
decode path (K slices, the scale on f32 partial products: every case but the
300-row one) measures f32 5e-8, bf16 4.8e-4; mxfp4's e4m3 decode path (bf16 lhs,
tiling.mxfp4_stacked) bf16 4.3e-4 to 5.7e-4 (one seed, three stacked cases).
Tolerances: 1e-5 (f32) and 1e-2 (bf16).
"""

import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import reference
from ragged_dot_tpu.common import pallas_helpers, quant_formats
from ragged_dot_tpu.gmm import pallas_gmm, quantized, tiling

SEED = int(os.environ.get("TEST_SEED", np.random.SeedSequence().entropy % (2**31)))
FORMATS = ["int8", "fp8", "mxfp4"]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def random_weights(rng, fmt_name, e, n, k, extreme="low"):
    """(values, scales) covering the format's range, as numpy arrays. mxfp4's
    output row 0 gets the extreme e8m0 codes: 20-23 (``extreme="low"``) or
    250-254 with magnitudes <= 0.5 (``"high"``: the caller scales lhs down
    so that the f32 sums stay finite)."""
    fmt = quant_formats.weight_format(fmt_name)
    vshape, sshape = fmt.values_shape(e, n, k), fmt.scales_shape(e, n, k)
    if fmt_name == "int8":
        values = rng.integers(-127, 128, size=vshape).astype(np.int8)
        values[..., 0] = 127
        values[..., -1] = -127
        scales = (10.0 ** rng.uniform(-4, 1, size=sshape)).astype(np.float32)
    elif fmt_name == "fp8":
        bits = rng.integers(0, 256, size=vshape).astype(np.uint8)
        bits[(bits & 0x7F) == 0x7F] = 0x7E  # no NaN: +-448, the largest finite
        bits[:, 0, :16] = np.arange(16, dtype=np.uint8) | (0x80 * (np.arange(16) % 2)).astype(np.uint8)  # subnormals
        values = bits.view(ml_dtypes.float8_e4m3fn)
        scales = (2.0 ** rng.uniform(-20, 4, size=sshape)).astype(np.float32)
    else:
        values = rng.integers(0, 256, size=vshape).astype(np.uint8)
        scales = rng.integers(117, 138, size=sshape).astype(np.uint8)
        if extreme == "low":
            # Weights down to 2**-108: their products with lhs entries of
            # N(0, 1) stay normal float32 (the TPU and XLA:CPU flush
            # subnormals); test_dequantize_is_exact covers codes down to 2.
            scales[:, 0, :] = rng.integers(20, 24, size=scales[:, 0, :].shape)
        else:
            scales[:, 0, :] = rng.integers(250, 255, size=scales[:, 0, :].shape)
            nibbles = rng.integers(0, 2, size=(2, *values[:, 0, :].shape)) | (8 * rng.integers(0, 2, size=(2, *values[:, 0, :].shape)))
            values[:, 0, :] = (nibbles[0] | (nibbles[1] << 4)).astype(np.uint8)
    return values, scales


def run_gmm(lhs, values, scales, sizes, fmt_name, dtype, **kw):
    return pallas_gmm.gmm(jnp.asarray(lhs, dtype), jnp.asarray(values), jnp.asarray(sizes),
                          rhs_scales=jnp.asarray(scales), weight_format=fmt_name,
                          interpret=pallas_helpers.interpret_params(), **kw)


def assert_matches(got, lhs, w, sizes, dtype, group_offset=0, what=""):
    want = reference.ragged_dot(lhs, w, sizes, "nk", group_offset)
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), dtype=np.float64)
    assert not np.isnan(got).any(), f"{what}: NaN (unwritten or unmasked) elements, seed={SEED}"
    # Per output column: its weights' magnitude times sqrt(K) (row scales of
    # mxfp4 span 2**-126 .. 2**127, one global scale would hide the small ones).
    col_scale = np.abs(w).max(axis=(0, 2)) * np.abs(lhs).max() * np.sqrt(lhs.shape[1])
    col_scale = np.where(col_scale > 0, col_scale, 1.0)
    err = np.abs(got - want) / col_scale
    assert err.max() <= TOL[dtype], f"{what}: max scaled error {err.max():.3g}, seed={SEED}"
    return err.max()


def inputs(rng, fmt_name, m, k, n, num_groups, kind, dtype, num_local=None, extreme="low"):
    num_local = num_groups if num_local is None else num_local
    sizes = reference.random_group_sizes(rng, num_groups, m, kind).astype(np.int32)
    lhs = rng.standard_normal((m, k)) * (2.0 ** -8 if extreme == "high" else 1.0)
    lhs = np.asarray(jnp.asarray(lhs, dtype).astype(jnp.float32), np.float64)
    values, scales = random_weights(rng, fmt_name, num_local, n, k, extreme)
    return lhs, values, scales, sizes


# (m, k, n, groups, kind, tiling, extreme): whole-K rule tiles, unaligned
# dims, split K and N (tails past K and N), one group over four row tiles
# (the dequantized tile reused by its later visits).
CASES = {
    "int8": [(37, 200, 136, 4, "with_zeros", None, "low"), (64, 384, 320, 3, "random", (16, 256, 256), "low"),
             (64, 384, 320, 3, "one_huge", (16, 384, 256), "low")],
    "fp8": [(37, 200, 136, 4, "with_zeros", None, "low"), (64, 384, 320, 3, "random", (16, 256, 256), "low"),
            (64, 384, 320, 3, "one_huge", (16, 384, 256), "low"),
            # groups averaging 100 rows at tm 256: sliced (tiling.fp8_sliced, v6e's rule); 267 rows: the dequantized tile
            (300, 384, 320, 3, "random", (256, 384, 256), "low"), (800, 384, 320, 3, "random", (256, 384, 256), "low")],
    "mxfp4": [(37, 224, 136, 4, "with_zeros", None, "low"), (40, 160, 136, 3, "random", None, "high"),
              (64, 384, 320, 3, "one_huge", (16, 384, 256), "low"),
              (24, 8192 + 64, 130, 2, "random", (16, 4096, 128), "low"),
              # bf16 lhs, N a multiple of 32, at most 16 rows a group: the stacked decode path
              # (tiling.mxfp4_stacked): a partial last lane group (K = 224), e8m0 codes 250-254,
              # a split K with a tail (scales past K zeroed), one row tile over four groups
              (37, 224, 160, 4, "with_zeros", None, "low"), (40, 160, 256, 3, "random", None, "high"),
              (24, 8192 + 64, 128, 2, "random", (16, 4096, 128), "low"),
              (64, 384, 256, 5, "random", None, "low")],
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_matches_float64_dequantized(fmt_name, dtype):
    rng = np.random.default_rng(SEED)
    for m, k, n, g, kind, t, extreme in CASES[fmt_name]:
        lhs, values, scales, sizes = inputs(rng, fmt_name, m, k, n, g, kind, dtype, extreme=extreme)
        got = run_gmm(lhs, values, scales, sizes, fmt_name, dtype, tiling=t)
        w = reference.dequantize_weights(values, scales, fmt_name)
        assert_matches(got, lhs, w, sizes, dtype, what=f"{fmt_name} {(m, k, n, g, kind, t)}")


def test_mxfp4_stacked_decode_path():
    """The e4m3 decode path of mxfp4 (pallas_qgmm: nibbles to e4m3 bytes, the
    e8m0 scale on each 32-wide block's partial product): taken at these
    shapes, every e2m1 code and e8m0 codes 20-23 and 250-254, row tiles
    below 8 rows, a window of local groups with empty ones, in the poisoning
    interpreter; and v4 (no e4m3 matmul) keeps the dequantized tile."""
    rng = np.random.default_rng(SEED)
    for m, k, n, g, kind, offset, local, extreme in (
            (4, 256, 256, 3, "random", 0, 3, "low"), (16, 512, 128, 4, "with_zeros", 0, 4, "high"),
            (40, 256, 256, 6, "random", 2, 3, "low"), (40, 256, 256, 6, "all_empty", 0, 3, "low")):
        lhs, values, scales, sizes = inputs(rng, "mxfp4", m, k, n, g, kind, jnp.bfloat16, num_local=local,
                                            extreme=extreme)
        t = tiling.choose_quantized_tiling("mxfp4", m, k, n, local, lhs_itemsize=2, out_itemsize=2)
        assert tiling.mxfp4_stacked(m, local, t.tm, t.tn), (m, k, n, t)
        w = reference.dequantize_weights(values, scales, "mxfp4")
        for generation in (None, "v4"):
            got = run_gmm(lhs, values, scales, sizes, "mxfp4", jnp.bfloat16, group_offset=offset,
                          generation=generation)
            assert_matches(got, lhs, w, sizes, jnp.bfloat16, offset,
                           what=f"mxfp4 stacked {(m, k, n, g, kind, offset)} {generation}")


def test_fp8_decode_path_without_e4m3_matmul():
    """v4's matmul refuses an e4m3 operand: its K slices convert to bf16 first
    (pallas_qgmm.FP8_MXU_GENERATIONS); same result as the float64 reference."""
    rng = np.random.default_rng(SEED)
    for dtype in (jnp.bfloat16, jnp.float32):
        lhs, values, scales, sizes = inputs(rng, "fp8", 37, 200, 136, 4, "with_zeros", dtype)
        got = run_gmm(lhs, values, scales, sizes, "fp8", dtype, generation="v4")
        assert_matches(got, lhs, reference.dequantize_weights(values, scales, "fp8"), sizes, dtype,
                       what=f"fp8 v4 {jnp.dtype(dtype).name}")


def test_fp8_sliced_rule_per_generation_and_v5e_prefill():
    """The K-sliced path's reach (tiling.fp8_sliced): v5e at every size (its
    128-deep MXU is filled by a 128-wide slice), v6e up to 256 rows a group
    (128 where the streamed path applies), tpu7x up to 128 (8), the others
    32; and on v5e a prefill (267 rows a group, tm 256, split N) through it
    matches the float64 reference."""
    for gen, limit, before_stream in (("v6e", 256, 128), ("tpu7x", 128, 8), ("v4", 32, None), ("v5p", 32, None)):
        assert tiling.fp8_sliced(limit * 4, 4, gen) and not tiling.fp8_sliced(limit * 4 + 1, 4, gen), gen
        if before_stream:
            assert tiling.fp8_sliced(before_stream * 4, 4, gen, streams=True), gen
            assert not tiling.fp8_sliced(before_stream * 4 + 1, 4, gen, streams=True), gen
    assert tiling.fp8_sliced(1 << 20, 4, "v5e")
    rng = np.random.default_rng(SEED)
    lhs, values, scales, sizes = inputs(rng, "fp8", 800, 384, 320, 3, "random", jnp.bfloat16)
    got = run_gmm(lhs, values, scales, sizes, "fp8", jnp.bfloat16, tiling=(256, 384, 256), generation="v5e")
    assert_matches(got, lhs, reference.dequantize_weights(values, scales, "fp8"), sizes, jnp.bfloat16,
                   what="fp8 v5e prefill sliced")


@pytest.mark.parametrize("fmt_name,dtype", [("fp8", jnp.bfloat16), ("fp8", jnp.float32), ("mxfp4", jnp.bfloat16)])
def test_streamed_dequantization_path(fmt_name, dtype):
    """The streamed path (tiling.streamed_dequantization: each 256 weight
    rows dequantized straight into the dot, one body per run of live row
    chunks): v6e's 1024-row tiles in four 256-row chunks, visits starting
    and ending in any chunk, with empty groups, a local window and N not a
    multiple of the piece; tpu7x at 256-row tiles, a split N. In the
    poisoning interpreter (an unwritten row reads NaN), against the float64
    reference; the rule takes the path at these shapes and not below its row
    tile or thresholds."""
    rng = np.random.default_rng(SEED)
    for m, k, n, g, kind, offset, local, t, generation in (
            (2100, 256, 320, 7, "with_zeros", 0, 7, (1024, 256, 320), "v6e"),
            (2100, 256, 320, 9, "random", 2, 4, (1024, 256, 320), "v6e"),
            (700, 384, 640, 3, "random", 0, 3, (256, 384, 384), "tpu7x")):
        itemsize = jnp.dtype(dtype).itemsize
        assert tiling.streamed_dequantization(fmt_name, m, local, generation, tiling.Tiling(*t), k, itemsize,
                                              itemsize), (m, t, generation)
        lhs, values, scales, sizes = inputs(rng, fmt_name, m, k, n, g, kind, dtype, num_local=local)
        got = run_gmm(lhs, values, scales, sizes, fmt_name, dtype, group_offset=offset, tiling=t,
                      generation=generation)
        assert_matches(got, lhs, reference.dequantize_weights(values, scales, fmt_name), sizes, dtype, offset,
                       what=f"{fmt_name} streamed {(m, k, n, g, kind, offset, t, generation)}")
    def streams(m, gen, t, itemsize=2):
        return tiling.streamed_dequantization(fmt_name, m, 4, gen, tiling.Tiling(*t), 256, itemsize, itemsize)

    assert not streams(4096, "v6e", (512, 256, 256))  # below v6e's row tile
    assert not streams(4096, "v6e", (1024, 128, 256))  # split K
    assert not streams(4096, "v5e", (1024, 256, 256))
    assert not streams(32, "tpu7x", (16, 256, 256))  # 8 rows a group at the decode tile: fp8 sliced, mxfp4 stacked
    assert fmt_name == "fp8" or not streams(4096, "tpu7x", (256, 256, 256), itemsize=4)  # mxfp4: bf16 lhs only
    assert not streams(4096, "tpu7x", (256, 512, 256))  # a tile past K (no tail masking)
    rule = tiling.choose_quantized_tiling(fmt_name, 8192, 4096, 28672, 8, lhs_itemsize=2, out_itemsize=2,
                                          generation="v6e")
    assert rule.tm == 1024 and tiling.streamed_dequantization(fmt_name, 8192, 8, "v6e", rule, 4096, 2, 2), rule
    # decode-sized groups keep their paths on the rule's tiles (no 1024-row raise): 32 / 8 rows a group
    for m, groups in ((4096, 128), (1024, 128)):
        rule = tiling.choose_quantized_tiling(fmt_name, m, 2048, 1536, groups, lhs_itemsize=2, out_itemsize=2,
                                              generation="v6e")
        assert not tiling.streamed_dequantization(fmt_name, m, groups, "v6e", rule, 2048, 2, 2), (m, rule)
        assert fmt_name == "fp8" or tiling.mxfp4_stacked(m, groups, rule.tm, rule.tn), (m, rule)


def test_chunk_runs_pick_exactly_the_live_run():
    """``pallas_qgmm.chunk_runs``: for every contiguous set of live chunks
    (and none), exactly the run equal to it is live, over its rows."""
    from ragged_dot_tpu.gmm.pallas_qgmm import chunk_runs

    for n in (1, 2, 4):
        for a in range(n + 1):
            for b in range(a, n + 1):
                live = [a <= c < b for c in range(n)]
                chunks = [(slice(c * 256, (c + 1) * 256), np.bool_(live[c])) for c in range(n)]
                picked = [rows for rows, on in chunk_runs(chunks) if on]
                assert picked == ([slice(a * 256, b * 256)] if b > a else []), (n, a, b, picked)


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_dequantize_is_exact(fmt_name):
    """The XLA dequantize (the kernel's decoders) equals the float64 one
    exactly in float32, every code: all 256 int8 / e4m3 bit patterns but NaN,
    all e2m1 pairs with e8m0 codes 2 .. 254."""
    rng = np.random.default_rng(SEED)
    if fmt_name == "mxfp4":
        values = np.tile(np.arange(256, dtype=np.uint8), (2, 253, 1))  # [2, 253, 256]: K = 512
        scales = np.repeat(np.arange(2, 255, dtype=np.uint8)[None, :, None], 16, axis=2).repeat(2, axis=0)
    else:
        values, scales = random_weights(rng, fmt_name, 2, 256, 256)
        bits = np.arange(256, dtype=np.uint8)
        bits[bits == 0xFF] = 0xFE
        bits[bits == 0x7F] = 0x7E
        values[0, 0, :] = bits.view(values.dtype)
    got = quantized.dequantize(jnp.asarray(values), jnp.asarray(scales), fmt_name, jnp.float32)
    want = reference.dequantize_weights(values, scales, fmt_name)
    np.testing.assert_array_equal(np.asarray(got, np.float64), want.astype(np.float32).astype(np.float64))


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_window_of_local_groups_and_empty_groups(fmt_name):
    """Expert parallelism: groups [offset, offset + local) are computed, every
    other row (and every row past sum(group_sizes)) is zero; also with no
    rows in the window at all."""
    rng = np.random.default_rng(SEED)
    m, k, n, g, local = 40, 256, 136, 6, 3
    for kind, offset in (("random", 2), ("with_zeros", 1), ("all_empty", 0), ("sum_below_m", 3)):
        lhs, values, scales, sizes = inputs(rng, fmt_name, m, k, n, g, kind, jnp.bfloat16, num_local=local)
        got = run_gmm(lhs, values, scales, sizes, fmt_name, jnp.bfloat16, group_offset=offset)
        w = reference.dequantize_weights(values, scales, fmt_name)
        assert_matches(got, lhs, w, sizes, jnp.bfloat16, offset, what=f"{fmt_name} {kind} offset={offset}")


@pytest.mark.parametrize("generation", ["v6e", "v4"])
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_weight_prefetch_over_column_tiles_and_a_group_window(fmt_name, generation):
    """Whole-K steps on one TensorCore (v6e): the kernel moves its value
    tiles itself, a run of visits ahead (``pallas_gmm.WeightPrefetch``),
    chaining runs over many groups and three column tiles (a partial last
    one of 64 rows: a legal 8-bit DMA), with idle visits of a group window
    before and after; a megacore (v4) keeps the grid's pipeline. Prefill
    rows (the dequantized tile kept over a group's visits) and decode rows
    (bf16, a few rows a group: fp8's K slices, mxfp4's stacked path)."""
    from ragged_dot_tpu.gmm import pallas_gmm as kernels

    assert kernels.prefetches_weights(True, generation) == (generation == "v6e")
    assert kernels.WeightBlock("nk", 128, 320, 256).tiles_align(3, 1)
    rng = np.random.default_rng([SEED, 23, FORMATS.index(fmt_name), generation == "v6e"])
    k, n, g, local, offset = 256, 320, 9, 7, 1
    for m, dtype, tm in ((300, jnp.float32, 64), (40, jnp.bfloat16, 16)):
        lhs, values, scales, sizes = inputs(rng, fmt_name, m, k, n, g, "random", dtype, num_local=local)
        got = run_gmm(lhs, values, scales, sizes, fmt_name, dtype, tiling=(tm, k, 128), generation=generation,
                      group_offset=offset)
        w = reference.dequantize_weights(values, scales, fmt_name)
        assert_matches(got, lhs, w, sizes, dtype, offset, what=f"{fmt_name} {generation} m={m} sizes={sizes}")


def _gate_reference(h, halves, bias=None, rows_group=None):
    """float64 clamped SwiGLU (gpt-oss's gate at alpha 1.5, limit 4) of the
    up projection ``h``, its halves where ``halves`` says, plus each row's bias."""
    if bias is not None:
        h = h + bias[rows_group]
    g, u = (h[:, 0::2], h[:, 1::2]) if halves == "interleaved" else np.split(h, 2, axis=1)
    g, u = np.minimum(g, 4.0), np.clip(u, -4.0, 4.0)
    return g * 0.5 * (1 + np.tanh(0.75 * g)) * (u + 1)  # sigmoid(1.5 g) without overflow


# (halves, m, k, 2I, groups, tiling (tn: the output tile), bias, generation): interleaved halves over
# three values tiles of 256 (a partial last one: 2I = 640) with a bias and a
# group window, and whole ones; concatenated halves in one whole tile; decode
# rows (fp8's K slices, mxfp4's stacked path); the v4 (grid pipeline) kernel.
GATED_CASES = [("interleaved", 300, 256, 640, 5, (64, 256, 128), True, "v6e"),
               ("interleaved", 40, 256, 512, 4, None, True, "v6e"),
               ("concatenated", 300, 256, 512, 5, (64, 256, 256), False, "v6e"),
               ("concatenated", 37, 256, 256, 4, None, False, "v6e"),
               ("interleaved", 300, 256, 640, 5, (64, 256, 128), True, "v4"),
               # concatenated halves over two column tiles, with a bias: int8 only (pallas_gmm's
               # forward reads each half's tile); fp8 / mxfp4 refuse it (gated_store_tiling)
               ("concatenated", 300, 256, 512, 5, (64, 256, 128), True, "v6e")]
# int8 only (pallas_gmm's forward): 18 local experts at decode-like sizes (at most 16 rows a group), so
# the column scales (f32: 8 experts a block) and biases (bf16: 16) are read in blocks past the first,
# the visit's row picked in the kernel; I = 144, whose column tiles are not lane-aligned, reads them
# through the [G, 2, 1, I] view instead (so do the 300-row cases above: 100 rows a group).
INT8_GATED_CASES = [("concatenated", 200, 256, 512, 20, (64, 256, 128), True, "v6e"),
                    ("interleaved", 120, 256, 512, 20, (16, 256, 128), "bf16", "v6e"),
                    ("concatenated", 64, 256, 288, 20, None, True, "v6e")]
ALL_GATED_CASES = ([(f, case) for f in FORMATS for case in GATED_CASES]
                   + [("int8", case) for case in INT8_GATED_CASES])


def test_column_vectors_in_place_rule():
    """Per-column vectors (int8 scales, gate biases) in their own layout at
    most 16 rows a group, in lane-aligned column tiles (whole halves of
    concatenated weights), in blocks of a whole native tile of experts."""
    rule = pallas_gmm.column_tiles_in_place
    assert rule(256, 128, 128, True, m=200, num_local=18)
    assert not rule(256, 128, 128, True, m=300, num_local=18)  # 17 rows a group: the views
    assert not rule(144, 144, 144, True, m=64, num_local=18)  # a half's tile not lane-aligned
    assert not rule(384, 256, 256, True, m=64, num_local=18)  # a tile straddling the halves
    assert rule(256, 128, 256, False, m=64, num_local=18)  # interleaved halves: 256-column tiles
    assert rule(200, 200, 200, False, m=64, num_local=18)  # the whole (unaligned) width
    assert not rule(400, 200, 200, False, m=64, num_local=18)
    assert [pallas_gmm.experts_per_block(18, d) for d in (jnp.float32, jnp.bfloat16)] == [8, 16]
    assert pallas_gmm.experts_per_block(5, jnp.bfloat16) == 5  # fewer experts: the whole (full-dim) block


@pytest.mark.parametrize("fmt_name,case", ALL_GATED_CASES,
                         ids=[f"{f}-{c[0]}-{c[1]}x{c[3]}-g{c[4]}-{c[7]}" for f, c in ALL_GATED_CASES])
def test_gated_store_matches_float64(fmt_name, case):
    """``gmm(glu=)`` on quantized weights: the gate (and the up bias) at the
    store, ``[M, I]`` bf16 activations. The same kernel's f32 product (held
    to float64 dequantize-then-matmul here too) plus the bias, gated in
    float64, must match within the bf16 rounding of the stored activation:
    a swapped half, a missed bias or a mispaired column fails. Rows outside
    the local groups (a window of the groups) are zeros, not a gate of the
    bias."""
    from moe_experts_tpu.experts.gates import pair_gate

    halves, m, k, n, g, t, with_bias, generation = case
    rng = np.random.default_rng([SEED, 29, FORMATS.index(fmt_name), m, n, g])
    offset, local = (1, g - 2) if with_bias else (0, g)
    lhs, values, scales, sizes = inputs(rng, fmt_name, m, k, n, g, "random", jnp.bfloat16, num_local=local)
    w = reference.dequantize_weights(values, scales, fmt_name)
    # Products of order 1 (the gate's curved range, limit 4 rarely reached).
    lhs = np.asarray(jnp.asarray(lhs * 2.0 / np.abs(reference.ragged_dot(lhs, w, sizes, "nk", offset)).max(),
                                 jnp.bfloat16).astype(jnp.float32), np.float64)
    bias = rng.standard_normal((local, n)).astype(np.float32) if with_bias else None
    if with_bias == "bf16":
        bias = bias.astype(ml_dtypes.bfloat16)
    kw = dict(tiling=t, generation=generation, group_offset=offset)
    glu = dict(out_dtype=jnp.bfloat16, glu=pair_gate("gpt_oss", 1.5, 4.0), glu_halves=halves,
               glu_bias=None if bias is None else jnp.asarray(bias))
    if halves == "concatenated" and t is not None and 2 * t[2] < n and fmt_name != "int8":
        with pytest.raises(ValueError, match=f"glu: the gated store of {fmt_name} weights needs concatenated"):
            run_gmm(lhs, values, scales, sizes, fmt_name, jnp.bfloat16, **glu, **kw)
        return
    h = np.asarray(run_gmm(lhs, values, scales, sizes, fmt_name, jnp.bfloat16, out_dtype=jnp.float32, **kw),
                   np.float64)
    assert_matches(h, lhs, w, sizes, jnp.float32 if fmt_name == "int8" else jnp.bfloat16, offset,
                   what=f"{fmt_name} product")
    got = run_gmm(lhs, values, scales, sizes, fmt_name, jnp.bfloat16, **glu, **kw)
    assert got.shape == (m, n // 2) and got.dtype == jnp.bfloat16
    starts, ends = reference.bounds(sizes)
    rows_group = np.zeros(m, np.int64)
    local_rows = np.zeros(m, bool)
    for j in range(local):
        rows_group[starts[offset + j]:ends[offset + j]] = j
        local_rows[starts[offset + j]:ends[offset + j]] = True
    want = np.where(local_rows[:, None], _gate_reference(h, halves, None if bias is None else bias.astype(np.float64),
                                                         rows_group), 0.0)
    got = np.asarray(got.astype(jnp.float32), np.float64)
    assert not np.isnan(got).any(), f"{fmt_name} {halves}: NaN (unwritten) elements"
    assert (got[~local_rows] == 0).all(), "rows outside the local groups must be zeros"
    err = (np.abs(got - want) / (2.0 ** -8 * np.abs(want) + 1e-5 * np.abs(want).max())).max()
    assert err <= 1, f"{fmt_name} {case}: error {err:.3g} of the bf16 rounding (seed {SEED})"


def test_gated_store_tiling_needs_both_halves_in_a_tile():
    """fp8 / mxfp4 gate a step's own values tile: concatenated halves only
    when one tile holds all 2I columns, interleaved ones in whole 256-column
    pairs (``gated_store_tiling``; int8 goes through pallas_gmm's forward,
    which reads each half's tile)."""
    from ragged_dot_tpu.gmm import pallas_qgmm

    assert pallas_qgmm.gated_store_tiling("fp8", "concatenated", 64, 256, 512, 2, lhs_itemsize=2, out_itemsize=2,
                                          tiling=(16, 256, 128)) is None
    assert pallas_qgmm.gated_store_tiling("fp8", "concatenated", 64, 256, 512, 2, lhs_itemsize=2, out_itemsize=2,
                                          tiling=(16, 256, 256)).tn == 512
    assert pallas_qgmm.gated_store_tiling("mxfp4", "interleaved", 64, 256, 512, 2, lhs_itemsize=2, out_itemsize=2,
                                          tiling=(16, 256, 128)).tn == 256
    assert pallas_qgmm.gated_store_tiling("fp8", "concatenated", 64, 256, 320, 2, lhs_itemsize=2,
                                          out_itemsize=2) is None  # I = 160: halves not lane aligned
    with pytest.raises(ValueError, match="this kernel decodes"):
        pallas_qgmm.gmm_quantized(*_args("int8"), weight_format="int8")


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_poisoned_output_every_element_written(fmt_name):
    """Row tiles shared by several groups and a zero suffix, in the poisoning
    interpreter: any element the kernel does not write reads back NaN."""
    rng = np.random.default_rng(SEED)
    sizes = np.array([3, 0, 21, 5, 0], np.int32)  # 29 of 48 rows; tm 16 splits the groups mid-tile
    lhs, values, scales, _ = inputs(rng, fmt_name, 48, 256, 256, 5, "random", jnp.float32)
    got = np.asarray(run_gmm(lhs, values, scales, sizes, fmt_name, jnp.float32, tiling=(16, 256, 128)))
    assert not np.isnan(got).any()
    assert (got[29:] == 0).all()
    assert_matches(got, lhs, reference.dequantize_weights(values, scales, fmt_name), sizes, jnp.float32)


def _args(fmt_name, e=2, n=128, k=256, m=8):
    fmt = quant_formats.weight_format(fmt_name)
    lhs = jnp.zeros((m, k), jnp.bfloat16)
    values = jnp.zeros(fmt.values_shape(e, n, k), fmt.values_dtype)
    scales = jnp.zeros(fmt.scales_shape(e, n, k), fmt.scales_dtype)
    return lhs, values, scales, jnp.array([4, 4], jnp.int32)


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_bad_arguments_raise_clear_errors(fmt_name):
    lhs, values, scales, sizes = _args(fmt_name)
    with pytest.raises(ValueError, match="rhs_layout='kn' is not supported"):
        pallas_gmm.gmm(lhs, values, sizes, rhs_scales=scales, weight_format=fmt_name, rhs_layout="kn")
    with pytest.raises(ValueError, match="rhs_scales must be"):
        pallas_gmm.gmm(lhs, values, sizes, rhs_scales=scales[:1], weight_format=fmt_name)
    with pytest.raises(ValueError, match="rhs_scales must be"):
        pallas_gmm.gmm(lhs, values, sizes, rhs_scales=scales.astype(jnp.float16), weight_format=fmt_name)
    with pytest.raises(ValueError, match="rhs_scales is required"):
        pallas_gmm.gmm(lhs, values, sizes, weight_format=fmt_name)
    with pytest.raises(ValueError, match=r"rhs \(\w+ values\) must be"):
        pallas_gmm.gmm(lhs, values.astype(jnp.float32), sizes, rhs_scales=scales, weight_format=fmt_name)
    with pytest.raises(ValueError, match="must have shape"):
        pallas_gmm.gmm(lhs[:, :128], values, sizes, rhs_scales=scales, weight_format=fmt_name)
    with pytest.raises(ValueError, match="lhs must be bfloat16 or float32"):
        pallas_gmm.gmm(lhs.astype(jnp.float16), values, sizes, rhs_scales=scales, weight_format=fmt_name)
    with pytest.raises(ValueError, match="tk"):
        pallas_gmm.gmm(lhs, values, sizes, rhs_scales=scales, weight_format=fmt_name, tiling=(8, 200, 128))
    if fmt_name == "mxfp4":  # a 128-multiple that splits mxfp4's scale blocks across lanes
        with pytest.raises(ValueError, match="need tk a multiple of 4096"):
            pallas_gmm.gmm(lhs, values, sizes, rhs_scales=scales, weight_format=fmt_name, tiling=(8, 128, 128))


def test_bad_format_name_and_mxfp4_k():
    lhs, values, scales, sizes = _args("int8")
    with pytest.raises(ValueError, match="weight format must be one of"):
        pallas_gmm.gmm(lhs, values, sizes, rhs_scales=scales, weight_format="int4")
    with pytest.raises(ValueError, match="rhs_scales given without weight_format"):
        pallas_gmm.gmm(lhs, values, sizes, rhs_scales=scales)
    lhs, values, scales, sizes = _args("mxfp4", k=256)
    with pytest.raises(ValueError, match="in_features divisible by 32"):
        pallas_gmm.gmm(jnp.zeros((8, 240), jnp.bfloat16), values[..., :120], sizes, rhs_scales=scales,
                       weight_format="mxfp4")


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_tiling_rule_keeps_format_blocks(fmt_name):
    """The rule's tiles are legal blocks of the format and fit the budget, from
    decode to prefill on every generation."""
    for gen in tiling.TILE_CAPS:
        for m, k, n in ((8, 2048, 1536), (4096, 2880, 5760), (512, 14336, 4096), (64, 7168, 4096), (32, 18432, 7168)):
            t = tiling.choose_quantized_tiling(fmt_name, m, k, n, 8, lhs_itemsize=2, out_itemsize=4, generation=gen)
            tiling.validate_quantized_tiling(fmt_name, t, m, k, n)
            streamed = tiling.streamed_dequantization(fmt_name, m, 8, gen, t, k, 2, 4)
            assert tiling.quantized_working_set_bytes(fmt_name, t, 2, 4, streamed) <= tiling.vmem_budget(gen), (
                gen, m, k, n, t, streamed)


# ----------------------------------------------------------------------------
# The experts program (routing -> up -> gate -> down -> combine) on quantized weights
# ----------------------------------------------------------------------------


def _moderate_weights(rng, fmt_name, e, n, k):
    """Quantized weights of a plausible layer: dequantized entries ~0.1."""
    fmt = quant_formats.weight_format(fmt_name)
    if fmt_name == "int8":
        values = rng.integers(-127, 128, size=fmt.values_shape(e, n, k)).astype(np.int8)
        scales = rng.uniform(0.5e-3, 2e-3, size=fmt.scales_shape(e, n, k)).astype(np.float32)
    elif fmt_name == "fp8":
        values = rng.standard_normal(fmt.values_shape(e, n, k)).astype(ml_dtypes.float8_e4m3fn)
        scales = rng.uniform(0.05, 0.2, size=fmt.scales_shape(e, n, k)).astype(np.float32)
    else:
        values = rng.integers(0, 256, size=fmt.values_shape(e, n, k)).astype(np.uint8)
        scales = rng.integers(121, 125, size=fmt.scales_shape(e, n, k)).astype(np.uint8)
    return values, scales


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("fmt_name,gate,fused", [
    (f, g, fused) for f in FORMATS for g, fused in [("glu_silu", None), ("glu_silu", True), ("gpt_oss", None)]
    if not (fused and f == "mxfp4")])  # mxfp4's refusal: test_experts_program_refuses_quantized_misuse
def test_experts_program_matches_the_program_on_dequantized_weights(fmt_name, gate, fused, dtype):
    """``program.experts_forward(weight_format=...)`` against (a) the same
    program on the dequantized weights (bf16 / f32) and (b) the float64
    layer on the float64-dequantized weights. gpt_oss: interleaved clamped
    SwiGLU with both biases. ``fused=True``: the fused experts kernel on the
    quantized weights (int8, fp8), past the rule that keeps decode-sized
    groups on the two matmuls."""
    from moe_experts_tpu.experts import program

    rng = np.random.default_rng(SEED)
    tokens, hidden, inter, experts, top_k = 9, 64, 96, 4, 2
    up_v, up_s = _moderate_weights(rng, fmt_name, experts, 2 * inter, hidden)
    down_v, down_s = _moderate_weights(rng, fmt_name, experts, hidden, inter)
    x = np.asarray(jnp.asarray(rng.standard_normal((tokens, hidden)), dtype).astype(jnp.float32))
    ids = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]).astype(np.int32)
    ids[0, 1] = experts  # a remote (expert-parallel) pick contributes nothing
    weights = rng.uniform(0.2, 1.0, size=(tokens, top_k)).astype(np.float32)
    biases = {}
    if gate == "gpt_oss":
        biases = dict(up_bias=rng.standard_normal((experts, 2 * inter)).astype(np.float32) * 0.1,
                      down_bias=rng.standard_normal((experts, hidden)).astype(np.float32) * 0.1)
    interp = pallas_helpers.interpret_params()
    got = program.experts_forward(
        jnp.asarray(x, dtype), jnp.asarray(ids), jnp.asarray(weights), jnp.asarray(up_v), jnp.asarray(down_v),
        **{k: jnp.asarray(v) for k, v in biases.items()}, up_scales=jnp.asarray(up_s),
        down_scales=jnp.asarray(down_s), weight_format=fmt_name, gate=gate, fused=fused, interpret=interp)
    assert got.dtype == dtype
    up_w = reference.dequantize_weights(up_v, up_s, fmt_name)
    down_w = reference.dequantize_weights(down_v, down_s, fmt_name)
    dense = program.experts_forward(
        jnp.asarray(x, dtype), jnp.asarray(ids), jnp.asarray(weights), jnp.asarray(up_w, dtype),
        jnp.asarray(down_w, dtype), **{k: jnp.asarray(v) for k, v in biases.items()}, gate=gate,
        interpret=interp)
    want64 = reference.moe_experts(x, ids, weights, up_w, down_w, gate=gate, **biases)
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert not np.isnan(got).any()
    scale = np.abs(want64).max()
    tol = TOL[dtype]
    # Both programs are held to ``tol`` of float64 (below, and the dense one's
    # own tests); the dense one also rounds the dequantized weights to
    # ``dtype`` (fp8 x block scale is not a bf16 value), the quantized one does
    # not, so the two may differ by up to both errors (seen: 0.0088 + 0.0032).
    np.testing.assert_allclose(got / scale, np.asarray(jnp.asarray(dense, jnp.float32)) / scale, rtol=0,
                               atol=2 * tol, err_msg=f"vs the program on dequantized weights, seed={SEED}")
    np.testing.assert_allclose(got / scale, want64 / scale, rtol=0, atol=tol,
                               err_msg=f"vs float64, seed={SEED}")


def test_experts_program_refuses_quantized_misuse():
    from moe_experts_tpu.experts import program

    rng = np.random.default_rng(SEED)
    up_v, up_s = _moderate_weights(rng, "int8", 2, 256, 128)
    down_v, down_s = _moderate_weights(rng, "int8", 2, 128, 128)
    args = (jnp.zeros((3, 128), jnp.bfloat16), jnp.zeros((3, 1), jnp.int32), jnp.ones((3, 1)),
            jnp.asarray(up_v), jnp.asarray(down_v))
    with pytest.raises(ValueError, match="fused=True: the fused experts kernel runs GLU gates it lowers in the kernel, without biases"):
        program.experts_forward(*args, up_bias=jnp.zeros((2, 256)), up_scales=jnp.asarray(up_s),
                                down_scales=jnp.asarray(down_s), weight_format="int8", fused=True)
    mx_up, mx_up_s = _moderate_weights(rng, "mxfp4", 2, 256, 128)
    mx_down, mx_down_s = _moderate_weights(rng, "mxfp4", 2, 128, 128)
    with pytest.raises(ValueError, match="fused experts kernel reads .*got 'mxfp4'"):
        program.experts_forward(*args[:3], jnp.asarray(mx_up), jnp.asarray(mx_down), up_scales=jnp.asarray(mx_up_s),
                                down_scales=jnp.asarray(mx_down_s), weight_format="mxfp4", fused=True)
    with pytest.raises(ValueError, match="rhs_layout='kn' is not supported"):
        program.experts_forward(*args, up_scales=jnp.asarray(up_s), down_scales=jnp.asarray(down_s),
                                weight_format="int8", rhs_layout="kn")
    with pytest.raises(ValueError, match="rhs_scales must be"):
        program.experts_forward(*args, up_scales=jnp.asarray(down_s), down_scales=jnp.asarray(down_s),
                                weight_format="int8")
    with pytest.raises(ValueError, match="without weight_format"):
        program.experts_forward(*args, up_scales=jnp.asarray(up_s))


# ----------------------------------------------------------------------------
# Ahead-of-time compilation for real TPU generations (libtpu, no TPU attached)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("generation", ["v4", "v5e", "v5p", "v6e", "tpu7x"])
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_compiles_for_tpu_generations(fmt_name, generation):
    """Each format lowers through Mosaic on every generation, at a small
    gpt-oss-like shape (K = 2880: mxfp4's scales 90 lanes wide, K not a
    multiple of 128) with the rule's tiles; fp8 also at 512 and 4096 rows
    (prefill row tiles: 128 rows a group sliced on v5e / v6e / tpu7x, 1024 the
    dequantized tile but on v5e, tiling.fp8_sliced); mxfp4 also at 4096 rows
    (the dequantized tile, through e4m3 bytes for bf16). The full model x
    tokens matrix is bench/aot_quantized.py."""
    pytest.importorskip("libtpu")
    from ragged_dot_tpu.common import aot

    fmt = quant_formats.weight_format(fmt_name)
    k, n, g = 2880, 384, 4
    for m in {"int8": (64,), "fp8": (64, 512, 4096), "mxfp4": (64, 4096)}[fmt_name]:
        aot.compile_for(generation, lambda x, v, s, gs: pallas_gmm.gmm(
            x, v, gs, rhs_scales=s, weight_format=fmt_name, generation=generation),
            ((m, k), jnp.bfloat16), (fmt.values_shape(g, n, k), jnp.dtype(fmt.values_dtype)),
            (fmt.scales_shape(g, n, k), jnp.dtype(fmt.scales_dtype)), ((g,), jnp.int32))
    if fmt_name == "mxfp4":  # the stacked decode path with a split K's tail (its scale codes past K masked)
        k, n, g = 8192 + 64, 128, 2
        aot.compile_for(generation, lambda x, v, s, gs: pallas_gmm.gmm(
            x, v, gs, rhs_scales=s, weight_format=fmt_name, generation=generation, tiling=(16, 4096, 128)),
            ((24, k), jnp.bfloat16), (fmt.values_shape(g, n, k), jnp.dtype(fmt.values_dtype)),
            (fmt.scales_shape(g, n, k), jnp.dtype(fmt.scales_dtype)), ((g,), jnp.int32))


@pytest.mark.parametrize("generation", ["v4", "v5e", "v5p", "v6e", "tpu7x"])
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_gated_store_compiles_for_tpu_generations(fmt_name, generation):
    """The gated store lowers on every generation: gpt-oss's interleaved
    halves with the up bias (f32, bf16; K = 2880) at decode (fp8's K slices, mxfp4's
    stacked path) and prefill rows (the dequantized tile), and concatenated
    halves in one whole tile; the kernel's own weight pipeline on v5e / v6e /
    tpu7x, the grid's on v4 / v5p."""
    pytest.importorskip("libtpu")
    from moe_experts_tpu.experts.gates import pair_gate
    from ragged_dot_tpu.common import aot

    fmt = quant_formats.weight_format(fmt_name)
    # 20 experts: the biases (and int8's column scales) in blocks of 8 (f32) or 16 (bf16) experts' rows
    for halves, m, k, n, g, bias_dtype in (("interleaved", 64, 2880, 768, 20, jnp.float32),
                                           ("interleaved", 1024, 2880, 768, 20, jnp.bfloat16),
                                           ("concatenated", 1024, 1024, 512, 20, None)):
        bias = ((g, n), bias_dtype) if bias_dtype else None

        def gated(x, v, s, gs, *b, halves=halves):
            return pallas_gmm.gmm(x, v, gs, rhs_scales=s, weight_format=fmt_name, generation=generation,
                                  out_dtype=jnp.bfloat16, glu=pair_gate("gpt_oss", 1.702, 7.0), glu_halves=halves,
                                  glu_bias=b[0] if b else None)

        aot.compile_for(generation, gated, ((m, k), jnp.bfloat16),
                        (fmt.values_shape(g, n, k), jnp.dtype(fmt.values_dtype)),
                        (fmt.scales_shape(g, n, k), jnp.dtype(fmt.scales_dtype)), ((g,), jnp.int32),
                        *([bias] if bias else []))
