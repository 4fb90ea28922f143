"""The torch-native attention: the CPU path (differentiable, torch.compile-able).

float32, bfloat16 and float16 in, the same dtype out, accumulated in f32.
Two ways, by what the layer needs:

* no soft-capping and no sinks (Llama, Qwen3, Mistral, ...): torch's own
  ``scaled_dot_product_attention`` with the boolean mask and ``enable_gqa``
  (K/V never repeated). Rows that see no key would come out NaN there, so
  they attend to every key and are zeroed afterwards;
* soft-capping or sinks (Gemma-2, gpt-oss): the softmax written out in f32,
  queries of one KV head flattened into one matrix (``[B, Hkv, G * Sq, D]``,
  a plain batched matmul against K, as in the Pallas kernel), in chunks of
  ``QUERY_CHUNK`` query positions so a long prefill's scores stay small.

Measured with ``python bench/bench_attention.py`` (bench/results/attention.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QUERY_CHUNK = 1024


def attention(q, k, v, visible, *, softcap: float, sinks, scale: float) -> torch.Tensor:
    """``q [B, Hq, Sq, D]``, ``k [B, Hkv, Skv, D]``, ``v [B, Hkv, Skv, Dv]``,
    ``visible`` bool ``[B, 1 or Hq, Sq, Skv]``; rows that see no key give 0."""
    if not softcap and sinks is None:
        return _sdpa(q, k, v, visible, scale)
    return _explicit_softmax(q, k, v, visible, softcap=softcap, sinks=sinks, scale=scale)


def _sdpa(q, k, v, visible, scale):
    sees_any = visible.any(dim=-1, keepdim=True)
    mask = visible | ~sees_any
    # float16 is computed in float32: torch's CPU sdpa rounds float16
    # intermediates (max error 1.07e-3 against 8.8e-4 for rounding the exact
    # output once, [2, 8, 300, 64] causal; bfloat16 already accumulates in f32).
    wide = q.dtype == torch.float16
    out = F.scaled_dot_product_attention(*(t.float() if wide else t for t in (q, k, v)), attn_mask=mask,
                                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.masked_fill(~sees_any, 0.0).to(q.dtype)


def _explicit_softmax(q, k, v, visible, *, softcap, sinks, scale):
    b, hq, sq, d = q.shape
    hkv, skv, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = hq // hkv
    q_rows = q.float().reshape(b, hkv, group, sq, d)
    kt, vf = k.float().transpose(-1, -2), v.float()
    # Masks per KV head group: [B, 1 or Hkv, 1 or G, Sq, Skv], broadcast, never copied.
    vis = visible.reshape(b, hkv, group, sq, skv) if visible.shape[1] > 1 else visible.unsqueeze(2)
    sink = None if sinks is None else sinks.float().reshape(1, hkv, group, 1, 1)
    outs = []
    for start in range(0, sq, QUERY_CHUNK):
        rows = slice(start, min(sq, start + QUERY_CHUNK))
        n = rows.stop - rows.start
        s = (q_rows[:, :, :, rows].reshape(b, hkv, group * n, d) @ kt) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.view(b, hkv, group, n, skv).masked_fill(~vis[:, :, :, rows], float("-inf"))
        m = s.amax(dim=-1, keepdim=True).detach()
        if sink is not None:  # the sink joins the max and the denominator, not the values
            m = torch.maximum(m, sink.detach())
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows that see nothing
        p = torch.exp(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        if sink is not None:
            denom = denom + torch.exp(sink - m)
        # Normalise after p @ v: [.., Dv] values to divide, not [.., Skv].
        out = (p.reshape(b, hkv, group * n, skv) @ vf).view(b, hkv, group, n, dv)
        outs.append(out / torch.where(denom == 0, torch.ones_like(denom), denom))
    out = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]
    return out.reshape(b, hq, sq, dv).to(q.dtype)
