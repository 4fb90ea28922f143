#!/usr/bin/env python
"""attention-tpu benchmark on the CPU: times against torch's SDPA and Transformers' eager
(TPU estimates: ``bench_attention_tpu.py``).

CPU: the default CPU path of ``attention`` against
``torch.nn.functional.scaled_dot_product_attention`` (GQA by ``enable_gqa``,
boolean mask) and Transformers' ``eager_attention_forward`` (K/V repeated),
interleaved rounds, ratios = peer time / ours in the same round (> 1: ours is
faster).

Usage: python bench/bench_attention.py [--repeats 5] [--out bench/results]
Writes bench/results/attention.md.
"""

from __future__ import annotations

import pathlib
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import parse_args, paired_ratio, time_rounds, use_shipped_packages, write_report  # noqa: E402

use_shipped_packages()
from transformers.integrations.sdpa_attention import repeat_kv  # noqa: E402

import attention_tpu  # noqa: E402

# (label, batch, q heads, kv heads, Sq, Skv, head_dim): Llama-3-8B heads.
# "sinks" rows: gpt-oss-style sinks, which SDPA cannot express (our explicit-softmax path).
CPU_CASES = [
    ("prefill 512", 1, 32, 8, 512, 512, 128, False),
    ("prefill 2048", 1, 32, 8, 2048, 2048, 128, False),
    ("decode, 1024 keys", 4, 32, 8, 1, 1024, 128, False),
    ("decode, 8192 keys", 4, 32, 8, 1, 8192, 128, False),
    ("prefill 512, sinks", 1, 32, 8, 512, 512, 128, True),
    ("decode, 8192 keys, sinks", 4, 32, 8, 1, 8192, 128, True),
]
def _causal_mask(b, sq, skv):
    pos = torch.arange(sq).view(-1, 1) + (skv - sq)
    return (torch.arange(skv).view(1, -1) <= pos).expand(b, 1, sq, skv)


def _eager(q, k, v, mask, scale, sinks=None):
    """Transformers' eager attention (gpt-oss's, with sinks)."""
    group = q.shape[1] // k.shape[1]
    s = (q @ repeat_kv(k, group).transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
        s = s - s.max(dim=-1, keepdim=True).values
        return torch.softmax(s, dim=-1)[..., :-1] @ repeat_kv(v, group)
    return torch.softmax(s, dim=-1) @ repeat_kv(v, group)


def cpu_table(repeats, min_seconds):
    rows = []
    gen = torch.Generator().manual_seed(0)
    for label, b, hq, hkv, sq, skv, d, with_sinks in CPU_CASES:
        q = torch.randn(b, hq, sq, d, generator=gen)
        k, v = torch.randn(b, hkv, skv, d, generator=gen), torch.randn(b, hkv, skv, d, generator=gen)
        sinks = torch.randn(hq, generator=gen) if with_sinks else None
        mask = _causal_mask(b, sq, skv)
        scale = d ** -0.5
        fns = {
            "ours": lambda: attention_tpu.attention(q, k, v, attention_mask=mask, sinks=sinks),
            "eager": lambda: _eager(q, k, v, mask, scale, sinks),
        }
        if not with_sinks:
            fns["sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                   enable_gqa=True)
        with torch.no_grad():
            samples = time_rounds(fns, repeats, min_seconds * len(fns))
        row = {"case": label, "ours_ms": statistics.median(samples["ours"]) * 1e3}
        row.update({f"{peer} / ours": paired_ratio(samples, peer) if peer in fns else "-"
                    for peer in ("sdpa", "eager")})
        row["rounds"] = len(samples["ours"])
        rows.append(row)
        print(row, flush=True)
    return rows


def main():
    args = parse_args([0], 5, 1.0)
    cpu = cpu_table(args.repeats, args.min_seconds)
    write_report(
        args.out, "attention.md", "attention-tpu benchmark",
        "CPU (float32, causal, Llama-3-8B heads 32/8, head_dim 128): median ms of ours and, per peer, the "
        "median over rounds of peer time / our time in the same round (> 1: ours is faster); "
        f"`python bench/bench_attention.py --repeats {args.repeats}`. TPU estimates against splash and JAX "
        "flash attention: `attention_tpu.md` (`bench/bench_attention_tpu.py`).",
        [("CPU", cpu)],
    )


if __name__ == "__main__":
    main()
