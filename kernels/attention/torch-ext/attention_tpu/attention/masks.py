"""Which keys each query sees, on the torch side.

The Pallas kernels take the mask as one contiguous key range ``[lo, hi)`` per
query (``key_bounds``, int32 ``[B, Sq, 2]``, shared by every head), not as a
dense tensor. Every mask Transformers builds for a decoder is such a range
per row: causal, sliding windows, padding on either side, a static cache,
packed sequences (each query sees its own document's keys). Without a mask
the ranges come from the rule (``rule_key_bounds``: every key, queries
aligned to the end of the keys, ``causal`` and ``window`` on positions),
written once in ``key_ranges.rule_range`` for this side, XLA and the kernels.

A dense boolean mask (``[B, 1 or H, Sq, Skv]``, True = attend) is turned into
ranges once per call; ``check_expressible`` refuses a mask whose rows are not
one range or that differs between heads rather than computing something else
(on the host), and on a TPU, where refusing would need a host sync,
``poison_where_not_expressible`` turns those batch rows to NaN.
"""

from __future__ import annotations

import torch

from . import key_ranges

FUNCTION = "attention"


def rule_key_bounds(kv_start: torch.Tensor, kv_end: torch.Tensor, sq: int, skv: int, *, causal: bool,
                    window: int) -> torch.Tensor:
    """int32 ``[B, Sq, 2]``: the rule's range (``key_ranges.rule_range``) of each
    query ``i``, at position ``p = kv_end - Sq + i`` (``hi <= lo``: it sees no key)."""
    start, end = kv_start.view(-1, 1).int(), kv_end.view(-1, 1).int()
    pos = end - sq + torch.arange(sq, device=kv_start.device, dtype=torch.int32)
    lo, hi = key_ranges.rule_range(start, end, pos, skv=skv, causal=causal, window=window, clip=torch.clamp)
    return torch.stack([lo.expand_as(pos), hi.expand_as(pos)], dim=-1).to(torch.int32)


def bounds_mask(bounds: torch.Tensor, skv: int) -> torch.Tensor:
    """The ranges as a dense ``[B, 1, Sq, Skv]`` boolean mask (True = attend)."""
    keys = torch.arange(skv, device=bounds.device)
    return ((keys >= bounds[..., :1]) & (keys < bounds[..., 1:])).unsqueeze(1)


def rule_mask(kv_start: torch.Tensor, kv_end: torch.Tensor, sq: int, skv: int, *, causal: bool,
              window: int) -> torch.Tensor:
    """The rule as a dense ``[B, 1, Sq, Skv]`` boolean mask (True = attend)."""
    return bounds_mask(rule_key_bounds(kv_start, kv_end, sq, skv, causal=causal, window=window), skv)


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """A boolean mask (True = attend) from a boolean or an additive float mask.
    A float mask may hold only 0 (attend) and large negative values (masked,
    at most half the dtype's minimum, as Transformers builds them): other
    values are biases (ALiBi, a -1e4 padding mask) a boolean mask would drop;
    ``check_no_bias`` refuses them on the host, and where that would need a
    host sync (TPU, ``torch.compile``) ``float_mask_bias_rows`` marks the batch
    rows to poison."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.dtype.is_floating_point:
        raise ValueError(f"{FUNCTION}: attention_mask must be bool or floating point, got {mask.dtype}")
    return mask > torch.finfo(mask.dtype).min / 2


def check_no_bias(mask: torch.Tensor) -> None:
    """ValueError if a float mask holds a value that is neither 0 nor masked."""
    biased = _biased(mask)
    if biased.any():
        raise ValueError(f"{FUNCTION}: a float attention_mask must hold 0 (attend) or a large negative value "
                         f"(<= {torch.finfo(mask.dtype).min / 2:.3g}, masked); it holds {float(mask[biased][0]):.6g}: "
                         "biases (ALiBi, a -1e4 padding mask) are not supported; pass a boolean mask")


def _biased(mask: torch.Tensor) -> torch.Tensor:
    return (mask != 0) & (mask > torch.finfo(mask.dtype).min / 2)


def float_mask_bias_rows(mask: torch.Tensor) -> torch.Tensor:
    """Per batch row of a float mask: does it hold a value that is neither 0
    nor masked (a bias ``as_bool_mask`` cannot keep)?"""
    return _biased(mask).flatten(1).any(dim=1)


def key_bounds(mask: torch.Tensor) -> torch.Tensor:
    """int32 ``[B, Sq, 2]``: per query of the first head, its first visible key
    and one past its last (``0, 0`` for a query that sees none). Exact for the
    mask only where ``check_expressible`` holds."""
    visible = mask[:, 0].to(torch.uint8)  # one byte per entry: argmax finds the first visible key
    skv = visible.shape[-1]
    if skv == 0:
        return torch.zeros((*visible.shape[:2], 2), dtype=torch.int32, device=mask.device)
    seen = visible.amax(dim=-1).bool()
    lo = visible.argmax(dim=-1)
    hi = skv - visible.flip(-1).argmax(dim=-1)
    zero = torch.zeros_like(lo)
    return torch.stack([torch.where(seen, lo, zero), torch.where(seen, hi, zero)], dim=-1).to(torch.int32)


def _differs(mask: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Per batch row: does ``mask`` differ anywhere from its ranges (a row that
    is not one range, a head that differs from the first)?"""
    b, heads, sq, skv = mask.shape
    return (mask != bounds_mask(bounds, skv).expand(b, heads, sq, skv)).flatten(1).any(dim=1)


def check_expressible(mask: torch.Tensor, bounds: torch.Tensor) -> None:
    """ValueError unless ``bounds`` reproduce ``mask`` exactly (host tensors only:
    on a TPU this check would cost a device-to-host sync)."""
    if _differs(mask, bounds).any():
        bad = (mask != bounds_mask(bounds, mask.shape[-1])).nonzero()[0].tolist()
        raise ValueError(
            f"{FUNCTION}: attention_mask is not expressible by the Pallas kernel (one contiguous key range per "
            f"query, the same for every head); first differing entry [batch, head, query, key] = {bad}. "
            "Such masks run on the native CPU path (impl='native')."
        )


def poison_where_not_expressible(out: torch.Tensor, mask: torch.Tensor, bounds: torch.Tensor,
                                 biased_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The device-side guard of the TPU path, where ``check_expressible`` would
    cost a host sync per call: batch rows whose mask the ranges do not
    reproduce (or, ``biased_rows``, whose float mask held biases) come out as
    NaN, loudly wrong, never a silently different attention. ``out``:
    ``[B, Hq, Sq, Dv]``."""
    differs = _differs(mask, bounds)
    return poison_rows(out, differs if biased_rows is None else differs | biased_rows)


def poison_rows(out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out [B, ...]`` with the batch rows where ``rows [B]`` is True set to NaN."""
    return torch.where(rows.view(-1, *([1] * (out.dim() - 1))), torch.full_like(out, float("nan")), out)
