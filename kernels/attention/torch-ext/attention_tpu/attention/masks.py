"""Which keys each query sees, on the torch side.

The kernels take the mask as a rule, not as a dense tensor: per batch row a
range of valid keys ``[kv_start, kv_end)`` (left padding, the filled part of
a static cache), queries aligned to the end of that range (query ``i`` at
position ``kv_end - Sq + i``), and ``causal`` / ``window`` on positions. A
dense boolean mask from Transformers (``[B, 1, Sq, Skv]``, True = attend) is
turned into ranges once per call; ``check_expressible`` refuses a mask the
rule cannot reproduce (packed sequences, arbitrary patterns) rather than
computing something else (on the host), and on a TPU, where refusing would
need a host sync, ``poison_where_not_expressible`` turns those batch rows to NaN.
"""

from __future__ import annotations

import torch

FUNCTION = "attention"


def rule_mask(kv_start: torch.Tensor, kv_end: torch.Tensor, sq: int, skv: int, *, causal: bool,
              window: int) -> torch.Tensor:
    """The rule as a dense ``[B, 1, Sq, Skv]`` boolean mask (True = attend)."""
    keys = torch.arange(skv, device=kv_start.device)
    pos = (kv_end.view(-1, 1) - sq + torch.arange(sq, device=kv_start.device)).view(-1, 1, sq, 1)
    visible = (keys >= kv_start.view(-1, 1, 1, 1)) & (keys < kv_end.view(-1, 1, 1, 1))
    if causal:
        visible = visible & (keys <= pos)
    if window:
        visible = visible & (keys > pos - window)
    return visible.expand(kv_start.shape[0], 1, sq, skv)


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """A boolean mask (True = attend) from a boolean or an additive float mask."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.dtype.is_floating_point:
        raise ValueError(f"{FUNCTION}: attention_mask must be bool or floating point, got {mask.dtype}")
    return mask > torch.finfo(mask.dtype).min / 2


def key_ranges(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kv_start, kv_end)`` int32 ``[B]``: the first and one past the last key any
    query of the batch row attends to (``0, 0`` for a row that attends to none)."""
    seen = mask.any(dim=-2).any(dim=1)  # [B, Skv]
    skv = seen.shape[-1]
    keys = torch.arange(skv, device=mask.device)
    start = torch.where(seen, keys, skv).amin(dim=-1)
    end = torch.where(seen, keys + 1, 0).amax(dim=-1)
    start = torch.where(end > 0, start, 0)
    return start.to(torch.int32), end.to(torch.int32)


def check_expressible(mask: torch.Tensor, kv_start, kv_end, *, causal: bool, window: int) -> None:
    """ValueError unless the rule with these ranges reproduces ``mask`` exactly
    (host tensors only: on a TPU this check would cost a device-to-host sync)."""
    b, heads, sq, skv = mask.shape
    want = rule_mask(kv_start, kv_end, sq, skv, causal=causal, window=window)
    if not torch.equal(mask, want.expand(b, heads, sq, skv)):
        bad = (mask != want).nonzero()[0].tolist()
        raise ValueError(
            f"{FUNCTION}: attention_mask is not expressible by the Pallas kernel's rule (a key range per batch "
            f"row, queries aligned to its end, causal={causal}, window={window}); first differing entry "
            f"[batch, head, query, key] = {bad}. Packed sequences and arbitrary masks run on the native CPU "
            "path (impl='native')."
        )


def poison_where_not_expressible(out: torch.Tensor, mask: torch.Tensor, kv_start, kv_end, *, causal: bool,
                                 window: int) -> torch.Tensor:
    """The device-side guard of the TPU path, where ``check_expressible`` would
    cost a host sync per call: batch rows whose mask the rule does not
    reproduce (packed sequences, arbitrary patterns) come out as NaN, loudly
    wrong, never a silently different attention. ``out``: ``[B, Hq, Sq, Dv]``."""
    b, heads, sq, skv = mask.shape
    want = rule_mask(kv_start, kv_end, sq, skv, causal=causal, window=window).expand(b, heads, sq, skv)
    differs = (mask != want).flatten(1).any(dim=1).view(-1, 1, 1, 1)
    return torch.where(differs, torch.full_like(out, float("nan")), out)
