"""Ragged dot benchmark: CPU timings as ratios against peers, TPU tilings.

CPU (this host): our op's default path against the peers measured in the
same run, at MoE expert shapes, bf16:
  * ``jax.lax.ragged_dot`` (XLA's CPU backend),
  * a per-group torch loop over every group (``torch.mm`` per expert, empty
    groups included),
  * ``torch._grouped_mm`` where this torch build has it for CPU.
Ratios are peer time / our time (> 1 means we are faster).

TPU (no chip here): for each generation, the tiling our rule picks and the
VMEM working set, from an ahead-of-time compile through libtpu. No speed
claims for TPUs.

Usage: python bench/bench_ragged_dot.py [--tokens 1 64 512] [--out bench/results]
"""

from __future__ import annotations

import pathlib
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import (evict_caches, paired_ratio, parse_args, time_interleaved, time_rounds,  # noqa: E402
                    use_shipped_packages, write_report)

use_shipped_packages()
import jax.numpy as jnp  # noqa: E402

import ragged_dot_tpu  # noqa: E402
from ragged_dot_tpu.common import aot  # noqa: E402
from ragged_dot_tpu.gmm import pallas_gmm, tiling  # noqa: E402

SHAPES = {  # (hidden, intermediate, experts, top_k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "gpt-oss-20b": (2880, 2880, 32, 4),
}
XLA_ROW_BUDGET = 64  # XLA-on-CPU ragged_dot multiplies every group by every row: seconds per call


def _routing(tokens, experts, top_k, gen):
    picks = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    return torch.bincount(picks.reshape(-1), minlength=experts).to(torch.int32)


def _peers(lhs, rhs, sizes):
    offsets = torch.cumsum(sizes, 0).to(torch.int32)

    def loop_all_groups():
        out, start = [], 0
        for g, size in enumerate(sizes.tolist()):
            out.append(lhs[start:start + size] @ rhs[g].t())
            start += size
        return torch.cat(out)

    peers = {"torch loop": loop_all_groups}
    if hasattr(torch, "_grouped_mm"):
        try:
            torch._grouped_mm(lhs, rhs.transpose(1, 2), offs=offsets)
            peers["torch._grouped_mm"] = lambda: torch._grouped_mm(lhs, rhs.transpose(1, 2), offs=offsets)
        except (RuntimeError, NotImplementedError) as e:
            print(f"torch._grouped_mm unavailable on CPU: {str(e).splitlines()[0]}")
    if lhs.shape[0] <= XLA_ROW_BUDGET:
        import jax
        import jax.numpy as jnp

        x, w = jnp.asarray(lhs.float().numpy(), jnp.bfloat16), jnp.asarray(rhs.float().numpy(), jnp.bfloat16)
        s = jnp.asarray(sizes.numpy())
        f = jax.jit(lambda a, b, c: jax.lax.ragged_dot(a, jnp.swapaxes(b, 1, 2), c))
        peers["jax.lax.ragged_dot (XLA CPU)"] = lambda: f(x, w, s).block_until_ready()
    return peers


def cpu_table(tokens_list, repeats, min_seconds):
    gen = torch.Generator().manual_seed(0)
    rows = []
    for model, (hidden, inter, experts, top_k) in SHAPES.items():
        rhs = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.02).bfloat16()
        for tokens in tokens_list:
            sizes = _routing(tokens, experts, top_k, gen)
            lhs = torch.randn(tokens * top_k, hidden, generator=gen).bfloat16()
            peers = _peers(lhs, rhs, sizes)
            xla = {k: peers.pop(k) for k in list(peers) if k.startswith("jax")}
            fns = {"ours": lambda: ragged_dot_tpu.ragged_dot(lhs, rhs, sizes), **peers}
            samples = time_rounds(fns, repeats, min_seconds * len(fns), before_each=evict_caches)
            ours = statistics.median(samples["ours"])
            row = {"model": model, "tokens": tokens, "ours_ms": ours * 1e3}
            row.update({name: paired_ratio(samples, name) for name in fns if name != "ours"})
            # Timed on its own: XLA's CPU thread pool keeps spinning after a call
            # and would slow whichever contender runs next in a round.
            xla_times = time_interleaved(xla, max(1, repeats // 2), before_each=evict_caches)
            row.update({name: t / ours for name, t in xla_times.items()})
            row["rounds"] = len(samples["ours"])
            rows.append(row)
            print(row, flush=True)
    return rows


def tpu_table(tokens_list):
    rows = []
    for generation in aot.TOPOLOGIES:
        for model, (hidden, inter, experts, top_k) in SHAPES.items():
            for tokens in tokens_list:
                m, k, n = tokens * top_k, hidden, 2 * inter
                t = tiling.choose_tiling(m, k, n, experts, lhs_itemsize=2, rhs_itemsize=2, out_itemsize=2,
                                         generation=generation)
                aot.compile_for(generation, lambda x, w, s, t=t, g=generation: pallas_gmm.gmm(
                    x, w, s, tiling=t, generation=g),
                    ((m, k), jnp.bfloat16), ((experts, n, k), jnp.bfloat16), ((experts,), jnp.int32))
                rows.append({"generation": generation, "model": model, "tokens": tokens,
                             "tiling (tm,tk,tn)": t.as_tuple(),
                             "VMEM working set (MiB)": tiling.working_set_bytes(t, 2, 2, 2) / 2**20})
    return rows


def main():
    args = parse_args([1, 64, 512], 5, 3.0)
    cpu = cpu_table(args.tokens, args.repeats, args.min_seconds)
    tpu = tpu_table([1, 64, 4096])
    write_report(
        args.out, "ragged_dot.md", "ragged_dot benchmark",
        f"gate_up projection (`[T*top_k, H] x [E, 2I, H]`), bf16, {torch.get_num_threads()} CPU threads, "
        "caches evicted before every call (weights from DRAM), contenders alternating in rounds (at least "
        f"{args.repeats}, and at least {args.min_seconds:g} s per contender); `ours_ms` is our median. Columns "
        "after it are the median over rounds of peer time / our time in the same round (>1: ours faster); "
        "XLA is timed apart (its thread pool keeps spinning after a call), median over our median.",
        [(None, cpu), ("TPU: tiling chosen and VMEM working set (AOT compile, no TPU attached)", tpu)],
    )


if __name__ == "__main__":
    main()
