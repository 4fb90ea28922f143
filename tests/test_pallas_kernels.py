"""Interpret-mode numerics of the Pallas kernels against the float64 loops.

The interpreter poisons memory (uninitialised and out-of-bounds reads are
NaN), so an output element the kernel never writes, or a tail it fails to
mask, shows up as NaN and fails the comparison.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import reference
from ragged_dot_tpu.common import pallas_helpers
from ragged_dot_tpu.gmm import pallas_gmm

SEED = int(os.environ.get("TEST_SEED", np.random.SeedSequence().entropy % (2**31)))
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=1e-2, atol=1e-2)}
KINDS = ["random", "with_zeros", "one_huge", "all_last", "sum_below_m", "all_empty"]


def _inputs(rng, m, k, n, num_groups, kind, layout, dtype, num_local=None, offset=0):
    num_local = num_groups if num_local is None else num_local
    sizes = reference.random_group_sizes(rng, num_groups, m, kind).astype(np.int32)
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    rhs_shape = (num_local, n, k) if layout == "nk" else (num_local, k, n)
    rhs = rng.standard_normal(rhs_shape).astype(np.float32)
    # Round through the kernel dtype so the reference sees the same inputs.
    lhs = np.asarray(jnp.asarray(lhs, dtype).astype(jnp.float32))
    rhs = np.asarray(jnp.asarray(rhs, dtype).astype(jnp.float32))
    return lhs, rhs, sizes


def _scale(k):
    return np.sqrt(k)  # entries of a K-long dot of N(0,1) values grow like sqrt(K)


def _assert_close(got, want, dtype, k, what):
    tol = TOL[dtype]
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), dtype=np.float64)
    assert not np.isnan(got).any(), f"{what}: NaN (unwritten or unmasked) elements, seed={SEED}"
    np.testing.assert_allclose(
        got / _scale(k), want / _scale(k), rtol=tol["rtol"], atol=tol["atol"],
        err_msg=f"{what} seed={SEED}",
    )


def _gmm(lhs, rhs, sizes, layout, dtype, **kw):
    return pallas_gmm.gmm(
        jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), jnp.asarray(sizes),
        rhs_layout=layout, interpret=pallas_helpers.interpret_params(), **kw,
    )


def _tgmm(lhs, dout, sizes, num_local, layout, dtype, **kw):
    return pallas_gmm.tgmm(
        jnp.asarray(lhs, dtype), jnp.asarray(dout, dtype), jnp.asarray(sizes),
        num_local_groups=num_local, rhs_layout=layout,
        interpret=pallas_helpers.interpret_params(), **kw,
    )


def test_poisoning_is_active():
    """The poison the other tests rely on: a kernel that writes nothing gives NaN."""

    def writes_nothing(x_ref, o_ref):
        del x_ref, o_ref

    out = pl.pallas_call(
        writes_nothing, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        interpret=pallas_helpers.interpret_params(),
    )(jnp.ones((8, 128), jnp.float32))
    assert np.isnan(np.asarray(out)).all()


def test_float16_operands_decode_exactly_in_a_kernel():
    """Every one of the 65536 float16 bit patterns, carried into a kernel as
    uint16 and decoded there: the float32 numpy gives, bit for bit (zeros of
    both signs, subnormals, infinities), and NaN for every NaN."""
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    operand = pallas_helpers.as_kernel_operand(jnp.asarray(halves).reshape(512, 128))
    assert operand.dtype == jnp.uint16 and pallas_helpers.kernel_dtype(jnp.float16) == jnp.float32

    def decode(x_ref, o_ref):
        o_ref[...] = pallas_helpers.load(x_ref)

    out = np.asarray(pl.pallas_call(decode, out_shape=jax.ShapeDtypeStruct((512, 128), jnp.float32),
                                    interpret=pallas_helpers.interpret_params())(operand)).reshape(-1)
    want = halves.astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(out[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("kind", KINDS)
def test_forward_f32(layout, kind):
    rng = np.random.default_rng([SEED, KINDS.index(kind), layout == "nk"])
    m, k, n, g = int(rng.integers(1, 70)), int(rng.integers(1, 150)), int(rng.integers(1, 140)), int(rng.integers(1, 7))
    lhs, rhs, sizes = _inputs(rng, m, k, n, g, kind, layout, jnp.float32)
    # The rule's tiles (at these sizes one row tile: its 128-row floor) and
    # 8-row tiles, so group boundaries fall inside and between row tiles.
    for tiling in (None, (8, 128, 128)):
        out = _gmm(lhs, rhs, sizes, layout, jnp.float32, tiling=tiling)
        assert out.shape == (m, n)
        _assert_close(out, reference.ragged_dot(lhs, rhs, sizes, layout), jnp.float32, k,
                      f"gmm m={m} k={k} n={n} sizes={sizes.tolist()} tiling={tiling}")


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("kind", ["random", "with_zeros"])
def test_forward_bf16(layout, kind):
    rng = np.random.default_rng([SEED, 100 + KINDS.index(kind), layout == "nk"])
    m, k, n, g = 50, 96, 72, 5
    lhs, rhs, sizes = _inputs(rng, m, k, n, g, kind, layout, jnp.bfloat16)
    for out_dtype in (jnp.bfloat16, jnp.float32):
        out = _gmm(lhs, rhs, sizes, layout, jnp.bfloat16, out_dtype=out_dtype)
        assert out.dtype == out_dtype
        _assert_close(out, reference.ragged_dot(lhs, rhs, sizes, layout), jnp.bfloat16, k, "gmm bf16")


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_forward_multi_tile_with_tails(layout):
    """Several tiles in every dim, none of M, K, N a multiple of its tile."""
    rng = np.random.default_rng([SEED, 7, layout == "nk"])
    m, k, n, g = 75, 300, 260, 6
    lhs, rhs, sizes = _inputs(rng, m, k, n, g, "with_zeros", layout, jnp.float32)
    out = _gmm(lhs, rhs, sizes, layout, jnp.float32, tiling=(16, 128, 128))
    _assert_close(out, reference.ragged_dot(lhs, rhs, sizes, layout), jnp.float32, k, "gmm tiled")


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("kind", ["random", "with_zeros", "one_huge"])
@pytest.mark.parametrize("generation,tm,chunk", [("v6e", 512, 256), ("v5e", 256, 128), ("tpu7x", 256, 256)])
@pytest.mark.parametrize("whole_k,dtype", [(False, jnp.float32), (True, jnp.bfloat16)])
def test_forward_row_chunks(layout, kind, generation, tm, chunk, whole_k, dtype):
    """Row tiles of several row chunks: a visit computes only the chunks
    holding its group's rows, or the half of a chunk that does
    (``visit_row_chunks``), with a local group window, so skipped chunks and
    halves must still come out right: split K (a K tail) into the
    accumulator, whole K stored straight into the output block; tpu7x's
    256-row tile is one chunk, run as halves too."""
    from ragged_dot_tpu.gmm import tiling

    assert tiling.row_chunk(tm, generation) == chunk
    rng = np.random.default_rng([SEED, 11, KINDS.index(kind), layout == "nk", tm, whole_k, dtype == jnp.float32])
    m, k, n, g = 700, 200, 136, 7
    lhs, rhs, sizes = _inputs(rng, m, k, n, g, kind, layout, dtype, 5, 1)
    out = _gmm(lhs, rhs, sizes, layout, dtype, group_offset=1, tiling=(tm, k if whole_k else 128, 136),
               generation=generation, out_dtype=jnp.float32)
    want = reference.ragged_dot(lhs, rhs, sizes, layout, group_offset=1)
    _assert_close(out, want, dtype, k, f"gmm row chunks sizes={sizes.tolist()}")


@pytest.mark.parametrize("tm,chunk", [(512, 256), (256, 128), (512, 128), (256, 256)])
def test_visit_row_chunks_cover_the_visit_once_in_halves(tm, chunk):
    """Every rows range ``[lo, hi)`` meeting a tile (also reaching past it):
    the live chunks lie inside the tile, cover the range's rows in it, never
    overlap, and leave no half chunk without a row of the range."""
    from ragged_dot_tpu.gmm.pallas_gmm import visit_row_chunks

    half = chunk // 2
    for lo in range(-5, tm, 3):
        for hi in range(max(lo, 0) + 1, tm + 8, 5):
            runs = np.zeros(tm, int)
            for size, first, live in visit_row_chunks(tm, chunk, lo, hi):
                assert 0 <= first and first + size <= tm and size in (chunk, half)
                if live:
                    runs[first:first + size] += 1
            assert (runs[max(lo, 0):hi] == 1).all(), (lo, hi)
            assert (runs <= 1).all(), (lo, hi)
            for h in range(0, tm, half):  # a computed half holds a row of the range
                assert not runs[h] or (h < hi and h + half > lo), (lo, hi, h)


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("kind", ["random", "with_zeros", "one_huge", "sum_below_m"])
@pytest.mark.parametrize("generation", ["v6e", "v4"])
def test_forward_weight_prefetch(layout, kind, generation):
    """Whole-K steps: the kernel's own weight pipeline (one TensorCore: v6e)
    and the grid's (a megacore: v4), over three column tiles and many groups, so runs of visits chain their prefetches within
    a column tile and across to the next; a local group window adds idle
    visits before and after, which must not start a fetch of their own."""
    from ragged_dot_tpu.gmm import pallas_gmm as kernels

    assert kernels.prefetches_weights(True, generation) == (generation == "v6e")
    rng = np.random.default_rng([SEED, 17, KINDS.index(kind), layout == "nk", generation == "v6e"])
    # Three column tiles of 128: "nk" with a partial last one (64 rows of
    # weights: a legal DMA), "kn" whole ones (a partial lane tile would take
    # the grid's pipeline, WeightBlock.tiles_align).
    m, k, n, g = int(rng.integers(300, 700)), int(rng.integers(1, 200)), 320 if layout == "nk" else 384, 9
    assert kernels.WeightBlock(layout, 128, n, k).tiles_align(3, 4)
    lhs, rhs, sizes = _inputs(rng, m, k, n, g, kind, layout, jnp.float32, 7, 1)
    out = _gmm(lhs, rhs, sizes, layout, jnp.float32, group_offset=1, tiling=(64, k, 128), generation=generation)
    want = reference.ragged_dot(lhs, rhs, sizes, layout, group_offset=1)
    _assert_close(out, want, jnp.float32, k, f"gmm weight prefetch k={k} sizes={sizes.tolist()}")


# float64 references of gates the gated up projection applies (gates.py), at
# alpha 1.5 and limit 4 for those that take them, and where their halves lie.
GLU_REFERENCES = {
    "glu_silu": (lambda g, u: g / (1 + np.exp(-g)) * u, "concatenated"),
    "softcap_swiglu": (lambda g, u: 1.5 * np.tanh(g / 1.5) / (1 + np.exp(-g)) * (4.0 * np.tanh(u / 4.0)),
                       "concatenated"),
    "gpt_oss": (lambda g, u: (np.clip(u, -4, 4) + 1) * np.minimum(g, 4) / (1 + np.exp(-1.5 * np.minimum(g, 4))),
                "interleaved"),
}


@pytest.mark.parametrize("gate", sorted(GLU_REFERENCES))
@pytest.mark.parametrize("kind,biased", [("random", False), ("with_zeros", False), ("all_empty", False),
                                         ("one_huge", True), ("sum_below_m", True)])
def test_forward_gated_up_projection(gate, kind, biased):
    """gmm(glu=): the gate applied at the store to both halves of the product
    (concatenated: two weight tiles; interleaved: pairs of columns), with an
    optional per-group bias, against float64, with a local group window
    (rows of other groups and past the sizes must be zeros, bias or not): the
    rule's tiles, small tiles with K and I tails, 512-row tiles of 256-row
    chunks (v6e; the three on random sizes, the small ones on the other kinds),
    and for interleaved halves the "kn" layout too."""
    from moe_experts_tpu.experts.gates import pair_gate

    reference_gate, halves = GLU_REFERENCES[gate]
    rng = np.random.default_rng([SEED, 13, KINDS.index(kind), sorted(GLU_REFERENCES).index(gate), biased])
    m, k, i = int(rng.integers(520, 700)), int(rng.integers(1, 300)), 16 * int(rng.integers(1, 20))
    layouts = ["nk", "kn"] if halves == "interleaved" else ["nk"]
    for layout in layouts:
        lhs, rhs, sizes = _inputs(rng, m, k, 2 * i, 6, kind, layout, jnp.float32, 5, 1)
        bias = rng.standard_normal((5, 2 * i)).astype(np.float32) if biased else None
        h = reference.ragged_dot(lhs, rhs, sizes, layout, group_offset=1)  # zero rows outside the window
        starts, ends = reference.bounds(sizes)
        if biased:
            for g in range(5):
                h[starts[g + 1]:ends[g + 1]] += bias[g]
        g_half, u_half = (h[:, 0::2], h[:, 1::2]) if halves == "interleaved" else (h[:, :i], h[:, i:])
        want = reference_gate(g_half, u_half)
        want[:starts[1]] = want[ends[5]:] = 0.0  # rows outside the local groups: zeros
        norm = max(1.0, float(np.abs(want).max()))
        # Every tiling on random sizes; the edge kinds (empty groups, one huge group, sizes summing
        # below M) at small tiles, where they span the most tiles and tails.
        tilings = ((None, None), ((8, 128, 128), None), ((512, 128, 128), "v6e"))
        for tiling, generation in tilings if kind == "random" else tilings[1:2]:
            out = _gmm(lhs, rhs, sizes, layout, jnp.float32, group_offset=1, glu=pair_gate(gate, 1.5, 4.0),
                       glu_halves=halves, glu_bias=None if bias is None else jnp.asarray(bias),
                       tiling=tiling, generation=generation)
            assert out.shape == (m, i)
            _assert_close(np.asarray(out) / norm, want / norm, jnp.float32, 1,
                          f"gated gmm {gate} {layout} m={m} k={k} i={i} sizes={sizes.tolist()} tiling={tiling}")


def test_gated_up_projection_bf16_out():
    """bf16 operands and output (the program's case), interleaved halves."""
    from moe_experts_tpu.experts.gates import pair_gate

    rng = np.random.default_rng([SEED, 14])
    m, k, i = 300, 256, 384
    lhs, rhs, sizes = _inputs(rng, m, k, 2 * i, 4, "random", "nk", jnp.bfloat16)
    h = reference.ragged_dot(lhs, rhs, sizes, "nk")
    want = GLU_REFERENCES["gpt_oss"][0](h[:, 0::2], h[:, 1::2])
    out = _gmm(lhs, rhs, sizes, "nk", jnp.bfloat16, out_dtype=jnp.bfloat16, glu=pair_gate("gpt_oss", 1.5, 4.0),
               glu_halves="interleaved", tiling=(128, 256, 128))
    assert out.dtype == jnp.bfloat16
    norm = float(np.abs(want).max())
    _assert_close(np.asarray(out.astype(jnp.float32)) / norm, want / norm, jnp.bfloat16, 1, "gated gmm bf16")


def test_gated_up_projection_refuses_weights_it_cannot_split():
    glu = lambda g, u: g * u  # noqa: E731
    x, sizes = jnp.ones((8, 128)), jnp.array([8], jnp.int32)
    with pytest.raises(ValueError, match="glu: concatenated halves .*\"nk\""):
        pallas_gmm.gmm(x, jnp.ones((1, 128, 64)), sizes, rhs_layout="kn", glu=glu)
    with pytest.raises(ValueError, match="glu: rhs's out dim holds two halves"):
        pallas_gmm.gmm(x, jnp.ones((1, 40, 128)), sizes, rhs_layout="nk", glu=glu)
    with pytest.raises(ValueError, match="glu: rhs's out dim holds two halves"):
        pallas_gmm.gmm(x, jnp.ones((1, 41, 128)), sizes, rhs_layout="nk", glu=glu, glu_halves="interleaved")
    with pytest.raises(ValueError, match="glu_halves must be one of"):
        pallas_gmm.gmm(x, jnp.ones((1, 64, 128)), sizes, glu=glu, glu_halves="alternating")
    with pytest.raises(ValueError, match="glu_bias: expected shape \\(1, 64\\)"):
        pallas_gmm.gmm(x, jnp.ones((1, 64, 128)), sizes, glu=glu, glu_bias=jnp.ones((64,)))
    with pytest.raises(ValueError, match="glu_bias given without glu"):
        pallas_gmm.gmm(x, jnp.ones((1, 64, 128)), sizes, glu_bias=jnp.ones((1, 64)))


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("offset,num_local", [(0, 2), (2, 3), (5, 1)])
def test_forward_local_group_window(layout, offset, num_local):
    rng = np.random.default_rng([SEED, 9, offset, layout == "nk"])
    m, k, n, g = 60, 40, 48, 6
    lhs, rhs, sizes = _inputs(rng, m, k, n, g, "random", layout, jnp.float32, num_local, offset)
    out = _gmm(lhs, rhs, sizes, layout, jnp.float32, group_offset=offset, tiling=(8, 40, 48))
    want = reference.ragged_dot(lhs, rhs, sizes, layout, group_offset=offset)
    _assert_close(out, want, jnp.float32, k, f"gmm window offset={offset}")


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("kind", ["random", "with_zeros", "all_last", "all_empty"])
def test_weight_grad(layout, kind):
    rng = np.random.default_rng([SEED, 200 + KINDS.index(kind), layout == "nk"])
    m, k, n, g = int(rng.integers(1, 70)), int(rng.integers(1, 150)), int(rng.integers(1, 140)), int(rng.integers(1, 6))
    lhs, _, sizes = _inputs(rng, m, k, n, g, kind, layout, jnp.float32)
    dout = rng.standard_normal((m, n)).astype(np.float32)
    got = _tgmm(lhs, dout, sizes, g, layout, jnp.float32)
    want = reference.weight_grad(lhs, dout, sizes, g, layout)
    assert got.shape == want.shape
    _assert_close(got, want, jnp.float32, m, f"tgmm m={m} k={k} n={n} sizes={sizes.tolist()}")


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_weight_grad_tiled_window_bf16(layout):
    rng = np.random.default_rng([SEED, 300, layout == "nk"])
    m, k, n, g, offset, num_local = 90, 200, 150, 6, 1, 4
    lhs, _, sizes = _inputs(rng, m, k, n, g, "with_zeros", layout, jnp.bfloat16, num_local, offset)
    dout = np.asarray(jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16).astype(jnp.float32))
    got = _tgmm(lhs, dout, sizes, num_local, layout, jnp.bfloat16, group_offset=offset,
                tiling=(16, 128, 128), out_dtype=jnp.float32)
    want = reference.weight_grad(lhs, dout, sizes, num_local, layout, group_offset=offset)
    _assert_close(got, want, jnp.bfloat16, m, "tgmm tiled window")


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_weight_grad_every_visit_case(layout):
    """16-row tiles over groups [0, 50, 3, 30] + 7 rows past the groups: an
    empty group, a group of four visits (first, two middle, last), a group
    inside one tile (its only visit) and one opening and closing across
    tiles; fresh random values against the float64 loop."""
    rng = np.random.default_rng([SEED, 310, layout == "nk"])
    sizes = np.array([0, 50, 3, 30], np.int32)
    m, k, n = 90, 130, 140
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    dout = rng.standard_normal((m, n)).astype(np.float32)
    got = _tgmm(lhs, dout, sizes, 4, layout, jnp.float32, tiling=(16, 128, 128))
    want = reference.weight_grad(lhs, dout, sizes, 4, layout)
    _assert_close(got, want, jnp.float32, m, f"tgmm visit cases {layout}")
    assert np.abs(np.asarray(got)[0]).max() == 0.0  # the empty group's gradient


def test_empty_lhs():
    out = pallas_gmm.gmm(jnp.zeros((0, 8)), jnp.ones((2, 4, 8)), jnp.zeros((2,), jnp.int32))
    assert out.shape == (0, 4)


def test_visit_count_skips_empty_groups():
    """Empty groups add no grid step: visits = row tiles + non-empty boundaries."""
    sizes = jnp.asarray([0, 0, 16, 0, 0, 0, 8, 0], jnp.int32)
    starts, ends = pallas_gmm.local_window(sizes, 0, 8)
    zero = jnp.zeros((1,), jnp.int32)
    seg_starts = jnp.concatenate([zero, starts, ends[-1:]])
    seg_ends = jnp.concatenate([starts[:1], ends, zero + 32])
    _, _, visits = pallas_gmm.make_visits(seg_starts, seg_ends, tm=8, tiles_m=4, visit_empty=False)
    assert int(visits) == 4  # rows 0-15, 16-23, and the zero tail 24-31


def test_fused_glu_experts_default_tile_is_the_kernel_rule():
    """Without ``tm`` the kernel takes its own rule (``fused_row_tile``: one
    MXU-wide pass of rows, a whole expert within the VMEM budget), also where
    the program's rule prefers the two matmuls (v5e from 64 rows an expert);
    an expert that does not fit is refused by name, not left to Mosaic."""
    from moe_experts_tpu.experts import pallas_fused_experts

    tiles = []
    real = pallas_fused_experts.pallas_gmm.forward_visits  # the moe_experts_tpu package's own copy

    def visits(*args, tm, **kw):
        tiles.append(tm)
        return real(*args, tm=tm, **kw)

    x = jax.ShapeDtypeStruct((8192, 2048), jnp.bfloat16)  # Qwen3-30B-A3B, 1024 tokens
    gate_up = jax.ShapeDtypeStruct((128, 1536, 2048), jnp.bfloat16)
    down = jax.ShapeDtypeStruct((128, 2048, 768), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((128,), jnp.int32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pallas_fused_experts.pallas_gmm, "forward_visits", visits)
        jax.eval_shape(lambda *a: pallas_fused_experts.fused_glu_experts(*a, gate="glu_silu", generation="v5e"),
                       x, gate_up, down, sizes)
    assert tiles == [128]  # v5e's 128-wide MXU pass (choose_tiling alone gives 512)
    big = jax.ShapeDtypeStruct((32, 5760, 2880), jnp.bfloat16)  # gpt-oss-20b's 33 MB expert
    with pytest.raises(ValueError, match="no row tile runs gate='glu_silu'"):
        jax.eval_shape(lambda *a: pallas_fused_experts.fused_glu_experts(*a, gate="glu_silu", generation="v6e"),
                       jax.ShapeDtypeStruct((1024, 2880), jnp.bfloat16), big,
                       jax.ShapeDtypeStruct((32, 2880, 2880), jnp.bfloat16), jax.ShapeDtypeStruct((32,), jnp.int32))


@pytest.mark.parametrize("kind", ["random", "with_zeros", "all_empty", "sum_below_m"])
@pytest.mark.parametrize("generation", ["tpu7x", "v4"])
@pytest.mark.parametrize("tm", [8, 256])
def test_fused_glu_experts_kernel(kind, generation, tm):
    """gate_up -> silu(gate) * up -> down in one kernel, against a float64 loop:
    experts fetched by the kernel a run ahead (tpu7x) or by the grid (v4);
    tpu7x's 256-row tiles run only the half of the tile holding a visit's rows
    where the other holds none (``pallas_gmm.visit_row_chunks``), each storing
    its own rows; v4's merge whole tiles into the block."""
    from moe_experts_tpu.experts import pallas_fused_experts

    rng = np.random.default_rng([SEED, 400 + KINDS.index(kind), generation == "tpu7x", tm])
    m, h, i, e = int(rng.integers(1, 60) if tm == 8 else rng.integers(300, 700)), 128, 48, 5
    x = rng.standard_normal((m, h)).astype(np.float32)
    gate_up = (rng.standard_normal((e, 2 * i, h)) * 0.1).astype(np.float32)
    down = (rng.standard_normal((e, h, i)) * 0.1).astype(np.float32)
    sizes = reference.random_group_sizes(rng, e, m, kind).astype(np.int32)
    got = pallas_fused_experts.fused_glu_experts(
        jnp.asarray(x), jnp.asarray(gate_up), jnp.asarray(down), jnp.asarray(sizes),
        gate="glu_silu", tm=tm, generation=generation, interpret=pallas_helpers.interpret_params())
    want = np.zeros((m, h))
    starts, ends = reference.bounds(sizes)
    for g in range(e):
        rows = x[starts[g]:ends[g]].astype(np.float64)
        a, b = rows @ gate_up[g, :i].T, rows @ gate_up[g, i:].T
        want[starts[g]:ends[g]] = (a / (1 + np.exp(-a)) * b) @ down[g].T
    _assert_close(got, want, jnp.float32, h, f"fused experts sizes={sizes.tolist()}")


@pytest.mark.parametrize("generation", ["v4", "v5e", "v5p", "v6e", "tpu7x"])
def test_row_tile_rule(generation):
    """tm: the average group size as a power of two, within the generation's
    bounds (a 128-row floor where the TPU estimator measured one), never more
    than M rounded up to the sublane tile."""
    from ragged_dot_tpu.gmm import tiling

    caps = tiling.TILE_CAPS[generation]
    floor = max(caps.tm_min, 16)
    for m, g, expected in [(512, 128, floor),  # decode: 4 rows per group
                           (4096, 128, max(32, floor)),
                           (32768, 128, 256),
                           (8192, 8, 512),  # 1024 rows per group: capped
                           (8, 128, 16)]:  # fewer rows than a sublane tile
        assert tiling.row_tile(m, g, 2, generation) == expected, (generation, m, g)
        # The forward kernels' tile where they have their own caps, within M:
        # 512 rows on v5e / v6e; on tpu7x one 256-row chunk from 64 rows per
        # group on, else the group-size rule below 256.
        forward = {"v5e": 512, "v6e": 512,
                   "tpu7x": 256 if m // g >= 64 else min(expected, 256)}.get(generation, expected)
        assert tiling.row_tile(m, g, 2, generation, row_chunks=True) == min(forward, max(m, 16)), (generation, m, g)
    assert tiling.TILE_CAPS["v5e"].tm_min == tiling.TILE_CAPS["v6e"].tm_min == 128


@pytest.mark.parametrize("generation", ["v4", "v5e", "v5p", "v6e", "tpu7x"])
def test_weight_gradient_tiling(generation):
    """tgmm's rule: the group-size row tile up to the MXU width, the whole [K, N] gradient where
    it fits the budget, else the larger side halved until it fits (each side
    a multiple of 128 or the whole dim); at bf16 training shapes (tokens x
    top-k rows)."""
    from ragged_dot_tpu.gmm import tiling

    kw = dict(lhs_itemsize=2, dout_itemsize=2, out_itemsize=2, generation=generation)
    budget = tiling.vmem_budget(generation, exact_count=True)
    caps = tiling.TILE_CAPS[generation]
    for m, k, n, g in [(32768, 2048, 1536, 128),  # Qwen3-30B-A3B up, 4096 tokens
                       (32768, 768, 2048, 128),  # its down projection
                       (16384, 2880, 5760, 32),  # gpt-oss-20b up
                       (8192, 4096, 28672, 8),  # Mixtral-8x7B up
                       (100, 200, 300, 3)]:  # unaligned
        t = tiling.weight_gradient_tiling(m, k, n, g, **kw)
        mxu = tiling.tpu_generations.get_generation(generation).mxu
        assert t.tm == min(tiling.row_tile(m, g, 2, generation), mxu), (generation, m, k, n, t)
        assert tiling.weight_gradient_working_set_bytes(t, 2, 2, 2) <= budget, (generation, m, k, n, t)
        for tile, dim in [(t.tk, k), (t.tn, n)]:
            assert tile == dim or (tile % 128 == 0 and tile < dim), (generation, m, k, n, t)
        whole = tiling.Tiling(t.tm, k, n)
        if k <= caps.tk_max and n <= caps.tk_max and tiling.weight_gradient_working_set_bytes(whole, 2, 2, 2) <= budget:
            assert t == whole, (generation, m, k, n, t)
        else:
            assert (t.tk, t.tn) != (k, n)
    # The figures of "Weight gradient" in tiling's docstring.
    assert tiling.weight_gradient_tiling(32768, 2048, 1536, 128, **{**kw, "generation": "v6e"}).as_tuple() == (256, 2048, 1536)
    assert tiling.weight_gradient_tiling(32768, 2048, 1536, 128, **{**kw, "generation": "tpu7x"}).as_tuple() == (256, 2048, 1536)
    assert tiling.weight_gradient_tiling(8192, 4096, 28672, 8, **{**kw, "generation": "v6e"}).as_tuple() == (256, 2048, 2048)
    assert tiling.weight_gradient_tiling(16384, 2880, 5760, 32, **{**kw, "generation": "v5e"}).tm == 128


def test_tpu7x_wide_tiles_fit_or_keep_the_cap():
    """tpu7x's forward output tiles reach 3072 columns only where the tile
    holds K whole within the budget and pads no more MXU columns than the
    2048 cap's tiles (tiling's "Forward tiles on tpu7x"), at 4096 tokens."""
    from ragged_dot_tpu.gmm import tiling

    def tiles(m, k, n, g):
        return tiling.choose_tiling(m, k, n, g, lhs_itemsize=2, rhs_itemsize=2, out_itemsize=2,
                                    generation="tpu7x").as_tuple()

    assert tiles(16384, 2880, 2880, 32) == (256, 2880, 2880)  # gpt-oss-20b down: one tile, not 2 x 1536
    assert tiles(16384, 2880, 5760, 32) == (256, 2880, 3072)  # its gated up: 2 x 3072, not 3 x 2048
    assert tiles(32768, 704, 2816, 128) == (256, 704, 2816)  # Gemma-4-26B-A4B down
    assert tiles(32768, 2048, 7168, 256) == (256, 2048, 1792)  # DeepSeek-V3 down: 3 x 2560 would pad 512 columns
    assert tiles(8192, 4096, 28672, 8) == (256, 4096, 2048)  # Mixtral-8x7B up: 3072 would not fit, nor 2048 halve
    assert tiles(256, 2880, 2880, 32) == (128, 2880, 1024)  # decode: below 64 rows a group, N past 2048
    assert tiling.mxu_columns(2880, 2880, 256) == tiling.mxu_columns(2880, 1536, 256) == 3072
    assert tiling.mxu_columns(7168, 2560, 256) == 7680 > tiling.mxu_columns(7168, 1792, 256) == 7168


@pytest.mark.parametrize("generation", ["v4", "v5e", "v6e", "tpu7x"])
def test_forward_tiles_differ_from_group_size_rule_only_where_estimated_faster(generation):
    """gpt-oss-20b's up projection at 512 tokens: the forward kernel takes
    512-row tiles on v5e and v6e, 256-row tiles (64 rows per group) on tpu7x
    (FORWARD_TILE_CAPS); v4 keeps the group-size rule, as the weight gradient
    does everywhere."""
    from ragged_dot_tpu.gmm import tiling

    forward = tiling.choose_tiling(2048, 2880, 5760, 32, lhs_itemsize=2, rhs_itemsize=2, out_itemsize=4,
                                   generation=generation)
    group_size_rows = tiling.row_tile(2048, 32, 2, generation)
    assert group_size_rows == max(64, tiling.TILE_CAPS[generation].tm_min, 16)
    assert tiling.weight_gradient_tiling(2048, 2880, 5760, 32, lhs_itemsize=2, dout_itemsize=2, out_itemsize=4,
                                         generation=generation).tm == group_size_rows
    assert forward.tm == {"v5e": 512, "v6e": 512, "tpu7x": 256}.get(generation, group_size_rows)
    assert tiling.forward_working_set_bytes(forward, 2880, 2, 2, 4, generation) <= \
        tiling.vmem_budget(generation, exact_count=True)
