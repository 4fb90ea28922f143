"""The gates the TPU experts program can run, as JAX functions.

A gate is named by a string (``module_layout.gate_of_module`` maps a
Transformers experts module to it), with two floats ``alpha`` and ``limit``:

* ``"<act>"``: ungated, ``act(up)``;
* ``"glu_<act>"``: ``act(g) * u`` on the two halves ``g, u`` of gate_up;
* ``"gpt_oss"``: gpt-oss's clamped SwiGLU on interleaved halves,
  ``(clip(u, +-limit) + 1) * g' * sigmoid(alpha * g')`` with ``g' = min(g, limit)``;
* ``"gpt_oss_concat"``: the same on concatenated halves (MiniMax-M3-VL,
  OpenAI privacy filter);
* ``"preclamp_glu_<act>"``: ``act(min(g, limit)) * clip(u, +-limit)``
  (HY-V4, HY-V4-VL, GLM-5-Next, DeepSeek-V4);
* ``"postclamp_glu_<act>"``: ``min(act(g), limit) * clip(u, +-limit)``
  (Step-3.7, Bailing-Hybrid);
* ``"softcap_swiglu"``: ``alpha tanh(g / alpha) * sigmoid(g) * limit tanh(u /
  limit)`` (Inkling-2: ``alpha`` and ``limit`` are the gate and up softcaps).

Only ``"glu_<act>"`` runs in the fused kernel; the others run between the two
grouped matmuls. ``RECOGNISERS`` propose the gate of a module that overrides
``_apply_gate``; ``module_layout.gate_of_module`` takes a proposal only if
``gate_matches_module`` finds it equal to the module's own code on a probe.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
}


def glu_activation(gate: str):
    """The activation of a ``"glu_<act>"`` gate."""
    if not gate.startswith("glu_") or gate[4:] not in ACTIVATIONS:
        raise ValueError(f"gate: expected 'glu_<act>' with <act> in {sorted(ACTIVATIONS)}, got {gate!r}")
    return ACTIVATIONS[gate[4:]]


def _clamped_swiglu(g, u, alpha, limit):
    g = jnp.minimum(g, limit)
    u = jnp.clip(u, -limit, limit)
    return (u + 1.0) * (g * jax.nn.sigmoid(g * alpha))


def _activation_after(prefix: str, gate: str):
    name = gate[len(prefix):]
    if name not in ACTIVATIONS:
        raise ValueError(f"gate: expected '{prefix}<act>' with <act> in {sorted(ACTIVATIONS)}, got {gate!r}")
    return ACTIVATIONS[name]


def gate_halves(gate: str) -> str | None:
    """How a gate's two halves lie in the up projection: "interleaved"
    (gpt-oss: gate at even columns, up at odd), "concatenated" (gate, then
    up), or None (an ungated activation)."""
    if gate in ACTIVATIONS:
        return None
    return "interleaved" if gate == "gpt_oss" else "concatenated"


def pair_gate(gate: str, alpha: float, limit: float):
    """The gate as a function ``(g, u) -> f32`` of its two halves (f32 tiles;
    ``gate_halves`` says where they are), or None for an ungated activation."""
    if gate in ACTIVATIONS:
        return None
    if gate in ("gpt_oss", "gpt_oss_concat"):
        return lambda g, u: _clamped_swiglu(g, u, alpha, limit)
    if gate == "softcap_swiglu":
        return lambda g, u: alpha * jnp.tanh(g / alpha) * jax.nn.sigmoid(g) * (limit * jnp.tanh(u / limit))
    if gate.startswith("glu_"):
        act = glu_activation(gate)
        return lambda g, u: act(g) * u
    if gate.startswith("preclamp_glu_"):
        act = _activation_after("preclamp_glu_", gate)
        return lambda g, u: act(jnp.minimum(g, limit)) * jnp.clip(u, -limit, limit)
    if gate.startswith("postclamp_glu_"):
        act = _activation_after("postclamp_glu_", gate)
        return lambda g, u: jnp.minimum(act(g), limit) * jnp.clip(u, -limit, limit)
    raise ValueError(f"gate: {gate!r} is not a gate of the TPU program (see gates.py)")


def lowers_in_kernel(gate: str) -> bool:
    """Whether Mosaic lowers the gate inside a Pallas kernel: exact GELU's erf
    has no TPU lowering (libtpu AOT: "Unimplemented primitive in Pallas TPU
    lowering for tc: erfc"), so a gate on it runs in XLA between the matmuls."""
    return not gate.endswith("_gelu")


def kernel_gate(gate: str, alpha: float, limit: float):
    """``pair_gate`` for a gate a kernel can apply at its store, else None."""
    return pair_gate(gate, alpha, limit) if lowers_in_kernel(gate) else None


def apply_gate(h, gate: str, alpha: float, limit: float):
    """The gate on the up projection ``h`` (f32 out)."""
    h = h.astype(jnp.float32)
    if gate in ACTIVATIONS:
        return ACTIVATIONS[gate](h)
    halves = (h[:, ::2], h[:, 1::2]) if gate_halves(gate) == "interleaved" else jnp.split(h, 2, axis=-1)
    return pair_gate(gate, alpha, limit)(*halves)


# --- Which gate a module that overrides ``_apply_gate`` computes -------------
# Keyed by the qualname of the override (a subclass that inherits it is the
# same gate); each recogniser reads the module's constants. A recognised gate
# is used only if it equals the module's own ``_apply_gate`` on a probe, so a
# Transformers release that changes a formula under the same name falls back
# (with the warning) instead of computing something else.


def _activation(module) -> str:
    from .module_layout import activation_name

    return activation_name(module)


def _no_limit(limit) -> bool:
    return limit is None or limit == float("inf")


def recognise_beam(module):
    """Beam: ``act(g) * u`` in f32, cast back (the program's gates run in f32)."""
    return "glu_" + _activation(module), 0.0, 0.0


def recognise_step3p7(module):
    """Step-3.7 and Bailing-Hybrid: the limit clamps after the activation; no
    limit (None in 5.25, inf in 5.22) is a plain GLU."""
    if _no_limit(module.limit):
        return "glu_" + _activation(module), 0.0, 0.0
    return "postclamp_glu_" + _activation(module), 0.0, float(module.limit)


def recognise_inkling2(module):
    """Inkling-2 (and its loop variant): softcapped SwiGLU, caps from ``act_fn``."""
    act = module.act_fn
    return "softcap_swiglu", float(act.gate_softcap.softcap), float(act.up_softcap.softcap)


def recognise_minimax_m3_vl(module):
    """MiniMax-M3-VL and the OpenAI privacy filter: gpt-oss's gate on
    concatenated halves."""
    alpha = module.swiglu_alpha if hasattr(module, "swiglu_alpha") else module.alpha
    limit = module.swiglu_limit if hasattr(module, "swiglu_limit") else module.limit
    return "gpt_oss_concat", float(alpha), float(limit)


def recognise_hy_v4(module):
    """HY-V4, HY-V4-VL, GLM-5-Next: clamp, then SiLU (fixed, not ``act_fn``)."""
    return "preclamp_glu_silu", 0.0, float(module.swiglu_limit)


def recognise_deepseek_v4(module):
    """DeepSeek-V4: clamp, then the module's ``act_fn``."""
    return "preclamp_glu_" + _activation(module), 0.0, float(module.limit)


def recognise_gpt_oss(module):
    return "gpt_oss", float(module.alpha), float(module.limit)


RECOGNISERS = {
    "GptOssExperts._apply_gate": recognise_gpt_oss,
    "BeamExperts._apply_gate": recognise_beam,
    "Step3p7Experts._apply_gate": recognise_step3p7,
    "BailingHybridExperts._apply_gate": recognise_step3p7,
    "Inkling2Experts._apply_gate": recognise_inkling2,
    "Inkling2LoopExperts._apply_gate": recognise_inkling2,
    "MiniMaxM3VLExperts._apply_gate": recognise_minimax_m3_vl,
    "OpenAIPrivacyFilterExperts._apply_gate": recognise_minimax_m3_vl,
    "HYV4Experts._apply_gate": recognise_hy_v4,
    "HYV4VLExperts._apply_gate": recognise_hy_v4,
    "Glm5NextTextExperts._apply_gate": recognise_hy_v4,
    "DeepseekV4Experts._apply_gate": recognise_deepseek_v4,
}

_PROBE_CHECKED: dict[tuple, bool] = {}


def gate_matches_module(module, gate: str, alpha: float, limit: float) -> bool:
    """Whether ``apply_gate(h, gate, alpha, limit)`` equals ``module._apply_gate(h)``
    (f32, on the host) on a probe spanning both sides of the limits and caps."""
    key = (type(module), gate, alpha, limit)
    if key not in _PROBE_CHECKED:
        import numpy as np
        import torch

        spread = 3.0 * max(4.0, abs(alpha), 0.0 if _no_limit(limit) else abs(limit))
        probe = np.random.default_rng(0).uniform(-spread, spread, size=(16, 64)).astype(np.float32)
        with torch.no_grad():
            want = module._apply_gate(torch.from_numpy(probe)).float().numpy()
        with jax.default_device(jax.devices("cpu")[0]):
            got = np.asarray(apply_gate(jnp.asarray(probe), gate, alpha, limit))
        _PROBE_CHECKED[key] = want.shape == got.shape and bool(np.allclose(got, want, rtol=1e-5, atol=1e-5))
    return _PROBE_CHECKED[key]
