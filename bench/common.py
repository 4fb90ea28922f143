"""Shared by the benchmarks: timing, markdown tables, writing results."""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEV_TREE = ROOT / ".dev"


def use_shipped_packages() -> None:
    """Assemble the Hub packages as they ship (`build/hub.py dev`) and put them on
    sys.path, so a benchmark measures what users load."""
    spec = importlib.util.spec_from_file_location("_hub_build_script", ROOT / "build" / "hub.py")
    hub = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = hub
    spec.loader.exec_module(hub)
    hub.dev(DEV_TREE)
    sys.path.insert(0, str(DEV_TREE))


_EVICT_BYTES = 128 << 20  # several times any L3 cache here
_evict_buffer = None


def evict_caches() -> None:
    """Streams through a buffer much larger than the L3 cache, so that the
    next call finds its weights in DRAM, as a decode step of a real model
    does (each layer's experts are other weights), whatever ran before it."""
    global _evict_buffer
    if _evict_buffer is None:
        import torch

        _evict_buffer = torch.zeros(_EVICT_BYTES, dtype=torch.uint8)
    _evict_buffer.add_(1)


def time_interleaved(fns: dict, repeats: int, min_seconds: float = 0.0, before_each=None) -> dict:
    """Median seconds per callable (see ``time_rounds``)."""
    return {name: statistics.median(s) for name, s in time_rounds(fns, repeats, min_seconds, before_each).items()}


def paired_ratio(samples: dict, peer: str, ours: str = "ours") -> float:
    """Median over rounds of peer time / our time within the same round: a
    slow spell of the host slows both calls of a round, so the per-round
    ratio is steadier than the ratio of the two medians."""
    return statistics.median(p / o for p, o in zip(samples[peer], samples[ours]))


def time_rounds(fns: dict, repeats: int, min_seconds: float = 0.0, before_each=None) -> dict:
    """Seconds per call of each callable, one list per callable, timed in alternating rounds (one call of
    each per round, after one warm-up each), so that a slow spell of a noisy
    host hits every contender alike instead of one of them. The order rotates
    every round, so no contender always runs right after the same other one
    (what the previous call left in the caches matters for memory-bound
    calls). Rounds continue past ``repeats`` until ``min_seconds`` have been
    spent, so that fast calls get enough samples for a stable median.
    ``before_each`` (untimed) runs before every timed call, e.g. ``evict_caches``."""
    names = list(fns)
    for fn in fns.values():
        fn()
    samples = {name: [] for name in fns}
    timed = 0.0
    rounds = 0
    while rounds < repeats or (timed < min_seconds and rounds < 50 * repeats):
        for i in range(len(names)):
            name = names[(rounds + i) % len(names)]
            if before_each is not None:
                before_each()
            start = time.perf_counter()
            fns[name]()
            samples[name].append(time.perf_counter() - start)
            timed += samples[name][-1]
        rounds += 1
    return samples


def markdown(rows, float_fmt="{:.2f}") -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = [float_fmt.format(r[k]) if isinstance(r.get(k), float) else str(r.get(k, "-")) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(default_tokens, default_repeats, default_min_seconds=0.0, flags=()):
    """``flags``: (name, help) pairs of extra on/off options."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=default_tokens)
    parser.add_argument("--repeats", type=int, default=default_repeats)
    parser.add_argument("--min-seconds", type=float, default=default_min_seconds,
                        help="keep timing rounds until this long has been spent per table cell")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    for name, help_text in flags:
        parser.add_argument(f"--{name}", action="store_true", help=help_text)
    return parser.parse_args()


def write_report(out_dir: str, filename: str, title: str, intro: str, sections) -> str:
    """``sections``: (heading or None, rows) pairs, rendered as tables."""
    parts = [f"# {title}\n", intro]
    for heading, rows in sections:
        if heading:
            parts.append(f"## {heading}")
        parts.append(markdown(rows))
    text = "\n\n".join(parts) + "\n"
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / filename).write_text(text)
    print(text)
    return text


CALIBRATION = ROOT / "bench" / "results" / "tpu_calibration.md"


def calibration_summary(chip: str, kind: str) -> str:
    """The estimator's measured error for one chip and kernel kind, as
    ``tpu_calibration.md`` states it (estimate / measured: median, share
    within 25%, entries); the other kinds of the chip when it has no
    table of that kind."""
    rows = {}
    for line in CALIBRATION.read_text().splitlines() if CALIBRATION.exists() else []:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 6 and cells[2].isdigit():
            rows[(cells[0], cells[1])] = f"{cells[1]} median estimate/measured {cells[3]}, {cells[5]} of {cells[2]} entries within 25%"
    exact = [text for (c, k), text in rows.items() if c == chip and k.startswith(kind)]
    if exact:
        return "; ".join(exact)
    others = [text for (c, _), text in rows.items() if c == chip]
    return (f"no measured {kind} table for {chip}" + (" (" + "; ".join(others) + ")" if others else "")
            + "; the other chips' figures in tpu_calibration.md")
