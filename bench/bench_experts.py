"""One MoE experts layer on CPU: our experts_forward against Transformers' own.

Peers, measured in the same run on the same module and routing:
``eager`` (the model's per-expert loop), ``grouped_mm`` and ``batched_mm``
(Transformers' experts implementations). Ratios are peer time / our time
(> 1: ours faster). ``batched_mm`` gathers one weight matrix per pick, so it
is skipped where that copy would not fit in memory.

Also, on paper for TPU v6e: the HBM bytes one decode step of our experts
forward moves, from the tiling the kernel picks, against the minimum (each
active expert's weights read once).

Usage: python bench/bench_experts.py [--tokens 1 16 64 256 512] [--out bench/results]
"""

from __future__ import annotations

import functools
import pathlib
import sys

import torch
from transformers import AutoConfig
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "kernels" / "ragged-dot" / "torch-ext"))
sys.path.insert(0, str(ROOT / "bench"))

import ragged_dot_tpu  # noqa: E402
from common import parse_args, time_interleaved, write_report  # noqa: E402
from ragged_dot_tpu import tiling  # noqa: E402

MODELS = {
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8),
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
                        num_local_experts=32, num_experts_per_tok=4),
}
BATCHED_MM_BYTES = 6 << 30  # skip batched_mm above this much gathered weight


def _experts(name):
    cfg = dict(MODELS[name])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    if name.startswith("qwen3"):
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as cls
    else:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as cls
    with torch.device("cpu"):
        module = cls(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return module.to(torch.bfloat16).eval(), config


def cpu_rows(tokens_list, repeats):
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name in MODELS:
        module, config = _experts(name)
        num_experts, top_k = module.num_experts, config.num_experts_per_tok
        weight_bytes = module.gate_up_proj[0].numel() * 2 + module.down_proj[0].numel() * 2
        eager = type(module).forward.__wrapped__
        impls = {
            "eager": lambda h, i, w: eager(module, h, i, w),
            "grouped_mm": lambda h, i, w: ALL_EXPERTS_FUNCTIONS["grouped_mm"](module, h, i, w),
            "batched_mm": lambda h, i, w: ALL_EXPERTS_FUNCTIONS["batched_mm"](module, h, i, w),
        }
        for tokens in tokens_list:
            hidden = torch.randn(tokens, config.hidden_size, generator=gen).bfloat16()
            index = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
            weights = torch.rand(tokens, top_k, generator=gen).bfloat16()
            fns = {"ours": lambda: ragged_dot_tpu.experts_forward(module, hidden, index, weights)}
            row = {"model": name, "tokens": tokens}
            for peer, fn in impls.items():
                if peer == "batched_mm" and tokens * top_k * weight_bytes > BATCHED_MM_BYTES:
                    row[peer] = "skipped (memory)"
                else:
                    fns[peer] = functools.partial(fn, hidden, index, weights)
            with torch.no_grad():
                times = time_interleaved(fns, repeats)
            row["ours_ms"] = times["ours"] * 1e3
            row.update({peer: times[peer] / times["ours"] for peer in fns if peer != "ours"})
            row = {k: row[k] for k in ["model", "tokens", "ours_ms", *impls] if k in row}
            rows.append(row)
            print(row, flush=True)
    return rows


def tpu_decode_bytes(tokens_list):
    """HBM traffic of one experts forward on v6e, from the kernel's grid walk.

    The forward grid is (n tiles, visits, k tiles). With the whole K in one
    tile, consecutive visits of one expert reuse its weight block, so each
    active expert's weights are read once per n tile column: exactly once in
    total. lhs tiles are re-read once per n tile, output written once.
    """
    rows = []
    for name, cfg in MODELS.items():
        h = cfg["hidden_size"]
        i = cfg.get("moe_intermediate_size", cfg.get("intermediate_size"))
        e = cfg.get("num_experts", cfg.get("num_local_experts"))
        k = cfg["num_experts_per_tok"]
        for tokens in tokens_list:
            m = tokens * k
            active = min(e, m) if tokens == 1 else e * (1 - (1 - k / e) ** tokens)
            total = minimum = 0.0
            for kk, nn in ((h, 2 * i), (i, h)):
                t = tiling.choose_tiling(m, kk, nn, e, lhs_itemsize=2, rhs_itemsize=2,
                                         out_itemsize=4, generation="v6e")
                tiles_n = -(-nn // t.tn)
                weight_reread = 1 if t.tk >= kk else (-(-m // t.tm) + active - 1) / max(active, 1)
                total += active * kk * nn * 2 * weight_reread + m * kk * 2 * tiles_n + m * nn * 4
                minimum += active * kk * nn * 2
            rows.append({"model": name, "tokens": tokens, "active experts": active,
                         "bytes moved (MB)": total / 1e6, "minimum (MB)": minimum / 1e6,
                         "ratio": total / minimum})
    return rows


def main():
    args = parse_args([1, 16, 64, 256, 512], 3)
    cpu = cpu_rows(args.tokens, args.repeats)
    tpu = tpu_decode_bytes([1, 8, 64])
    write_report(
        args.out, "experts.md", "MoE experts layer benchmark",
        f"One experts layer, bf16, {torch.get_num_threads()} CPU threads, median of interleaved runs, no grad. "
        "Columns after `ours_ms` are peer time / our time (>1: ours faster).",
        [(None, cpu), ("TPU v6e on paper: HBM bytes per experts forward vs the minimum", tpu)],
    )


if __name__ == "__main__":
    main()
