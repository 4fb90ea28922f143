"""Transformers experts implementation on top of ``ragged_dot``.

``experts_forward(module, hidden_states [T, H], top_k_index [T, K],
top_k_weights [T, K])`` follows the contract of Transformers'
``@use_experts_implementation`` and reads the layout from the module's flags:
``is_transposed`` picks the weight layout ("kn" for ``[E, in, out]``, else
"nk"), ``has_gate`` chooses between ``gate_up_proj`` + the module's own
``_apply_gate`` (so gpt-oss's clamped, interleaved SwiGLU is the model's
code, not a copy) and ``up_proj`` + ``act_fn``; ``has_bias`` adds the
per-expert biases and ``has_post_expert_norm`` applies the module's norm.

Routing has static shapes only (no ``unique``, no host sync): one stable
sort by expert, group sizes by a scatter-add into ``E + 1`` bins (the last
bin takes the expert-parallel sentinel ``E``), one gather back. Picks of a
remote expert sort to the tail, past ``sum(group_sizes)``, where
``ragged_dot`` writes zeros, so they cost no matmul and add nothing.
"""

from __future__ import annotations

import torch

from . import jax_bridge
from .ops import _needs_grad, ragged_dot, register_tpu_ops

_GELU_TANH = {"GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "GELUPytorchTanh"}
_ACTIVATION_NAMES = {
    "SiLU": "silu", "SiLUActivation": "silu", "ReLU": "relu", "GELUActivation": "gelu",
    **{name: "gelu_tanh" for name in _GELU_TANH},
}


def gate_of_module(module) -> tuple[str, float, float]:
    """Names the module's gate for the fused JAX program: ``(gate, alpha, limit)``.

    Raises NotImplementedError for a gate or activation the program cannot
    express, rather than computing something else.
    """
    apply_gate = type(module)._apply_gate
    if type(module).__name__ == "GptOssExperts" or apply_gate.__qualname__ == "GptOssExperts._apply_gate":
        return "gpt_oss", float(module.alpha), float(module.limit)
    act = getattr(module, "act_fn", None)
    act_name = type(act).__name__
    if isinstance(act, torch.nn.GELU):
        act_name = "GELUTanh" if act.approximate == "tanh" else "GELUActivation"
    if act_name not in _ACTIVATION_NAMES:
        raise NotImplementedError(
            f"experts_forward (fused TPU program): activation {act_name} of "
            f"{type(module).__name__} is not supported; supported: {sorted(_ACTIVATION_NAMES)}"
        )
    if not getattr(module, "has_gate", True):
        return _ACTIVATION_NAMES[act_name], 0.0, 0.0
    if apply_gate.__qualname__ != "_default_apply_gate":
        raise NotImplementedError(
            f"experts_forward (fused TPU program): {type(module).__name__} overrides "
            f"_apply_gate ({apply_gate.__qualname__}), which has no fused equivalent"
        )
    return "glu_" + _ACTIVATION_NAMES[act_name], 0.0, 0.0


def route(top_k_index: torch.Tensor, num_experts: int):
    """Sorted order of the (token, expert) picks and rows per expert."""
    expert_ids = top_k_index.reshape(-1)
    sorted_ids, order = torch.sort(expert_ids, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=expert_ids.device)
    counts.scatter_add_(0, expert_ids.clamp(0, num_experts).long(),
                        torch.ones_like(expert_ids, dtype=torch.int32))
    return sorted_ids, order, counts[:num_experts]


def _projection(x, weight, bias, sorted_ids, group_sizes, layout, num_experts):
    out = ragged_dot(x.to(weight.dtype), weight, group_sizes, rhs_layout=layout)
    if bias is not None:
        # Clamped ids keep the gather in bounds; sentinel rows are masked below.
        out = out + bias[sorted_ids.clamp(max=num_experts - 1)].to(out.dtype)
    return out


def _fused_args(self):
    if getattr(self, "has_post_expert_norm", False):
        raise NotImplementedError(
            f"experts_forward (fused TPU program): post-expert norm of {type(self).__name__}"
        )
    gate, alpha, limit = gate_of_module(self)
    has_gate, has_bias = getattr(self, "has_gate", True), getattr(self, "has_bias", False)
    up = self.gate_up_proj if has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if has_gate else self.up_proj_bias) if has_bias else None
    down_bias = self.down_proj_bias if has_bias else None
    layout = "kn" if getattr(self, "is_transposed", False) else "nk"
    return up, self.down_proj, up_bias, down_bias, gate, alpha, limit, layout


def fused_experts_forward_interpret(self, hidden_states, top_k_index, top_k_weights):
    """The fused JAX program of the TPU path, run on CPU in interpret mode (tests)."""
    up, down, up_bias, down_bias, gate, alpha, limit, layout = _fused_args(self)
    from . import experts_jax

    def j(t):
        return None if t is None else jax_bridge.to_jax(t)

    out = experts_jax.experts_forward(
        j(hidden_states), j(top_k_index), j(top_k_weights.to(hidden_states.dtype)), j(up), j(down),
        j(up_bias), j(down_bias), gate=gate, alpha=alpha, limit=limit, rhs_layout=layout,
        interpret=jax_bridge.interpret_params(),
    )
    return jax_bridge.to_torch(out)


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Transformers experts function. On TPU at inference: one fused jax_op;
    otherwise (CPU, or training) grouped matmul ops with autograd."""
    if hidden_states.device.type == "tpu":
        args = _fused_args(self)
        if not _needs_grad(hidden_states, top_k_weights, *(t for t in args[:4] if t is not None)):
            up, down, up_bias, down_bias, gate, alpha, limit, layout = args
            op = register_tpu_ops()["experts"]
            return op(hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype), up, down,
                      up_bias, down_bias, gate, alpha, limit, layout)
    return composed_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def composed_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    num_experts = self.num_experts
    layout = "kn" if getattr(self, "is_transposed", False) else "nk"
    has_bias = getattr(self, "has_bias", False)

    sorted_ids, order, group_sizes = route(top_k_index, num_experts)
    x = hidden_states[order // top_k]
    remote = (sorted_ids >= num_experts).unsqueeze(-1)

    if getattr(self, "has_gate", True):
        up = _projection(x, self.gate_up_proj, self.gate_up_proj_bias if has_bias else None,
                         sorted_ids, group_sizes, layout, num_experts)
        act = self._apply_gate(up)
    else:
        up = _projection(x, self.up_proj, self.up_proj_bias if has_bias else None,
                         sorted_ids, group_sizes, layout, num_experts)
        act = self.act_fn(up)
    out = _projection(act, self.down_proj, self.down_proj_bias if has_bias else None,
                      sorted_ids, group_sizes, layout, num_experts)
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    weights = top_k_weights.reshape(-1)[order].to(out.dtype).unsqueeze(-1)
    out = out * weights
    if has_bias or getattr(self, "has_post_expert_norm", False):
        # Remote picks: ragged_dot left their rows zero, but a bias or norm
        # may have made them non-zero again.
        out = torch.where(remote, torch.zeros_like(out), out)
    # Un-sort with a static-shape scatter; summing over top_k per token.
    combined = torch.zeros(num_tokens * top_k, hidden, dtype=out.dtype, device=out.device)
    combined = combined.index_copy(0, order, out)
    return combined.view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)
