#!/usr/bin/env python
"""attention-tpu benchmark: CPU times against torch's SDPA and Transformers' eager,
and, for TPUs, the kernel's block plan (no TPU here: what the mask rule skips).

CPU: the default CPU path of ``attention`` against
``torch.nn.functional.scaled_dot_product_attention`` (GQA by ``enable_gqa``,
boolean mask) and Transformers' ``eager_attention_forward`` (K/V repeated),
interleaved rounds, ratios = peer time / ours in the same round (> 1: ours is
faster). TPU: per generation the blocks of the rule, the VMEM working set, and
the fraction of KV block steps that compute and that fetch K/V, from the
kernel's own visit plan (``pallas_flash.kv_block_plan``), for causal and
windowed prefill and for decode against a partly filled static cache; each
case is also compiled ahead of time for the chip.

Usage: python bench/bench_attention.py [--repeats 5] [--out bench/results]
Writes bench/results/attention.md.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import parse_args, paired_ratio, time_rounds, use_shipped_packages, write_report  # noqa: E402

use_shipped_packages()
import jax.numpy as jnp  # noqa: E402
from transformers.integrations.sdpa_attention import repeat_kv  # noqa: E402

import attention_tpu  # noqa: E402
from attention_tpu.attention import blocks, pallas_flash  # noqa: E402
from attention_tpu.common import aot, tpu_generations  # noqa: E402

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
# (label, q heads, kv heads, Sq, Skv, filled keys, head_dim, window)
TPU_CASES = [
    ("llama3-8b causal prefill 8k", 32, 8, 8192, 8192, 8192, 128, 0),
    ("llama3-8b causal prefill 32k", 32, 8, 32768, 32768, 32768, 128, 0),
    ("gpt-oss sliding-128 prefill 8k", 64, 8, 8192, 8192, 8192, 64, 128),
    ("gpt-oss sliding-128 prefill 32k", 64, 8, 32768, 32768, 32768, 64, 128),
    ("llama3-8b decode, 8k cache, 2k filled", 32, 8, 1, 8192, 2048, 128, 0),
    ("llama3-8b decode, 32k cache, 2k filled", 32, 8, 1, 32768, 2048, 128, 0),
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


def tpu_table():
    rows = []
    for label, hq, hkv, sq, skv, filled, d, window in TPU_CASES:
        rows_q = hq // hkv * sq
        block_q, block_k = blocks.choose_blocks(rows_q, skv)
        live, fetched, dense = pallas_flash.kv_block_plan([0], [filled], rows=rows_q, sq=sq, skv=skv,
                                                          causal=True, window=window)
        row = {"case": label, "blocks (q, k)": (block_q, block_k),
               "VMEM working set (MiB)": blocks.working_set_bytes(block_q, block_k, d, d, 2) / 2**20,
               "KV steps computed": live / dense, "K/V blocks fetched": fetched / dense}
        for generation in tpu_generations.GENERATIONS:
            start = time.perf_counter()

            def fn(q, k, v, s, e, window=window, generation=generation):
                return pallas_flash.flash_attention(q, k, v, s, e, causal=True, window=window,
                                                    generation=generation)

            aot.compile_for(generation, fn, ((1, hq, sq, d), jnp.bfloat16), ((1, hkv, skv, d), jnp.bfloat16),
                            ((1, hkv, skv, d), jnp.bfloat16), ((1,), jnp.int32), ((1,), jnp.int32))
            row[f"{generation} compile (s)"] = time.perf_counter() - start
        rows.append(row)
        print(row, flush=True)
    return rows


def main():
    args = parse_args([0], 5, 1.0)
    cpu = cpu_table(args.repeats, args.min_seconds)
    tpu = tpu_table()
    write_report(
        args.out, "attention.md", "attention-tpu benchmark",
        "CPU (float32, causal, Llama-3-8B heads 32/8, head_dim 128): median ms of ours and, per peer, the "
        "median over rounds of peer time / our time in the same round (> 1: ours is faster); "
        f"`python bench/bench_attention.py --repeats {args.repeats}`.\n\n"
        "TPU (no TPU here): the kernel's block plan. 'KV steps computed' and 'K/V blocks fetched' are "
        "fractions of the dense grid (every query block against every KV block); every case compiled "
        "ahead of time for each generation (bf16). Estimated TPU times against splash / JAX flash attention "
        "need the schedule-based estimator of its own issue and are not in this table.",
        [("CPU", cpu), ("TPU block plan and AOT compiles", tpu)],
    )


if __name__ == "__main__":
    main()
