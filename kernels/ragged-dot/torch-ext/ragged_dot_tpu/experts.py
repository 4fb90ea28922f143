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

from .ops import ragged_dot


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


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
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
    out = torch.where(remote, torch.zeros_like(out), out * weights)
    # Un-sort with a static-shape scatter; summing over top_k per token.
    combined = torch.zeros(num_tokens * top_k, hidden, dtype=out.dtype, device=out.device)
    combined = combined.index_copy(0, order, out)
    return combined.view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)
