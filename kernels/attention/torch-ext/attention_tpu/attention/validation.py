"""Argument checks of ``attention``: clear errors before any kernel runs."""

from __future__ import annotations

import math

import torch

from ..common import validation

FUNCTION = "attention"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fail(message: str, error: type[Exception] = ValueError):
    validation.fail(FUNCTION, message, error)


def check_attention_args(q, k, v, attention_mask, sinks, *, window, softcap, scale) -> None:
    validation.check_tensors(FUNCTION, query=q, key=k, value=v)
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() != 4:
            _fail(f"{name} must be 4-D [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
        validation.check_dtype(FUNCTION, name, t, SUPPORTED_DTYPES)
    if not (q.dtype == k.dtype == v.dtype):
        _fail(f"query, key and value must have one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    b, hq, sq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        _fail(f"batch sizes differ: query {b}, key {k.shape[0]}, value {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        _fail(f"key and value must share heads and length, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[3] != d:
        _fail(f"key head_dim {k.shape[3]} differs from query head_dim {d}")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv:
        _fail(f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) for grouped-query attention")
    skv = k.shape[2]
    validation.check_one_device(FUNCTION, query=q, key=k, value=v, attention_mask=attention_mask, sinks=sinks)
    if attention_mask is not None:
        validation.check_tensors(FUNCTION, attention_mask=attention_mask)
        shape = tuple(attention_mask.shape)
        if attention_mask.dim() != 4 or shape[0] != b or shape[1] not in (1, hq) or shape[2:] != (sq, skv):
            _fail(f"attention_mask must be [batch={b}, 1 or {hq}, {sq}, {skv}], got {shape}")
    if sinks is not None:
        validation.check_tensors(FUNCTION, sinks=sinks)
        if tuple(sinks.shape) != (hq,):
            _fail(f"sinks (s_aux) must be [query heads={hq}], got {tuple(sinks.shape)}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        _fail(f"window must be a non-negative int (0: none), got {window!r}")
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or not softcap >= 0 or math.isinf(softcap):
        _fail(f"softcap must be a finite number >= 0 (0: none), got {softcap!r}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        _fail(f"scale must be a finite number, got {scale!r}")
