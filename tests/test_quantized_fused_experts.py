"""The fused experts kernel on quantized weights (int8 as it is, fp8 decoded
once per expert in VMEM) in interpret mode against a float64 loop over the
dequantized weights (tests/reference.py), with the interpreter's poisoned
memory: an output element never written reads NaN and fails.

Shapes are chosen against the kernel's seams: I = 96, so fp8's first 128-row
scale block of gate_up straddles the gate and up halves; H = 200, neither
whole 128-column scale blocks nor whole lanes; ragged, empty and all-empty
groups, rows past the groups' sum. Generations: tpu7x (weights fetched by the
kernel a run ahead, 256-row tiles computed by halves), v6e (fetched by the
kernel, whole tiles), v4 (the grid's pipeline).

Measured error (max |got - want| / max |want|, seeds 0-2, the tpu7x and v6e
cases of the test with random groups): f32 rows 5.8e-7
(int8) and 4.6e-7 (fp8); bf16 rows 3.6e-3 (int8) and 6.4e-3 (fp8): the
bf16 rounding of the gated intermediate and of fp8's value x scale (the
reference takes the bf16-rounded rows).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from moe_experts_tpu.common import pallas_helpers
from moe_experts_tpu.experts import pallas_fused_experts
from test_quantized_gmm import random_weights

SEED = int(os.environ.get("TEST_SEED", np.random.SeedSequence().entropy % (2**31)))
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
H, I, E = 200, 96, 5


def _inputs(rng, fmt_name, m, kind, dtype):
    x = np.asarray(jnp.asarray(rng.standard_normal((m, H)), dtype).astype(jnp.float32), np.float64)
    up, up_scales = random_weights(rng, fmt_name, E, 2 * I, H)
    down, down_scales = random_weights(rng, fmt_name, E, H, I)
    # moderate magnitudes per expert (the activations stay finite and bf16 keeps its relative error)
    def moderate(values, scales):
        peak = np.abs(reference.dequantize_weights(values, scales, fmt_name)).max(axis=(1, 2))
        return (scales / peak.reshape(-1, *(1,) * (scales.ndim - 1)) * 0.05).astype(np.float32)

    up_scales, down_scales = moderate(up, up_scales), moderate(down, down_scales)
    sizes = reference.random_group_sizes(rng, E, m, kind).astype(np.int32)
    return x, up, up_scales.astype(np.float32), down, down_scales.astype(np.float32), sizes


def _want(x, up, up_scales, down, down_scales, sizes, fmt_name):
    gate_up = reference.dequantize_weights(up, up_scales, fmt_name)
    down_w = reference.dequantize_weights(down, down_scales, fmt_name)
    want = np.zeros((x.shape[0], H))
    starts, ends = reference.bounds(sizes)
    for g in range(E):
        rows = x[starts[g]:ends[g]]
        a, b = rows @ gate_up[g, :I].T, rows @ gate_up[g, I:].T
        want[starts[g]:ends[g]] = (a / (1 + np.exp(-a)) * b) @ down_w[g].T
    return want


@pytest.mark.parametrize("kind", ["random", "with_zeros", "all_empty", "sum_below_m"])
@pytest.mark.parametrize("generation,tm", [("tpu7x", 256), ("v6e", 32), ("v4", 32)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt_name", ["int8", "fp8"])
def test_fused_quantized_experts_match_float64(fmt_name, dtype, generation, tm, kind):
    rng = np.random.default_rng([SEED, ["int8", "fp8"].index(fmt_name), dtype == jnp.bfloat16, tm,
                                 ["random", "with_zeros", "all_empty", "sum_below_m"].index(kind)])
    m = int(rng.integers(300, 600) if tm == 256 else rng.integers(1, 90))
    x, up, up_scales, down, down_scales, sizes = _inputs(rng, fmt_name, m, kind, dtype)
    got = pallas_fused_experts.fused_glu_experts(
        jnp.asarray(x, dtype), jnp.asarray(up), jnp.asarray(down), jnp.asarray(sizes), gate="glu_silu",
        tm=tm, generation=generation, interpret=pallas_helpers.interpret_params(),
        up_scales=jnp.asarray(up_scales), down_scales=jnp.asarray(down_scales), weight_format=fmt_name)
    assert got.dtype == dtype
    got = np.asarray(got.astype(jnp.float32), np.float64)
    what = f"{fmt_name} {generation} tm={tm} sizes={sizes.tolist()} seed={SEED}"
    assert not np.isnan(got).any(), f"{what}: NaN (unwritten) elements"
    want = _want(x, up, up_scales, down, down_scales, sizes, fmt_name)
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e}"
    if kind == "sum_below_m":
        assert not got[sizes.sum():].any(), f"{what}: rows past the groups are not zero"


def test_fused_quantized_rule_and_refusals():
    """The rule sizes the working set with the quantized bytes (and fp8's
    decoded expert); mxfp4 and mismatched arrays are refused by name."""
    # Qwen3-30B-A3B at 4096 tokens on v6e: bf16, int8 and fp8 experts all fit with 256-row tiles
    for fmt_name in (None, "int8", "fp8"):
        assert pallas_fused_experts.fused_row_tile("glu_silu", "nk", 32768, 2048, 768, 128, 2, "v6e", fmt_name) == 256
    # DeepSeek-V3's expert (I = 2048, H = 7168: 44 MB in int8) fits nowhere in bf16, in int8 only v6e's budget
    for chip in ("v6e", "tpu7x"):
        assert pallas_fused_experts.fused_row_tile("glu_silu", "nk", 4096, 7168, 2048, 256, 2, chip) is None
    assert pallas_fused_experts.fused_row_tile("glu_silu", "nk", 4096, 7168, 2048, 256, 2, "tpu7x", "int8") is None
    assert pallas_fused_experts.fused_row_tile("glu_silu", "nk", 4096, 2048, 768, 128, 2, "v6e", "mxfp4") is None
    # fp8's decoded copy (and int8's f32 copies for f32 rows) count: tpu7x's 45 MiB takes Gemma-4's
    # expert as int8 with bf16 rows at 256-row tiles, with f32 rows only at smaller tiles
    assert pallas_fused_experts.fused_row_tile("glu_silu", "nk", 32768, 2816, 704, 128, 2, "tpu7x", "int8") == 256
    assert pallas_fused_experts.fused_row_tile("glu_silu", "nk", 32768, 2816, 704, 128, 4, "tpu7x", "int8") < 256

    x = jnp.zeros((8, 256), jnp.bfloat16)
    sizes = jnp.array([4, 4], jnp.int32)
    up, up_s = jnp.zeros((2, 256, 256), jnp.int8), jnp.ones((2, 256), jnp.float32)
    down, down_s = jnp.zeros((2, 256, 128), jnp.int8), jnp.ones((2, 256), jnp.float32)
    call = lambda **kw: jax.eval_shape(lambda: pallas_fused_experts.fused_glu_experts(  # noqa: E731
        x, kw.get("up", up), kw.get("down", down), sizes, gate="glu_silu", generation="v6e",
        up_scales=kw.get("up_s", up_s), down_scales=kw.get("down_s", down_s),
        weight_format=kw.get("fmt", "int8")))
    assert call().shape == (8, 256)
    with pytest.raises(ValueError, match="reads .*'int8', 'fp8'.* got 'mxfp4'"):
        call(fmt="mxfp4")
    with pytest.raises(ValueError, match="down / down_scales .*rhs_scales must be float32 \\(2, 256\\)"):
        call(down_s=jnp.ones((2, 128), jnp.float32))
    with pytest.raises(ValueError, match="rhs_scales must be float32 \\(2, 256\\)"):
        call(up_s=jnp.ones((2, 128), jnp.float32))
    with pytest.raises(ValueError, match="gate_up must be \\[E, 2I, H\\]"):
        call(up=jnp.zeros((2, 255, 256), jnp.int8))
    with pytest.raises(ValueError, match="without weight_format"):
        jax.eval_shape(lambda: pallas_fused_experts.fused_glu_experts(
            x, up.astype(jnp.bfloat16), down.astype(jnp.bfloat16), sizes, gate="glu_silu", up_scales=up_s))


@pytest.mark.parametrize("generation", ["v4", "v5e", "v5p", "v6e", "tpu7x"])
@pytest.mark.parametrize("fmt_name", ["int8", "fp8"])
def test_fused_quantized_experts_compile_for_tpu_generations(fmt_name, generation):
    """The kernel lowers through Mosaic on every generation at Qwen3-30B-A3B's
    expert (H = 2048, I = 768; 8 of its 128 experts) with bf16 rows, the rule's
    row tile at 32 rows a group (and 256 on v6e / tpu7x), and fp8 at
    Gemma-4-26B-A4B's (I = 704: its scale block straddles the gate and up
    halves); v4 at smaller experts, which its VMEM holds; the kernel's own weight
    pipeline on v5e / v6e / tpu7x, the grid's on v4 / v5p."""
    pytest.importorskip("libtpu")
    from moe_experts_tpu.common import aot, quant_formats

    fmt = quant_formats.weight_format(fmt_name)
    shapes = [(256, 2048, 768, 8)]
    if generation in ("v6e", "tpu7x"):  # 256 rows a group: 256-row tiles (tpu7x: computed by halves)
        shapes.append((2048, 2048, 768, 8))
    if fmt_name == "fp8":
        shapes.append((512, 2816, 704, 8))
    if generation == "v4":  # 16 MiB of VMEM: no whole Qwen3 expert; I = 224 straddles a scale block too
        shapes = [(256, 1024, 256, 8), (1024, 1024, 224, 8)][:2 if fmt_name == "fp8" else 1]
    for m, hidden, inter, e in shapes:
        aot.compile_for(generation, lambda x, up, up_s, down, down_s, gs: pallas_fused_experts.fused_glu_experts(
            x, up, down, gs, gate="glu_silu", generation=generation, up_scales=up_s, down_scales=down_s,
            weight_format=fmt_name),
            ((m, hidden), jnp.bfloat16),
            (fmt.values_shape(e, 2 * inter, hidden), jnp.dtype(fmt.values_dtype)),
            (fmt.scales_shape(e, 2 * inter, hidden), jnp.dtype(fmt.scales_dtype)),
            (fmt.values_shape(e, hidden, inter), jnp.dtype(fmt.values_dtype)),
            (fmt.scales_shape(e, hidden, inter), jnp.dtype(fmt.scales_dtype)), ((e,), jnp.int32))
    if generation == "tpu7x" and fmt_name == "int8":  # f32 rows (the tiles' f32 copies in the working set)
        m, hidden, inter, e = 2048, 2816, 704, 8
        aot.compile_for(generation, lambda x, up, up_s, down, down_s, gs: pallas_fused_experts.fused_glu_experts(
            x, up, down, gs, gate="glu_silu", generation=generation, up_scales=up_s, down_scales=down_s,
            weight_format=fmt_name),
            ((m, hidden), jnp.float32), (fmt.values_shape(e, 2 * inter, hidden), jnp.int8),
            (fmt.scales_shape(e, 2 * inter, hidden), jnp.float32), (fmt.values_shape(e, hidden, inter), jnp.int8),
            (fmt.scales_shape(e, hidden, inter), jnp.float32), ((e,), jnp.int32))


def test_program_takes_the_fused_kernel_by_the_rule():
    """``program.fused_kernel_row_tile`` with quantized weights follows
    ``FUSED_QUANTIZED_FROM_ROWS_PER_GROUP`` (and v5e's bf16 limit), at
    Qwen3-30B-A3B's experts: the estimates that chose it are in its comment."""
    from moe_experts_tpu.experts import program

    def tile(fmt_name, chip, rows_per_group, gate="glu_silu", bias=None):
        up = jax.ShapeDtypeStruct((128, 1536, 2048), jnp.int8 if fmt_name == "int8" else jnp.float8_e4m3fn)
        down = jax.ShapeDtypeStruct((128, 2048, 768), up.dtype)
        return program.fused_kernel_row_tile(128 * rows_per_group, up, down, bias, None, gate, "nk", chip,
                                             fmt_name, 2)

    assert tile("int8", "v6e", 32) is None and tile("int8", "v6e", 64) is not None
    assert tile("int8", "tpu7x", 1) is not None
    assert tile("int8", "v5e", 1) is None and tile("int8", "v5e", 4) is not None
    assert tile("int8", "v5e", 256) is None  # v5e's two matmuls from 256 rows a group, any format
    assert tile("fp8", "v6e", 128) is None and tile("fp8", "v6e", 256) is not None
    assert tile("fp8", "tpu7x", 256) is not None and tile("fp8", "v5e", 64) is None
    assert tile("int8", "v4", 64) is None and tile("int8", "v5p", 64) is None  # not measured
    assert tile("mxfp4", "v6e", 256) is None
    assert tile("int8", "v6e", 256, gate="gpt_oss") is None
    assert tile("int8", "v6e", 256, bias=jax.ShapeDtypeStruct((128, 1536), jnp.float32)) is None
    # DeepSeek-V3's int8 expert fits v6e only at 32-row tiles (2.3x slower than the two matmuls): not taken
    ds_up, ds_down = (jax.ShapeDtypeStruct(s, jnp.int8) for s in ((256, 4096, 7168), (256, 7168, 2048)))
    assert pallas_fused_experts.fused_row_tile("glu_silu", "nk", 32768, 7168, 2048, 256, 2, "v6e", "int8") == 32
    assert program.fused_kernel_row_tile(32768, ds_up, ds_down, None, None, "glu_silu", "nk", "v6e", "int8", 2) is None


@pytest.mark.parametrize("fmt_name", ["int8", "fp8"])
def test_program_on_group_aligned_rows(fmt_name, monkeypatch):
    """tpu7x from 256 rows an expert: the program aligns each expert's rows to
    128 (``program.GROUP_ALIGN_QUANTIZED``) and runs the fused kernel on the
    padded layout; the layer still matches float64 (padding rows never read
    back, a remote pick adds nothing)."""
    from moe_experts_tpu.experts import program

    aligns = []
    real = program.AlignedRows.of.__func__

    def record(cls, sorted_ids, group_sizes, align):
        aligns.append(align)
        return real(cls, sorted_ids, group_sizes, align)

    monkeypatch.setattr(program.AlignedRows, "of", classmethod(record))
    kernels = []
    real_kernel = program.pallas_fused_experts.fused_glu_experts

    def fused_kernel(*args, **kw):
        kernels.append(kw["weight_format"])
        return real_kernel(*args, **kw)

    monkeypatch.setattr(program.pallas_fused_experts, "fused_glu_experts", fused_kernel)
    rng = np.random.default_rng([SEED, 77, fmt_name == "fp8"])
    tokens, experts = 601, 2
    x = np.asarray(jnp.asarray(rng.standard_normal((tokens, H)), jnp.bfloat16).astype(jnp.float32), np.float64)
    up, up_scales = random_weights(rng, fmt_name, experts, 2 * I, H)
    down, down_scales = random_weights(rng, fmt_name, experts, H, I)
    for values, scales in ((up, up_scales), (down, down_scales)):  # moderate magnitudes, per expert
        peak = np.abs(reference.dequantize_weights(values, scales, fmt_name)).max(axis=(1, 2))
        scales *= (0.05 / peak).reshape(-1, *(1,) * (scales.ndim - 1)).astype(np.float32)
    ids = rng.integers(0, experts, size=(tokens, 1)).astype(np.int32)
    ids[0, 0] = experts  # a remote pick
    weights = rng.uniform(0.5, 1.0, size=(tokens, 1)).astype(np.float32)
    got = program.experts_forward(
        jnp.asarray(x, jnp.bfloat16), jnp.asarray(ids), jnp.asarray(weights), jnp.asarray(up), jnp.asarray(down),
        up_scales=jnp.asarray(up_scales), down_scales=jnp.asarray(down_scales), weight_format=fmt_name,
        gate="glu_silu", generation="tpu7x", interpret=pallas_helpers.interpret_params())
    assert aligns == [128] and kernels == [fmt_name]
    want = reference.moe_experts(x, ids, weights, reference.dequantize_weights(up, up_scales, fmt_name),
                                 reference.dequantize_weights(down, down_scales, fmt_name), gate="glu_silu")
    got = np.asarray(got.astype(jnp.float32), np.float64)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= TOL[jnp.bfloat16], f"{fmt_name}: relative error {err:.2e}, seed={SEED}"
