"""The torch-native attention: the CPU path (differentiable, torch.compile-able).

Plain torch ops in f32, so autograd and ``torch.compile`` work on it with no
custom op. GQA is a view (queries grouped per KV head), never a repeat of K/V.
Queries are processed in chunks of ``QUERY_CHUNK`` rows so the f32 score
matrix of a long prefill stays a few MB per chunk.
"""

from __future__ import annotations

import torch

QUERY_CHUNK = 1024


def attention(q, k, v, visible, *, softcap: float, sinks, scale: float) -> torch.Tensor:
    """``q [B, Hq, Sq, D]``, ``k [B, Hkv, Skv, D]``, ``v [B, Hkv, Skv, Dv]``,
    ``visible`` bool ``[B, 1 or Hq, Sq, Skv]``; rows that see no key give 0."""
    b, hq, sq, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    group = hq // hkv
    qg = q.reshape(b, hkv, group, sq, d).float()
    kt = k.float().unsqueeze(2).transpose(-1, -2)  # [B, Hkv, 1, D, Skv]
    vf = v.float().unsqueeze(2)
    vis = visible.reshape(b, visible.shape[1] // group if visible.shape[1] > 1 else 1,
                          group if visible.shape[1] > 1 else 1, sq, visible.shape[-1])
    outs = []
    for start in range(0, sq, QUERY_CHUNK):
        rows = slice(start, min(sq, start + QUERY_CHUNK))
        s = (qg[:, :, :, rows] @ kt) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~vis[:, :, :, rows], float("-inf"))
        if sinks is not None:
            sink = sinks.float().reshape(1, hkv, group, 1, 1).expand(b, hkv, group, s.shape[3], 1)
            s = torch.cat([s, sink], dim=-1)
        m = s.amax(dim=-1, keepdim=True).detach()
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows that see nothing
        p = torch.exp(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        p = p / torch.where(denom == 0, torch.ones_like(denom), denom)
        if sinks is not None:
            p = p[..., :-1]
        outs.append(p @ vf)
    out = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]
    return out.reshape(b, hq, sq, dv).to(q.dtype)
