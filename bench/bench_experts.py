"""One MoE experts layer on CPU: our experts_forward against Transformers' own.

Peers, measured in the same run on the same module and routing:
``eager`` (the model's per-expert loop), ``grouped_mm`` and ``batched_mm``
(Transformers' experts implementations). Ratios are peer time / our time
(> 1: ours faster). ``batched_mm`` gathers one weight matrix per pick, so it
is skipped where that copy would not fit in memory.

Also, on paper for TPU v6e: the HBM bytes one decode step of our experts
forward moves, from the tiling the kernel picks, against the minimum (each
active expert's weights read once), and a roofline model of the fused
experts kernel against the two grouped matmuls at every token count.

Usage: python bench/bench_experts.py [--tokens 1 16 64 256 512 1024 4096] [--repeats 5]
       [--min-seconds 4] [--chunk-sweep] [--out bench/results]
Writes bench/results/experts.md and experts.png. ``--chunk-sweep`` adds the
measurement behind the CPU chunk rule (``experts.CPU_CHUNK_BYTES``): our CPU
path at the largest token count with several rows per chunk.
"""

from __future__ import annotations

import functools
import pathlib
import statistics
import sys

import torch
from transformers import AutoConfig
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import (evict_caches, paired_ratio, parse_args, time_interleaved, time_rounds,  # noqa: E402
                    use_shipped_packages, write_report)

use_shipped_packages()
import moe_experts_tpu  # noqa: E402
from moe_experts_tpu.experts import cpu_path, pallas_fused_experts  # noqa: E402
from moe_experts_tpu.gmm import tiling  # noqa: E402

MODELS = {
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8),
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
                        num_local_experts=32, num_experts_per_tok=4),
}
BATCHED_MM_BYTES = 6 << 30  # skip batched_mm above this much gathered weight
PEERS = ("eager", "grouped_mm", "batched_mm")
# TPU v6e, per chip: HBM bandwidth and bf16 MXU peak (public spec figures).
V6E_HBM_BYTES_PER_S = 1640e9
V6E_BF16_FLOPS = 918e12


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


def _routing(tokens, num_experts, top_k, hidden_size, gen):
    hidden = torch.randn(tokens, hidden_size, generator=gen).bfloat16()
    index = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen).bfloat16()
    return hidden, index, weights


def cpu_rows(tokens_list, repeats, min_seconds):
    """``eager`` and ``grouped_mm`` alternate with ours in rounds. ``batched_mm``
    is timed apart, after them: it gathers one weight matrix per pick (GBs at
    64 tokens), and whatever runs right after it pays for that memory being
    returned and faulted in again, which is noise we do not want in the
    ratios of the close contenders."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name in MODELS:
        module, config = _experts(name)
        num_experts, top_k = module.num_experts, config.num_experts_per_tok
        weight_bytes = module.gate_up_proj[0].numel() * 2 + module.down_proj[0].numel() * 2
        eager = type(module).forward.__wrapped__
        for tokens in tokens_list:
            hidden, index, weights = _routing(tokens, num_experts, top_k, config.hidden_size, gen)
            args = (module, hidden, index, weights)
            fns = {"ours": functools.partial(moe_experts_tpu.experts_forward, *args),
                   "eager": functools.partial(eager, *args),
                   "grouped_mm": functools.partial(ALL_EXPERTS_FUNCTIONS["grouped_mm"], *args)}
            with torch.no_grad():
                samples = time_rounds(fns, repeats, min_seconds * len(fns), before_each=evict_caches)
            ours = statistics.median(samples["ours"])
            row = {"model": name, "tokens": tokens, "ours_ms": ours * 1e3}
            row.update({peer: paired_ratio(samples, peer) for peer in ("eager", "grouped_mm")})
            if tokens * top_k * weight_bytes > BATCHED_MM_BYTES:
                row["batched_mm"] = "skipped (memory)"
            else:
                batched = functools.partial(ALL_EXPERTS_FUNCTIONS["batched_mm"], *args)
                with torch.no_grad():
                    row["batched_mm"] = time_interleaved({"b": batched}, 3, before_each=evict_caches)["b"] / ours
            row["fastest built-in"] = min(row["eager"], row["grouped_mm"])
            row["rounds"] = len(samples["ours"])
            rows.append(row)
            print(row, flush=True)
    return rows


def chunk_sweep(tokens, repeats, rows_options=(128, 256, 512, 1024, 2048, 4096)):
    """Our CPU path at ``tokens`` with several chunk sizes, and the rule's own choice."""
    rows = []
    gen = torch.Generator().manual_seed(1)
    for name in MODELS:
        module, config = _experts(name)
        hidden, index, weights = _routing(tokens, module.num_experts, config.num_experts_per_tok,
                                          config.hidden_size, gen)
        rule = cpu_path.cpu_chunk_rows(module)
        fns = {f"{r} rows": functools.partial(cpu_path.cpu_inference_forward, module,
                                              hidden, index, weights, chunk_rows=r)
               for r in rows_options}
        fns["rule"] = functools.partial(cpu_path.cpu_inference_forward, module,
                                        hidden, index, weights, chunk_rows=rule)
        with torch.no_grad():
            times = time_interleaved(fns, repeats, before_each=evict_caches)
        row = {"model": name, "tokens": tokens, "rows per expert": tokens * config.num_experts_per_tok
               / module.num_experts, "rule (rows)": rule}
        row.update({k: v * 1e3 for k, v in times.items()})
        rows.append(row)
        print(row, flush=True)
    return rows


def _shape(cfg):
    h = cfg["hidden_size"]
    i = cfg.get("moe_intermediate_size", cfg.get("intermediate_size"))
    e = cfg.get("num_experts", cfg.get("num_local_experts"))
    return h, i, e, cfg["num_experts_per_tok"]


def _active_experts(tokens, num_experts, top_k):
    """Expected experts hit by ``tokens`` tokens routed uniformly at random."""
    return min(num_experts, top_k) if tokens == 1 else num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def tpu_decode_bytes(tokens_list):
    """HBM traffic of one experts forward on v6e, from the kernel's grid walk.

    The forward grid is (n tiles, visits, k tiles). With the whole K in one
    tile, consecutive visits of one expert reuse its weight block, so each
    active expert's weights are read once per n tile column: exactly once in
    total. lhs tiles are re-read once per n tile, output written once.
    """
    rows = []
    for name, cfg in MODELS.items():
        h, i, e, k = _shape(cfg)
        for tokens in tokens_list:
            m = tokens * k
            active = _active_experts(tokens, e, k)
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


def tpu_fused_vs_unfused(tokens_list, name="qwen3-30b-a3b", generation="v6e"):
    """Roofline model of one experts forward on v6e: fused kernel vs two grouped matmuls.

    Both paths do the same MXU work (each active expert's rows padded to
    whole ``tm`` tiles) and read each active expert's weights once. The two
    matmuls also write the ``[M, 2I]`` f32 gate_up output, read it back for
    the gate, write the ``[M, I]`` activation and read it again (once per
    output column tile of the down projection); the fused kernel keeps all of
    that in VMEM. Modeled time per kernel = max(bytes / HBM bandwidth,
    flops / MXU peak). Not a measurement: no TPU here.
    """
    h, i, e, k = _shape(MODELS[name])
    rows = []
    for tokens in tokens_list:
        m = tokens * k
        active = _active_experts(tokens, e, k)
        up = tiling.choose_tiling(m, h, 2 * i, e, lhs_itemsize=2, rhs_itemsize=2, out_itemsize=4,
                                  generation=generation)
        down = tiling.choose_tiling(m, i, h, e, lhs_itemsize=2, rhs_itemsize=2, out_itemsize=4,
                                    generation=generation)
        # Rows padded to whole tiles (the fused kernel's tile is never larger).
        padded_rows = active * -(-(m / active) // up.tm) * up.tm
        flops = 2 * padded_rows * 3 * i * h
        weights = active * 3 * i * h * 2

        def seconds(nbytes, nflops):
            return max(nbytes / V6E_HBM_BYTES_PER_S, nflops / V6E_BF16_FLOPS)

        fused_bytes = weights + m * h * 2 + m * h * 4
        unfused_up = active * 2 * i * h * 2 + m * h * 2 * -(-2 * i // up.tn) + m * 2 * i * 4
        gate = m * 2 * i * 4 + m * i * 2
        unfused_down = active * i * h * 2 + m * i * 2 * -(-h // down.tn) + m * h * 4
        fused_s = seconds(fused_bytes, flops)
        unfused_s = (seconds(unfused_up, 2 * padded_rows * 2 * i * h) + gate / V6E_HBM_BYTES_PER_S
                     + seconds(unfused_down, 2 * padded_rows * i * h))
        fused_tm = pallas_fused_experts.fused_row_tile("glu_silu", "nk", m, h, i, e, 2, generation)
        rows.append({"model": name, "tokens": tokens, "tm (matmuls / fused)": f"{up.tm} / {fused_tm}",
                     "fused MB": fused_bytes / 1e6, "two matmuls MB": (unfused_up + gate + unfused_down) / 1e6,
                     "fused us": fused_s * 1e6, "two matmuls us": unfused_s * 1e6,
                     "two matmuls / fused": unfused_s / fused_s,
                     "rule picks": "fused" if fused_tm else "two matmuls"})
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        for peer in PEERS:
            points = [(r["tokens"], r[peer]) for r in mine if isinstance(r.get(peer), float)]
            if points:
                ax.plot(*zip(*points), marker="o", label=peer)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("peer time / our time (>1: ours faster)")
        ax.set_title(f"{model} experts layer, bf16, CPU")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    args = parse_args([1, 16, 64, 256, 512, 1024, 4096], 5, 4.0,
                      flags=[("chunk-sweep", "also time the CPU path with several rows per chunk")])
    cpu = cpu_rows(args.tokens, args.repeats, args.min_seconds)
    sweep = chunk_sweep(max(args.tokens), args.repeats) if args.chunk_sweep else []
    tpu = tpu_decode_bytes([1, 8, 64])
    fused = tpu_fused_vs_unfused([1, 8, 64, 256, 512, 1024, 4096])
    write_report(
        args.out, "experts.md", "MoE experts layer benchmark",
        f"One experts layer, bf16, {torch.get_num_threads()} CPU threads, no grad, the same routing for "
        "every contender, caches evicted before every call (weights come from DRAM, as in a real decode "
        f"step). Contenders alternate in rounds (at least {args.repeats}, and at least "
        f"{args.min_seconds:g} s per contender); `ours_ms` is our median. Columns after it are the median "
        "over rounds of peer time / our time in the same round (>1: ours faster); `fastest built-in` is "
        "the lower of eager and grouped_mm. batched_mm is timed apart (3 calls, its median over our "
        "median): its multi-GB weight gathers disturb whatever runs next. Plot: experts.png.",
        [(None, cpu), ("TPU v6e on paper: HBM bytes per experts forward vs the minimum", tpu),
         ("TPU v6e on paper: fused experts kernel vs two grouped matmuls (roofline model)", fused)]
        + ([("CPU chunk rule: our CPU path (ms) by rows per chunk", sweep)] if sweep else []),
    )
    plot(cpu, pathlib.Path(args.out) / "experts.png")


if __name__ == "__main__":
    main()
