"""The gates the TPU experts program can run, as JAX functions.

A gate is named by a string (``module_layout.gate_of_module`` maps a
Transformers experts module to it): ``"<act>"`` (ungated: ``act(up)``),
``"glu_<act>"`` (``act(gate) * up`` on the two halves of gate_up) or
``"gpt_oss"`` (gpt-oss's interleaved, clamped SwiGLU with ``alpha`` and
``limit``). Used by the two-matmul program and by the fused kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
}


def glu_activation(gate: str):
    """The activation of a ``"glu_<act>"`` gate."""
    if not gate.startswith("glu_") or gate[4:] not in ACTIVATIONS:
        raise ValueError(f"gate: expected 'glu_<act>' with <act> in {sorted(ACTIVATIONS)}, got {gate!r}")
    return ACTIVATIONS[gate[4:]]


def apply_gate(h, gate: str, alpha: float, limit: float):
    """The gate on the up projection ``h`` (f32 out)."""
    h = h.astype(jnp.float32)
    if gate == "gpt_oss":
        g, u = h[:, ::2], h[:, 1::2]
        g = jnp.minimum(g, limit)
        u = jnp.clip(u, -limit, limit)
        return (u + 1.0) * (g * jax.nn.sigmoid(g * alpha))
    if gate.startswith("glu_"):
        g, u = jnp.split(h, 2, axis=-1)
        return glu_activation(gate)(g) * u
    return ACTIVATIONS[gate](h)
