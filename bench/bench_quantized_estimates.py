"""Quantized expert weights (int8, fp8, mxfp4) against our bf16 experts, by the TPU estimator.

The layer of ``bench_tpu_estimates.py`` (``down(gate(up(x)))`` on rows sorted
by expert, group sizes from a random top-k routing) with the weights in each
format of ``common.quant_formats``: the experts program's ``two_matmuls(...,
weight_format=...)`` (the gate at the up projection's store where
``pallas_qgmm.gated_store_tiling`` allows it, else an XLA pass).
Each contender is compared with its own roofline: the MXU time of the
flops, or the HBM time of what it must move at least (rows in, bf16; the
weights of every expert with rows, in the format: values + scales bytes,
``WeightFormat.hbm_bytes``; rows out, f32), whichever is larger. bf16 is
the better of our two-matmul and fused kernels (the experts program's
rule picks the fused one where it applies).

    python bench/bench_quantized_estimates.py [--chips v6e] [--models ...] [--tokens 1 8 64 512 4096]
        [--formats bf16 int8 fp8 mxfp4] [--out bench/results/tpu_estimates_quantized.md] [--from-logs LOG]

Progress lines go to stderr (``--from-logs`` rebuilds the tables from them).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import tpu_estimator  # noqa: E402  (sets libtpu's dump folder before jax loads libtpu)
from bench_tpu_estimates import MODELS, contender_fn, routing_group_sizes  # noqa: E402
from common import ROOT, calibration_summary, markdown, use_shipped_packages  # noqa: E402

import numpy as np  # noqa: E402

FORMATS = ("bf16", "int8", "fp8", "mxfp4")
RESULTS = ROOT / "bench" / "results"


def weight_bytes(fmt_name: str, experts: int, n: int, k: int) -> int:
    from moe_experts_tpu.common import quant_formats

    if fmt_name == "bf16":
        return 2 * experts * n * k
    return quant_formats.weight_format(fmt_name).hbm_bytes(experts, n, k)


def problem(model: str, tokens: int, fmt_name: str, rng_seed=0):
    """Group sizes, flops and the bytes the layer must move at least in ``fmt_name``."""
    hidden, inter, experts, top_k, _ = MODELS[model]
    gs = routing_group_sizes(tokens, experts, top_k, np.random.default_rng(rng_seed))
    rows = tokens * top_k
    used = int((gs > 0).sum())
    flops = 2.0 * rows * hidden * 3 * inter
    weights = weight_bytes(fmt_name, used, 2 * inter, hidden) + weight_bytes(fmt_name, used, hidden, inter)
    return gs, flops, 2.0 * rows * hidden + weights + 4.0 * rows * hidden


def layer_fn(fmt_name: str, gate: str, generation: str, fused: bool):
    if fmt_name == "bf16":  # our bf16 kernels exactly as the layer table runs them
        return contender_fn("ours fused" if fused else "ours", gate, generation)

    from moe_experts_tpu.experts import program

    def fn(x, up, up_s, down, down_s, gs):  # the experts program's quantized path (gated store where it applies)
        return program.two_matmuls(x, up, down, gs, gate=gate, alpha=1.702, limit=7.0, rhs_layout="nk",
                                   generation=generation, up_scales=up_s, down_scales=down_s,
                                   weight_format=fmt_name)
    return fn


def layer_args(fmt_name: str, model: str, tokens: int, gs):
    import jax
    import jax.numpy as jnp

    from moe_experts_tpu.common import quant_formats

    hidden, inter, experts, top_k, _ = MODELS[model]
    x = jax.ShapeDtypeStruct((tokens * top_k, hidden), jnp.bfloat16)
    shapes = ((experts, 2 * inter, hidden), (experts, hidden, inter))
    if fmt_name == "bf16":
        return [x, *(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes), gs]
    fmt = quant_formats.weight_format(fmt_name)
    args = [x]
    for e, n, k in shapes:
        args += [jax.ShapeDtypeStruct(fmt.values_shape(e, n, k), jnp.dtype(fmt.values_dtype)),
                 jax.ShapeDtypeStruct(fmt.scales_shape(e, n, k), jnp.dtype(fmt.scales_dtype))]
    return args + [gs]


def estimate_one(chip: str, model: str, tokens: int, contender: str) -> tuple[float, float]:
    """(estimated seconds, roofline seconds) of one contender: a format, or "bf16 fused"."""
    fmt_name, fused = contender.split()[0], contender.endswith("fused")
    gs, flops, min_bytes = problem(model, tokens, fmt_name)
    fn = layer_fn(fmt_name, MODELS[model][4], chip, fused)
    est = tpu_estimator.estimate(fn, layer_args(fmt_name, model, tokens, gs), chip, flops=flops,
                                 min_bytes=min_bytes)
    return est.seconds, est.roofline_s


_LINE = re.compile(r"^\[(\S+)\] (\S+) (\d+) (bf16 fused|\S+): ([\d.]+) us \(roofline ([\d.]+) us")


def parse_logs(paths) -> dict:
    out: dict = {}
    for path in paths:
        for line in pathlib.Path(path).read_text().splitlines():
            m = _LINE.match(line)
            if m:
                chip, model, tokens, name, t, r = m.groups()
                out.setdefault((chip, model, int(tokens)), {})[name] = (float(t) * 1e-6, float(r) * 1e-6)
    return out


def run(args) -> dict:
    use_shipped_packages()
    results: dict = {}
    for chip in args.chips:
        for model in args.models:
            for tokens in args.tokens:
                cell = results.setdefault((chip, model, tokens), {})
                for name in args.formats:
                    t0 = time.time()
                    try:
                        cell[name] = estimate_one(chip, model, tokens, name)
                    except Exception as exc:  # noqa: BLE001 -- reported in the table
                        print(f"[{chip}] {model} {tokens} {name}: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:200]}", file=sys.stderr, flush=True)
                        continue
                    t, r = cell[name]
                    print(f"[{chip}] {model} {tokens} {name}: {t * 1e6:.1f} us (roofline {r * 1e6:.1f} us, "
                          f"{time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    return results


def table(chip: str, results: dict, models, tokens_list, formats) -> str:
    rows = []
    for model in models:
        for tokens in tokens_list:
            cell = results.get((chip, model, tokens))
            if not cell:
                continue
            bf16 = [cell[n][0] for n in ("bf16", "bf16 fused") if n in cell]
            best_bf16 = min(bf16) if bf16 else None
            row = {"model": model, "tokens": tokens,
                   "bf16 us (best of ours)": f"{best_bf16 * 1e6:.1f}" if best_bf16 else "-"}
            for fmt_name in [f for f in formats if not f.startswith("bf16")]:
                if fmt_name not in cell:
                    row[f"{fmt_name} us"] = row[f"{fmt_name} speed-up"] = row[f"{fmt_name} / roofline"] = "-"
                    continue
                t, r = cell[fmt_name]
                row[f"{fmt_name} us"] = f"{t * 1e6:.1f}"
                row[f"{fmt_name} speed-up"] = f"{best_bf16 / t:.2f}x" if best_bf16 else "-"
                row[f"{fmt_name} / roofline"] = f"{t / r:.2f}"
            if "bf16" in cell:
                row["bf16 / roofline"] = f"{best_bf16 / cell['bf16'][1]:.2f}"
            rows.append(row)
    return markdown(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chips", nargs="+", default=["v6e"])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 512, 4096])
    ap.add_argument("--formats", nargs="+", default=["bf16", "bf16 fused", "int8", "fp8", "mxfp4"])
    ap.add_argument("--out", default=str(RESULTS / "tpu_estimates_quantized.md"))
    ap.add_argument("--from-logs", nargs="+", default=None)
    args = ap.parse_args(argv)
    results = parse_logs(args.from_logs) if args.from_logs else run(args)
    sections = []
    for chip in args.chips:
        sections.append(f"## {chip} ({tpu_estimator.CHIPS[chip].topology})\n\n"
                        f"Estimator error on this chip: {calibration_summary(chip, 'ragged dot')}.\n\n"
                        + table(chip, results, args.models, args.tokens, args.formats))
    text = ("# Quantized expert weights: estimated layer time (TPU estimator)\n\n"
            "Generated by `python bench/bench_quantized_estimates.py` (see its docstring). Each format's "
            "speed-up is against the best of our bf16 kernels (two matmuls or fused); `/ roofline` is "
            "against the format's own roofline (values + scales bytes).\n\n" + "\n\n".join(sections) + "\n")
    pathlib.Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
