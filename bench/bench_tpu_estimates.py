"""Our MoE experts kernels against the peers on TPU, by the TPU estimator.

One experts layer's matmuls on the rows already sorted by expert (the part
the kernels differ in): ``down(gate(up(x)))`` with group sizes drawn from a
random top-k routing, at Qwen3-30B-A3B, gpt-oss-20b, Mixtral-8x7B and
DeepSeek-V3 shapes, 1 to 4096 tokens. Contenders, all compiled here for the
chip and estimated from the compiler's schedule (bench/tpu_estimator.py;
calibration error in bench/results/tpu_calibration.md):

- ours, two matmuls: ``gmm`` (up, f32 out) -> gate -> ``gmm`` (down), our tiling rule;
- ours, fused: ``fused_glu_experts`` (both matmuls and the gate in one kernel);
- tokamax 0.0.12 ``PallasMosaicTpuRaggedDot`` twice and JAX's megablox ``gmm``
  twice, each ``@best``: every matmul at the best tiles of the recorded sweep
  of ``peer_sweep.py`` (sweeping what the record lacks);
- tpu-inference 0.32.0's gmm at the block sizes its own code picks; on
  request (``--contenders fused-ep-moe``) its fused_ep_moe at ep=1
  (bench/tpu_inference_peers.py).

A peer at named configs: ``tokamax@tm,tk,tn[,input buffers]`` (both matmuls)
or ``tokamax@UP/DOWN``, ``megablox@tm,tk,tn``; ``tokamax`` / ``megablox``
alone: the peer's own default (tokamax's heuristics, megablox's 128 x 128 x
128). The table names the best peer of each row, its configs, and ours / it.

Weights are in Transformers' ``[E, out, in]`` layout for ours, ``[E, in, out]``
for the peers (their layout): the same bytes. Writes bench/results/tpu_estimates.md
and tpu_estimates.png.

    python bench/bench_tpu_estimates.py [--chips v5e v6e] [--models qwen3 ...] [--tokens 1 8 ...]
        [--contenders ours "ours fused" megablox@best tokamax@best tpu-inference-gmm]
        [--sweep-rounds 0] [--from-logs LOG ...]
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import peer_sweep  # noqa: E402
import tpu_estimator  # noqa: E402  (sets libtpu's dump folder before jax loads libtpu)
import tpu_inference_peers  # noqa: E402  (tpu-inference 0.32.0's gmm and fused_ep_moe)
from common import ROOT, calibration_summary, markdown, use_shipped_packages  # noqa: E402

MODELS = {  # hidden, intermediate, experts, top_k, gate
    "qwen3-30b-a3b": (2048, 768, 128, 8, "glu_silu"),
    "gpt-oss-20b": (2880, 2880, 32, 4, "gpt_oss"),  # interleaved halves: no gated up projection
    "mixtral-8x7b": (4096, 14336, 8, 2, "glu_silu"),
    "deepseek-v3": (7168, 2048, 256, 8, "glu_silu"),
    # google/gemma-4-26B-A4B text config: 128 experts of 704 (not a multiple of
    # 128), top 8, a tanh-GELU GLU on concatenated halves.
    "gemma-4-26b-a4b": (2816, 704, 128, 8, "glu_gelu_tanh"),
}
CONTENDERS = ("ours", "ours fused", "megablox@best", "tokamax@best", "tpu-inference-gmm")
RESULTS = ROOT / "bench" / "results"


ROUTINGS = ("uniform", "skewed", "balanced")
# Balanced routing: every expert gets the same rows (the remainder one each
# to the first experts), so where that is a multiple of the row tile no tile
# holds a group boundary: the layer's bound without boundary visits.
# Skewed routing: expert e (in a random order) is picked with a weight
# (rank + 1) ** -SKEW, so a few experts are hot and the tail cold or empty
# (Qwen3-30B-A3B at 512 tokens: the hottest expert takes 510 of the 512
# tokens, 61 of 128 experts get under a quarter of the mean, 3 none).
SKEW = 1.5


def routing_group_sizes(tokens, experts, top_k, rng, routing="uniform") -> np.ndarray:
    """Group sizes of a random top-k routing (k distinct experts per token):
    every expert equally likely ("uniform") or the "skewed" weights above
    (sampled without replacement: the top k of log-weight + Gumbel noise);
    "balanced": no randomness, ``tokens * top_k`` rows split evenly."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if routing == "balanced":
        rows, rest = divmod(tokens * top_k, experts)
        return (rows + (np.arange(experts) < rest)).astype(np.int32)
    scores = rng.random((tokens, experts))  # uniform: the k smallest of uniform noise
    if routing == "skewed":
        scores = SKEW * np.log1p(rng.permutation(experts)) + np.log(-np.log(scores))
    picks = np.argsort(scores, axis=1)[:, :top_k]
    return np.bincount(picks.reshape(-1), minlength=experts).astype(np.int32)


def contender_fn(name, gate, generation):
    import jax.numpy as jnp

    from moe_experts_tpu.experts import pallas_fused_experts, program
    from moe_experts_tpu.experts.gates import apply_gate

    def act(h):
        return apply_gate(h, gate, 1.702, 7.0).astype(jnp.bfloat16)

    if name == "ours":
        def fn(x, up, down, gs):  # the experts program's unfused path (gated up projection where it applies)
            return program.two_matmuls(x, up, down, gs, gate=gate, alpha=1.702, limit=7.0, rhs_layout="nk",
                                       generation=generation)
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
    elif peer_name(name) in (*peer_sweep.PEERS, peer_sweep.OURS):
        up_config, down_config = peer_configs(name)
        if up_config is None:  # the peer's own default: tokamax's heuristics, megablox's 128 x 128 x 128
            up_matmul = down_matmul = default_peer_matmul(peer_name(name))
        else:
            up_matmul = peer_sweep.peer_matmul(peer_name(name), up_config, generation)
            down_matmul = peer_sweep.peer_matmul(peer_name(name), down_config, generation)

        def fn(x, up, down, gs):
            return down_matmul(act(up_matmul(x, up, gs)), down, gs)
    elif name == "tpu-inference-gmm":
        fn = tpu_inference_peers.gmm_fn(act)
    else:
        raise ValueError(name)
    return fn


def peer_name(contender: str) -> str:
    """``"tokamax@512,2048,1024,3"`` -> ``"tokamax"``."""
    return contender.split("@")[0]


def peer_configs(contender: str) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """A peer's named configs for the up and the down matmul:
    ``name@tm,tk,tn`` (both), ``name@UP/DOWN``; tokamax adds its input buffer
    count (``,3``; default 2). (None, None): the peer's own default."""
    if "@" not in contender:
        return None, None
    parts = [tuple(int(v) for v in part.split(",")) for part in contender.split("@")[1].split("/")]
    if peer_name(contender) == "tokamax":
        parts = [p if len(p) == 4 else p + (2,) for p in parts]
    return parts[0], parts[-1]


def default_peer_matmul(peer: str):
    import jax.numpy as jnp

    if peer == "tokamax":
        from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tk

        op = tk.PallasMosaicTpuRaggedDot()
        return lambda x, w, gs: op(x, w, group_sizes=gs, preferred_element_type=jnp.float32)
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    return lambda x, w, gs: gmm(x, w, gs, preferred_element_type=jnp.float32)


def weight_specs(name, hidden, inter, experts):
    import jax
    import jax.numpy as jnp

    bf16 = jnp.bfloat16
    if name.startswith("ours"):  # Transformers' [E, out, in]
        return (jax.ShapeDtypeStruct((experts, 2 * inter, hidden), bf16),
                jax.ShapeDtypeStruct((experts, hidden, inter), bf16))
    return (jax.ShapeDtypeStruct((experts, hidden, 2 * inter), bf16),
            jax.ShapeDtypeStruct((experts, inter, hidden), bf16))


def problem_size(model, tokens, rng_seed=0, routing="uniform"):
    """Group sizes, flops, and the bytes the layer must move at least: the
    rows in (bf16), the weights of every expert with rows, the rows out (f32)."""
    hidden, inter, experts, top_k, _ = MODELS[model]
    gs = routing_group_sizes(tokens, experts, top_k, np.random.default_rng(rng_seed), routing)
    rows = tokens * top_k
    flops = 2.0 * rows * hidden * 3 * inter
    used = int((gs > 0).sum())
    min_bytes = 2.0 * (rows * hidden + used * 3 * hidden * inter) + 4.0 * rows * hidden
    return gs, flops, min_bytes


def estimate_one(chip, model, tokens, name, rng_seed=0, routing="uniform"):
    import jax
    import jax.numpy as jnp

    hidden, inter, experts, top_k, gate = MODELS[model]
    gs, flops, min_bytes = problem_size(model, tokens, rng_seed, routing)
    if name == "fused-ep-moe":  # its own inputs: hidden states and router logits
        return tpu_inference_peers.estimate_fused(chip, tokens, hidden, inter, experts, top_k, rng_seed,
                                                  flops=flops, min_bytes=min_bytes)
    rows = tokens * top_k
    if name.startswith("ours"):  # the rows as the experts program lays them out (its group-aligned rule)
        rows, gs = aligned_rows(name, rows, gs, chip)
    x = jax.ShapeDtypeStruct((rows, hidden), jnp.bfloat16)
    up, down = weight_specs(name, hidden, inter, experts)
    fn = contender_fn(name, gate, chip)
    return peer_sweep.estimate_peer(peer_name(name), fn, [x, up, down, gs], chip, flops=flops, min_bytes=min_bytes)


def aligned_rows(name, rows, gs, chip):
    """Rows and group sizes of our kernels' input as ``program.experts_forward``
    gives it: where ``program.group_alignment`` aligns each expert's rows (tpu7x
    and v6e prefill), the static ``rows + E x (align - 1)`` and the sizes rounded
    up. What the larger gather costs the program is in ``bench_experts_program``."""
    from moe_experts_tpu.experts import program

    experts = gs.shape[0]
    align = program.group_alignment(rows, experts, name == "ours fused", chip)  # "ours": the two matmuls
    if align == 1:
        return rows, gs
    return rows + experts * (align - 1), ((gs + align - 1) // align * align).astype(np.int32)


def resolve(chip, model, tokens, name, record, start_from=None, max_rounds=None):
    """``peer@best`` -> the peer at its best recorded configs (``peer_sweep``;
    a shape the record lacks is swept first: tokamax after megablox follows
    megablox's best tiles); other names unchanged. None: the peer runs no
    config of the shape."""
    if not name.endswith("@best"):
        return name
    peer = peer_name(name)
    follow = "megablox" if peer == "tokamax" else None
    return peer_sweep.best_contender(chip, peer, model, tokens, record, start_from, follow, max_rounds)


_LINE = re.compile(r"^\[(\S+)\] (\S+) (\d+) (ours fused|ours|\S+): (.*?)(?: config (\S+))?$")
_TIME = re.compile(r"^([\d.]+) us \(roofline")


def parse_logs(paths) -> tuple[dict, dict]:
    """{(chip, model, tokens): {contender: seconds or error text}} and the
    configs the ``@best`` contenders ran, from the progress lines this script
    prints (``--from-logs``: tables from runs that were cut short)."""
    out: dict = {}
    configs: dict = {}
    for path in paths:
        for line in pathlib.Path(path).read_text().splitlines():
            m = _LINE.match(line)
            if m:
                chip, model, tokens, name, rest, config = m.groups()
                t = _TIME.match(rest)
                out.setdefault((chip, model, int(tokens)), {})[name] = float(t.group(1)) * 1e-6 if t else rest
                if config:
                    configs.setdefault((chip, model, int(tokens)), {})[name] = config
    return out, configs


def _short_reason(error) -> str:
    """Why a contender has no estimate, in a few words."""
    text = str(error)
    for needle, reason in (("CompileTimeHbmOom", "weights exceed the chip's HBM"),
                           ("must be >= 128", "takes >= 128 rows only"),
                           ("must be divisible by x-dimension tile size", "rows must be a multiple of its 128 tile"),
                           ("does not fit VMEM", "rule runs two matmuls (expert > VMEM)"),
                           ("no config runs", "no config of its sweep runs the shape"),
                           *tpu_inference_peers.SHORT_REASONS):
        if needle in text:
            return reason
    return text.splitlines()[0][:70]


def config_text(resolved: str) -> str:
    """``tokamax@512,2048,768,2/256,2048,1024,3`` -> ``up (512, 2048, 768) x2, down (256, 2048, 1024) x3``."""
    up, down = peer_configs(resolved)
    if up is None:
        return "at its own tiles (notes)" if peer_name(resolved) not in peer_sweep.PEERS else "at its default"

    def one(c):
        return f"({c[0]}, {c[1]}, {c[2]})" + (f" x{c[3]}" if len(c) == 4 else "")

    return one(up) if up == down else f"up {one(up)}, down {one(down)}"


def table_row(chip, model, tokens, results, contenders, configs, routing="uniform"):
    chip_ = tpu_estimator.CHIPS[chip]
    _, flops, min_bytes = problem_size(model, tokens, routing=routing)
    mxu, hbm = flops / chip_.bf16_flops_per_s, min_bytes / chip_.hbm_bytes_per_s
    roofline = max(mxu, hbm)
    times = {n: v for n, v in results.items() if isinstance(v, float)}
    notes = [f"{n}: {_short_reason(v)}" for n, v in results.items() if not isinstance(v, float)]
    best_ours = min((times[n] for n in ("ours", "ours fused") if n in times), default=None)
    row = {"model": model, "tokens": tokens}
    for name in contenders:
        row[f"{name} us"] = f"{times[name] * 1e6:.1f}" if name in times else "-"
    peers = {n: t for n, t in times.items() if not n.startswith("ours") and n in contenders}
    best = min(peers, key=peers.get, default=None)
    if best:
        config = configs.get(best)
        row["best peer (config)"] = f"{peer_name(best)} {config_text(config or best)}"
        row["ours / best peer"] = f"{best_ours / peers[best]:.2f}" if best_ours else "-"
    else:
        row["best peer (config)"], row["ours / best peer"] = "-", "-"
    row["roofline us"] = f"{roofline * 1e6:.1f} ({'HBM' if hbm >= mxu else 'MXU'})"
    row["ours / roofline"] = f"{best_ours / roofline:.2f}" if best_ours else "-"
    row["notes"] = "; ".join(notes + tpu_inference_peers.config_notes(MODELS[model], tokens, results))
    return row, times, roofline


def run_estimates(args) -> tuple[dict, dict]:
    from absl import flags

    flags.FLAGS(sys.argv[:1], known_only=True)  # tokamax reads absl flags
    use_shipped_packages()
    record = peer_sweep.Record()
    results, configs = {}, {}
    for chip in args.chips:
        for model in args.models:
            for tokens in args.tokens:
                cell = results.setdefault((chip, model, tokens), {})
                for name in args.contenders:
                    t0 = time.time()
                    resolved = resolve(chip, model, tokens, name, record, args.start_from, args.sweep_rounds)
                    if resolved is None:
                        cell[name] = "no config runs the shape"
                        print(f"[{chip}] {model} {tokens} {name}: {cell[name]}", file=sys.stderr)
                        continue
                    if resolved != name:
                        configs.setdefault((chip, model, tokens), {})[name] = resolved
                    shown = f" config {resolved}" if resolved != name else ""
                    try:
                        est = estimate_one(chip, model, tokens, resolved, routing=args.routing)
                    except Exception as exc:  # noqa: BLE001 -- a contender that cannot run a shape is reported
                        cell[name] = f"{type(exc).__name__}: {exc}"
                        print(f"[{chip}] {model} {tokens} {name}: {cell[name].splitlines()[0]}{shown}",
                              file=sys.stderr)
                        continue
                    cell[name] = est.seconds
                    unmatched = "" if all(k.regions_matched for k in est.kernels) else " MXU regions unmatched"
                    unmatched += "" if all(k.inner_loops_matched for k in est.kernels) else " inner loops unmatched"
                    unmatched += "" if all(k.manual_dmas_matched for k in est.kernels) else " DMA waits unplaced"
                    manual = sum(k.manual_dma_bytes for k in est.kernels)
                    unmatched += f" (own DMAs {manual / 1e6:.1f} MB)" if manual else ""
                    print(f"[{chip}] {model} {tokens} {name}: {est.seconds * 1e6:.1f} us "
                          f"(roofline {est.roofline_s * 1e6:.1f} us, {time.time() - t0:.0f} s){unmatched}{shown}",
                          file=sys.stderr)
    return results, configs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chips", nargs="+", default=["v5e", "v6e", "tpu7x"])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 512, 4096])
    ap.add_argument("--contenders", nargs="+", default=list(CONTENDERS))
    ap.add_argument("--start-from", default=None,
                    help="peer sweeps (@best) start from this chip's recorded best and walk one round")
    ap.add_argument("--sweep-rounds", type=int, default=None,
                    help="rounds of the walk for a shape the sweep record lacks (0: its starts only)")
    ap.add_argument("--routing", choices=ROUTINGS, default="uniform",
                    help="group sizes of the routing; skewed / balanced: peers keep their best configs for uniform "
                         "routing")
    ap.add_argument("--out", default=None, help="default: results/tpu_estimates.md (tpu_estimates_<routing>.md)")
    ap.add_argument("--from-logs", nargs="+", default=None,
                    help="build the tables from the progress output of earlier runs instead of estimating")
    args = ap.parse_args(argv)
    suffix = "" if args.routing == "uniform" else f"_{args.routing}"
    args.out = args.out or str(RESULTS / f"tpu_estimates{suffix}.md")
    results, configs = parse_logs(args.from_logs) if args.from_logs else run_estimates(args)
    sections, plot_rows = [], []
    for chip in args.chips:
        keys = [k for k in results if k[0] == chip]
        if not keys:
            continue
        rows = []
        for _, model, tokens in sorted(keys, key=lambda k: (list(MODELS).index(k[1]), k[2])):
            row, times, roofline = table_row(chip, model, tokens, results[(chip, model, tokens)], args.contenders,
                                             configs.get((chip, model, tokens), {}), args.routing)
            rows.append(row)
            plot_rows.append((chip, model, tokens, times, roofline))
        missing = [f"{m} {t}" for m in args.models for t in args.tokens if (chip, m, t) not in results]
        note = f"\n\nNot estimated in this run (cut short): {', '.join(missing)}." if missing else ""
        sections.append(f"## {chip} ({tpu_estimator.CHIPS[chip].topology})\n\n"
                        f"Estimator error on this chip: {calibration_summary(chip, 'ragged dot')}.\n\n"
                        + markdown(rows) + note)
    out = pathlib.Path(args.out)
    out.write_text(
        "# MoE experts on TPU: estimated times, ours against the peers at their best\n\n"
        "Generated by `python bench/bench_tpu_estimates.py` (the command below). Estimates from the TPU "
        "compiler's static schedule (`bench/tpu_estimator.py`), not measurements on a TPU; each chip's section "
        "states the estimator's error against measured timings (`tpu_calibration.md`). One experts layer's two "
        "matmuls and the gate on rows sorted by expert, bf16 inputs, f32 outputs, group sizes from a random "
        f"top-k routing (seed 0), {ROUTING_TEXT[args.routing]}. Each model's own gate (gpt-oss-20b: its clamped SwiGLU on "
        "interleaved halves; Gemma-4-26B-A4B a tanh-GELU GLU, the others a SiLU GLU, on concatenated halves; gpt-oss rows of logs before the gated up "
        "projection used the concatenated GLU for every contender, which flattered all of them: its interleaved "
        "gate in XLA reads its halves with strided lane slices). 'ours' = the experts program's unfused path "
        "(`program.two_matmuls`: the first gmm applies the gate at its store, `gmm(glu=)`), 'ours fused' = one "
        "kernel, both on the rows as the experts program lays them out (where its rule aligns each expert's rows "
        "to 128, `program.group_alignment`: tpu7x from 256 rows a group, v6e's two matmuls from 512, below 1024; "
        "the static rows grow by E x 127, the sizes round up; the program's larger gather is in "
        "`experts_program.md`); the peers get the plain sorted rows; "
        "the peers and tpu-inference run the gate in XLA between their two matmuls; 'ours / best peer' uses the "
        "better of the two (< 1: ours is faster). Peers `@best`: each matmul (up, down) at the best tiles of a "
        "recorded sweep (`bench/peer_sweep.py`: tokamax's own autotuning space walked from MaxText's default, "
        "tokamax's tuned table for the same weight shape and our rule's tiles; every config tried is in "
        "`peer_sweep.jsonl`; the walk ran on v6e first: tpu7x's peers took v6e's best and their starts; v5e's, "
        "at 512 and 4096 tokens, were walked last (up to three rounds, from their starts and our current forward "
        "tiles, `tpu_estimates_v5e_peers_walked.log`: e.g. Qwen3-30B-A3B 4096 tokens tokamax 4062 -> 3724 us, "
        "gpt-oss-20b 4096 13229 -> 11420 (megablox), Mixtral-8x7B 4096 25094 -> 22362, Gemma-4-26B-A4B 4096 "
        "8884 -> 6068), their 64-token rows keep their starts; after our forward tiles changed (512-row "
        "tiles on v5e and v6e, gmm/tiling.py), the v6e peers at gpt-oss-20b and Mixtral-8x7B 512 / 4096 tokens "
        "took our new tiles as one more start and walked one round from their best (their layer figures moved by 1.4% at most); "
        "after tpu7x's own forward tiles (256 rows, gmm/tiling.py) the tpu7x "
        "peers at gpt-oss-20b, Mixtral-8x7B and Qwen3-30B-A3B 512 / 4096 tokens did the same (Mixtral-8x7B 512 "
        "tokens: megablox 1464 -> 1162 us, tokamax 1401 -> 1196; the others 0-4%; megablox's gpt-oss-20b 4096-token "
        "figure stays at its earlier, faster in-layer configs; they cannot run our 44 MiB whole-K Mixtral-8x7B "
        "down tiles within their scoped VMEM limit); Gemma-4-26B-A4B's peers, added last, walked one round from "
        "their starts on v6e; on tpu7x they ran their starts and v6e's best, no walk; on v5e they were walked as "
        "above); the best peer column names its configs (tm, tk, tn) and tokamax's input buffers "
        "(xN). Roofline: max(MXU-bound, HBM-bound: rows in, the weights of the experts that have rows, rows "
        f"out). Neither tokamax nor megablox takes fewer than 128 rows (decode).\n\n    {command_line(args)}\n\n"
        + tpu_inference_peers.table_note(args.contenders) + "\n\n".join(sections) + "\n")
    _plot(plot_rows, out.with_suffix(".png"), args.contenders)
    print(f"wrote {out}")


ROUTING_TEXT = {
    "uniform": "every expert equally likely",
    "skewed": (f"skewed (expert weights (rank + 1) ** -{SKEW}: a few hot experts, a cold or empty tail; the peers "
               "run their best configs for the uniform routing of the same shape, not re-swept)"),
    "balanced": ("balanced (every expert the same rows: no group boundary inside a row tile where that is a "
                 "multiple of it; the peers run their best configs for the uniform routing of the same shape)"),
}


def command_line(args) -> str:
    return ("python bench/bench_tpu_estimates.py --chips " + " ".join(args.chips)
            + ("" if args.routing == "uniform" else f" --routing {args.routing}")
            + " --models " + " ".join(args.models) + " --tokens " + " ".join(map(str, args.tokens))
            + " --contenders " + " ".join(f'"{c}"' if " " in c else c for c in args.contenders)
            + (" --sweep-rounds 0" if not args.from_logs else " --from-logs " + " ".join(
                str(pathlib.Path(p).resolve().relative_to(ROOT)) for p in args.from_logs)))


def _plot(rows, path, contenders):
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
            for name in contenders:
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
