"""Shared by the benchmarks: timing, markdown tables, writing results."""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def time_interleaved(fns: dict, repeats: int) -> dict:
    """Median seconds per callable, timed in alternating rounds (one call of
    each per round, after one warm-up each), so that a slow spell of a noisy
    host hits every contender alike instead of one of them."""
    for fn in fns.values():
        fn()
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def markdown(rows, float_fmt="{:.2f}") -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = [float_fmt.format(r[k]) if isinstance(r.get(k), float) else str(r.get(k, "-")) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(default_tokens, default_repeats):
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=default_tokens)
    parser.add_argument("--repeats", type=int, default=default_repeats)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
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
