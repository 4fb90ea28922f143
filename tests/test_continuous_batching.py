"""Transformers' continuous batching (``generate_batch``) with our attention, on
CPU with a tiny random Llama: the same greedy tokens as sdpa through
``register_continuous_batching()`` (native path and the Pallas kernel in
interpret mode), and clear errors for the forms the kernel cannot take."""

import pytest
import torch
from transformers import (AttentionInterface, AutoConfig, AutoModelForCausalLM, ContinuousBatchingConfig,
                          GenerationConfig)

import attention_tpu
from attention_tpu.attention import paged

PROMPTS = [[1, 5, 9, 33, 7], [3, 4], [100, 20, 21, 22, 23, 24, 25, 26, 27]]  # ragged: packed into one row
GENERATION = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1, pad_token_id=0)
# A small cache: sized from free memory by default, gigabytes on a CPU host.
BATCHING = dict(num_blocks=16, block_size=16, max_batch_tokens=64)


@pytest.fixture(scope="module")
def model():
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                                  max_position_embeddings=128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model


@pytest.fixture
def paged_eager_slot():
    """register_continuous_batching() replaces a built-in: put it back after the test."""
    saved = AttentionInterface._global_mapping.get(paged.CONTINUOUS_BATCHING_NAME)
    yield
    AttentionInterface._global_mapping[paged.CONTINUOUS_BATCHING_NAME] = saved


def _greedy(model, implementation):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        out = model.generate_batch(inputs=PROMPTS, generation_config=GENERATION,
                                   continuous_batching_config=ContinuousBatchingConfig(**BATCHING))
    model.set_attn_implementation("sdpa")
    return [out[key].generated_tokens for key in sorted(out)]


def _one_by_one(model):
    """Each prompt alone with the ordinary generate loop: what packing must not change."""
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), generation_config=GENERATION)[0, len(p):].tolist() for p in PROMPTS]


@pytest.mark.parametrize("interpret", [False, True], ids=["native", "interpret"])
def test_generate_batch_same_greedy_tokens_as_sdpa(model, paged_eager_slot, monkeypatch, interpret):
    calls = []
    function = attention_tpu.attention_forward_interpret if interpret else attention_tpu.attention_forward
    from attention_tpu.attention import transformers_api

    def counted(module, query, key, value, attention_mask, **kwargs):
        calls.append((query.shape[2], key.shape[2], attention_mask is not None))
        return function(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(transformers_api, "attention_forward_interpret" if interpret else "attention_forward", counted)
    want = _greedy(model, "sdpa")
    assert want == _one_by_one(model)
    got = _greedy(model, attention_tpu.register_continuous_batching(interpret=interpret))
    assert got == want
    # ours ran, on packed requests (more keys than any one prompt) with the block-diagonal mask
    assert calls and all(has_mask for _, _, has_mask in calls)
    assert max(keys for _, keys, _ in calls) > max(map(len, PROMPTS))


def test_our_own_name_is_refused_by_transformers_naming_what_runs(model):
    name = attention_tpu.register()
    model.set_attn_implementation(name)
    try:
        with pytest.raises(ValueError, match="attention_tpu is not supported for continuous batching. Use "
                                             "'paged\\|eager', 'sdpa' or a flash implementation"):
            model.generate_batch(inputs=PROMPTS[:1], generation_config=GENERATION,
                                   continuous_batching_config=ContinuousBatchingConfig(**BATCHING))
    finally:
        model.set_attn_implementation("sdpa")


def test_block_table_call_is_refused_naming_the_missing_paged_kernel():
    pages = torch.zeros(4, 16, 2, 16)
    with pytest.raises(NotImplementedError, match="block_table=, k_cache=, v_cache=.*needs a paged attention kernel"):
        paged.check_paged_call(None, dict(block_table=torch.zeros(1, 2, dtype=torch.int32), k_cache=pages,
                                          v_cache=pages, cu_seq_lens_q=torch.tensor([0, 1, 2])))


def test_packed_requests_without_a_mask_are_refused():
    with pytest.raises(NotImplementedError, match="2 requests packed in one row .* attention_mask=None"):
        paged.check_paged_call(None, dict(cu_seq_lens_q=torch.tensor([0, 3, 5]), cu_seq_lens_k=torch.tensor([0, 3, 5])))
    # one request, or a mask: nothing to refuse
    paged.check_paged_call(None, dict(cu_seq_lens_q=torch.tensor([0, 4])))
    paged.check_paged_call(torch.zeros(1, 1, 5, 5), dict(cu_seq_lens_q=torch.tensor([0, 3, 5])))
