"""The kernels compile for real TPU generations (libtpu, no TPU attached).

Shapes: Qwen3-30B-A3B experts (H=2048, I=768, E=128, top-8) at 1, 64 and 4096
tokens, gpt-oss-20b (H=2880, I=2880, E=32, top-4) at 64 tokens and
Mixtral-8x7B (H=4096, I=14336, E=8, top-2) at 4096 tokens (whole-K tiles of
the large VMEM budget). The
forward runs gate_up ([E, 2I, H], "nk") and down ([E, H, I]); the backward
d_lhs is the forward with the "kn" reading of the same weights, d_rhs the
transposed grouped matmul.
"""

import jax
import jax.numpy as jnp
import pytest

from ragged_dot_tpu.common import aot, tpu_generations
from ragged_dot_tpu.gmm import pallas_gmm, tiling

pytest.importorskip("libtpu")

QWEN = dict(hidden=2048, inter=768, experts=128, top_k=8)
GPT_OSS = dict(hidden=2880, inter=2880, experts=32, top_k=4)
MIXTRAL = dict(hidden=4096, inter=14336, experts=8, top_k=2)
GENERATIONS = ["v4", "v5e", "v5p", "v6e", "tpu7x"]


def _rule_tiling(generation, m, k, n, g, dtype):
    size = jnp.dtype(dtype).itemsize
    return tiling.choose_tiling(m, k, n, g, lhs_itemsize=size, rhs_itemsize=size, out_itemsize=size,
                                generation=generation)


def compile_gmm(generation, m, k, n, g, *, rhs_layout="nk", dtype=jnp.bfloat16, tiling=None):
    """The forward kernel compiled for ``generation``; returns the tiling it used."""
    t = tiling or _rule_tiling(generation, m, k, n, g, dtype)
    rhs_shape = (g, n, k) if rhs_layout == "nk" else (g, k, n)
    aot.compile_for(generation, lambda x, w, s: pallas_gmm.gmm(x, w, s, rhs_layout=rhs_layout, tiling=t,
                                                                generation=generation),
                    ((m, k), dtype), (rhs_shape, dtype), ((g,), jnp.int32))
    return t


def compile_tgmm(generation, m, k, n, g, *, rhs_layout="nk", dtype=jnp.bfloat16, tiling=None):
    """The weight gradient compiled for ``generation``, at ``tiling`` or its own rule."""
    aot.compile_for(generation, lambda x, dy, s: pallas_gmm.tgmm(
        x, dy, s, num_local_groups=g, rhs_layout=rhs_layout, tiling=tiling, generation=generation),
        ((m, k), dtype), ((m, n), dtype), ((g,), jnp.int32))


def _expert_matmuls(model, tokens):
    m = tokens * model["top_k"]
    return [("gate_up", m, model["hidden"], 2 * model["inter"], model["experts"]),
            ("down", m, model["inter"], model["hidden"], model["experts"])]


FORWARD_CASES = [
    (name, "qwen3", t, *shape) for t in (1, 64, 4096) for name, *shape in _expert_matmuls(QWEN, t)
] + [(name, "gpt-oss", t, *shape) for t in (1, 64) for name, *shape in _expert_matmuls(GPT_OSS, t)
] + [(name, "mixtral", 4096, *shape) for name, *shape in _expert_matmuls(MIXTRAL, 4096)]


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("case", FORWARD_CASES, ids=lambda c: f"{c[1]}-{c[0]}-{c[2]}tok")
def test_forward_compiles(generation, case, record_property):
    if case[:3] == ("down", "mixtral", 4096) and generation == "v5e":
        pytest.skip("v5e takes v6e's tiles for Mixtral's down projection (a 2-minute compile): v6e's stands for both")
    if case[:3] == ("gate_up", "mixtral", 4096) and generation == "v6e":
        pytest.skip("v6e's Mixtral gate_up (a minute's compile) compiles with f32 out (test_forward_f32_out_compiles, "
                    "the same output bytes a tile) and gated (test_gated_up_projection_compiles)")
    _, _, _, m, k, n, g = case
    t = compile_gmm(generation, m, k, n, g, rhs_layout="nk")
    working_set = tiling.forward_working_set_bytes(t, k, 2, 2, 2, generation)
    assert working_set <= tiling.vmem_budget(generation, exact_count=True)
    record_property("tiling", t.as_tuple())
    record_property("vmem_working_set", working_set)


F32_OUT_CASES = [(name, model_name, tokens, *shape)
                 # (Mixtral at 512 tokens chose the same tiles as at 4096 on all three)
                 for model_name, model, tokens in (("mixtral", MIXTRAL, 4096), ("gpt-oss", GPT_OSS, 512))
                 for name, *shape in _expert_matmuls(model, tokens)]


# Mixtral's down projection takes the same tiles on v5e as on v6e (a minute's compile): v6e's stands for both.
@pytest.mark.parametrize("generation,case", [
    (g, c) for g in ("v5e", "v6e", "tpu7x") for c in F32_OUT_CASES if (g, c[1], c[0]) != ("v5e", "mixtral", "down")],
    ids=lambda p: p if isinstance(p, str) else f"{p[1]}-{p[0]}-{p[2]}tok")
def test_forward_f32_out_compiles(generation, case):
    """The forward tiles with the experts program's f32 output: the largest
    working sets of the 15/16-of-the-large-limit forward budget (tpu7x:
    Mixtral (256, 14336, 512) and (256, 4096, 2048), 44 MiB counted of 48;
    v5e / v6e: Mixtral's down projection (512, 14336, 1024), 89 MiB counted
    of 96, whole-K steps holding no accumulator) compile within the limit."""
    _, _, _, m, k, n, g = case
    t = tiling.choose_tiling(m, k, n, g, lhs_itemsize=2, rhs_itemsize=2, out_itemsize=4, generation=generation)
    assert tiling.forward_working_set_bytes(t, k, 2, 2, 4, generation) <= tiling.vmem_budget(generation, exact_count=True)
    aot.compile_for(generation, lambda x, w, s: pallas_gmm.gmm(x, w, s, rhs_layout="nk", tiling=t,
                                                                out_dtype=jnp.float32, generation=generation),
                    ((m, k), jnp.bfloat16), ((g, n, k), jnp.bfloat16), ((g,), jnp.int32))


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize("tokens", [64, 4096])
def test_backward_compiles(generation, tokens):
    for _, m, k, n, g in _expert_matmuls(QWEN, tokens):
        compile_gmm(generation, m, n, k, g, rhs_layout="kn")  # d_lhs = d_out @ W
        compile_tgmm(generation, m, k, n, g, rhs_layout="nk")  # d_W


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("model", [QWEN, MIXTRAL], ids=["qwen3", "mixtral"])
def test_weight_gradient_rule_compiles(generation, model):
    """tgmm at its rule's gradient tiles (the whole [K, N] where the budget
    holds it: the largest working sets of the training shapes), 4096 tokens."""
    for _, m, k, n, g in _expert_matmuls(model, 4096):
        compile_tgmm(generation, m, k, n, g)


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("m", [1, 4, 12])
def test_decode_rows_below_one_tile_with_k_tail(generation, m):
    """bf16 blocks of fewer rows than a native tile, with the K-tail mask."""
    compile_gmm(generation, m, 2880, 1024, 32, tiling=tiling.Tiling(m if m < 8 else 16, 2048, 512))


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_f32_and_unaligned_shapes_compile(generation):
    compile_gmm(generation, 100, 300, 260, 5, dtype=jnp.float32)
    compile_gmm(generation, 100, 300, 260, 5, dtype=jnp.float32, rhs_layout="kn",
                    tiling=tiling.Tiling(16, 128, 128))
    compile_tgmm(generation, 100, 300, 260, 5, dtype=jnp.float32, tiling=tiling.Tiling(16, 128, 128))


def _experts_inputs(tokens, model, dtype=jnp.bfloat16):
    """(shape, dtype) of the program's tensors: Qwen3 "nk" bias-free, gpt-oss "kn" biased."""
    e, h, i, k = model["experts"], model["hidden"], model["inter"], model["top_k"]
    routing = (((tokens, h), dtype), ((tokens, k), jnp.int32), ((tokens, k), dtype))
    if model is GPT_OSS:
        return routing + (((e, h, 2 * i), dtype), ((e, i, h), dtype), ((e, 2 * i), dtype), ((e, h), dtype))
    return routing + (((e, 2 * i, h), dtype), ((e, h, i), dtype))


# "rule": the path the fused-kernel rule picks on that chip; "two-matmuls": forced.
EXPERTS_PROGRAM_CASES = [("qwen3", "rule"), ("qwen3", "two-matmuls"), ("gpt-oss", "rule")]


# The longest program compiles (0.5-1 minute) that another chip's compile or this
# chip's kernel compiles above stand for: gpt-oss on v5e and at 4096 tokens on v4
# (its matmuls compile in test_forward_compiles / test_gated_up_projection_compiles,
# the program on the other chips), the forced two-matmul path of 4096 tokens on v5e / v5p (64
# tokens there, 4096 on v4 / v6e / tpu7x).
EXPERTS_PROGRAM_SKIPPED = {("gpt-oss", "rule", 64, "v5e"), ("gpt-oss", "rule", 4096, "v5e"),
                           ("gpt-oss", "rule", 4096, "v4"), ("qwen3", "two-matmuls", 4096, "v5e"),
                           ("qwen3", "two-matmuls", 4096, "v5p")}


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("tokens", [1, 64, 4096])
@pytest.mark.parametrize("case", EXPERTS_PROGRAM_CASES, ids="-".join)
def test_experts_program_compiles(generation, tokens, case, record_property):
    """The whole TPU experts layer on every generation, each with its own tiles
    and VMEM limit (v4's 16 MiB caught a v6e tiling here)."""
    from moe_experts_tpu.experts import program

    if (*case, tokens, generation) in EXPERTS_PROGRAM_SKIPPED:
        pytest.skip("stood for by another compile (EXPERTS_PROGRAM_SKIPPED)")

    model_name, path = case
    model = QWEN if model_name == "qwen3" else GPT_OSS
    inputs = _experts_inputs(tokens, model)
    spec = aot.abstract_input(generation)
    abstract = [spec(*shape_dtype) for shape_dtype in inputs]
    gate, layout = ("gpt_oss", "kn") if model is GPT_OSS else ("glu_silu", "nk")
    tm = program.fused_kernel_row_tile(tokens * model["top_k"], abstract[3], abstract[4],
                                       *(abstract[5:7] if model is GPT_OSS else (None, None)), gate, layout,
                                       generation)
    # Qwen3-30B-A3B's 9.4 MB expert, double-buffered, fits the fused kernel's
    # VMEM budget on v5e/v5p/v6e/tpu7x (90 / 36 / 90 / 45 MiB) but not v4's
    # 12 MiB; gpt-oss (biased, interleaved) never fuses; v5e runs the two
    # matmuls from 256 rows a group (program.TWO_MATMULS_FROM_ROWS_PER_GROUP).
    assert (tm is not None) == (model is QWEN and generation != "v4" and (generation, tokens) != ("v5e", 4096))
    record_property("fused_row_tile", tm)
    fused = None if path == "rule" else False

    def fn(*a):
        return program.experts_forward(*a, gate=gate, rhs_layout=layout, fused=fused, generation=generation)

    aot.compile_for(generation, fn, *inputs)


GEMMA4 = dict(hidden=2816, inter=704, experts=128, top_k=8)


@pytest.mark.parametrize("generation", ["v5e", "v6e", "tpu7x"])
def test_gemma4_experts_program_compiles(generation):
    """Gemma-4-26B-A4B (I = 704, not a multiple of 128) through the rule at
    4096 tokens: the fused kernel at one MXU-wide pass of rows, whose 11.9 MB
    expert double-buffered (37.8 MiB counted at 256 rows) fits tpu7x's 45 MiB
    forward budget, and the weights fetched a run ahead."""
    from moe_experts_tpu.experts import program

    inputs = _experts_inputs(4096, GEMMA4)
    abstract = [aot.abstract_input(generation)(*shape_dtype) for shape_dtype in inputs]
    tm = program.fused_kernel_row_tile(4096 * GEMMA4["top_k"], abstract[3], abstract[4], None, None,
                                       "glu_gelu_tanh", "nk", generation)
    # v5e runs the two matmuls from 256 rows a group (program.TWO_MATMULS_FROM_ROWS_PER_GROUP).
    assert tm == (None if generation == "v5e" else tpu_generations.get_generation(generation).mxu)

    def fn(*a):
        return program.experts_forward(*a, gate="glu_gelu_tanh", generation=generation)

    aot.compile_for(generation, fn, *inputs)


@pytest.mark.parametrize("tokens", [1, 64, 512, 1024, 4096])
def test_fused_row_tile_rule_on_v6e(tokens):
    from moe_experts_tpu.experts import program

    spec = aot.abstract_input("v6e")
    inputs = [spec(*shape_dtype) for shape_dtype in _experts_inputs(tokens, QWEN)]
    tm = program.fused_kernel_row_tile(tokens * QWEN["top_k"], inputs[3], inputs[4], None, None,
                                       "glu_silu", "nk", "v6e")
    # Qwen3-30B-A3B experts fit whole in v6e VMEM: the rule picks the fused
    # kernel at every token count. Rows: the forward kernels' tile (8 rows at
    # 1 token: one 16-row tile) capped at one MXU-wide pass, 256 rows on v6e,
    # 128 on v5e's 128-wide MXUs.
    assert tm == {1: 16, 64: 256, 512: 256, 1024: 256, 4096: 256}[tokens]
    v5e = [aot.abstract_input("v5e")(*shape_dtype) for shape_dtype in _experts_inputs(tokens, QWEN)]
    # v5e: the two matmuls from 256 rows a group (program.TWO_MATMULS_FROM_ROWS_PER_GROUP), 4096 tokens here.
    assert program.fused_kernel_row_tile(tokens * QWEN["top_k"], v5e[3], v5e[4], None, None, "glu_silu", "nk",
                                         "v5e") == (None if tokens == 4096 else min(tm, 128))


def test_fused_kernel_rule_refuses_gpt_oss_experts():
    from moe_experts_tpu.experts import program

    spec = aot.abstract_input("v6e")
    e, h, i = GPT_OSS["experts"], GPT_OSS["hidden"], GPT_OSS["inter"]
    up, down = spec((e, 2 * i, h), jnp.bfloat16), spec((e, h, i), jnp.bfloat16)
    assert program.fused_kernel_row_tile(256, up, down, None, None, "glu_silu", "nk", "v6e") is None  # 33 MB
    assert program.fused_kernel_row_tile(256, up, down, None, None, "gpt_oss", "nk", "v6e") is None


def test_fused_experts_program_traces_once_per_shape():
    """Routing has static shapes: new routing values reuse the program, decode never recompiles."""
    import jax
    import numpy as np

    from moe_experts_tpu.common import pallas_helpers
    from moe_experts_tpu.experts import program

    traces = []

    def traced(*args):
        traces.append(args[0].shape)
        return program.experts_forward(*args, gate="glu_silu", interpret=pallas_helpers.interpret_params())

    fn = jax.jit(traced)
    rng = np.random.default_rng(0)
    e, h, i = 4, 16, 8
    weights = (jnp.asarray(rng.standard_normal((e, 2 * i, h)), jnp.float32),
               jnp.asarray(rng.standard_normal((e, h, i)), jnp.float32))
    for tokens, seed in ((3, 1), (3, 2), (3, 3), (5, 4)):
        r = np.random.default_rng(seed)
        x = jnp.asarray(r.standard_normal((tokens, h)), jnp.float32)
        idx = jnp.asarray(r.integers(0, e + 1, (tokens, 2)), jnp.int32)  # e = remote sentinel
        w = jnp.asarray(r.random((tokens, 2)), jnp.float32)
        fn(x, idx, w, *weights).block_until_ready()
    assert traces == [(3, h), (5, h)]


def test_device_kinds_name_their_generation_and_vmem_limits_fit_it():
    """A v7x chip (device kind "TPU7x") gets its own facts: v6e's 96 MiB large
    VMEM limit does not compile on its 64 MiB cores. Every generation's limits
    fit its VMEM, and the large limit compiles (a scratch just under it)."""
    kinds = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v6 lite": "v6e",
             "TPU v6e": "v6e", "TPU7x": "tpu7x", "TPU v7": "tpu7x", "TPU v3": "v4",
             "TPU8i": "tpu7x", "a TPU of the future": "tpu7x"}
    assert {kind: tpu_generations.generation_from_device_kind(kind) for kind in kinds} == kinds
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    from ragged_dot_tpu.common import pallas_helpers

    for name, gen in tpu_generations.GENERATIONS.items():
        assert gen.vmem_limit <= gen.large_vmem_limit <= gen.vmem_bytes
        rows = (gen.large_vmem_limit - (2 << 20)) // (4 * 1024)  # a scratch 2 MiB under the limit

        def kernel(x_ref, o_ref, scratch_ref):
            scratch_ref[...] = jnp.zeros_like(scratch_ref) + x_ref[0:1, :]
            o_ref[...] = scratch_ref[:8, :]

        def fn(x):
            return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 1024), jnp.float32),
                                  scratch_shapes=[pltpu.VMEM((rows, 1024), jnp.float32)],
                                  compiler_params=pallas_helpers.compiler_params(name, (), large_vmem=True))(x)

        aot.compile_for(name, fn, ((8, 1024), jnp.float32))


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("model_name", ["mixtral", "gpt-oss"])
def test_gated_up_projection_compiles(generation, model_name):
    """gmm(glu=) at 4096 tokens: Mixtral-8x7B (concatenated "nk" halves,
    whole-K tiles of both halves: the largest working set of its rule) and
    gpt-oss-20b (interleaved "kn" halves with its up bias), within each
    generation's VMEM limit."""
    from moe_experts_tpu.experts.gates import gate_halves, kernel_gate

    model, gate = (MIXTRAL, "glu_silu") if model_name == "mixtral" else (GPT_OSS, "gpt_oss")
    m, k, i, g = 4096 * model["top_k"], model["hidden"], model["inter"], model["experts"]
    glu, halves = kernel_gate(gate, 1.702, 7.0), gate_halves(gate)
    if model is MIXTRAL:
        aot.compile_for(generation, lambda x, w, s: pallas_gmm.gmm(
            x, w, s, rhs_layout="nk", out_dtype=jnp.bfloat16, generation=generation, glu=glu, glu_halves=halves),
            ((m, k), jnp.bfloat16), ((g, 2 * i, k), jnp.bfloat16), ((g,), jnp.int32))
    else:
        aot.compile_for(generation, lambda x, w, b, s: pallas_gmm.gmm(
            x, w, s, rhs_layout="kn", out_dtype=jnp.bfloat16, generation=generation, glu=glu, glu_halves=halves,
            glu_bias=b), ((m, k), jnp.bfloat16), ((g, k, 2 * i), jnp.bfloat16), ((g, 2 * i), jnp.bfloat16),
            ((g,), jnp.int32))


IN_KERNEL_GATES = ["glu_gelu_tanh", "glu_relu", "glu_relu2", "preclamp_glu_silu", "postclamp_glu_silu",
                   "softcap_swiglu", "gpt_oss_concat", "gpt_oss"]


@pytest.mark.parametrize("gate", IN_KERNEL_GATES)
def test_every_in_kernel_gate_compiles(gate):
    """Each gate ``kernel_gate`` puts in a kernel lowers in Mosaic (v6e)."""
    from moe_experts_tpu.experts.gates import gate_halves, kernel_gate

    glu = kernel_gate(gate, 1.702, 7.0)
    assert glu is not None
    aot.compile_for("v6e", lambda x, w, s: pallas_gmm.gmm(x, w, s, rhs_layout="nk", out_dtype=jnp.bfloat16,
                                                           generation="v6e", glu=glu, glu_halves=gate_halves(gate)),
                    ((512, 2048), jnp.bfloat16), ((8, 1536, 2048), jnp.bfloat16), ((8,), jnp.int32))


def test_exact_gelu_gate_stays_out_of_the_kernels():
    """Mosaic has no erf: the exact-GELU GLU runs in XLA between two plain
    grouped matmuls (neither the fused kernel nor the gated one), and compiles."""
    from moe_experts_tpu.experts import gates, program

    assert gates.kernel_gate("glu_gelu", 0.0, 0.0) is None and gates.kernel_gate("glu_silu", 0.0, 0.0)
    inputs = _experts_inputs(64, QWEN)
    spec = aot.abstract_input("v6e")
    abstract = [spec(*shape_dtype) for shape_dtype in inputs]
    assert program.fused_kernel_row_tile(512, abstract[3], abstract[4], None, None, "glu_gelu", "nk", "v6e") is None
    aot.compile_for("v6e", lambda *a: program.experts_forward(*a, gate="glu_gelu", generation="v6e"), *inputs)
