"""Routing on the torch side, with static shapes only (no ``unique``, no host sync).

One stable sort of the (token, pick) pairs by expert, rows per expert by a
scatter-add into ``E + 1`` bins (the last bin takes the expert-parallel
sentinel ``E``, a pick of an expert owned by another rank). Picks of a remote
expert sort to the tail, past ``sum(group_sizes)``, where ``ragged_dot``
writes zeros, so they cost no matmul and add nothing.
"""

from __future__ import annotations

import torch


def route(top_k_index: torch.Tensor, num_experts: int):
    """``(sorted_ids, order, group_sizes)``: expert id of each sorted row, the
    flat pick each sorted row came from, and rows per local expert (int32)."""
    expert_ids = top_k_index.reshape(-1).long()  # any integer dtype; long for index ops
    sorted_ids, order = torch.sort(expert_ids, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=expert_ids.device)
    counts.scatter_add_(0, expert_ids.clamp(0, num_experts), torch.ones_like(expert_ids, dtype=torch.int32))
    return sorted_ids, order, counts[:num_experts]


def remote_rows(sorted_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[rows, 1]`` True where a sorted row is a pick of a remote expert."""
    return (sorted_ids >= num_experts).unsqueeze(-1)
