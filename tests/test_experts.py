"""experts_forward inside real (tiny, random) Transformers MoE models."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

import ragged_dot_tpu

NAME = "ragged_dot_tpu_test"
CALLS = []


def _counted_experts_forward(module, hidden_states, top_k_index, top_k_weights):
    CALLS.append(type(module).__name__)
    return ragged_dot_tpu.experts_forward(module, hidden_states, top_k_index, top_k_weights)


ALL_EXPERTS_FUNCTIONS.register(NAME, _counted_experts_forward)

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64)
MODELS = {
    "qwen3_moe": dict(model_type="qwen3_moe", moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[]),
    "mixtral": dict(model_type="mixtral", num_local_experts=6, num_experts_per_tok=2),
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
                    intermediate_size=32, layer_types=["full_attention", "sliding_attention"]),
}


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


def test_expert_parallel_sentinels_add_nothing():
    model = _model("qwen3_moe", "eager")
    experts = model.model.layers[0].mlp.experts
    torch.manual_seed(5)
    hidden = torch.randn(6, 64)
    index = torch.randint(0, 8, (6, 2))
    weights = torch.rand(6, 2)
    remote = torch.tensor([[True, False], [False, False], [True, True], [False, True], [False, False], [True, False]])
    with_sentinels = ragged_dot_tpu.experts_forward(
        experts, hidden, torch.where(remote, 8, index), torch.where(remote, 0.0, weights))
    # Reference: same picks, remote ones given zero weight on a real expert.
    local_only = ragged_dot_tpu.experts_forward(experts, hidden, torch.where(remote, 0, index),
                                                torch.where(remote, 0.0, weights))
    torch.testing.assert_close(with_sentinels, local_only)
    assert (ragged_dot_tpu.experts_forward(experts, hidden[2:3], torch.full((1, 2), 8),
                                           torch.zeros(1, 2)) == 0).all()


def test_compiles_fullgraph_static():
    model = _model("qwen3_moe", "eager")
    experts = model.model.layers[0].mlp.experts
    fn = torch.compile(ragged_dot_tpu.experts_forward, fullgraph=True, dynamic=False)
    hidden = torch.randn(5, 64)
    index = torch.randint(0, 8, (5, 2))
    weights = torch.rand(5, 2)
    torch.testing.assert_close(fn(experts, hidden, index, weights),
                               ragged_dot_tpu.experts_forward(experts, hidden, index, weights))
