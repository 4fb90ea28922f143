"""Argument-error helpers shared by every kernel's checks.

Errors name the function, the argument and what was expected, and are raised
before any kernel runs (never a crash inside Mosaic or a silent wrong answer).
Checks that need tensor *values* run only where the values are on the host:
on a TPU they would force a device-to-host sync per call.
"""

from __future__ import annotations

import torch


def fail(function: str, message: str, error: type[Exception] = ValueError):
    raise error(f"{function}: {message}")


def check_tensors(function: str, **tensors) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            fail(function, f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)


def check_dtype(function: str, name: str, t: torch.Tensor, allowed) -> None:
    if t.dtype not in allowed:
        fail(function, f"{name} dtype must be one of {tuple(allowed)}, got {t.dtype}")


def check_one_device(function: str, **tensors) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {d}" for name, d in devices.items())
        fail(function, f"{', '.join(devices)} must be on one device, got {listed}")


def check_integer_dtype(function: str, name: str, t: torch.Tensor, allowed=(torch.int32, torch.int64)) -> None:
    if t.dtype not in allowed:
        fail(function, f"{name} must be {' or '.join(str(d).replace('torch.', '') for d in allowed)}, got {t.dtype}")
