"""Training: the experts layer's grouped matmuls forward and backward, ours against tokamax, by the TPU estimator.

Per matmul of the layer (up: ``[M, H] x [E, H, 2I]``, down: ``[M, I] x [E, I, H]``)
the three kernels a training step runs: the forward, the input gradient
(``dlhs = dout @ W^T`` per group) and the weight gradient (``drhs = x^T @
dout`` per group), bf16 in and out, group sizes of a random top-k routing
(``bench_tpu_estimates.routing_group_sizes``, seed 0; ``--routing skewed``: its
skewed routing, a few hot experts and a cold or empty tail, with tokamax at the
same starts). The gate's backward is elementwise and the same for everyone: not
counted.

- ours: ``gmm`` (forward), ``gmm`` on the other weight layout (input
  gradient), ``tgmm`` (weight gradient), our tile rule: what the torch op's
  autograd runs;
- tokamax 0.0.12 ``PallasMosaicTpuRaggedDot``: each of its three kernels at the
  best of its starts (estimated here, every one recorded in the log): the
  entries of its own tuned tables for that kernel and the same (K, N) (its
  tables hold training-sized M: the entry of the nearest M of each expert
  count), the best forward tiles of ``peer_sweep.jsonl`` for the shape,
  MaxText's (512, 1024, 1024) and our forward rule's tiles for the shape. Not a
  walk: its best may lie off these starts.

The MXU-bound time is 3 x 2 x M x K x N flops per matmul at the chip's bf16
peak; the roofline is, per matmul, the sum over its three kernels of max(the
kernel's MXU-bound time, the HBM time of its bf16 bytes: two of x [M, K],
dout [M, N], W [E, K, N] read, the third written; the forward and input
gradient read only the weights of experts with rows, the weight gradient
writes every expert's, zeros included). A kernel with fewer flops per byte than the chip's peak
ratio is HBM-bound and its MXU-bound time out of reach (Qwen3-30B-A3B at
4096 tokens: its 128 experts' weights and gradients outweigh the rows).
Writes bench/results/tpu_training_estimates.md (``--routing skewed``:
tpu_training_estimates_skewed.md; ``balanced``: every expert the same rows,
tpu_training_estimates_balanced.md).

    python bench/bench_training_estimates.py [--chips v6e] [--models ...] [--tokens 4096 16384]
        [--routing uniform|skewed|balanced] [--breakdown]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import peer_sweep  # noqa: E402
import tpu_estimator  # noqa: E402  (sets libtpu's dump folder before jax loads libtpu)
from bench_tpu_estimates import MODELS, ROUTINGS, problem_size  # noqa: E402
from common import ROOT, calibration_summary, markdown, use_shipped_packages  # noqa: E402

KERNELS = ("forward", "dlhs", "drhs")
RESULTS = ROOT / "bench" / "results"


def matmul_dims(model: str, tokens: int, matmul: str) -> tuple[int, int, int, int]:
    return peer_sweep.matmul_shape(model, tokens, matmul)


def tokamax_table_starts(kernel: str, m: int, k: int, n: int) -> list[tuple[int, ...]]:
    """tokamax's tuned entries for ``kernel`` and the same (K, N): per expert
    count, the entry of the M nearest ``m``."""
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tk

    table = {"forward": tk.GMM_TILING_TUNED_LUT, "dlhs": tk.GMM_RHS_TRANSPOSE_TILING_TUNED_LUT,
             "drhs": tk.TGMM_TILING_TUNED_LUT}[kernel]
    nearest: dict[int, tuple] = {}
    for (mm, kk, nn, g, quantized), (tiles, buffers) in table.items():
        if (kk, nn) == (k, n) and not quantized:
            if g not in nearest or abs(mm - m) < abs(nearest[g][0] - m):
                nearest[g] = (mm, tuple(tiles) + (buffers,))
    return [config for _, config in nearest.values()]


def tokamax_starts(chip: str, model: str, tokens: int, matmul: str, kernel: str) -> list[tuple[int, ...]]:
    m, k, n, experts = matmul_dims(model, tokens, matmul)
    starts = tokamax_table_starts(kernel, m, k, n)
    swept = peer_sweep.Record().best(chip, "tokamax", model, tokens, matmul)
    if swept:
        starts.append(tuple(swept[0]))
    starts.append(peer_sweep.MAXTEXT_MEGABLOX + (2,))
    starts.append(our_forward_tiles(chip, m, k, n, experts) + (2,))
    return list(dict.fromkeys(starts))


def our_forward_tiles(chip: str, m: int, k: int, n: int, experts: int) -> tuple[int, int, int]:
    from moe_experts_tpu.gmm import tiling

    return tiling.choose_tiling(m, k, n, experts, lhs_itemsize=2, rhs_itemsize=2, out_itemsize=2,
                                generation=chip).as_tuple()


def tokamax_kernel(kernel: str, config: tuple[int, ...]):
    """``fn(x, w [E, K, N], dout, gs)`` running one of tokamax's kernels at ``config``."""
    import jax.numpy as jnp
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tk

    tm, tk_, tn, buffers = config
    op = tk.PallasMosaicTpuRaggedDot(config=tk.Config(tile_m=tm, tile_k=tk_, tile_n=tn, input_buffer_count=buffers))
    if kernel == "forward":
        return lambda x, w, dout, gs: op(x, w, group_sizes=gs, preferred_element_type=jnp.bfloat16)
    if kernel == "dlhs":
        return lambda x, w, dout, gs: op(dout, w, group_sizes=gs, ragged_dot_dimension_numbers=tk.DLHS_RAGGED_DOT_DIM_NUMS,
                                         preferred_element_type=jnp.bfloat16)
    return lambda x, w, dout, gs: op(x, dout, group_sizes=gs, ragged_dot_dimension_numbers=tk.DRHS_RAGGED_DOT_DIM_NUMS,
                                     preferred_element_type=jnp.bfloat16)


def ours(generation: str, kernels=KERNELS):
    """``fn(x, w [E, N, K], dout, gs)``: our ``kernels``, as the torch op's autograd runs them."""
    import jax.numpy as jnp

    from moe_experts_tpu.gmm import pallas_gmm

    run = {
        "forward": lambda x, w, dout, gs: pallas_gmm.gmm(x, w, gs, rhs_layout="nk", out_dtype=jnp.bfloat16,
                                                         generation=generation),
        "dlhs": lambda x, w, dout, gs: pallas_gmm.gmm(dout, w, gs, rhs_layout="kn", out_dtype=jnp.bfloat16,
                                                      generation=generation),
        "drhs": lambda x, w, dout, gs: pallas_gmm.tgmm(x, dout, gs, num_local_groups=w.shape[0], rhs_layout="nk",
                                                       out_dtype=jnp.bfloat16, generation=generation),
    }
    return lambda x, w, dout, gs: tuple(run[kernel](x, w, dout, gs) for kernel in kernels)


def breakdown(chip: str, model: str, tokens: int, routing: str = "uniform") -> None:
    """Prints each of our kernels alone (no peers, no table): the figures of
    the tile rules' docstrings (``gmm/tiling.py``)."""
    for matmul in peer_sweep.MATMULS:
        args, (m, k, n) = arguments(model, tokens, matmul, "nk", routing)
        for kernel in KERNELS:
            us = estimate_us("ours", ours(chip, (kernel,)), args, chip, m, k, n, 1)
            print(f"[{chip}] {model} {tokens} {matmul} ours {kernel}: {us:.1f} us", flush=True)


def arguments(model: str, tokens: int, matmul: str, weight_layout: str, routing: str = "uniform"):
    import jax
    import jax.numpy as jnp

    m, k, n, experts = matmul_dims(model, tokens, matmul)
    gs, _, _ = problem_size(model, tokens, routing=routing)
    weight = (experts, n, k) if weight_layout == "nk" else (experts, k, n)
    bf16 = jnp.bfloat16
    return [jax.ShapeDtypeStruct((m, k), bf16), jax.ShapeDtypeStruct(weight, bf16),
            jax.ShapeDtypeStruct((m, n), bf16), gs], (m, k, n)


def estimate_us(peer: str, fn, args, chip: str, m: int, k: int, n: int, passes: int) -> float:
    flops = passes * 2.0 * m * k * n
    est = peer_sweep.estimate_peer(peer, fn, args, chip, flops=flops, min_bytes=passes * 2.0 * (m * k + m * n))
    return est.seconds * 1e6


def run(chip: str, model: str, tokens: int, routing: str = "uniform", log=sys.stderr) -> dict:
    """{matmul: {"ours": us, "tokamax": {kernel: (us, config)}, "mxu": us}}."""
    row = {}
    chip_ = tpu_estimator.CHIPS[chip]
    for matmul in peer_sweep.MATMULS:
        args, (m, k, n) = arguments(model, tokens, matmul, "nk", routing)
        t0 = time.time()
        ours_us = estimate_us("ours", ours(chip), args, chip, m, k, n, 3)
        print(f"[{chip}] {model} {tokens} {matmul} ours: {ours_us:.1f} us ({time.time() - t0:.0f} s)", file=log,
              flush=True)
        peer = {}
        targs, _ = arguments(model, tokens, matmul, "kn", routing)
        for kernel in KERNELS:
            for config in tokamax_starts(chip, model, tokens, matmul, kernel):
                t0 = time.time()
                try:
                    us = estimate_us("tokamax", tokamax_kernel(kernel, config), targs, chip, m, k, n, 1)
                except Exception as exc:  # noqa: BLE001 -- a config tokamax or the compiler refuses
                    print(f"[{chip}] {model} {tokens} {matmul} tokamax {kernel} {config}: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}",
                          file=log, flush=True)
                    continue
                print(f"[{chip}] {model} {tokens} {matmul} tokamax {kernel} {config}: {us:.1f} us "
                      f"({time.time() - t0:.0f} s)", file=log, flush=True)
                if kernel not in peer or us < peer[kernel][0]:
                    peer[kernel] = (us, config)
        experts = matmul_dims(model, tokens, matmul)[3]
        used = int((args[3] > 0).sum())
        mxu = 2.0 * m * k * n / chip_.bf16_flops_per_s * 1e6  # one kernel's
        # Each kernel reads two of (x, W, dout) and writes the third, bf16: the forward and the input gradient
        # only the weights of experts with rows, the weight gradient every expert's gradient.
        hbm = [2.0 * (m * k + m * n + e * k * n) / chip_.hbm_bytes_per_s * 1e6 for e in (used, used, experts)]
        row[matmul] = {"ours": ours_us, "tokamax": peer, "mxu": 3 * mxu,
                       "roofline": sum(max(mxu, kernel_hbm) for kernel_hbm in hbm)}
    return row


def table_row(model: str, tokens: int, row: dict) -> dict:
    ours_us = sum(r["ours"] for r in row.values())
    mxu = sum(r["mxu"] for r in row.values())
    roofline = sum(r["roofline"] for r in row.values())
    complete = all(len(r["tokamax"]) == len(KERNELS) for r in row.values())
    peer_us = sum(us for r in row.values() for us, _ in r["tokamax"].values()) if complete else None
    configs = "; ".join(f"{matmul} " + ", ".join(f"{kernel} {c[:3]} x{c[3]}" for kernel, (_, c) in r["tokamax"].items())
                        for matmul, r in row.items())
    return {"model": model, "tokens": tokens, "ours us": f"{ours_us:.0f}",
            "tokamax us": f"{peer_us:.0f}" if peer_us else "-",
            "ours / tokamax": f"{ours_us / peer_us:.2f}" if peer_us else "-",
            "MXU-bound us": f"{mxu:.0f}", "ours / MXU-bound": f"{ours_us / mxu:.2f}",
            "roofline us": f"{roofline:.0f}", "ours / roofline": f"{ours_us / roofline:.2f}",
            "tokamax configs (tm, tk, tn) x buffers": configs}


def main(argv=None):
    from absl import flags

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chips", nargs="+", default=["v6e"])
    ap.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-20b", "mixtral-8x7b"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--routing", choices=ROUTINGS, default="uniform",
                    help="group sizes of the routing; skewed / balanced: tokamax keeps the same starts")
    ap.add_argument("--out", default=None, help="default: results/tpu_training_estimates.md (_<routing>.md)")
    ap.add_argument("--breakdown", action="store_true", help="print each of our kernels alone; no peers, no table")
    args = ap.parse_args(argv)
    flags.FLAGS(sys.argv[:1], known_only=True)  # tokamax reads absl flags
    use_shipped_packages()
    if args.breakdown:
        for chip in args.chips:
            for model in args.models:
                for tokens in args.tokens:
                    breakdown(chip, model, tokens, args.routing)
        return
    sections = []
    for chip in args.chips:
        rows = [table_row(model, tokens, run(chip, model, tokens, args.routing)) for model in args.models
                for tokens in args.tokens]
        sections.append(f"## {chip}\n\nEstimator error on this chip: {calibration_summary(chip, 'ragged dot')}.\n\n"
                        + markdown(rows))
    command = ("python bench/bench_training_estimates.py --chips " + " ".join(args.chips) + " --models "
               + " ".join(args.models) + " --tokens " + " ".join(map(str, args.tokens))
               + ("" if args.routing == "uniform" else f" --routing {args.routing}"))
    suffix = "" if args.routing == "uniform" else f"_{args.routing}"
    out = pathlib.Path(args.out or RESULTS / f"tpu_training_estimates{suffix}.md")
    routing = {"uniform": "",
               "skewed": " Routing: bench_tpu_estimates' skewed top-k (a few hot experts, a cold or empty tail); "
                         "tokamax at the same starts as for the uniform routing.",
               "balanced": " Routing: bench_tpu_estimates' balanced one (every expert the same rows); tokamax at "
                           "the same starts as for the uniform routing."}[args.routing]
    out.write_text(
        "# Training: the experts layer's grouped matmuls, forward + both gradients, estimated\n\n"
        "Generated by `bench/bench_training_estimates.py` (its docstring says what runs); estimates from the TPU "
        "compiler's static schedule (`bench/tpu_estimator.py`), not measurements. Both matmuls of the layer (up, "
        "down), each forward + input gradient + weight gradient, bf16; < 1 in 'ours / tokamax': ours is faster. "
        "tokamax at the best of its starts (its tuned tables, the forward sweep's best, MaxText's tiles, our "
        "forward rule's tiles) per "
        f"kernel.{routing}\n\n    {command}\n\n" + "\n\n".join(sections) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
