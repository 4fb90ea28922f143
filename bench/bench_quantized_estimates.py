"""Quantized expert weights (int8, fp8, mxfp4) against our bf16 experts, by the TPU estimator.

The layer of ``bench_tpu_estimates.py`` (``down(gate(up(x)))`` on rows sorted
by expert, group sizes from a random top-k routing) with the weights in each
format of ``common.quant_formats``, down the experts program's path: the
fused experts kernel where ``program.fused_kernel_row_tile`` takes it (int8,
fp8; marked ``*`` in the table), else ``two_matmuls(..., weight_format=...)``
(the gate at the up projection's store where
``pallas_qgmm.gated_store_tiling`` allows it, else an XLA pass). A contender
"int8 fused" / "fp8 fused" forces the fused kernel (its own row tile).
Our contenders run on the rows as the experts program lays them out (each
expert's rows aligned to 128 where ``program.group_alignment`` says, for
bf16, and for a format where ``program.GROUP_ALIGN_QUANTIZED`` takes the
rule; ``aligned_layer_args``), the peers on their own.
Each contender is compared with its own roofline: the MXU time of the
flops, or the HBM time of what it must move at least (rows in, bf16; the
weights of every expert with rows, in the format: values + scales bytes,
``WeightFormat.hbm_bytes``; rows out, f32), whichever is larger. bf16 is
the better of our two-matmul and fused kernels (the experts program's
rule picks the fused one where it applies).

Peers (``--peers int8 fp8 mxfp4``, or ``"tpu-inference-gmm int8"`` in
``--formats``): tpu-inference 0.32.0's grouped matmul on the same format
(``tpu_inference_peers.quantized_gmm_fn``: its ``gmm`` with ``rhs_scale``, at
the tiles it picks itself), the same layer, compared with our own format's
roofline; the table adds ``ours / tpu-inference`` per format.

    python bench/bench_quantized_estimates.py [--chips v6e] [--models ...] [--tokens 1 8 64 512 4096]
        [--formats bf16 int8 fp8 mxfp4] [--peers int8 fp8 mxfp4]
        [--out bench/results/tpu_estimates_quantized.md] [--from-logs LOG]

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
import tpu_inference_peers  # noqa: E402  (tpu-inference 0.32.0's gmm on quantized weights)
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


def layer_fn(fmt_name: str, gate: str, generation: str, fused: bool, fused_tm: int | None = None):
    """The layer of ``fmt_name``'s weights; quantized: the fused kernel at row
    tile ``fused_tm`` when ``fused`` (decided on the problem's own rows, as
    the program decides before it pads them), else the two grouped matmuls."""
    if fmt_name == "bf16":  # our bf16 kernels exactly as the layer table runs them
        return contender_fn("ours fused" if fused else "ours", gate, generation)

    from moe_experts_tpu.experts import pallas_fused_experts, program

    def fn(x, up, up_s, down, down_s, gs):
        if fused:
            return pallas_fused_experts.fused_glu_experts(x, up, down, gs, gate=gate, generation=generation,
                                                          tm=fused_tm, up_scales=up_s, down_scales=down_s,
                                                          weight_format=fmt_name)
        # the gate at the up projection's store where it applies
        return program.two_matmuls(x, up, down, gs, gate=gate, alpha=1.702, limit=7.0, rhs_layout="nk",
                                   generation=generation, up_scales=up_s, down_scales=down_s,
                                   weight_format=fmt_name)
    return fn


def runs_fused(fmt_name: str, gate: str, generation: str, rows: int, up, down) -> bool:
    """Whether the experts program runs ``fmt_name``'s weights through the fused kernel here."""
    from moe_experts_tpu.experts import program

    return program.fused_kernel_row_tile(rows, up, down, None, None, gate, "nk", generation, fmt_name, 2) is not None


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


def peer_format(contender: str) -> str | None:
    """``"tpu-inference-gmm fp8"`` -> ``"fp8"``; our own contenders -> None."""
    prefix = tpu_inference_peers.QUANTIZED_PREFIX
    return contender[len(prefix):] if contender.startswith(prefix) else None


def estimate_peer(chip: str, model: str, tokens: int, fmt_name: str) -> tuple[float, float]:
    """tpu-inference's gmm on ``fmt_name``'s weights, the same layer (the gate
    between its two calls, as ``bench_tpu_estimates``' bf16 tpu-inference-gmm),
    against our format's roofline: the same problem, whatever it pads."""
    from moe_experts_tpu.experts.gates import apply_gate
    import jax.numpy as jnp

    hidden, inter, experts, top_k, gate = MODELS[model]
    gs, flops, min_bytes = problem(model, tokens, fmt_name)
    fn = tpu_inference_peers.quantized_gmm_fn(lambda h: apply_gate(h, gate, 1.702, 7.0).astype(jnp.bfloat16))
    args = tpu_inference_peers.quantized_gmm_args(fmt_name, tokens * top_k, hidden, inter, experts, gs)
    est = tpu_estimator.estimate(fn, args, chip, flops=flops, min_bytes=min_bytes)
    return est.seconds, est.roofline_s


def estimate_one(chip: str, model: str, tokens: int, contender: str) -> tuple[float, float]:
    """(estimated seconds, roofline seconds) of one contender: a format, "bf16
    fused", or a peer on a format ("tpu-inference-gmm int8")."""
    if peer_format(contender):
        return estimate_peer(chip, model, tokens, peer_format(contender))
    fmt_name, fused = contender.split()[0], contender.endswith("fused")
    gs, flops, min_bytes = problem(model, tokens, fmt_name)
    hidden, inter, experts, top_k, gate = MODELS[model]
    rows, fused_tm = tokens * top_k, None
    if fmt_name != "bf16":  # the program's path and row tile, on its unpadded rows
        from moe_experts_tpu.experts import pallas_fused_experts

        fused = fused or runs_fused(fmt_name, gate, chip, rows, *layer_args(fmt_name, model, tokens, gs)[1:4:2])
        if fused:
            fused_tm = pallas_fused_experts.fused_row_tile(gate, "nk", rows, hidden, inter, experts, 2, chip, fmt_name)
    fn = layer_fn(fmt_name, gate, chip, fused, fused_tm)
    est = tpu_estimator.estimate(fn, aligned_layer_args(fmt_name, model, tokens, gs, chip, fused), chip,
                                 flops=flops, min_bytes=min_bytes)
    return est.seconds, est.roofline_s


def aligned_layer_args(fmt_name: str, model: str, tokens: int, gs, chip: str, fused: bool):
    """``layer_args`` on the rows as the experts program lays them out for the
    path ``fused`` (as ``estimate_one`` decided it): where
    ``program.group_alignment`` aligns each expert's rows for the path that
    runs (tpu7x from 256 rows a group, v6e's two matmuls from 512, below
    1024), ``rows + E x 127`` rows and the sizes rounded up (as
    ``bench_tpu_estimates.aligned_rows`` does for bf16). The roofline stays the
    problem's own."""
    import jax

    from moe_experts_tpu.experts import program

    hidden, inter, experts, top_k, gate = MODELS[model]
    rows = tokens * top_k
    args = layer_args(fmt_name, model, tokens, gs)
    if fmt_name != "bf16" and chip not in program.GROUP_ALIGN_QUANTIZED.get(fmt_name, ()):
        return args
    align = program.group_alignment(rows, experts, fused, chip)
    if align == 1:
        return args
    args[0] = jax.ShapeDtypeStruct((rows + experts * (align - 1), hidden), args[0].dtype)
    args[-1] = ((gs + align - 1) // align * align).astype(np.int32)
    return args


_NAME = r"(\S+ fused|tpu-inference-gmm \S+|\S+)"
_LINE = re.compile(r"^\[(\S+)\] (\S+) (\d+) " + _NAME + r": ([\d.]+) us \(roofline ([\d.]+) us")
_FAILED = re.compile(r"^\[(\S+)\] (\S+) (\d+) " + _NAME + r": ([A-Za-z_.]+: .*)$")


def parse_logs(paths) -> dict:
    """{(chip, model, tokens): {contender: (seconds, roofline seconds)}} from
    the progress lines; a peer's failure is kept as its error text (the
    table says why it has no time), ours are left out as before."""
    out: dict = {}
    for path in paths:
        for line in pathlib.Path(path).read_text().splitlines():
            m = _LINE.match(line)
            if m:
                chip, model, tokens, name, t, r = m.groups()
                out.setdefault((chip, model, int(tokens)), {})[name] = (float(t) * 1e-6, float(r) * 1e-6)
            elif (m := _FAILED.match(line)) and peer_format(m.group(4)):
                chip, model, tokens, name, error = m.groups()
                out.setdefault((chip, model, int(tokens)), {})[name] = error
    return out


def run(args) -> dict:
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
                        first = str(exc).splitlines()[0][:200] if str(exc) else ""
                        print(f"[{chip}] {model} {tokens} {name}: {type(exc).__name__}: {first}",
                              file=sys.stderr, flush=True)
                        if peer_format(name):
                            cell[name] = f"{type(exc).__name__}: {first}"
                        continue
                    t, r = cell[name]
                    print(f"[{chip}] {model} {tokens} {name}: {t * 1e6:.1f} us (roofline {r * 1e6:.1f} us, "
                          f"{time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    return results


def _short_error(error: str) -> str:
    """A peer's failure in a few words (the whole text goes to the notes)."""
    for needle, reason in (*tpu_inference_peers.SHORT_REASONS, ("CompileTimeHbmOom", "weights exceed HBM"),
                           ("Bad lhs/rhs type", "Mosaic: no bf16 x e2m1 matmul on this chip"),
                           ("Conversion to 4-bit not supported", "Mosaic: no cast to 4 bits before TPU7x")):
        if needle in error:
            return reason
    return "fails: " + error.split(":")[0]


def table(chip: str, results: dict, models, tokens_list, formats, peers=()) -> str:
    """The chip's table; ``peers``: the formats whose tpu-inference-gmm
    contender was asked for (columns ``ours / tpu-inference`` and its time,
    its tiles and failures in the notes below)."""
    rows, notes, failures = [], [], {}
    for model in models:
        for tokens in tokens_list:
            cell = results.get((chip, model, tokens))
            if not cell:
                continue
            cell = dict(cell)
            failed = {n: cell.pop(n) for n in list(cell) if isinstance(cell[n], str)}
            bf16 = [cell[n][0] for n in ("bf16", "bf16 fused") if n in cell]
            best_bf16 = min(bf16) if bf16 else None
            row = {"model": model, "tokens": tokens,
                   "bf16 us (best of ours)": f"{best_bf16 * 1e6:.1f}" if best_bf16 else "-"}
            for fmt_name in [f for f in formats if not f.startswith("bf16") and not peer_format(f)]:
                if fmt_name not in cell:
                    row[f"{fmt_name} us"] = row[f"{fmt_name} speed-up"] = row[f"{fmt_name} / roofline"] = "-"
                    continue
                t, r = cell[fmt_name]
                hidden, inter, experts, top_k, gate = MODELS[model]
                base = fmt_name.split()[0]  # "int8 fused": the forced contender
                up, down = layer_args(base, model, tokens, None)[1:4:2]
                fused = fmt_name.endswith("fused") or runs_fused(base, gate, chip, tokens * top_k, up, down)
                row[f"{fmt_name} us"] = f"{t * 1e6:.1f}" + ("*" if fused else "")
                row[f"{fmt_name} speed-up"] = f"{best_bf16 / t:.2f}x" if best_bf16 else "-"
                row[f"{fmt_name} / roofline"] = f"{t / r:.2f}"
            if "bf16" in cell:
                row["bf16 / roofline"] = f"{best_bf16 / cell['bf16'][1]:.2f}"
            for fmt_name in peers:
                peer = tpu_inference_peers.QUANTIZED_PREFIX + fmt_name
                ours = cell.get(fmt_name)
                if peer in cell:
                    t = cell[peer][0]
                    row[f"tpu-inference {fmt_name} us"] = f"{t * 1e6:.1f}"
                    row[f"{fmt_name} ours / tpu-inference"] = f"{ours[0] / t:.2f}" if ours else "-"
                    hidden, inter, experts, top_k, _ = MODELS[model]
                    config = tpu_inference_peers.quantized_gmm_config(fmt_name, tokens * top_k, hidden, inter,
                                                                      experts)
                    notes.append(f"{model} {tokens} {fmt_name}: tpu-inference-gmm tiles {config}")
                else:
                    row[f"tpu-inference {fmt_name} us"] = _short_error(failed[peer]) if peer in failed else "-"
                    row[f"{fmt_name} ours / tpu-inference"] = "-"
                    if peer in failed:  # each reason once, with the shapes it hit
                        failures.setdefault((fmt_name, _short_error(failed[peer])), [failed[peer], []])[1].append(
                            f"{model} {tokens}")
            rows.append(row)
    for (fmt_name, _), (error, shapes) in failures.items():
        notes.append(f"{fmt_name}: tpu-inference-gmm fails at {', '.join(shapes)}: {error}")
    text = markdown(rows)
    if notes:
        text += "\n\n" + "\n".join(f"- {n}" for n in notes)
    return text


def peer_formats(args) -> list[str]:
    """The formats whose tpu-inference-gmm runs: ``--peers``, and peers named
    in ``--formats``."""
    named = [peer_format(f) for f in args.formats if peer_format(f)]
    return list(dict.fromkeys([*(args.peers or []), *named]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chips", nargs="+", default=["v6e"])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 512, 4096])
    ap.add_argument("--formats", nargs="+", default=["bf16", "bf16 fused", "int8", "fp8", "mxfp4"])
    ap.add_argument("--peers", nargs="*", default=[], choices=sorted(tpu_inference_peers.QUANTIZED_GMM),
                    help="formats to run tpu-inference's quantized gmm on (after ours)")
    ap.add_argument("--out", default=str(RESULTS / "tpu_estimates_quantized.md"))
    ap.add_argument("--from-logs", nargs="+", default=None)
    args = ap.parse_args(argv)
    peers = peer_formats(args)
    args.formats = [f for f in args.formats if not peer_format(f)] + [tpu_inference_peers.QUANTIZED_PREFIX + f
                                                                       for f in peers]
    use_shipped_packages()  # the table asks the program which path each row ran
    results = parse_logs(args.from_logs) if args.from_logs else run(args)
    sections = []
    for chip in args.chips:
        sections.append(f"## {chip} ({tpu_estimator.CHIPS[chip].topology})\n\n"
                        f"Estimator error on this chip: {calibration_summary(chip, 'ragged dot')}.\n\n"
                        + table(chip, results, args.models, args.tokens, args.formats, peers))
    text = ("# Quantized expert weights: estimated layer time (TPU estimator)\n\n"
            "Generated by `python bench/bench_quantized_estimates.py` (see its docstring). Each format's "
            "speed-up is against the best of our bf16 kernels (two matmuls or fused); `/ roofline` is "
            "against the format's own roofline (values + scales bytes). Each format's time is the experts "
            "program's path: `*` marks the fused experts kernel (int8, fp8: "
            "`program.FUSED_QUANTIZED_FROM_ROWS_PER_GROUP`), else the two grouped matmuls.\n\n"
            + tpu_inference_peers.quantized_table_note(peers) + "\n\n".join(sections) + "\n")
    pathlib.Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
