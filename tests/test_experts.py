"""experts_forward inside real (tiny, random) Transformers MoE models."""

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

import moe_experts_tpu
import ragged_dot_tpu
import tiny_experts
from moe_experts_tpu.experts import module_layout

NAME = "ragged_dot_tpu_test"
CALLS = []


def _counted_experts_forward(module, hidden_states, top_k_index, top_k_weights):
    CALLS.append(type(module).__name__)
    return moe_experts_tpu.experts_forward(module, hidden_states, top_k_index, top_k_weights)


ALL_EXPERTS_FUNCTIONS.register(NAME, _counted_experts_forward)

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64)
MODELS = {
    "qwen3_moe": dict(model_type="qwen3_moe", moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[]),
    "mixtral": dict(model_type="mixtral", num_local_experts=6, num_experts_per_tok=2),
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
                    intermediate_size=32, layer_types=["full_attention", "sliding_attention"]),
    "deepseek_v3": dict(model_type="deepseek_v3", n_routed_experts=8, n_shared_experts=1,
                        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=0,
                        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                        v_head_dim=16, head_dim=8, n_group=1, topk_group=1),
    "gemma4_text": dict(model_type="gemma4_text", enable_moe_block=True, num_experts=8, top_k_experts=2,
                        moe_intermediate_size=32, hidden_activation="gelu_pytorch_tanh",
                        layer_types=["full_attention", "sliding_attention"]),
}
FUSED = "ragged_dot_tpu_fused_interpret_test"
ALL_EXPERTS_FUNCTIONS.register(FUSED, moe_experts_tpu.fused_experts_forward_interpret)


def _model(kind, implementation, dtype=torch.float32):
    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**TINY, **MODELS[kind]})
    model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    # Random (non-zero) biases and weights everywhere, so every term counts.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.set_experts_implementation(implementation)
    return model.eval()


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_logits_match_eager(kind):
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    eager = _model(kind, "eager")
    ours = _model(kind, NAME)
    CALLS.clear()
    with torch.no_grad():
        want = eager(ids).logits
        assert not CALLS
        got = ours(ids).logits
    assert len(CALLS) == 2  # one call per MoE layer: our path really ran
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss", "gemma4_text"])
def test_fused_program_in_interpret_mode_matches_eager(kind):
    """The TPU path's single JAX program (routing, Pallas matmuls, gate,
    combine), run by the TPU interpreter inside a whole model."""
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = _model(kind, "eager")(ids).logits
        got = _model(kind, FUSED)(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_greedy_generate_same_tokens(kind):
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=6, do_sample=False)
    want = _model(kind, "eager").generate(ids, **kw)
    got = _model(kind, NAME).generate(ids, **kw)
    assert torch.equal(got, want)


def test_gradients_match_eager():
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    grads = []
    for impl in ("eager", NAME):
        model = _model("qwen3_moe", impl).train()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-5, msg=name)


def test_bf16_logits_close():
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = _model("mixtral", "eager", torch.bfloat16)(ids).logits.float()
        got = _model("mixtral", NAME, torch.bfloat16)(ids).logits.float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])  # gpt-oss: biases on remote rows
def test_expert_parallel_sentinels_add_nothing(kind):
    model = _model(kind, "eager")
    experts = next(m for m in model.modules() if hasattr(m, "has_gate"))
    e = experts.num_experts
    torch.manual_seed(5)
    hidden = torch.randn(6, 64)
    index = torch.randint(0, e, (6, 2))
    weights = torch.rand(6, 2)
    remote = torch.tensor([[True, False], [False, False], [True, True], [False, True], [False, False], [True, False]])
    with_sentinels = moe_experts_tpu.experts_forward(
        experts, hidden, torch.where(remote, e, index), torch.where(remote, 0.0, weights))
    # Reference: same picks, remote ones given zero weight on a real expert.
    local_only = moe_experts_tpu.experts_forward(experts, hidden, torch.where(remote, 0, index),
                                                torch.where(remote, 0.0, weights))
    torch.testing.assert_close(with_sentinels, local_only)
    assert (moe_experts_tpu.experts_forward(experts, hidden[2:3], torch.full((1, 2), e),
                                           torch.zeros(1, 2)) == 0).all()


def test_compiles_fullgraph_static():
    model = _model("qwen3_moe", "eager")
    experts = model.model.layers[0].mlp.experts
    fn = torch.compile(moe_experts_tpu.experts_forward, fullgraph=True, dynamic=False)
    hidden = torch.randn(5, 64)
    index = torch.randint(0, 8, (5, 2))
    weights = torch.rand(5, 2)
    torch.testing.assert_close(fn(experts, hidden, index, weights),
                               moe_experts_tpu.experts_forward(experts, hidden, index, weights))


LAYOUT_MODULES = {
    "has_gate=False (NemotronH, relu2)": "nemotron_h",
    "has_post_expert_norm=True (MuseSpark)": "muse_spark",
}


def _experts_module(kind):
    return tiny_experts.build(kind, seed=7)


@pytest.mark.parametrize("name", sorted(LAYOUT_MODULES))
def test_other_expert_layouts_match_module_eager(name):
    experts = _experts_module(LAYOUT_MODULES[name])
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(7, 32, generator=gen)
    index = torch.randint(0, 6, (7, 2), generator=gen)
    weights = torch.rand(7, 2, generator=gen)
    assert experts.config._experts_implementation in (None, "eager")
    with torch.no_grad():
        want = experts(hidden, index, weights)  # the module's own eager loop
        got = moe_experts_tpu.experts_forward(experts, hidden, index, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_program_refuses_what_it_cannot_express():
    nemotron = tiny_experts.build("nemotron_h", seed=7, mlp_hidden_act="tanh")  # an activation the program lacks
    with pytest.raises(NotImplementedError, match="activation Tanh"):
        module_layout.gate_of_module(nemotron)
    muse = _experts_module("muse_spark")
    with pytest.raises(NotImplementedError, match="post-expert norm"):
        module_layout.program_args(muse)

    class CustomGate(type(_model("qwen3_moe", "eager").model.layers[0].mlp.experts)):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return gate * up

    custom = CustomGate.__new__(CustomGate)
    custom.__dict__.update(_model("qwen3_moe", "eager").model.layers[0].mlp.experts.__dict__)
    with pytest.raises(NotImplementedError, match="overrides _apply_gate"):
        module_layout.gate_of_module(custom)


@pytest.mark.parametrize("case", ["one_expert_only", "single_token", "zero_tokens"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_routing_edge_cases_match_module_eager(case, kind):
    model = _model(kind, "eager")
    experts = next(m for m in model.modules() if hasattr(m, "has_gate"))
    gen = torch.Generator().manual_seed(9)
    tokens = {"one_expert_only": 6, "single_token": 1, "zero_tokens": 0}[case]
    hidden = torch.randn(tokens, 64, generator=gen)
    if case == "one_expert_only":
        index = torch.tensor([[2, 3]] * tokens)  # every token to the same two experts
    else:
        index = torch.stack([torch.randperm(experts.num_experts, generator=gen)[:2] for _ in range(tokens)]) \
            if tokens else torch.zeros(0, 2, dtype=torch.int64)
    weights = torch.rand(tokens, 2, generator=gen)
    with torch.no_grad():
        want = type(experts).forward.__wrapped__(experts, hidden, index, weights)
        got = moe_experts_tpu.experts_forward(experts, hidden, index, weights)
    assert got.shape == (tokens, 64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused_kernel", [True, False])
def test_fused_program_both_matmul_paths_match_eager(fused_kernel):
    """The fused experts kernel and the two-matmul path of the JAX program, interpret mode."""
    import jax.numpy as jnp

    from moe_experts_tpu.common import pallas_helpers
    from moe_experts_tpu.experts import program

    experts = _model("qwen3_moe", "eager").model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(10)
    hidden = torch.randn(9, 64, generator=gen)
    index = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(9)])
    index[0, 1] = 8  # one remote (expert-parallel) pick
    weights = torch.rand(9, 2, generator=gen)
    with torch.no_grad():
        want = type(experts).forward.__wrapped__(experts, hidden, index.clamp(max=7),
                                                 torch.where(index == 8, 0.0, weights))
        got = program.experts_forward(
            *(jnp.asarray(t.detach().numpy()) for t in (hidden, index, weights, experts.gate_up_proj,
                                                        experts.down_proj)),
            gate="glu_silu", fused=fused_kernel, interpret=pallas_helpers.interpret_params())
    torch.testing.assert_close(torch.from_numpy(np.array(got)), want, rtol=1e-5, atol=1e-5)


# The two-matmul path of Qwen3 aligned: test_bf16_program_matches_float64_eager.
@pytest.mark.parametrize("kind,fused_kernel", [("qwen3_moe", True), ("gpt_oss", False)])
def test_group_aligned_rows_match_eager(kind, fused_kernel):
    """The program with each expert's rows aligned to 16 (the prefill layout,
    ``program.AlignedRows``), interpret mode: an empty expert, a remote pick,
    groups of 1 to 16 rows and more; gpt-oss's biases and interleaved gate."""
    import jax.numpy as jnp

    from moe_experts_tpu.common import pallas_helpers
    from moe_experts_tpu.experts import program

    experts = _model(kind, "eager").model.layers[0].mlp.experts
    num_experts, tokens = experts.num_experts, 23
    gen = torch.Generator().manual_seed(12)
    hidden = torch.randn(tokens, 64, generator=gen)
    index = torch.stack([torch.randperm(num_experts - 1, generator=gen)[:2] for _ in range(tokens)])  # last: empty
    index[:12, 0] = 0  # one group of 12+ rows
    index[3, 1] = num_experts  # a remote (expert-parallel) pick
    weights = torch.rand(tokens, 2, generator=gen)
    params = [module_layout.up_weight(experts), experts.down_proj, module_layout.up_bias(experts),
              module_layout.down_bias(experts)]
    gate, alpha, limit = module_layout.gate_of_module(experts)
    with torch.no_grad():
        want = type(experts).forward.__wrapped__(experts, hidden, index.clamp(max=num_experts - 1),
                                                 torch.where(index == num_experts, 0.0, weights))
        got = program.experts_forward(
            *(None if t is None else jnp.asarray(t.detach().numpy()) for t in (hidden, index, weights, *params)),
            gate=gate, alpha=alpha, limit=limit, rhs_layout=module_layout.rhs_layout(experts), fused=fused_kernel,
            group_align=16, interpret=pallas_helpers.interpret_params())
    torch.testing.assert_close(torch.from_numpy(np.array(got)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,fused_kernel,align", [("qwen3_moe", True, 1), ("qwen3_moe", False, 16),
                                                      ("gpt_oss", False, 16)])
def test_bf16_program_matches_float64_eager(kind, fused_kernel, align):
    """A bf16 layer through the program (interpret mode): the kernels write
    bf16 rows, the combine adds the down bias and sums in f32. Against the
    module's eager forward in float64 on the same bf16-rounded weights and
    inputs, within bf16's error (a few roundings of 2**-9)."""
    import copy

    import jax.numpy as jnp

    from moe_experts_tpu.common import pallas_helpers
    from moe_experts_tpu.experts import program

    experts = _model(kind, "eager").model.layers[0].mlp.experts.to(torch.bfloat16)
    reference = copy.deepcopy(experts).double()
    num_experts, tokens = experts.num_experts, 21
    gen = torch.Generator().manual_seed(13)
    hidden = torch.randn(tokens, 64, generator=gen).to(torch.bfloat16)
    index = torch.stack([torch.randperm(num_experts, generator=gen)[:2] for _ in range(tokens)])
    index[5, 0] = num_experts  # a remote pick adds nothing
    weights = torch.rand(tokens, 2, generator=gen).to(torch.bfloat16)
    params = [module_layout.up_weight(experts), experts.down_proj, module_layout.up_bias(experts),
              module_layout.down_bias(experts)]
    gate, alpha, limit = module_layout.gate_of_module(experts)

    def as_jax(t):
        if t is None:
            return None
        return jnp.asarray(t.detach().float().numpy(), dtype=jnp.bfloat16 if t.is_floating_point() else None)

    with torch.no_grad():
        want = type(reference).forward.__wrapped__(reference, hidden.double(), index.clamp(max=num_experts - 1),
                                                   torch.where(index == num_experts, 0.0, weights.double()))
        got = program.experts_forward(
            *(as_jax(t) for t in (hidden, index, weights, *params)), gate=gate, alpha=alpha, limit=limit,
            rhs_layout=module_layout.rhs_layout(experts), fused=fused_kernel, group_align=align,
            interpret=pallas_helpers.interpret_params())
    assert got.dtype == jnp.bfloat16
    got = torch.from_numpy(np.array(got.astype(jnp.float32))).double()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_aligned_rows_layout_against_a_loop():
    """Each group starts at a multiple of the alignment, in order, rows of
    remote experts after the last group; sizes rounded up; every sorted row
    at its own row, inside the static bound."""
    import jax.numpy as jnp

    from moe_experts_tpu.experts import program

    rng = np.random.default_rng(3)
    num_experts, align = 6, 8
    ids = np.sort(rng.choice([0, 0, 1, 3, 3, 3, 5, 6], size=40)).astype(np.int32)  # 2, 4 empty; 6 remote
    sizes = np.bincount(ids, minlength=num_experts + 1)[:num_experts].astype(np.int32)
    layout = program.AlignedRows.of(jnp.asarray(ids), jnp.asarray(sizes), align)
    want, row = [], 0
    for e in range(num_experts + 1):
        for i in range(int((ids == e).sum())):
            want.append(row + i)
        row += -(-int((ids == e).sum()) // align) * align
    np.testing.assert_array_equal(np.array(layout.position), want)
    np.testing.assert_array_equal(np.array(layout.group_sizes), -(-sizes // align) * align)
    assert layout.rows == 40 + num_experts * (align - 1) > max(want)
    spread = np.array(layout.spread(jnp.arange(40, dtype=jnp.int32) + 1))
    np.testing.assert_array_equal(spread[want], np.arange(40) + 1)
    assert (np.delete(spread, want) == 0).all() and spread.shape == (layout.rows,)
    order = rng.permutation(40).astype(np.int32)  # sorted row i came from slot order[i]
    slots = np.array(layout.rows_of_slots(jnp.asarray(order)))
    np.testing.assert_array_equal(slots[order], want)
    plain = program.AlignedRows.of(jnp.asarray(ids), jnp.asarray(sizes), 1)
    assert plain.position is None and plain.rows == 40
    np.testing.assert_array_equal(np.array(plain.rows_of_slots(jnp.asarray(order)))[order], np.arange(40))


@pytest.mark.parametrize("generation,fused,rows_per_group,aligned", [
    ("tpu7x", True, 256, True), ("tpu7x", False, 512, True), ("tpu7x", False, 1024, False),
    ("tpu7x", True, 32, False), ("v6e", False, 512, True), ("v6e", False, 256, False), ("v6e", True, 256, False), ("v5e", True, 256, False),
    ("v4", False, 512, False)])
def test_group_alignment_rule(generation, fused, rows_per_group, aligned):
    from moe_experts_tpu.experts import program

    align = program.group_alignment(rows_per_group * 32, 32, fused, generation)
    assert align == (program.GROUP_ALIGN_ROWS if aligned else 1)


@pytest.mark.parametrize("name", ["eager", "EAGER", "eager ", "grouped_mm", "Batched_MM", "", "has space", 3])
def test_register_refuses_builtin_and_malformed_names(name):
    before = dict(ALL_EXPERTS_FUNCTIONS._global_mapping)
    with pytest.raises(ValueError, match="register: "):
        moe_experts_tpu.register(name)
    assert ALL_EXPERTS_FUNCTIONS._global_mapping == before


def test_register_refuses_a_name_taken_by_another_function_unless_overridden():
    ALL_EXPERTS_FUNCTIONS.register("someone_elses_experts", _counted_experts_forward)
    with pytest.raises(ValueError, match="already registered to another function"):
        moe_experts_tpu.register("someone_elses_experts")
    assert ALL_EXPERTS_FUNCTIONS["someone_elses_experts"] is _counted_experts_forward
    assert moe_experts_tpu.register("someone_elses_experts", override=True) == "someone_elses_experts"
    assert ALL_EXPERTS_FUNCTIONS["someone_elses_experts"] is moe_experts_tpu.experts_forward
    # Ours (any build) may be registered again under its name.
    assert moe_experts_tpu.register("someone_elses_experts") == "someone_elses_experts"
    assert moe_experts_tpu.register() == "moe_experts_tpu"


def test_ragged_dot_tpu_keeps_the_v1_experts_api():
    """get_kernel(".../ragged-dot-tpu", version=1).experts_forward, as users call it today."""
    module = _experts_module("qwen3_moe")
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, module.down_proj.shape[1], generator=gen)
    index = torch.randint(0, module.num_experts, (5, 2), generator=gen)
    weights = torch.rand(5, 2, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(ragged_dot_tpu.experts_forward(module, hidden, index, weights),
                                   module(hidden, index, weights), rtol=1e-5, atol=1e-5)
