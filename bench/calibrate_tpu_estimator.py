"""Calibrate the TPU estimator against TPU timings someone else measured.

tokamax 0.0.12 ships the timings of its own Pallas TPU ragged dot
(``tokamax/data/autotuning/<chip>/pallas_mosaic_tpu_ragged_dot.json``: shapes,
group sizes, tile config, ``evaluation_times_ms`` measured on the chip). For
every entry with a measurement we compile tokamax's kernel with that exact
config for the same chip, estimate its time (``tpu_estimator``, no parameter
fitted), and compare. Writes bench/results/tpu_calibration.md.

    python bench/calibrate_tpu_estimator.py [--chips v5e tpu7x] [--limit N]
        [--unrecorded-sizes equal|random] [--out FILE]

Where a table keeps only the group count and total rows (tpu7x), the sizes
are equal by default; ``--unrecorded-sizes random`` draws them from a uniform
random routing instead (seed 0): how much of the gap that choice explains.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import re
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import tpu_estimator  # noqa: E402  (sets libtpu's dump folder before jax loads libtpu)
from common import ROOT, markdown  # noqa: E402

TABLE_DIRS = {"v5e": "tpu_v5_lite", "tpu7x": "tpu7x"}
RESULTS = ROOT / "bench" / "results" / "tpu_calibration.md"


def _shape(spec: str):
    m = re.fullmatch(r"(\w+)\[([\d,]*)\]", spec)
    dtype = {"bf16": "bfloat16", "f32": "float32"}[m.group(1)]
    return tuple(int(d) for d in m.group(2).split(",") if d), dtype


def table_entries(chip: str):
    """(key, config, measured seconds) of every measured entry of the shipped table."""
    import tokamax

    path = pathlib.Path(tokamax.__file__).parent / "data" / "autotuning" / TABLE_DIRS[chip] / "pallas_mosaic_tpu_ragged_dot.json"
    for key, configs in json.loads(path.read_text()).items():
        for config, result in configs.items():
            times = result.get("evaluation_times_ms") or []
            if times:
                yield json.loads(key), json.loads(config), statistics.median(times) / 1e3


def group_sizes_of(key, unrecorded: str = "equal") -> tuple[np.ndarray, str]:
    """The recorded sizes, or, where the table keeps only their count and
    total (the tpu7x tables), equal sizes or (``unrecorded="random"``) the
    sizes of a uniform random routing: said in the table."""
    gs = key["group_sizes"]
    if isinstance(gs, list):
        return np.asarray(gs, np.int32), "recorded"
    g, total = gs["num_groups"], gs["total_size"]
    if unrecorded == "random":
        rows = np.random.default_rng(0).integers(0, g, total)
        return np.bincount(rows, minlength=g).astype(np.int32), "random group sizes"
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


def estimate_entry(chip, key, config, unrecorded: str = "equal"):
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tk

    lhs, rhs, numbers, flops, min_bytes = problem(key)
    sizes, sizes_note = group_sizes_of(key, unrecorded)
    op = tk.PallasMosaicTpuRaggedDot(config=tk.Config(**config))
    residuals = bool(key["return_residuals"])

    def fn(a, b, g):
        return op(a, b, group_sizes=g, ragged_dot_dimension_numbers=numbers, return_residuals=residuals)

    with PipelineRecorder() as recorder:
        est = tpu_estimator.estimate(fn, [lhs, rhs, sizes], chip, flops=flops, min_bytes=min_bytes,
                                     replay_for=recorder.replay_for())
    return est, sizes_note


_LINE = re.compile(r"^\[(\S+)\] (\d+): est ([\d.]+) ms, measured [\d.]+ ms, ratio [\d.]+ \(\d+ s\)(.*)$")
_FAILED = re.compile(r"^\[(\S+)\] entry (\d+): (.*)$")


def parse_logs(paths) -> dict:
    """{(chip, entry): (estimated seconds, flags) or error text} from the
    progress lines this script prints (``--from-logs``: a run cut short)."""
    out = {}
    for path in paths:
        for line in pathlib.Path(path).read_text().splitlines():
            if m := _LINE.match(line):
                out[(m.group(1), int(m.group(2)))] = (float(m.group(3)) * 1e-3, m.group(4).strip(" ;"))
            elif m := _FAILED.match(line):
                out[(m.group(1), int(m.group(2)))] = m.group(3)
    return out


def _kind(key) -> str:
    (lc, rc), _ = key["ragged_dot_dimension_numbers"]["dot_dimension_numbers"]
    return "dlhs" if rc == [2] else ("drhs" if lc == [0] else "fwd")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chips", nargs="+", default=["v5e", "tpu7x"])
    ap.add_argument("--limit", type=int, default=None, help="at most N entries per chip (a quick look)")
    ap.add_argument("--from-logs", nargs="+", default=None,
                    help="build the tables from the progress output of earlier runs instead of estimating")
    ap.add_argument("--unrecorded-sizes", choices=("equal", "random"), default="equal",
                    help="group sizes where the table keeps only their count and total")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    from absl import flags

    flags.FLAGS(sys.argv[:1], known_only=True)  # tokamax reads absl flags; ours are argparse's
    logged = parse_logs(args.from_logs) if args.from_logs else None
    sections = []
    for chip in args.chips:
        rows, ratios = [], []
        for i, (key, config, measured) in enumerate(table_entries(chip)):
            if args.limit is not None and i >= args.limit:
                break
            t0 = time.time()
            if logged is not None:
                if (chip, i) not in logged:
                    continue
                result = logged[(chip, i)]
            else:
                try:
                    est, note = estimate_entry(chip, key, config, args.unrecorded_sizes)
                    flags_ = [] if all(k.regions_matched for k in est.kernels) else ["regions unmatched"]
                    if note != "recorded":
                        flags_.append(note)
                    result = (est.seconds, ", ".join(flags_))
                except Exception as exc:  # noqa: BLE001 -- an entry that cannot be estimated is reported
                    result = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
            if isinstance(result, str):
                rows.append(_row(key, _kind(key), config, None, measured, f"not estimated: {result}"))
                print(f"[{chip}] entry {i}: {result}", file=sys.stderr)
                continue
            seconds, notes = result
            ratios.append(seconds / measured)
            rows.append(_row(key, _kind(key), config, seconds, measured, notes))
            print(f"[{chip}] {i}: est {seconds * 1e3:.3f} ms, measured {measured * 1e3:.3f} ms, "
                  f"ratio {seconds / measured:.2f} ({time.time() - t0:.0f} s); {notes}", file=sys.stderr)
        summary = (f"{len(ratios)} entries estimated; estimate / measured: median {statistics.median(ratios):.2f}, "
                   f"min {min(ratios):.2f}, max {max(ratios):.2f}; within 10%: "
                   f"{sum(abs(r - 1) <= 0.10 for r in ratios)} of {len(ratios)}") if ratios else "no entry estimated"
        sections.append(f"## {chip} ({tpu_estimator.CHIPS[chip].topology})\n\n{summary}\n\n" + markdown(rows))
    out = pathlib.Path(args.out)
    out.write_text(
        "# TPU estimator calibration against tokamax's measured ragged dot timings\n\n"
        "Generated by `python bench/calibrate_tpu_estimator.py`. Each row: one measured entry of tokamax "
        "0.0.12's shipped autotuning table for its Pallas TPU ragged dot, compiled here for the same chip with "
        "the recorded tile config and estimated by `bench/tpu_estimator.py` (the compiler's static schedule + "
        "a DMA pipeline simulation at the chip's published clock and HBM bandwidth; nothing fitted). "
        "'measured' is the median of the table's `evaluation_times_ms`.\n\n" + "\n\n".join(sections) + "\n")
    print(f"wrote {out}")


def _row(key, kind, config, estimate, measured, notes) -> dict:
    return {
        "lhs": key["lhs"], "rhs": key["rhs"],
        "op": kind + (" +res" if key["return_residuals"] else ""),
        "tiles m/k/n, buffers": _tiles(config),
        "estimate ms": "-" if estimate is None else f"{estimate * 1e3:.3f}",
        "measured ms": f"{measured * 1e3:.3f}",
        "est/meas": "-" if estimate is None else f"{estimate / measured:.2f}",
        "notes": notes,
    }


def _tiles(config) -> str:
    return f"{config['tile_m']}/{config['tile_k']}/{config['tile_n']}, {config['input_buffer_count']}"


if __name__ == "__main__":
    main()
