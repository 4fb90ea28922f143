"""Argument checks of ``ragged_dot``: clear errors before any kernel runs.

Shape, dtype, device and tiling checks run on every call (they work on fake
tensors, so also under ``torch.compile``). Checks that need the *values* of
``group_sizes`` (non-negative, sum <= M) run only where the values are on the
host already (CPU kernels); on a TPU they would force a device-to-host sync
per call, and the kernel clamps its block indices so bad sizes cannot make it
touch memory outside its arrays.
"""

from __future__ import annotations

import torch

from ..common import validation
from . import layouts, tiling as tiling_lib

FUNCTION = "ragged_dot"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def _fail(message: str, error: type[Exception] = ValueError):
    validation.fail(FUNCTION, message, error)


def check_ragged_dot_args(lhs, rhs, group_sizes, rhs_layout: str, group_offset, out_dtype) -> None:
    """Raises ``ValueError`` / ``TypeError`` naming the argument at fault."""
    validation.check_tensors(FUNCTION, lhs=lhs, rhs=rhs, group_sizes=group_sizes)
    if rhs_layout not in layouts.LAYOUTS:
        _fail(f"rhs_layout must be one of {layouts.LAYOUTS}, got {rhs_layout!r}")
    if lhs.dim() != 2:
        _fail(f"lhs must be 2-D [M, K], got shape {tuple(lhs.shape)}")
    if rhs.dim() != 3:
        dims = "[G, N, K]" if rhs_layout == "nk" else "[G, K, N]"
        _fail(f"rhs must be 3-D {dims} (rhs_layout={rhs_layout!r}), got shape {tuple(rhs.shape)}")
    if group_sizes.dim() != 1:
        _fail(f"group_sizes must be 1-D [G], got shape {tuple(group_sizes.shape)}")
    validation.check_integer_dtype(FUNCTION, "group_sizes", group_sizes)
    validation.check_dtype(FUNCTION, "lhs", lhs, SUPPORTED_DTYPES)
    validation.check_dtype(FUNCTION, "rhs", rhs, SUPPORTED_DTYPES)
    if lhs.dtype != rhs.dtype:
        _fail(f"lhs and rhs must have the same dtype, got {lhs.dtype} and {rhs.dtype}")
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        _fail(f"out_dtype must be None or one of {SUPPORTED_DTYPES}, got {out_dtype}")
    validation.check_one_device(FUNCTION, lhs=lhs, rhs=rhs, group_sizes=group_sizes)
    k = lhs.shape[1]
    rhs_k = layouts.in_features(rhs.shape, rhs_layout)
    if rhs_k != k:
        where = "rhs.shape[2]" if rhs_layout == "nk" else "rhs.shape[1]"
        _fail(f"contraction dims differ: lhs.shape[1]={k} but {where}={rhs_k} (rhs_layout={rhs_layout!r})")
    num_groups, num_local = group_sizes.shape[0], rhs.shape[0]
    if group_offset is None:
        if num_local != num_groups:
            _fail(f"group_sizes has {num_groups} groups but rhs has {num_local} (rhs.shape[0]); "
                  "pass group_offset to compute a window of local groups")
    elif isinstance(group_offset, bool) or not isinstance(group_offset, int) or group_offset < 0:
        _fail(f"group_offset must be None or a non-negative int, got {group_offset!r}")
    elif group_offset + num_local > num_groups:
        _fail(f"local groups [{group_offset}, {group_offset + num_local}) (group_offset + "
              f"rhs.shape[0]) do not fit in the {num_groups} groups of group_sizes")
    if num_local == 0:
        _fail("rhs must hold at least one group (rhs.shape[0] == 0)")


def check_tiling(tiling, m: int, k: int, n: int) -> tiling_lib.Tiling | None:
    """``tiling=None`` (the rule) or three positive ints legal as TPU blocks; the
    same check on every path, so a tiling the TPU would refuse fails on CPU too."""
    if tiling is None:
        return None
    values = tiling.as_tuple() if isinstance(tiling, tiling_lib.Tiling) else tiling
    if (not isinstance(values, (tuple, list)) or len(values) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in values)):
        _fail(f"tiling must be None or three ints (tm, tk, tn), got {tiling!r}")
    t = tiling_lib.Tiling(*values)
    try:
        tiling_lib.validate_tiling(t, m, k, n)
    except ValueError as e:
        _fail(str(e))
    return t


def check_group_size_values(group_sizes: torch.Tensor, m: int) -> None:
    """Value checks, in the tensor's own dtype (before any narrowing cast, so
    an int64 size of 2**32 + 3 is not read as 3); host tensors only."""
    if group_sizes.numel() == 0:
        return
    smallest = int(group_sizes.min())
    if smallest < 0:
        _fail(f"group_sizes must be non-negative, got a size of {smallest}")
    largest = int(group_sizes.max())  # first, so that the sum below cannot overflow int64
    total = largest if largest > m else int(group_sizes.sum())
    if total > m:
        _fail(f"sum(group_sizes)={total} exceeds the {m} rows of lhs")
