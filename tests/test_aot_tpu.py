"""The kernels compile for real TPU generations (libtpu, no TPU attached).

Shapes: Qwen3-30B-A3B experts (H=2048, I=768, E=128, top-8) at 1, 64 and 4096
tokens and gpt-oss-20b (H=2880, I=2880, E=32, top-4) at 64 tokens. The
forward runs gate_up ([E, 2I, H], "nk") and down ([E, H, I]); the backward
d_lhs is the forward with the "kn" reading of the same weights, d_rhs the
transposed grouped matmul.
"""

import jax.numpy as jnp
import pytest

from ragged_dot_tpu import aot, tiling

pytest.importorskip("libtpu")

QWEN = dict(hidden=2048, inter=768, experts=128, top_k=8)
GPT_OSS = dict(hidden=2880, inter=2880, experts=32, top_k=4)
GENERATIONS = ["v4", "v5e", "v5p", "v6e"]


def _expert_matmuls(model, tokens):
    m = tokens * model["top_k"]
    return [("gate_up", m, model["hidden"], 2 * model["inter"], model["experts"]),
            ("down", m, model["inter"], model["hidden"], model["experts"])]


FORWARD_CASES = [
    (name, "qwen3", t, *shape) for t in (1, 64, 4096) for name, *shape in _expert_matmuls(QWEN, t)
] + [(name, "gpt-oss", t, *shape) for t in (1, 64) for name, *shape in _expert_matmuls(GPT_OSS, t)]


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("case", FORWARD_CASES, ids=lambda c: f"{c[1]}-{c[0]}-{c[2]}tok")
def test_forward_compiles(generation, case, record_property):
    _, _, _, m, k, n, g = case
    report = aot.compile_gmm(generation, m, k, n, g, rhs_layout="nk")
    limit = tiling.get_generation(generation).vmem_budget
    assert report.vmem_working_set <= limit
    record_property("tiling", report.tiling.as_tuple())
    record_property("vmem_working_set", report.vmem_working_set)


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize("tokens", [64, 4096])
def test_backward_compiles(generation, tokens):
    for _, m, k, n, g in _expert_matmuls(QWEN, tokens):
        aot.compile_gmm(generation, m, n, k, g, rhs_layout="kn")  # d_lhs = d_out @ W
        aot.compile_tgmm(generation, m, k, n, g, rhs_layout="nk")  # d_W


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("m", [1, 4, 12])
def test_decode_rows_below_one_tile_with_k_tail(generation, m):
    """bf16 blocks of fewer rows than a native tile, with the K-tail mask."""
    aot.compile_gmm(generation, m, 2880, 1024, 32, tiling=tiling.Tiling(m if m < 8 else 16, 2048, 512))


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_f32_and_unaligned_shapes_compile(generation):
    aot.compile_gmm(generation, 100, 300, 260, 5, dtype=jnp.float32)
    aot.compile_gmm(generation, 100, 300, 260, 5, dtype=jnp.float32, rhs_layout="kn",
                    tiling=tiling.Tiling(16, 128, 128))
    aot.compile_tgmm(generation, 100, 300, 260, 5, dtype=jnp.float32, tiling=tiling.Tiling(16, 128, 128))


def _experts_specs(spec, tokens, model=QWEN, dtype=jnp.bfloat16):
    e, h, i, k = model["experts"], model["hidden"], model["inter"], model["top_k"]
    return (spec((tokens, h), dtype), spec((tokens, k), jnp.int32), spec((tokens, k), dtype),
            spec((e, 2 * i, h), dtype), spec((e, h, i), dtype))


@pytest.mark.parametrize("fused_kernel", [True, False], ids=["fused-kernel", "two-matmuls"])
@pytest.mark.parametrize("tokens", [1, 64, 512, 4096])
def test_experts_program_compiles_for_v6e(tokens, fused_kernel):
    import jax

    from ragged_dot_tpu import experts_jax

    spec = aot._spec(aot.tpu_device("v6e"))
    specs = _experts_specs(spec, tokens)
    tm = experts_jax.fused_kernel_row_tile(tokens * QWEN["top_k"], specs[3], specs[4], None, None,
                                           "glu_silu", "nk", "v6e")
    # Qwen3-30B-A3B experts fit whole in v6e VMEM: the rule picks the fused
    # kernel at every token count, with a smaller row tile than the grouped
    # matmul's (256) in prefill so the working set fits.
    assert tm == {1: 16, 64: 16, 512: 32, 4096: 128}[tokens]
    fn = jax.jit(lambda *a: experts_jax.experts_forward(
        *a, gate="glu_silu", fused=fused_kernel, generation="v6e"))
    compiled = fn.lower(*specs).compile()
    assert compiled.memory_analysis() is not None


def test_fused_kernel_rule_refuses_gpt_oss_experts():
    from ragged_dot_tpu import experts_jax

    spec = aot._spec(aot.tpu_device("v6e"))
    e, h, i = GPT_OSS["experts"], GPT_OSS["hidden"], GPT_OSS["inter"]
    up, down = spec((e, 2 * i, h), jnp.bfloat16), spec((e, h, i), jnp.bfloat16)
    assert experts_jax.fused_kernel_row_tile(256, up, down, None, None, "glu_silu", "nk", "v6e") is None  # 33 MB
    assert experts_jax.fused_kernel_row_tile(256, up, down, None, None, "gpt_oss", "nk", "v6e") is None


def test_fused_experts_program_traces_once_per_shape():
    """Routing has static shapes: new routing values reuse the program, decode never recompiles."""
    import jax
    import numpy as np

    from ragged_dot_tpu import experts_jax, jax_bridge

    traces = []

    def program(*args):
        traces.append(args[0].shape)
        return experts_jax.experts_forward(*args, gate="glu_silu", interpret=jax_bridge.interpret_params())

    fn = jax.jit(program)
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
