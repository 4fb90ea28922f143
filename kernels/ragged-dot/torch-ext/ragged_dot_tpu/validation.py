"""Argument checks for ``ragged_dot``: clear errors before any kernel runs.

Shape, dtype and device checks run on every call (they work on fake tensors,
so also under ``torch.compile``). Checks that need the *values* of
``group_sizes`` (non-negative, sum <= M) run only where the values are on the
host already (CPU kernels); on a TPU they would force a device-to-host sync
per call, and the kernel clamps its block indices so bad sizes cannot make it
touch memory outside its arrays.
"""

from __future__ import annotations

import torch

from . import layouts
from .layouts import LAYOUTS

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def _fail(message: str, function: str = "ragged_dot"):
    raise ValueError(f"{function}: {message}")


def check_ragged_dot_args(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    group_sizes: torch.Tensor,
    rhs_layout: str,
    group_offset: int | None,
    out_dtype: torch.dtype | None,
) -> tuple[int, int, int]:
    """Returns ``(M, K, N)`` or raises ``ValueError`` / ``TypeError``."""
    for name, t in (("lhs", lhs), ("rhs", rhs), ("group_sizes", group_sizes)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ragged_dot: {name} must be a torch.Tensor, got {type(t).__name__}")
    if rhs_layout not in LAYOUTS:
        _fail(f"rhs_layout must be one of {LAYOUTS}, got {rhs_layout!r}")
    if lhs.dim() != 2:
        _fail(f"lhs must be 2-D [M, K], got shape {tuple(lhs.shape)}")
    if rhs.dim() != 3:
        dims = "[G, N, K]" if rhs_layout == "nk" else "[G, K, N]"
        _fail(f"rhs must be 3-D {dims} (rhs_layout={rhs_layout!r}), got shape {tuple(rhs.shape)}")
    if group_sizes.dim() != 1:
        _fail(f"group_sizes must be 1-D [G], got shape {tuple(group_sizes.shape)}")
    if group_sizes.dtype not in (torch.int32, torch.int64):
        _fail(f"group_sizes must be int32 or int64, got {group_sizes.dtype}")
    for name, t in (("lhs", lhs), ("rhs", rhs)):
        if t.dtype not in SUPPORTED_DTYPES:
            _fail(f"{name} dtype must be one of {SUPPORTED_DTYPES}, got {t.dtype}")
    if lhs.dtype != rhs.dtype:
        _fail(f"lhs and rhs must have the same dtype, got {lhs.dtype} and {rhs.dtype}")
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        _fail(f"out_dtype must be None or one of {SUPPORTED_DTYPES}, got {out_dtype}")
    if lhs.device != rhs.device or lhs.device != group_sizes.device:
        _fail(
            "lhs, rhs and group_sizes must be on one device, got "
            f"{lhs.device}, {rhs.device} and {group_sizes.device}"
        )
    m, k = lhs.shape
    rhs_k = layouts.in_features(rhs.shape, rhs_layout)
    n = layouts.out_features(rhs.shape, rhs_layout)
    if rhs_k != k:
        where = "rhs.shape[2]" if rhs_layout == "nk" else "rhs.shape[1]"
        _fail(f"contraction dims differ: lhs.shape[1]={k} but {where}={rhs_k} (rhs_layout={rhs_layout!r})")
    num_groups, num_local = group_sizes.shape[0], rhs.shape[0]
    if group_offset is None:
        if num_local != num_groups:
            _fail(
                f"group_sizes has {num_groups} groups but rhs has {num_local} (rhs.shape[0]); "
                "pass group_offset to compute a window of local groups"
            )
    elif isinstance(group_offset, bool) or not isinstance(group_offset, int) or group_offset < 0:
        _fail(f"group_offset must be None or a non-negative int, got {group_offset!r}")
    elif group_offset + num_local > num_groups:
        _fail(
            f"local groups [{group_offset}, {group_offset + num_local}) (group_offset + "
            f"rhs.shape[0]) do not fit in the {num_groups} groups of group_sizes"
        )
    if num_local == 0:
        _fail("rhs must hold at least one group (rhs.shape[0] == 0)")
    return m, k, n


def check_group_size_values(group_sizes: torch.Tensor, m: int) -> None:
    """Value checks; call only where ``group_sizes`` lives on the host."""
    if group_sizes.numel() == 0:
        return
    smallest = int(group_sizes.min())
    if smallest < 0:
        _fail(f"group_sizes must be non-negative, got a size of {smallest}")
    total = int(group_sizes.sum())
    if total > m:
        _fail(f"sum(group_sizes)={total} exceeds the {m} rows of lhs")


# ----------------------------------------------------------------------------
# experts_forward
# ----------------------------------------------------------------------------


def _fail_experts(message: str):
    _fail(message, "experts_forward")


def check_experts_args(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    hidden_size: int,
    check_values: bool,
) -> None:
    """Shapes and dtypes always (they hold for fake tensors too); the expert
    ids only where their values are on the host (``check_values``), as for
    ``group_sizes`` above. Ids in ``[0, num_experts]`` are valid: ``num_experts``
    is the expert-parallel sentinel of a pick owned by another rank."""
    if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden_size:
        _fail_experts(f"hidden_states must be [tokens, {hidden_size}] (the module's hidden size), "
                      f"got shape {tuple(hidden_states.shape)}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0]:
        _fail_experts(f"top_k_index must be [tokens={hidden_states.shape[0]}, top_k], "
                      f"got shape {tuple(top_k_index.shape)}")
    if top_k_weights.shape != top_k_index.shape:
        _fail_experts(f"top_k_weights must have the shape of top_k_index {tuple(top_k_index.shape)}, "
                      f"got {tuple(top_k_weights.shape)}")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype.is_complex or top_k_index.dtype == torch.bool:
        _fail_experts(f"top_k_index must hold integer expert ids, got {top_k_index.dtype}")
    if not top_k_weights.dtype.is_floating_point:
        _fail_experts(f"top_k_weights must be floating point, got {top_k_weights.dtype}")
    devices = {hidden_states.device, top_k_index.device, top_k_weights.device}
    if len(devices) != 1:
        _fail_experts(f"hidden_states, top_k_index and top_k_weights must be on one device, got {devices}")
    if check_values and top_k_index.numel():
        low, high = top_k_index.min().item(), top_k_index.max().item()
        if low < 0 or high > num_experts:
            _fail_experts(f"top_k_index holds expert ids in [{low}, {high}]; expected ids in "
                          f"[0, {num_experts - 1}], or {num_experts} for a pick of a remote expert")
