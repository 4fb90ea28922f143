"""Calibrate the TPU estimator against TPU timings someone else measured.

Measured timings of tokamax's Pallas TPU kernels (its autotuning tables:
shapes, group sizes or masks, the kernel config, ``evaluation_times_ms``
measured on the chip): for every measured entry we compile tokamax's kernel
with that exact config for the same chip, estimate its time
(``tpu_estimator``, nothing fitted), and compare. Per chip (v5e, v5p, v6e,
tpu7x) and kernel kind (ragged dot, flash attention forward and backward):
entries, median estimate / measured, share within 10% and 25%, worst.

    python bench/calibrate_tpu_estimator.py [--data DIR] [--chips ...]
        [--kinds ...] [--max-entries N] [--unrecorded-sizes tokamax|equal]
        [--from-logs LOG ...] [--skip-logged LOG ...] [--out FILE]

Tables: tokamax 0.0.12's wheel ships ``tokamax/data/autotuning/<chip>/`` (v5e
and tpu7x ragged dot, tpu7x flash attention forward and backward). ``--data
DIR`` adds a folder laid out the same way (``DIR/<tokamax chip folder>/
<table>.json``, e.g. the tables of tokamax's repository, which cover v5p and
v6e); where both hold a table, DIR's is used. The results file names every
table it read.

Where a ragged dot table keeps only the group count and total rows, the
sizes are tokamax's own representative value for that key
(``tokamax._src.ops.ragged_dot.base.generate_group_sizes``: the rows drawn
uniformly at random with seed 0, what tokamax's autotuner measured on);
``--unrecorded-sizes equal`` uses equal sizes instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import pathlib
import re
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import tpu_estimator  # noqa: E402  (sets libtpu's dump folder before jax loads libtpu)
from common import ROOT, markdown  # noqa: E402

# tokamax's folder name per chip (its device kind, lower case, spaces -> _).
TABLE_DIRS = {"v5e": "tpu_v5_lite", "v5p": "tpu_v5", "v6e": "tpu_v6_lite", "tpu7x": "tpu7x"}
KIND_TABLES = {
    "ragged dot": "pallas_mosaic_tpu_ragged_dot.json",
    "attention fwd": "pallas_mosaic_tpu_flash_attention.json",
    "attention bwd": "pallas_mosaic_tpu_flash_attention_vjp.json",
}
RESULTS = ROOT / "bench" / "results" / "tpu_calibration.md"
# What the misses say (written by hand from the published table; included in it as is, not in other --out files).
NOTES = ROOT / "bench" / "results" / "tpu_calibration_notes.md"


def wheel_tables() -> pathlib.Path:
    import tokamax

    return pathlib.Path(tokamax.__file__).parent / "data" / "autotuning"


def table_path(chip: str, kind: str, data_dir: str | None) -> tuple[pathlib.Path | None, str]:
    """The table to read and where it came from (DIR's copy first, then the wheel's)."""
    name = pathlib.Path(TABLE_DIRS[chip]) / KIND_TABLES[kind]
    if data_dir and (pathlib.Path(data_dir) / name).is_file():
        return pathlib.Path(data_dir) / name, f"--data {name}"
    if (wheel_tables() / name).is_file():
        return wheel_tables() / name, f"tokamax 0.0.12 wheel, {name}"
    return None, ""


def table_entries(path: pathlib.Path):
    """(key, config, measured seconds) of every measured entry, in file order;
    'measured' is the median of ``evaluation_times_ms``."""
    for key, configs in json.loads(path.read_text()).items():
        for config, result in configs.items():
            times = (result or {}).get("evaluation_times_ms") or []
            if times:
                yield json.loads(key), json.loads(config), statistics.median(times) / 1e3


def sample(n: int, limit: int | None) -> list[int]:
    """``limit`` indices spread evenly over ``n`` entries (all when None)."""
    if limit is None or limit >= n:
        return list(range(n))
    return sorted({int(round(i)) for i in np.linspace(0, n - 1, limit)})


def _shape(spec: str):
    m = re.fullmatch(r"(\w+)\[([\d,]*)\]", spec)
    dtype = {"bf16": "bfloat16", "f32": "float32"}[m.group(1)]
    return tuple(int(d) for d in m.group(2).split(",") if d), dtype


def group_sizes_of(key, unrecorded: str = "tokamax") -> tuple[np.ndarray, str]:
    """The recorded sizes, or, where the table keeps only their count and
    total, tokamax's representative sizes for that key (or equal sizes)."""
    gs = key["group_sizes"]
    if isinstance(gs, list):
        return np.asarray(gs, np.int32), "recorded"
    g, total = gs["num_groups"], gs["total_size"]
    if unrecorded == "tokamax":
        from tokamax._src.ops.ragged_dot.base import generate_group_sizes

        return np.asarray(generate_group_sizes(m=total, num_groups=g), np.int32), "tokamax's sizes"
    sizes = np.full(g, total // g, np.int32)
    sizes[: total % g] += 1
    return sizes, "equal group sizes"


def problem(key):
    """lhs/rhs specs, dimension numbers, flops and minimum bytes of one entry."""
    import jax
    import jax.numpy as jnp

    (lshape, ldt), (rshape, rdt) = _shape(key["lhs"]), _shape(key["rhs"])
    dn = key["ragged_dot_dimension_numbers"]
    ((lc, rc), _) = dn["dot_dimension_numbers"]
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=((tuple(lc), tuple(rc)), ((), ())),
        lhs_ragged_dimensions=tuple(dn["lhs_ragged_dimensions"]),
        rhs_group_dimensions=tuple(dn["rhs_group_dimensions"]),
    )
    lhs = jax.ShapeDtypeStruct(lshape, jnp.dtype(ldt))
    rhs = jax.ShapeDtypeStruct(rshape, jnp.dtype(rdt))
    groups = jax.ShapeDtypeStruct((_num_groups(key),), jnp.int32)
    out_shape = jax.eval_shape(lambda a, b, g: jax.lax.ragged_dot_general(a, b, g, numbers), lhs, rhs, groups).shape
    # Every lhs element meets every output column once (fwd, dlhs); for the
    # weight gradient (contraction over the ragged rows) every rhs column.
    columns = rshape[1] if list(lc) == [0] else out_shape[-1]
    flops = 2 * int(np.prod(lshape)) * columns
    min_bytes = (np.prod(lshape) * lhs.dtype.itemsize + np.prod(rshape) * rhs.dtype.itemsize
                 + np.prod(out_shape) * 2)
    return lhs, rhs, numbers, float(flops), float(min_bytes)


def _num_groups(key) -> int:
    gs = key["group_sizes"]
    return len(gs) if isinstance(gs, list) else gs["num_groups"]


class PipelineRecorder:
    """tokamax runs its grid through ``pltpu.emit_pipeline`` inside a
    gridless pallas_call (``tokamax._src.mosaic_tpu.custom_buffered_pallas_call``).
    This records the grid spec it is given, in call order, so the estimator
    replays the same grid (index maps, block shapes, buffer counts) on the
    concrete scalar-prefetch operands of each call."""

    def __init__(self):
        from tokamax._src import mosaic_tpu

        self.module = mosaic_tpu
        self.original = mosaic_tpu.custom_buffered_pallas_call
        self.specs = []

    def __enter__(self):
        import jax

        # A kernel traced earlier in the process (under another recorder) would be
        # reused from jax's caches and never reach this recorder's wrapper.
        jax.clear_caches()
        original, specs = self.original, self.specs

        def recording(kernel, out_shape, grid_spec, compiler_params, input_buffer_count=None, **kw):
            inner = original(kernel, out_shape, grid_spec, compiler_params, input_buffer_count, **kw)

            def call(*args):
                import jax

                specs.append((grid_spec, input_buffer_count, out_shape,
                              jax.tree.structure(args[:grid_spec.num_scalar_prefetch]),
                              [a for a in jax.tree.leaves(args[grid_spec.num_scalar_prefetch:])]))
                return inner(*args)

            return call

        self.module.custom_buffered_pallas_call = recording
        return self

    def __exit__(self, *exc):
        self.module.custom_buffered_pallas_call = self.original

    def replay_for(self):
        calls = itertools.count()

        def replay(call):
            import jax

            # The estimator traces once for the replay, then again to compile:
            # the first records are the first trace's, in call order.
            grid_spec, buffer_counts, out_shape, prefetch_tree, inputs = self.specs[next(calls)]
            operands = list(call.operands)
            grid = []
            for d in grid_spec.grid:
                grid.append(d if isinstance(d, int) else int(np.asarray(operands.pop(0)).reshape(-1)[0]))
            prefetch = jax.tree.unflatten(prefetch_tree, [np.asarray(v) for v in operands[:prefetch_tree.num_leaves]])
            steps = int(np.prod(grid))
            index = tpu_estimator.grid_indices(grid)
            specs = list(jax.tree.leaves(grid_spec.in_specs, is_leaf=lambda x: hasattr(x, "index_map")))
            outs = list(jax.tree.leaves(grid_spec.out_specs, is_leaf=lambda x: hasattr(x, "index_map")))
            arrays = list(inputs) + list(jax.tree.leaves(out_shape))
            block_indices, block_bytes, whole = [], [], []
            for spec, arr in zip(specs + outs, arrays):
                block = spec.index_map(*index, *prefetch)
                block_indices.append(tpu_estimator.stack_block_indices(block, steps))
                dims = [d for d in spec.block_shape if isinstance(d, int)]  # None / Squeezed: one row
                block_bytes.append(int(np.prod(dims)) * np.dtype(arr.dtype).itemsize)
                whole.append(int(np.prod(arr.shape)) * np.dtype(arr.dtype).itemsize)
            counts = list(buffer_counts or [2] * len(specs)) + [2] * len(outs)
            return tpu_estimator.GridReplay(tuple(grid), block_indices, block_bytes,
                                            [False] * len(specs) + [True] * len(outs), None, counts, whole)

        return replay


def what_if(chip):
    """Alternative constants each tpu7x estimate is re-simulated with (same
    schedule): the unpublished clock 25% lower, and one TensorCore getting
    half of its modelled HBM share. They test which constant a miss points
    at; the table's estimates use the published ones."""
    base = tpu_estimator.CHIPS[chip]
    if chip != "tpu7x":
        return None
    return {"clock 0.75x": dataclasses.replace(base, clock_hz=base.clock_hz * 0.75),
            "HBM 0.5x": dataclasses.replace(base, hbm_bytes_per_s=base.hbm_bytes_per_s / 2)}


def check_tiles_fit(key, config, lhs, rhs):
    """The wheel's kernel applies ``tile_k`` to the lhs columns and
    ``tile_n`` to the output columns (the rhs columns for the weight
    gradient). A recorded tile at least twice as wide as its dimension is
    not what the measured kernel ran (the wheel would pad the dimension to
    it and do that many times the work, which no autotuner picks as best:
    the measured tokamax applied the dlhs tiles the other way round), so
    the entry is reported, not estimated. Tiles a little wider than their
    dimension (2944 for 2880, 1024 for 768) are padding the kernel does."""
    op = _op_of("ragged dot", key).split()[0]
    n = rhs.shape[1] if op in ("drhs", "dlhs") else rhs.shape[2]
    for name, dim in (("tile_k", lhs.shape[1]), ("tile_n", n)):
        if config[name] >= 2 * dim:
            raise NotImplementedError(f"recorded {name}={config[name]} is at least twice its dimension {dim} in "
                                      "the wheel's kernel (the measured tokamax applied it elsewhere)")


def refusal(kind, key, config) -> str | None:
    """Why an entry is not estimated before compiling it, or None."""
    if kind != "ragged dot":
        return None
    lhs, rhs, *_ = problem(key)
    try:
        check_tiles_fit(key, config, lhs, rhs)
    except NotImplementedError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def estimate_ragged_dot(chip, key, config, unrecorded: str = "tokamax"):
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tk

    lhs, rhs, numbers, flops, min_bytes = problem(key)
    check_tiles_fit(key, config, lhs, rhs)
    sizes, sizes_note = group_sizes_of(key, unrecorded)
    fields = {f.name for f in dataclasses.fields(tk.Config)}
    dropped = sorted(set(config) - fields)  # fields of a newer tokamax than the wheel
    op = tk.PallasMosaicTpuRaggedDot(config=tk.Config(**{k: v for k, v in config.items() if k in fields}))
    residuals = bool(key["return_residuals"])

    def fn(a, b, g):
        return op(a, b, group_sizes=g, ragged_dot_dimension_numbers=numbers, return_residuals=residuals)

    with PipelineRecorder() as recorder:
        est = tpu_estimator.estimate(fn, [lhs, rhs, sizes], chip, flops=flops, min_bytes=min_bytes,
                                     replay_for=recorder.replay_for(), what_if=what_if(chip))
    notes = [] if sizes_note == "recorded" else [sizes_note]
    notes += [f"{k}={config[k]} ignored" for k in dropped if config[k]]
    return est, notes


def _attention_specs(key):
    import jax

    q, k, v = (jax.ShapeDtypeStruct(*_shape_dtype(key[n])) for n in ("q", "k", "v"))
    b, t, h, d = q.shape
    s = k.shape[1]
    causal = bool(key["mask"]["is_causal"])
    # (query, key) pairs computed: a causal mask (top-left aligned) keeps i >= j.
    pairs = t * s - (t * (t - 1) // 2 if causal and t == s else 0)
    flops = 4 * b * h * pairs * d
    min_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in (q, k, v)) + b * t * h * v.shape[-1] * 2
    return q, k, v, causal, float(flops), float(min_bytes)


def _shape_dtype(spec: str):
    import jax.numpy as jnp

    shape, dtype = _shape(spec)
    return shape, jnp.dtype(dtype)


def _attention_kwargs(key, causal):
    unsupported = [n for n in ("bias", "dropout_mask", "paging_info", "q_indices", "k_indices") if key.get(n)]
    mask = key["mask"]
    if unsupported or any(mask.get(n) is not None for n in ("bool_mask", "q_start", "q_end", "k_start", "k_end")):
        raise NotImplementedError(f"entry uses {unsupported or 'a mask beyond is_causal'}")
    return dict(is_causal=causal, logits_scale=key["logits_scale"], logits_soft_cap=key["logits_soft_cap"])


def estimate_attention_fwd(chip, key, config, _unrecorded=None):
    from tokamax._src.ops.attention import pallas_mosaic_tpu as tk

    q, k, v, causal, flops, min_bytes = _attention_specs(key)
    cfg = dict(config)
    for name in ("q_layout", "k_layout", "v_layout"):
        cfg[name] = tk.splash.QKVLayout(cfg[name])
    op = tk.PallasMosaicTpuFlashAttention(config=tk.Config(**cfg))
    kwargs = _attention_kwargs(key, causal)
    residuals = bool(key["return_residuals"])

    def fn(q, k, v):
        return op(q, k, v, return_residuals=residuals, **kwargs)

    return tpu_estimator.estimate(fn, [q, k, v], chip, flops=flops, min_bytes=min_bytes, what_if=what_if(chip)), []


def estimate_attention_bwd(chip, key, config, _unrecorded=None):
    import jax
    from tokamax._src.ops.attention import pallas_mosaic_tpu_vjp as tk

    q, k, v, causal, flops, min_bytes = _attention_specs(key)
    res = [jax.ShapeDtypeStruct(*_shape_dtype(r)) for r in key["residuals"]]
    out, dout = (jax.ShapeDtypeStruct(*_shape_dtype(key[n])) for n in ("out", "dout"))
    from tokamax._src import precision as precision_lib
    from tokamax._src.ops.attention import base

    op = tk.PallasMosaicTpuFlashAttentionVjp(config=tk.Config(**config))
    kwargs = _attention_kwargs(key, causal)
    # The VJP op takes its arguments as the forward op passes them: the
    # recorded precisions as dot algorithm presets, the mask as a Mask.
    (qk, pv) = [tuple(getattr(jax.lax.Precision, name) for name in pair) for pair in key["precision"]]
    precision = (precision_lib.to_dot_algorithm_preset(q.dtype, k.dtype, qk),
                 precision_lib.to_dot_algorithm_preset(v.dtype, v.dtype, pv))
    full = dict(precision=precision, logits_dtype=np.dtype(key["logits_dtype"]), logits_scale=kwargs["logits_scale"],
                bias=None, logits_soft_cap=kwargs["logits_soft_cap"], mask=base.Mask(is_causal=causal),
                dropout_mask=None, dropout_rate=key["dropout_rate"], paging_info=None, q_indices=None, k_indices=None,
                normalize_output=key["normalize_output"], return_residuals=False)

    def fn(m, l, o, do, q, k, v):
        return op((m, l), o, do, q, k, v, **full)

    # dq, dk, dv: 2.5x the forward's matmuls (recompute logits, dv, dp, dq, dk).
    return tpu_estimator.estimate(fn, [*res, out, dout, q, k, v], chip, flops=2.5 * flops,
                                  min_bytes=2 * min_bytes + 2 * sum(np.prod(x.shape) * 4 for x in res),
                                  what_if=what_if(chip)), []


ESTIMATORS = {"ragged dot": estimate_ragged_dot, "attention fwd": estimate_attention_fwd,
              "attention bwd": estimate_attention_bwd}

_LINE = re.compile(r"^\[(\S+) ([\w ]+)\] (\d+): est ([\d.]+) ms, measured [\d.]+ ms, ratio [\d.]+ \(\d+ s\);?(.*)$")
_FAILED = re.compile(r"^\[(\S+) ([\w ]+)\] entry (\d+): (.*)$")


def parse_logs(paths) -> dict:
    """{(chip, kind, entry): (estimated seconds, notes) or error text} from the
    progress lines this script prints (``--from-logs``: a run cut short)."""
    out = {}
    for path in paths:
        for line in pathlib.Path(path).read_text().splitlines():
            if m := _LINE.match(line):
                notes, _, parts = m.group(5).partition(" | ")
                out[(m.group(1), m.group(2), int(m.group(3)))] = (float(m.group(4)) * 1e-3, notes.strip(" ;"),
                                                                   parts.strip())
            elif m := _FAILED.match(line):
                out[(m.group(1), m.group(2), int(m.group(3)))] = m.group(4)
    return out


def _op_of(kind, key) -> str:
    if kind == "ragged dot":
        (lc, rc), _ = key["ragged_dot_dimension_numbers"]["dot_dimension_numbers"]
        op = "dlhs" if rc == [2] else ("drhs" if lc == [0] else "fwd")
        return op + (" +res" if key["return_residuals"] else "")
    mask = "causal" if key["mask"]["is_causal"] else "full"
    return mask + (" +res" if key.get("return_residuals") else "")


def _shapes_of(kind, key) -> str:
    if kind == "ragged dot":
        return f"{key['lhs']} x {key['rhs']}"
    return f"q {key['q']}, kv {key['k']}"


def _config_of(kind, config) -> str:
    if kind == "ragged dot":
        return f"{config['tile_m']}/{config['tile_k']}/{config['tile_n']}, {config['input_buffer_count']}"
    return ", ".join(f"{k}={v}" for k, v in config.items() if k.startswith("block"))


def summary(ratios: list[float]) -> dict:
    """Entries, median estimate / measured, shares within 10% and 25%, worst
    (the ratio farthest from 1 on a log scale)."""
    if not ratios:
        return {"entries": 0, "median": "-", "within 10%": "-", "within 25%": "-", "worst": "-"}
    n = len(ratios)
    within = lambda tol: sum(abs(r - 1) <= tol for r in ratios) / n
    worst = max(ratios, key=lambda r: abs(math.log(r)))
    return {"entries": n, "median": f"{statistics.median(ratios):.2f}", "within 10%": f"{within(0.10):.0%}",
            "within 25%": f"{within(0.25):.0%}", "worst": f"{worst:.2f}"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="a folder of tokamax tables (DIR/<chip folder>/<table>.json)")
    ap.add_argument("--chips", nargs="+", default=list(TABLE_DIRS), choices=list(TABLE_DIRS))
    ap.add_argument("--kinds", nargs="+", default=list(KIND_TABLES), choices=list(KIND_TABLES))
    ap.add_argument("--max-entries", type=int, default=None,
                    help="at most N entries per chip and kind, spread evenly over the table")
    ap.add_argument("--from-logs", nargs="+", default=None,
                    help="build the tables from the progress output of earlier runs instead of estimating")
    ap.add_argument("--skip-logged", nargs="+", default=None,
                    help="estimate only the chosen entries these progress logs do not hold yet (a resumed run)")
    ap.add_argument("--unrecorded-sizes", choices=("tokamax", "equal"), default="tokamax",
                    help="ragged dot group sizes where the table keeps only their count and total")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    from absl import flags

    flags.FLAGS(sys.argv[:1], known_only=True)  # tokamax reads absl flags; ours are argparse's
    logged = parse_logs(args.from_logs) if args.from_logs else None
    done = parse_logs(args.skip_logged) if args.skip_logged else {}
    sections, overview, sources = [], [], []
    for chip, kind in itertools.product(args.chips, args.kinds):
        path, source = table_path(chip, kind, args.data)
        if path is None:
            continue
        entries = list(table_entries(path))
        chosen = sample(len(entries), args.max_entries)
        if logged is not None:  # the entries the logs hold
            chosen = [i for i in chosen if (chip, kind, i) in logged]
        chosen = [i for i in chosen if (chip, kind, i) not in done]
        sources.append(f"- {chip} {kind}: {source} ({len(chosen)} of its {len(entries)} measured entries"
                       + (", spread evenly)" if len(chosen) < len(entries) else ")"))
        rows, ratios, uses, alternatives = [], [], [], {}
        for i in chosen:
            key, config, measured = entries[i]
            t0 = time.time()
            if (refused := refusal(kind, key, config)) is not None:  # also for entries logged before the check
                result = refused
            elif logged is not None:
                if (chip, kind, i) not in logged:
                    continue
                result = logged[(chip, kind, i)]
            else:
                try:
                    est, notes = ESTIMATORS[kind](chip, key, config, args.unrecorded_sizes)
                    if not all(k.regions_matched for k in est.kernels):
                        notes.append("regions unmatched")
                    result = (est.seconds, ", ".join(notes), breakdown(est))
                except Exception as exc:  # noqa: BLE001 -- an entry that cannot be estimated is reported
                    result = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
            if isinstance(result, str):
                rows.append(_row(kind, key, config, None, measured, f"not estimated: {result}"))
                print(f"[{chip} {kind}] entry {i}: {result}", file=sys.stderr, flush=True)
                continue
            seconds, notes, parts = result
            ratios.append(seconds / measured)
            for name, x in re.findall(r"(\w+ [\d.]+x): ([\d.]+)", parts or ""):
                alternatives.setdefault(name, []).append(float(x) * seconds / measured)
            if (serial := serial_seconds(parts)) is not None:
                alternatives.setdefault(NO_OVERLAP, []).append(serial / measured)
            use = mxu_use(chip, kind, key, measured, parts)
            uses.append(use[0])
            rows.append(_row(kind, key, config, seconds, measured, notes, parts, use))
            print(f"[{chip} {kind}] {i}: est {seconds * 1e3:.3f} ms, measured {measured * 1e3:.3f} ms, "
                  f"ratio {seconds / measured:.2f} ({time.time() - t0:.0f} s); {notes}"
                  + (f" | {parts}" if parts else ""), file=sys.stderr, flush=True)
        s = summary(ratios)
        overview.append({"chip": chip, "kind": kind, **s,
                         "best measured MXU use": f"{max(uses):.0%}" if uses else "-",
                         **{f"if {name}: median, within 25%": f"{statistics.median(r):.2f}, {summary(r)['within 25%']}"
                            for name, r in alternatives.items()}})
        sections.append(f"## {chip} {kind} ({tpu_estimator.CHIPS[chip].topology})\n\n"
                        f"{s['entries']} entries estimated: median {s['median']}, within 10% {s['within 10%']}, "
                        f"within 25% {s['within 25%']}, worst {s['worst']}.\n\n" + markdown(rows))
    command = "python bench/calibrate_tpu_estimator.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = pathlib.Path(args.out)
    out.write_text(
        "# TPU estimator calibration against measured TPU timings\n\n"
        f"Generated by `{command.strip()}`. Each row: one measured entry of a tokamax autotuning table for "
        "its Pallas TPU kernel (ragged dot; flash attention, which is tokamax's splash attention), compiled "
        "here for the same chip with the recorded config and estimated by `bench/tpu_estimator.py` (the "
        "compiler's static schedule + a DMA pipeline simulation at the chip's published clock and HBM "
        "bandwidth; nothing fitted). 'measured' is the median of the entry's `evaluation_times_ms`. Goal: "
        "median within 0.9-1.1 and at least 70% of the entries within 25%.\n\n"
        "Tables read:\n" + "\n".join(sources) + "\n\n" + markdown(overview) + "\n\n"
        + CAVEATS + "\n\n" + (NOTES.read_text().strip() + "\n\n" if NOTES.is_file() and out.resolve() == RESULTS else "")
        + "\n\n".join(sections) + "\n")
    print(f"wrote {out}")


CAVEATS = """What the estimate does not model, and which way each bends it, is in the docstring of
`bench/tpu_estimator.py` ("Not modelled")."""


def breakdown(est) -> str:
    """Where an estimate's time goes: the kernels' busiest-core compute
    (step cycles at the clock) and DMA time (bytes at the core's bandwidth
    share), the other XLA ops, and the cores the grid ran on."""
    compute = sum(k.compute_s for k in est.kernels)
    dma = sum(k.dma_s for k in est.kernels)
    cores = max(k.cores for k in est.kernels)
    alternatives = "".join(f", {name}: {t / est.seconds:.3f}" for name, t in est.what_if.items())
    return (f"compute {compute * 1e3:.3f} ms, dma {dma * 1e3:.3f} ms, other {est.other_ops_s * 1e3:.3f} ms, "
            f"cores {cores}{alternatives}")


NO_OVERLAP = "no DMA/compute overlap"


def serial_seconds(parts) -> float | None:
    """The estimate's parts summed (compute + DMA + other ops): what the
    kernel would take if its DMAs never overlapped its compute."""
    fields = dict(re.findall(r"(compute|dma|other) ([\d.]+) ms", parts or ""))
    return sum(float(v) for v in fields.values()) * 1e-3 if len(fields) == 3 else None


def flops_of(kind, key) -> float:
    if kind == "ragged dot":
        return problem(key)[3]
    fwd = _attention_specs(key)[4]
    return fwd if kind == "attention fwd" else 2.5 * fwd


def mxu_use(chip, kind, key, measured, parts) -> tuple[float, float | None]:
    """The share of the MXU peak of the TensorCores the kernel ran on that
    the measured time reaches, and that the estimate's compute time (the
    static schedule at the clock) reaches: a measured share far below the
    schedule's says the chip ran the MXU work slower than scheduled."""
    spec = tpu_estimator.CHIPS[chip]
    fields = dict(re.findall(r"(\w+) ([\d.]+)", parts or ""))
    cores = int(fields.get("cores", 1))
    ideal = flops_of(kind, key) / (spec.bf16_flops_per_s * cores)
    compute = float(fields.get("compute", 0)) * 1e-3
    return ideal / measured, (ideal / compute if compute else None)


def _row(kind, key, config, estimate, measured, notes, parts="", use=None) -> dict:
    return {
        "shapes": _shapes_of(kind, key),
        "op": _op_of(kind, key),
        "config": _config_of(kind, config),
        "estimate ms": "-" if estimate is None else f"{estimate * 1e3:.3f}",
        "measured ms": f"{measured * 1e3:.3f}",
        "est/meas": "-" if estimate is None else f"{estimate / measured:.2f}",
        "where the estimate goes": parts or "-",
        **({"est/meas if " + name: f"{float(x) * estimate / measured:.2f}"
            for name, x in re.findall(r"(\w+ [\d.]+x): ([\d.]+)", parts or "")} if estimate else {}),
        **({f"if {NO_OVERLAP}": f"{serial_seconds(parts) / measured:.2f}"} if serial_seconds(parts) else {}),
        "MXU use measured / scheduled": "-" if use is None else
        f"{use[0]:.0%} / {'-' if use[1] is None else format(use[1], '.0%')}",
        "notes": notes,
    }


if __name__ == "__main__":
    main()
