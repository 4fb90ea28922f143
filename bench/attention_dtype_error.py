#!/usr/bin/env python
"""attention-tpu error per dtype on the CPU paths: forward and gradients against
float64 (what the tolerances of tests/test_attention.py are set from).

For float32, bfloat16 and float16 inputs, on the native path and the Pallas
kernel in interpret mode (the TPU kernel's code, float16 decoded from its
bits as on a TPU), over masks with padding, GQA / MQA, a sliding window,
soft-capping and sinks, several seeds: the largest absolute error of the
output against the float64 loop of ``tests/reference.py`` on the same
(rounded) inputs, next to the error of rounding that exact output once to the
dtype (no implementation can do better); and of the gradients of
``out.square().sum()`` against float64 autograd, with the largest gradient.

Usage: python bench/attention_dtype_error.py [--seeds 3] [--out bench/results]
Writes bench/results/attention_dtype_error.md.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from common import use_shipped_packages, write_report  # noqa: E402

use_shipped_packages()
import attention_tpu  # noqa: E402
import reference  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
IMPLS = ("native", "interpret")
# name: ((batch, q heads, kv heads, Sq, Skv, D, Dv), attention keywords, sinks, block sizes)
CASES = {
    "GQA prefill, left padding": ((2, 4, 2, 13, 13, 32, 32), dict(causal=True), False, None),
    "window + softcap + sinks + scale": ((2, 4, 2, 13, 13, 32, 32),
                                         dict(causal=True, window=3, softcap=5.0, scale=0.37), True, None),
    "MQA decode, sinks": ((2, 8, 1, 1, 37, 16, 16), dict(causal=True), True, None),
    "long cache, window 40, 8x128 blocks": ((1, 4, 2, 3, 300, 16, 16), dict(causal=True, window=40), False,
                                            (8, 128)),
    "prefill 128, D 64": ((1, 8, 2, 128, 128, 64, 64), dict(causal=True), False, None),
}


def _inputs(shape, dtype, seed):
    b, hq, hkv, sq, skv, d, dv = shape
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*s, generator=gen).to(dtype)
               for s in ((b, hq, sq, d), (b, hkv, skv, d), (b, hkv, skv, dv)))
    return q, k, v, torch.randn(hq, generator=gen)


def _mask(b, sq, skv, causal, window):
    """Batch row 0 sees every key, row 1 is left-padded by 2 and its cache is one short."""
    start, end = [0, min(2, skv - 1)][:b], [skv, max(skv - 1, 3)][:b]
    return torch.from_numpy(reference.attention_rule_mask(start, end, sq, skv, causal=causal, window=window))


def measure(case, dtype, impl, seed):
    shape, opts, use_sinks, block_sizes = CASES[case]
    q, k, v, sinks = _inputs(shape, dtype, seed)
    visible = _mask(shape[0], shape[3], shape[4], opts["causal"], opts.get("window", 0))
    scale = opts.get("scale", shape[5] ** -0.5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = attention_tpu.attention(*leaves[:3], attention_mask=visible, sinks=leaves[3] if use_sinks else None,
                                  block_sizes=block_sizes, impl=impl, **opts)
    out.float().square().sum().backward()
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    no_sink = torch.full_like(ref_leaves[3], -1e4)  # weighs exactly nothing in float64
    want = reference.attention_autograd(*ref_leaves[:3], ref_leaves[3] if use_sinks else no_sink, visible,
                                        softcap=opts.get("softcap", 0.0), scale=scale)
    want.square().sum().backward()
    exact = want.detach()
    row = dict(forward=(out.detach().double() - exact).abs().max().item(),
               rounding=(exact.to(dtype).double() - exact).abs().max().item())
    names = "q k v sinks".split() if use_sinks else "q k v".split()
    grad_error = max((got.grad.double() - ref.grad).abs().max().item()
                     for name, got, ref in zip(names, leaves, ref_leaves))
    row.update(gradients=grad_error, largest_gradient=max(ref.grad.abs().max().item() for ref in ref_leaves[:3]))
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    rows, worst = [], {}
    for dtype in DTYPES:
        for impl in IMPLS:
            for case in CASES:
                runs = [measure(case, dtype, impl, seed) for seed in range(args.seeds)]
                row = {key: max(r[key] for r in runs) for key in runs[0]}
                rows.append({"dtype": str(dtype).replace("torch.", ""), "path": impl, "case": case,
                             **{key: f"{value:.2e}" for key, value in row.items()}})
                w = worst.setdefault((dtype, impl), dict.fromkeys(row, 0.0))
                for key, value in row.items():
                    w[key] = max(w[key], value)
    summary = [{"dtype": str(d).replace("torch.", ""), "path": impl, **{k: f"{v:.2e}" for k, v in w.items()}}
               for (d, impl), w in worst.items()]
    intro = (__doc__.split("\n\n", 1)[1].rsplit("\n\nUsage", 1)[0]
             + f"\n\nMaximum absolute errors over {args.seeds} seeds; inputs ~ N(0, 1).")
    write_report(args.out, "attention_dtype_error.md", "attention-tpu: error per dtype (CPU paths)", intro,
                 [("Worst case per dtype and path", summary), ("Per case", rows)])


if __name__ == "__main__":
    main()
