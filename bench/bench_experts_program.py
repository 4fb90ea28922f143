#!/usr/bin/env python
"""The whole experts program as a user runs it, estimated: routing, the sorted
rows' gather, the kernels, the combine.

``bench_tpu_estimates`` compares the layer's matmuls (what the peers are
kernels for) on rows already sorted by expert. A Transformers layer pays more:
``program.experts_forward`` sorts the picks by expert, gathers the hidden rows
into that order, runs the kernels, and sums each token's picks times their
routing weights. This bench estimates that whole program (``tpu_estimator``:
the kernels from libtpu's schedule and their DMA, every other XLA op at its
static schedule or its HBM bytes, whichever is longer), bf16 weights, a random
top-k routing (seed 0), and splits it into the kernels and the XLA ops around
them, with the three largest of those named.

    python bench/bench_experts_program.py [--chips v6e tpu7x] [--models qwen3-30b-a3b ...]
        [--tokens 64 4096] [--out bench/results/experts_program.md]
        [--from-log LOG] [--before LOG]

``--from-log``: the table from the progress lines of an earlier run instead
of estimating; ``--before``: a column of another run's program times (the
same script run on an earlier commit), and now / before.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import tpu_estimator  # noqa: E402  (sets libtpu's dump folder before jax loads libtpu)
from bench_tpu_estimates import MODELS  # noqa: E402
from common import ROOT, calibration_summary, markdown, use_shipped_packages  # noqa: E402

def program_args(model: str, tokens: int, seed: int = 0):
    """The program's inputs: hidden states, the routing (concrete: the grid
    sizes depend on it), routing weights, the experts' weights (and biases)."""
    import jax
    import jax.numpy as jnp

    hidden, inter, experts, top_k, gate = MODELS[model]
    ids = np.argsort(np.random.default_rng(seed).random((tokens, experts)), axis=1)[:, :top_k].astype(np.int32)
    bf16 = jnp.bfloat16
    args = [jax.ShapeDtypeStruct((tokens, hidden), bf16), ids, jax.ShapeDtypeStruct((tokens, top_k), bf16),
            jax.ShapeDtypeStruct((experts, 2 * inter, hidden), bf16),
            jax.ShapeDtypeStruct((experts, hidden, inter), bf16)]
    if gate == "gpt_oss":  # gpt-oss's experts carry biases
        args += [jax.ShapeDtypeStruct((experts, 2 * inter), bf16), jax.ShapeDtypeStruct((experts, hidden), bf16)]
    return args


PATHS = {"rule": None, "fused": True, "two-matmuls": False}  # --paths: experts_forward's fused=


def estimate_program(chip: str, model: str, tokens: int, path: str = "rule") -> dict:
    from moe_experts_tpu.experts import program

    gate = MODELS[model][4]
    ops = {}

    def record(other_ops, c):  # each other XLA op's time, as the estimator charges it
        if c.name == chip:
            ops.update({name: max(cy / c.clock_hz, b / c.hbm_bytes_per_s) for name, (cy, b) in other_ops.items()})
        return seconds_of(other_ops, c)

    def fn(x, ids, weights, up, down, *biases):
        return program.experts_forward(x, ids, weights, up, down, *(biases or (None, None)),
                                       gate=gate, generation=chip, fused=PATHS[path])

    seconds_of, tpu_estimator.other_ops_seconds = tpu_estimator.other_ops_seconds, record
    try:
        est = tpu_estimator.estimate(fn, program_args(model, tokens), chip, flops=1.0, min_bytes=1.0)
    finally:
        tpu_estimator.other_ops_seconds = seconds_of
    largest = sorted(ops.items(), key=lambda kv: -kv[1])[:3]
    return {
        "model": model, "tokens": tokens, **({"path": path} if path != "rule" else {}),
        "program us": est.seconds * 1e6,
        "kernels us": sum(k.seconds for k in est.kernels) * 1e6,
        "other XLA ops us": est.other_ops_s * 1e6,
        "largest other ops (us)": ", ".join(f"{name} {t * 1e6:.1f}" for name, t in largest),
    }


LINE = re.compile(r"^\[(\S+)\] (\S+) (\d+)(?: \((fused|two-matmuls)\))?: "
                  r"program ([\d.]+) us, kernels ([\d.]+), other ([\d.]+) \((.*)\)$")


def read_log(path) -> dict:
    """``{(chip, model, tokens, path): row}`` from a run's progress lines."""
    rows = {}
    for line in pathlib.Path(path).read_text().splitlines():
        if m := LINE.match(line.strip()):
            chip, model, tokens, forced, program_us, kernels_us, other_us, largest = m.groups()
            rows[chip, model, int(tokens), forced or "rule"] = {
                "model": model, "tokens": int(tokens), **({"path": forced} if forced else {}),
                "program us": float(program_us),
                "kernels us": float(kernels_us), "other XLA ops us": float(other_us),
                "largest other ops (us)": largest}
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chips", nargs="+", default=["v6e", "tpu7x"])
    parser.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-20b", "mixtral-8x7b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[64, 4096])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "experts_program.md"))
    parser.add_argument("--from-log")
    parser.add_argument("--before")
    parser.add_argument("--paths", nargs="+", choices=list(PATHS), default=["rule"],
                        help="the program's path: its rule's, or the fused kernel / two matmuls forced")
    args = parser.parse_args(argv)
    logged = read_log(args.from_log) if args.from_log else None
    before = read_log(args.before) if args.before else {}
    if logged is None:
        use_shipped_packages()
    sections = []
    for chip in args.chips:
        rows = []
        for model in args.models:
            for tokens, path in ((t, p) for t in args.tokens for p in args.paths):
                key = (chip, model, tokens, path)
                if logged is not None:
                    if key not in logged:  # a shape that run did not estimate
                        continue
                    row = dict(logged[key])
                else:
                    row = estimate_program(chip, model, tokens, path)
                    forced = f" ({path})" if path != "rule" else ""
                    print(f"[{chip}] {model} {tokens}{forced}: program {row['program us']:.1f} us, kernels "
                          f"{row['kernels us']:.1f}, other {row['other XLA ops us']:.1f} "
                          f"({row['largest other ops (us)']})", flush=True)
                if key in before:
                    row["before us"] = before[key]["program us"]
                    row["now / before"] = f"{row['program us'] / row['before us']:.2f}"
                rows.append(row)
        sections.append(f"## {chip}\n\nEstimator error on this chip: {calibration_summary(chip, 'ragged dot')}.\n\n"
                        + markdown(rows, "{:.1f}"))
    command = "python bench/bench_experts_program.py --chips " + " ".join(args.chips) + " --models " + \
        " ".join(args.models) + " --tokens " + " ".join(map(str, args.tokens)) + \
        (" --paths " + " ".join(args.paths) if args.paths != ["rule"] else "") + \
        "".join(f" --{k.replace('_', '-')} {v}" for k, v in (("from_log", args.from_log), ("before", args.before)) if v)
    text = ("# The experts program, whole: estimated time (TPU estimator)\n\nGenerated by\n\n    " + command
            + "\n\n" + __doc__.split("\n\n")[1].replace("\n", " ")
            + (f" `before us`: the program times of `{args.before}` (the same script run on the commit its name"
               " gives)." if args.before else "") + "\n\n" + "\n\n".join(sections) + "\n")
    pathlib.Path(args.out).write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
