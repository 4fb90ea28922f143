"""attention-tpu inside tiny random Transformers decoders: logits on left-padded
batches, greedy generation with dynamic and static caches, and a training step's
gradients, all against `eager`; on the native CPU path and (inference) with the
Pallas kernel in interpret mode. In float16, the logits of every family whose
Transformers tests were run with our attention forced in (issue 24)."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import attention_tpu

NATIVE = attention_tpu.register("attention_tpu_models_test")
INTERPRET = attention_tpu.register("attention_tpu_models_interpret", interpret=True)

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64)
MODELS = {
    "llama": dict(model_type="llama"),
    "qwen3": dict(model_type="qwen3"),  # q/k norms before the call
    "gemma2": dict(model_type="gemma2", attn_logit_softcapping=50.0, sliding_window=4,
                   query_pre_attn_scalar=16),  # softcap, alternating sliding layers
    # Gemma-4: sliding layers at head_dim 16, the global layer at 32 with one KV head and K = V sharing.
    "gemma4": dict(model_type="gemma4_text", sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                   global_head_dim=32, attention_k_eq_v=True, num_global_key_value_heads=1,
                   hidden_size_per_layer_input=16, vocab_size_per_layer_input=128),
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                    sliding_window=4, layer_types=["sliding_attention", "full_attention"]),  # sinks, window
}

# The other families of issue 24, for the float16 test (pad ids inside the tiny vocabulary).
MORE_FAMILIES = {
    "mistral": dict(model_type="mistral", sliding_window=4),
    "qwen2": dict(model_type="qwen2"),
    "gemma": dict(model_type="gemma"),
    "gemma3": dict(model_type="gemma3_text", sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(model_type="phi3", pad_token_id=0),
    "olmo2": dict(model_type="olmo2"),
    "starcoder2": dict(model_type="starcoder2", sliding_window=4),
    "cohere2": dict(model_type="cohere2", sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "granite": dict(model_type="granite"),
    "smollm3": dict(model_type="smollm3", pad_token_id=0),
}
FAMILIES = {**MODELS, **MORE_FAMILIES}


def _model(kind):
    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**TINY, **FAMILIES[kind]})
    model = AutoModelForCausalLM.from_config(config)
    if kind == "gemma4":  # the mixed head dims the test is about
        assert [layer.self_attn.head_dim for layer in model.model.layers] == [16, 32]
    with torch.no_grad():  # larger than the default init: decisive logits, every term counts
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    return model.eval()


def _batch(length=9, pad=3):
    ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :pad] = 0  # left padding
    return ids, mask


@pytest.mark.parametrize("impl", [NATIVE, INTERPRET])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_left_padded_logits_match_eager(kind, impl):
    model = _model(kind)
    ids, mask = _batch()
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation(impl)
        got = model(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()  # padded positions are garbage in every implementation
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_float16_logits_match_eager(kind):
    """A float16 model (a float16 checkpoint) with our attention: float16 logits
    on a left-padded batch, native path and Pallas kernel (interpret), as close
    to eager's float16 logits as twice eager's own float16 error (its distance
    to the float32 model), which sets the scale of float16 rounding here."""
    model = _model(kind)
    ids, mask = _batch()
    valid = mask.bool()  # padded positions are garbage in every implementation
    with torch.no_grad():
        model.set_attn_implementation("eager")
        exact = model(input_ids=ids, attention_mask=mask).logits[valid]
        model.half()
        logits = {}
        for impl in ("eager", NATIVE, INTERPRET):
            model.set_attn_implementation(impl)
            logits[impl] = model(input_ids=ids, attention_mask=mask).logits[valid]
    eager_error = (logits["eager"].float() - exact).abs().max().item()
    for impl in (NATIVE, INTERPRET):
        assert logits[impl].dtype == torch.float16
        torch.testing.assert_close(logits[impl].float(), logits["eager"].float(), rtol=0, atol=2 * eager_error,
                                   msg=lambda m: f"{kind} {impl}: {m}")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_greedy_generate_same_tokens(kind, cache):
    model = _model(kind)
    ids, mask = _batch(length=6, pad=2)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    out = {}
    for impl in ("eager", NATIVE):
        model.set_attn_implementation(impl)
        out[impl] = model.generate(ids, **kw)
    assert torch.equal(out[NATIVE], out["eager"])


@pytest.mark.parametrize("kind", ["llama", "gpt_oss", "gemma4"])
def test_greedy_generate_through_the_pallas_kernel(kind):
    model = _model(kind)
    ids, mask = _batch(length=6, pad=2)
    out = {}
    for impl in ("eager", INTERPRET):
        model.set_attn_implementation(impl)
        out[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(out[INTERPRET], out["eager"])


@pytest.mark.parametrize("kind,impl", [("llama", NATIVE), ("gemma2", NATIVE), ("gpt_oss", NATIVE), ("gemma4", NATIVE),
                                       ("llama", INTERPRET), ("gpt_oss", INTERPRET)])
def test_training_step_gradients_match_eager(kind, impl):
    """One training step's gradients: native path, and the Pallas backward (interpret)."""
    ids, mask = _batch()
    grads = {}
    for impl in ("eager", impl):
        model = _model(kind).train()
        model.set_attn_implementation(impl)
        # Labels predicted from a padded position (the first real token) are left
        # out: padded rows are garbage in every implementation.
        labels = ids.masked_fill(mask == 0, -100)
        labels[1, 3] = -100
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    ours = grads[impl]
    assert ours.keys() == grads["eager"].keys()
    for name, want in grads["eager"].items():
        torch.testing.assert_close(ours[name], want, rtol=1e-4, atol=1e-5, msg=name)


def _packed_batch(length=12):
    """Row 0: two documents packed into one row (position ids restart at 5),
    Transformers builds the block-diagonal causal mask from the position ids;
    row 1: one document with the same positions as a plain row."""
    ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(2))
    positions = torch.stack([torch.cat([torch.arange(5), torch.arange(length - 5)]), torch.arange(length)])
    return ids, positions


@pytest.mark.parametrize("kind", ["llama", "gpt_oss"])
def test_packed_sequences_and_right_padding_through_the_pallas_kernel(kind):
    """Masks the kernel takes as one key range per query: packed documents
    (position ids, no attention mask) and right padding, in the logits of the
    Pallas path (interpret) against eager, and a training step's gradients."""
    model = _model(kind)
    ids, positions = _packed_batch()
    right = torch.ones(2, 12, dtype=torch.long)
    right[1, 8:] = 0  # right padding
    with torch.no_grad():
        for kw, valid in ((dict(position_ids=positions), torch.ones(2, 12, dtype=torch.bool)),
                          (dict(attention_mask=right), right.bool())):
            model.set_attn_implementation("eager")
            want = model(input_ids=ids, **kw).logits
            model.set_attn_implementation(INTERPRET)
            got = model(input_ids=ids, **kw).logits
            torch.testing.assert_close(got[valid], want[valid], rtol=1e-4, atol=1e-4)
    grads = {}
    for impl in ("eager", INTERPRET):
        model = _model(kind).train()
        model.set_attn_implementation(impl)
        model(input_ids=ids, position_ids=positions, labels=ids).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for name, want in grads["eager"].items():
        torch.testing.assert_close(grads[INTERPRET][name], want, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("name", ["eager", "my_flash_attention", "sdpa_like", "has space", ""])
def test_register_refuses_names_transformers_treats_specially(name):
    with pytest.raises(ValueError, match="register: "):
        attention_tpu.register(name)
