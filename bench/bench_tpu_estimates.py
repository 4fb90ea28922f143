"""Our MoE experts kernels against the peers on TPU, by the TPU estimator.

One experts layer's matmuls on the rows already sorted by expert (the part
the kernels differ in): ``down(gate(up(x)))`` with group sizes drawn from a
random top-k routing, at Qwen3-30B-A3B, gpt-oss-20b, Mixtral-8x7B and
DeepSeek-V3 shapes, 1 to 4096 tokens. Contenders, all compiled here for the
chip and estimated from the compiler's schedule (bench/tpu_estimator.py;
calibration error in bench/results/tpu_calibration.md):

- ours, two matmuls: ``gmm`` (up, f32 out) -> gate -> ``gmm`` (down), our tiling rule;
- ours, fused: ``fused_glu_experts`` (both matmuls and the gate in one kernel);
- tokamax 0.0.12 ``PallasMosaicTpuRaggedDot`` twice, its own default config;
- JAX's megablox ``gmm`` twice, its default tiling (128, 128, 128).

A peer at a named config: ``tokamax@tm,tk,tn[,input buffers]`` or
``megablox@tm,tk,tn`` in ``--contenders``; the table then adds the best peer
of the row and its ratio to ours.

Weights are in Transformers' ``[E, out, in]`` layout for ours, ``[E, in, out]``
for the peers (their layout): the same bytes. Writes bench/results/tpu_estimates.md
and tpu_estimates.png.

    python bench/bench_tpu_estimates.py [--chips v5e v6e] [--models qwen3 ...] [--tokens 1 8 ...]
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import tpu_estimator  # noqa: E402  (sets libtpu's dump folder before jax loads libtpu)
from calibrate_tpu_estimator import PipelineRecorder  # noqa: E402
from common import ROOT, markdown, use_shipped_packages  # noqa: E402

MODELS = {  # hidden, intermediate, experts, top_k, gate
    "qwen3-30b-a3b": (2048, 768, 128, 8, "glu_silu"),
    "gpt-oss-20b": (2880, 2880, 32, 4, "glu_silu"),
    "mixtral-8x7b": (4096, 14336, 8, 2, "glu_silu"),
    "deepseek-v3": (7168, 2048, 256, 8, "glu_silu"),
}
CONTENDERS = ("ours", "ours fused", "tokamax", "megablox")
RESULTS = ROOT / "bench" / "results"


def routing_group_sizes(tokens, experts, top_k, rng) -> np.ndarray:
    """Group sizes of a random top-k routing (k distinct experts per token)."""
    picks = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    return np.bincount(picks.reshape(-1), minlength=experts).astype(np.int32)


def contender_fn(name, gate, generation):
    import jax.numpy as jnp

    from moe_experts_tpu.experts import pallas_fused_experts
    from moe_experts_tpu.experts.gates import apply_gate
    from moe_experts_tpu.gmm import pallas_gmm

    def act(h):
        return apply_gate(h, gate, 1.702, 7.0).astype(jnp.bfloat16)

    if name == "ours":
        def fn(x, up, down, gs):
            h = pallas_gmm.gmm(x, up, gs, rhs_layout="nk", out_dtype=jnp.float32, generation=generation)
            return pallas_gmm.gmm(act(h), down, gs, rhs_layout="nk", out_dtype=jnp.float32, generation=generation)
    elif name == "ours fused":
        def fn(x, up, down, gs):
            # The experts program's own rule: the row tile whose working set
            # fits VMEM, or none (then it runs the two matmuls).
            tm = pallas_fused_experts.fused_row_tile(gate, "nk", x.shape[0], x.shape[1], up.shape[1] // 2,
                                                     up.shape[0], up.dtype.itemsize, generation)
            if tm is None:
                raise ValueError("one expert does not fit VMEM: the rule runs two matmuls")
            return pallas_fused_experts.fused_glu_experts(x, up, down, gs, gate=gate, out_dtype=jnp.float32,
                                                          tm=tm, generation=generation)
    elif peer_name(name) == "tokamax":
        from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tk

        config = peer_config(name)
        if config is None:
            op = tk.PallasMosaicTpuRaggedDot()
        else:
            tm, tk_, tn, *buffers = config
            op = tk.PallasMosaicTpuRaggedDot(config=tk.Config(
                tile_m=tm, tile_k=tk_, tile_n=tn, input_buffer_count=buffers[0] if buffers else 2))

        def fn(x, up, down, gs):
            h = op(x, up, group_sizes=gs, preferred_element_type=jnp.float32)
            return op(act(h), down, group_sizes=gs, preferred_element_type=jnp.float32)
    elif peer_name(name) == "megablox":
        from jax.experimental.pallas.ops.tpu.megablox import gmm

        tiling = dict(tiling=peer_config(name)[:3]) if peer_config(name) else {}

        def fn(x, up, down, gs):
            h = gmm(x, up, gs, preferred_element_type=jnp.float32, **tiling)
            return gmm(act(h), down, gs, preferred_element_type=jnp.float32, **tiling)
    else:
        raise ValueError(name)
    return fn


def peer_name(contender: str) -> str:
    """``"tokamax@512,2048,1024,3"`` -> ``"tokamax"``."""
    return contender.split("@")[0]


def peer_config(contender: str) -> tuple[int, ...] | None:
    """A peer's named config: ``name@tm,tk,tn`` (tokamax may add its input
    buffer count: ``,3``); None: the peer's own default."""
    if "@" not in contender:
        return None
    return tuple(int(v) for v in contender.split("@")[1].split(","))


def weight_specs(name, hidden, inter, experts):
    import jax
    import jax.numpy as jnp

    bf16 = jnp.bfloat16
    if name.startswith("ours"):  # Transformers' [E, out, in]
        return (jax.ShapeDtypeStruct((experts, 2 * inter, hidden), bf16),
                jax.ShapeDtypeStruct((experts, hidden, inter), bf16))
    return (jax.ShapeDtypeStruct((experts, hidden, 2 * inter), bf16),
            jax.ShapeDtypeStruct((experts, inter, hidden), bf16))


def problem_size(model, tokens, rng_seed=0):
    """Group sizes, flops, and the bytes the layer must move at least: the
    rows in (bf16), the weights of every expert with rows, the rows out (f32)."""
    hidden, inter, experts, top_k, _ = MODELS[model]
    gs = routing_group_sizes(tokens, experts, top_k, np.random.default_rng(rng_seed))
    rows = tokens * top_k
    flops = 2.0 * rows * hidden * 3 * inter
    used = int((gs > 0).sum())
    min_bytes = 2.0 * (rows * hidden + used * 3 * hidden * inter) + 4.0 * rows * hidden
    return gs, flops, min_bytes


def estimate_one(chip, model, tokens, name, rng_seed=0):
    import jax
    import jax.numpy as jnp

    hidden, inter, experts, top_k, gate = MODELS[model]
    gs, flops, min_bytes = problem_size(model, tokens, rng_seed)
    x = jax.ShapeDtypeStruct((tokens * top_k, hidden), jnp.bfloat16)
    up, down = weight_specs(name, hidden, inter, experts)
    fn = contender_fn(name, gate, chip)
    if peer_name(name) == "tokamax":
        with PipelineRecorder() as recorder:
            return tpu_estimator.estimate(fn, [x, up, down, gs], chip, flops=flops, min_bytes=min_bytes,
                                          replay_for=recorder.replay_for())
    return tpu_estimator.estimate(fn, [x, up, down, gs], chip, flops=flops, min_bytes=min_bytes)


_LINE = re.compile(r"^\[(\S+)\] (\S+) (\d+) (ours fused|ours|tokamax\S*|megablox\S*): (.*)$")
_TIME = re.compile(r"^([\d.]+) us \(roofline")


def parse_logs(paths) -> dict:
    """{(chip, model, tokens): {contender: seconds or error text}} from the
    progress lines this script prints (``--from-logs``: tables from runs that
    were cut short)."""
    out: dict = {}
    for path in paths:
        for line in pathlib.Path(path).read_text().splitlines():
            m = _LINE.match(line)
            if m:
                chip, model, tokens, name, rest = m.groups()
                t = _TIME.match(rest)
                out.setdefault((chip, model, int(tokens)), {})[name] = float(t.group(1)) * 1e-6 if t else rest
    return out


def _short_reason(error) -> str:
    """Why a contender has no estimate, in a few words."""
    text = str(error)
    for needle, reason in (("CompileTimeHbmOom", "weights exceed the chip's HBM"),
                           ("must be >= 128", "takes >= 128 rows only"),
                           ("must be divisible by x-dimension tile size", "rows must be a multiple of its 128 tile"),
                           ("does not fit VMEM", "rule runs two matmuls (expert > VMEM)")):
        if needle in text:
            return reason
    return text.splitlines()[0][:70]


def table_row(chip, model, tokens, results, contenders):
    chip_ = tpu_estimator.CHIPS[chip]
    _, flops, min_bytes = problem_size(model, tokens)
    mxu, hbm = flops / chip_.bf16_flops_per_s, min_bytes / chip_.hbm_bytes_per_s
    roofline = max(mxu, hbm)
    times = {n: v for n, v in results.items() if isinstance(v, float)}
    notes = [f"{n}: {_short_reason(v)}" for n, v in results.items() if not isinstance(v, float)]
    best_ours = min((times[n] for n in ("ours", "ours fused") if n in times), default=None)
    row = {"model": model, "tokens": tokens}
    for name in contenders:
        row[f"{name} us"] = f"{times[name] * 1e6:.1f}" if name in times else "-"
    for peer in ("tokamax", "megablox"):
        if peer in contenders:
            row[f"{peer} / ours"] = f"{times[peer] / best_ours:.2f}" if peer in times and best_ours else "-"
    peers = {n: t for n, t in times.items() if not n.startswith("ours")}
    if any(peer_config(n) for n in contenders):  # named configs: the best of every peer run
        best = min(peers, key=peers.get, default=None)
        row["best peer"] = best or "-"
        row["best peer / ours"] = f"{peers[best] / best_ours:.2f}" if best and best_ours else "-"
    row["roofline us"] = f"{roofline * 1e6:.1f} ({'HBM' if hbm >= mxu else 'MXU'})"
    row["ours / roofline"] = f"{best_ours / roofline:.2f}" if best_ours else "-"
    row["notes"] = "; ".join(notes)
    return row, times, roofline


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chips", nargs="+", default=["v5e", "v6e"])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 512, 4096])
    ap.add_argument("--contenders", nargs="+", default=list(CONTENDERS))
    ap.add_argument("--out", default=str(RESULTS / "tpu_estimates.md"))
    ap.add_argument("--from-logs", nargs="+", default=None,
                    help="build the tables from the progress output of earlier runs instead of estimating")
    args = ap.parse_args(argv)
    if args.from_logs:
        results = parse_logs(args.from_logs)
    else:
        from absl import flags

        flags.FLAGS(sys.argv[:1], known_only=True)  # tokamax reads absl flags
        use_shipped_packages()
        results = {}
        for chip in args.chips:
            for model in args.models:
                for tokens in args.tokens:
                    cell = results.setdefault((chip, model, tokens), {})
                    for name in args.contenders:
                        t0 = time.time()
                        try:
                            est = estimate_one(chip, model, tokens, name)
                        except Exception as exc:  # noqa: BLE001 -- a contender that cannot run a shape is reported
                            cell[name] = f"{type(exc).__name__}: {exc}"
                            print(f"[{chip}] {model} {tokens} {name}: {cell[name].splitlines()[0]}", file=sys.stderr)
                            continue
                        cell[name] = est.seconds
                        unmatched = "" if all(k.regions_matched for k in est.kernels) else " MXU regions unmatched"
                        print(f"[{chip}] {model} {tokens} {name}: {est.seconds * 1e6:.1f} us "
                              f"(roofline {est.roofline_s * 1e6:.1f} us, {time.time() - t0:.0f} s){unmatched}",
                              file=sys.stderr)
    sections, plot_rows = [], []
    for chip in args.chips:
        keys = [k for k in results if k[0] == chip]
        if not keys:
            continue
        rows = []
        for _, model, tokens in sorted(keys, key=lambda k: (list(MODELS).index(k[1]), k[2])):
            row, times, roofline = table_row(chip, model, tokens, results[(chip, model, tokens)], args.contenders)
            rows.append(row)
            plot_rows.append((chip, model, tokens, times, roofline))
        missing = [f"{m} {t}" for m in args.models for t in args.tokens if (chip, m, t) not in results]
        note = f"\n\nNot estimated in this run (cut short): {', '.join(missing)}." if missing else ""
        sections.append(f"## {chip} ({tpu_estimator.CHIPS[chip].topology})\n\n" + markdown(rows) + note)
    out = pathlib.Path(args.out)
    out.write_text(
        "# MoE experts on TPU: estimated times, ours against the peers\n\n"
        "Generated by `python bench/bench_tpu_estimates.py`. Estimates from the TPU compiler's static "
        "schedule (`bench/tpu_estimator.py`), not measurements on a TPU; the estimator's error against "
        "measured timings is in `tpu_calibration.md`. One experts layer's two matmuls and the gate on rows "
        "sorted by expert, bf16 inputs, f32 outputs, group sizes from a random top-k routing (seed 0). "
        "Ratios use the best of our two kernels ('ours' = two gmm calls, 'ours fused' = one kernel); "
        "> 1: the peer is slower. Roofline: max(MXU-bound, HBM-bound: rows in, the weights of the experts "
        "that have rows, rows out). The peers run their defaults: at every shape here both tokamax (its "
        "heuristics; its tuned tables do not cover these shapes) and megablox use 128 x 128 x 128 tiles, so "
        "most of their time is per-step overhead; tuned peer tiles were not estimated. Neither peer takes "
        "fewer than 128 rows (decode).\n\n" + "\n\n".join(sections) + "\n")
    _plot(plot_rows, out.with_suffix(".png"))
    print(f"wrote {out}")


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chips = sorted({r[0] for r in rows})
    models = list(dict.fromkeys(r[1] for r in rows))
    if not chips or not models:
        return
    fig, axes = plt.subplots(len(chips), len(models), figsize=(4 * len(models), 3.2 * len(chips)), squeeze=False)
    for i, chip in enumerate(chips):
        for j, model in enumerate(models):
            ax = axes[i][j]
            sel = [r for r in rows if r[0] == chip and r[1] == model]
            tokens = [r[2] for r in sel]
            if not any(r[3] for r in sel):  # e.g. weights larger than the chip's HBM
                ax.text(0.5, 0.5, "no estimate", ha="center", va="center", transform=ax.transAxes)
                ax.set_title(f"{model}, {chip}", fontsize=9)
                continue
            for name in CONTENDERS:
                ys = [r[3].get(name, np.nan) / r[4] for r in sel]
                ax.plot(tokens, ys, marker="o", label=name)
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{model}, {chip}", fontsize=9)
            ax.set_xlabel("tokens")
            ax.set_ylabel("estimate / roofline")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
