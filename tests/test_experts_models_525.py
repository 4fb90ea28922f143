"""The experts classes Transformers 5.25 added to ``@use_experts_implementation``
and every class that overrides ``_apply_gate``: tiny modules built from each
model's own config class (random weights), our ``experts_forward`` against the
module's eager loop, the TPU program (interpret mode) where it can express the
layer, and for every override either a gate of ``gates.py`` equal to the
module's own ``_apply_gate`` or the fallback warning naming the class."""

import importlib
import os
import pathlib
import re

import numpy as np
import pytest
import torch
from transformers import AutoConfig
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

import moe_experts_tpu
from moe_experts_tpu.experts import forward, gates, module_layout

SEED = int(os.environ.get("TEST_SEED", np.random.SeedSequence().entropy % (2**31)))
HIDDEN, INTER, EXPERTS = 32, 24, 6
SMALL = dict(hidden_size=HIDDEN, moe_intermediate_size=INTER, intermediate_size=INTER, expert_ffn_hidden_size=INTER,
             num_experts=EXPERTS, num_local_experts=EXPERTS, n_routed_experts=EXPERTS, num_hidden_layers=2)

# name -> (module, class, model_type of its config, config overrides, extra constructor args).
# Limits and softcaps are small next to the gate_up outputs (~1 at these sizes)
# so that every clamp and cap bites.
NEW_IN_525 = {
    "dots3_note": ("dots3_note", "Dots3NoteExperts", "dots3_note_text", {}, ()),
    "ergo": ("ergo", "ErgoExperts", "ergo", {}, ()),  # relu2, no gate, transposed; norm after our call
    "hy_v4_vl": ("hy_v4_vl", "HYV4VLExperts", "hy_v4_vl_text", dict(swiglu_limit=0.6), ()),
    "inkling2": ("inkling2", "Inkling2Experts", "inkling2_text", dict(mlp_gate_softcap=0.7, mlp_up_softcap=0.9), ()),
    "inkling2_loop": ("inkling2_loop", "Inkling2LoopExperts", "inkling2_loop_text",
                      dict(mlp_gate_softcap=0.8, mlp_up_softcap=0.6), ()),
    "kolibri1_1": ("kolibri1_1", "Kolibri1_1Experts", "kolibri1_1", {}, ()),
    "lara_mini": ("lara_mini", "LaraMiniExperts", "lara_mini", dict(hidden_act="gelu"), ()),
    "longcat_flash": ("longcat_flash", "LongcatFlashExperts", "longcat_flash", {}, ()),
    "minicpm5_moe": ("minicpm5_moe", "MiniCPM5MoeExperts", "minicpm5_moe", {}, ()),
    "step3p7": ("step3p7", "Step3p7Experts", "step3p5", dict(swiglu_limits=[0.5, 0.0]), (0,)),
}
OTHER_OVERRIDES = {
    "step3p7_no_limit": ("step3p7", "Step3p7Experts", "step3p5", dict(swiglu_limits=[0.5, 0.0]), (1,)),
    "beam": ("beam", "BeamExperts", "beam", dict(hidden_act="gelu_pytorch_tanh"), ()),
    "bailing_hybrid": ("bailing_hybrid", "BailingHybridExperts", "bailing_hybrid", dict(swiglu_limits=[0.4, 0.0]),
                       (0,)),
    "minimax_m3_vl": ("minimax_m3_vl", "MiniMaxM3VLExperts", "minimax_m3_vl_text",
                      dict(swiglu_limit=0.7, swiglu_alpha=1.3), ()),
    "openai_privacy_filter": ("openai_privacy_filter", "OpenAIPrivacyFilterExperts", "openai_privacy_filter",
                              dict(swiglu_limit=0.5, swiglu_alpha=1.702), ()),
    "deepseek_v4": ("deepseek_v4", "DeepseekV4Experts", "deepseek_v4", dict(swiglu_limit=0.6, hidden_act="gelu"), ()),
    "hy_v4": ("hy_v4", "HYV4Experts", "hy_v4", dict(swiglu_limit=0.6), ()),
    "glm5_next": ("glm5_next", "Glm5NextTextExperts", "glm5_next_text", dict(swiglu_limit=0.6), ()),
    "gpt_oss": ("gpt_oss", "GptOssExperts", "gpt_oss", dict(swiglu_limit=0.8), ()),
}
ALL = {**NEW_IN_525, **OTHER_OVERRIDES}
# The gate each override is run with by the TPU program (None: falls back, with the warning).
EXPECTED_GATES = {
    "hy_v4_vl": "preclamp_glu_silu", "inkling2": "softcap_swiglu", "inkling2_loop": "softcap_swiglu",
    "step3p7": "postclamp_glu_silu", "step3p7_no_limit": "glu_silu", "beam": "glu_gelu_tanh",
    "bailing_hybrid": "postclamp_glu_silu", "minimax_m3_vl": "gpt_oss_concat",
    "openai_privacy_filter": "gpt_oss_concat", "deepseek_v4": "preclamp_glu_gelu", "hy_v4": "preclamp_glu_silu",
    "glm5_next": "preclamp_glu_silu", "gpt_oss": "gpt_oss",
}

OURS = "tpu_hub_experts_models_525"
ALL_EXPERTS_FUNCTIONS.register(OURS, moe_experts_tpu.experts_forward)
INTERPRET = "tpu_hub_experts_models_525_interpret"  # the TPU program, Pallas in interpret mode
ALL_EXPERTS_FUNCTIONS.register(INTERPRET, moe_experts_tpu.fused_experts_forward_interpret)


def build(name, dtype=torch.float32):
    module_name, cls_name, model_type, overrides, args = ALL[name]
    cls = getattr(importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}"), cls_name)
    config = AutoConfig.for_model(model_type, **{**SMALL, **overrides})
    torch.manual_seed(SEED)
    module = cls(config, *args)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
    return module.to(dtype).eval()


def routing(num_tokens, gen, top_k=2):
    index = torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(num_tokens)])
    return index, torch.rand(num_tokens, top_k, generator=gen)


def run(module, implementation, hidden, index, weights):
    """The module's own (decorated) forward with ``implementation`` picked, as in a model."""
    module.config._experts_implementation = implementation
    with torch.no_grad():
        return module(hidden, index, weights)


def test_every_apply_gate_override_of_transformers_is_listed():
    """A release that adds an override fails here until it is recognised or
    listed as a fallback."""
    import transformers

    models = pathlib.Path(transformers.__file__).parent / "models"
    overriding = set()
    for path in models.glob("*/modeling_*.py"):
        source = path.read_text(errors="replace")
        for match in re.finditer(r"^class (\w+)\(.*?(?=^class |\Z)", source, flags=re.S | re.M):
            if "def _apply_gate" in match.group(0):
                overriding.add(match.group(1))
    assert overriding == {ALL[name][1] for name in EXPECTED_GATES}, sorted(overriding)
    assert set(gates.RECOGNISERS) == {f"{cls}._apply_gate" for cls in overriding}


@pytest.mark.parametrize("name", sorted(ALL))
def test_our_experts_forward_matches_module_eager(name):
    module = build(name)
    gen = torch.Generator().manual_seed(SEED + 1)
    hidden = torch.randn(13, HIDDEN, generator=gen)
    index, weights = routing(13, gen)
    want = run(module, "eager", hidden, index, weights)
    got = run(module, OURS, hidden, index, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"seed={SEED}")


@pytest.mark.parametrize("name", sorted(ALL))
def test_tpu_program_in_interpret_mode_matches_module_eager(name):
    module = build(name)
    gen = torch.Generator().manual_seed(SEED + 2)
    hidden = torch.randn(9, HIDDEN, generator=gen)
    index, weights = routing(9, gen)
    index[0, 1] = EXPERTS  # one remote (expert-parallel) pick: adds nothing
    want = run(module, "eager", hidden, index.clamp(max=EXPERTS - 1), torch.where(index == EXPERTS, 0.0, weights))
    got = run(module, INTERPRET, hidden, index, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"seed={SEED}")


@pytest.mark.parametrize("name", sorted(EXPECTED_GATES))
def test_each_override_gets_a_gate_equal_to_its_own_apply_gate(name):
    import jax.numpy as jnp

    module = build(name)
    named = module_layout.gate_of_module(module)
    assert named[0] == EXPECTED_GATES[name], named
    # fresh values spanning both sides of the limits and caps, not the probe's
    h = torch.randn(40, 2 * INTER, generator=torch.Generator().manual_seed(SEED + 3)) * 2.5
    with torch.no_grad():
        want = module._apply_gate(h)
    got = torch.from_numpy(np.array(gates.apply_gate(jnp.asarray(h.numpy()), *named)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_override_within_bf16_tolerance():
    """The program runs the gate in f32 on the f32 matmul output; the module
    rounds to bf16 in between: equal within bf16 tolerance."""
    module = build("glm5_next", torch.bfloat16)
    gen = torch.Generator().manual_seed(SEED + 4)
    hidden = torch.randn(9, HIDDEN, generator=gen).bfloat16()
    index, weights = routing(9, gen)
    want = run(module, "eager", hidden, index, weights.bfloat16())
    got = run(module, INTERPRET, hidden, index, weights.bfloat16())
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)


def test_a_formula_changed_under_a_known_name_falls_back_with_the_warning():
    """The probe catches a release that changes a recognised class's gate (here:
    HY-V4's without the clamp of ``up``)."""
    module = build("hy_v4")

    def changed_apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate.clamp(max=self.swiglu_limit)) * up

    changed_apply_gate.__qualname__ = "HYV4Experts._apply_gate"
    module.__class__ = type("HYV4Experts", (type(module),), {"_apply_gate": changed_apply_gate})
    with pytest.raises(NotImplementedError, match="computes none of the program's gates"):
        module_layout.gate_of_module(module)
    forward._WARNED_FALLBACK.clear()
    with pytest.warns(UserWarning, match=r"HYV4Experts overrides _apply_gate \(HYV4Experts._apply_gate\)"):
        assert forward.choose_path(module, "tpu", grad=False, compiling=False) == ("composed", None)


def test_an_unsupported_activation_in_a_recognised_override_falls_back_with_the_warning():
    module = build("deepseek_v4")
    module.act_fn = torch.nn.Tanh()
    forward._WARNED_FALLBACK.clear()
    with pytest.warns(UserWarning, match="DeepseekV4Experts overrides _apply_gate"):
        assert forward.choose_path(module, "tpu", grad=False, compiling=False) == ("composed", None)
