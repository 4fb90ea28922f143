#!/usr/bin/env python
"""The fused experts kernel alone at several row tiles, by the TPU estimator:
the figures behind ``pallas_fused_experts.fused_row_tile`` (its module
docstring). Routing as ``bench_tpu_estimates`` (uniform, seed 0), bf16 in,
f32 out; per tile: the kernel's time, its compute and DMA times and its grid
steps.

    python bench/fused_row_tiles.py --chip v6e --model gemma-4-26b-a4b --tokens 64 512 4096 --tm 128 256 512
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import tpu_estimator  # noqa: E402  (sets libtpu's dump folder before jax loads libtpu)
from bench_tpu_estimates import MODELS, problem_size, weight_specs  # noqa: E402
from common import use_shipped_packages  # noqa: E402


def estimate_tile(chip: str, model: str, tokens: int, tm: int) -> str:
    import jax
    import jax.numpy as jnp

    from moe_experts_tpu.experts import pallas_fused_experts

    hidden, inter, experts, top_k, gate = MODELS[model]
    group_sizes, flops, min_bytes = problem_size(model, tokens)
    x = jax.ShapeDtypeStruct((tokens * top_k, hidden), jnp.bfloat16)
    up, down = weight_specs("ours", hidden, inter, experts)

    def fused(x, up, down, group_sizes):
        return pallas_fused_experts.fused_glu_experts(x, up, down, group_sizes, gate=gate, out_dtype=jnp.float32,
                                                      tm=tm, generation=chip)

    try:
        est = tpu_estimator.estimate(fused, [x, up, down, group_sizes], chip, flops=flops, min_bytes=min_bytes)
    except Exception as exc:  # noqa: BLE001 -- a tile the compiler refuses is reported
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    kernel = est.kernels[0]
    return (f"{est.seconds * 1e6:.1f} us (compute {kernel.compute_s * 1e6:.1f}, DMA {kernel.dma_s * 1e6:.1f}, "
            f"{kernel.steps} steps; roofline {est.roofline_s * 1e6:.1f})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chip", default="v6e")
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=[64, 512, 4096])
    ap.add_argument("--tm", nargs="+", type=int, default=[128, 256, 512])
    args = ap.parse_args(argv)
    use_shipped_packages()
    for tokens in args.tokens:
        for tm in args.tm:
            print(f"[{args.chip}] {args.model} {tokens} tokens, tm {tm}: "
                  f"{estimate_tile(args.chip, args.model, tokens, tm)}", flush=True)


if __name__ == "__main__":
    main()
