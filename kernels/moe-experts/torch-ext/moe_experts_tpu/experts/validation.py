"""Argument checks of ``experts_forward``: clear errors before any kernel runs."""

from __future__ import annotations

import torch

from ..common import validation

FUNCTION = "experts_forward"
# Every integer dtype reads the same after routing's cast to int64; bool does not.
EXPERT_ID_DTYPES = (torch.int32, torch.int64)


def check_experts_args(hidden_states, top_k_index, top_k_weights, num_experts: int, hidden_size: int,
                       check_values: bool, function: str = FUNCTION) -> None:
    """Shapes and dtypes always (they hold for fake tensors too); the expert
    ids only where their values are on the host (``check_values``). Ids in
    ``[0, num_experts]`` are valid: ``num_experts`` is the expert-parallel
    sentinel of a pick owned by another rank. Errors name ``function``."""
    def _fail(message: str):
        validation.fail(function, message)

    validation.check_tensors(function, hidden_states=hidden_states, top_k_index=top_k_index,
                             top_k_weights=top_k_weights)
    if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden_size:
        _fail(f"hidden_states must be [tokens, {hidden_size}] (the module's hidden size), "
              f"got shape {tuple(hidden_states.shape)}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0]:
        _fail(f"top_k_index must be [tokens={hidden_states.shape[0]}, top_k], got shape {tuple(top_k_index.shape)}")
    if top_k_weights.shape != top_k_index.shape:
        _fail(f"top_k_weights must have the shape of top_k_index {tuple(top_k_index.shape)}, "
              f"got {tuple(top_k_weights.shape)}")
    # One rule on every path: int32 or int64 ids (Transformers' routers give
    # int64). uint8 or int8 would be read as masks or refused by index ops.
    validation.check_integer_dtype(function, "top_k_index", top_k_index, EXPERT_ID_DTYPES)
    if not top_k_weights.dtype.is_floating_point:
        _fail(f"top_k_weights must be floating point, got {top_k_weights.dtype}")
    validation.check_one_device(function, hidden_states=hidden_states, top_k_index=top_k_index,
                                top_k_weights=top_k_weights)
    if check_values and top_k_index.numel():
        low, high = top_k_index.min().item(), top_k_index.max().item()
        if low < 0 or high > num_experts:
            _fail(f"top_k_index holds expert ids in [{low}, {high}]; expected ids in "
                  f"[0, {num_experts - 1}], or {num_experts} for a pick of a remote expert")
