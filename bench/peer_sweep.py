"""The peers' grouped matmuls at their best tiles: a recorded sweep.

A peer's figure in our tables is the best the peer can do on the shape, not
its default. Each of the layer's two matmuls (up: ``[M, H] x [E, H, 2I]``,
down: ``[M, I] x [E, I, H]``) is swept separately, for each peer, chip and
routing, because a user tunes each call separately:

* the search space is tokamax's own autotuning space (``tile_m`` 64..1024 in
  powers of two up to M; ``tile_k`` / ``tile_n`` powers of two from 128 and
  the padded dimension halved up to five times, plus the whole dimension;
  tokamax adds 2-4 input buffers); megablox gets the same tiles from 128 rows
  (it needs ``M % tm == 0``);
* the walk starts from the configs the peers' users pick: MaxText's megablox
  default (512, 1024, 1024), every entry of tokamax's tuned table for the same
  (K, N) (its tables hold training-sized M only), and our own tile rule's
  choice; from the best start, each round tries one step along every axis
  (and the step of all the axes that helped at once) and moves to the best,
  while a round helps, at most ``MAX_ROUNDS`` rounds;
* every config estimated is appended to a JSON-lines record
  (``bench/results/peer_sweep.jsonl``: chip, peer, model, tokens, matmul,
  config, microseconds or the reason it cannot run, the estimator's source
  digest), so a run that is cut resumes where it stopped and the tables name
  what each peer ran. The record chooses configs; the tables re-estimate the
  whole layer at the chosen configs with the current estimator.

A walk is not an exhaustive search: a better config may exist off the path.
The record shows every config tried, so a reader can judge how far the walk
went.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import ROOT  # noqa: E402

RECORD = ROOT / "bench" / "results" / "peer_sweep.jsonl"
PEERS = ("tokamax", "megablox")
# Our own grouped matmul walks the same space (no buffer axis): the tile rule
# of gmm/tiling.py is checked against its best (issue 22).
OURS = "ours"
MATMULS = ("up", "down")
MAX_ROUNDS = 3
MAXTEXT_MEGABLOX = (512, 1024, 1024)
# Estimates whose MXU regions the estimator could not pair with the kernel's
# dots (less reliable); recorded with the entry.
UNMATCHED: set[tuple] = set()


def round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def axis_values(dim: int) -> list[int]:
    """tokamax's autotuning values for a K or N tile."""
    padded = round_up(dim, 128)
    values = {128 * 2 ** i for i in range(8) if 128 * 2 ** i <= padded}
    values |= {padded // 2 ** i for i in range(6) if padded // 2 ** i >= 128 and (padded // 2 ** i) % 128 == 0}
    if dim % 128:  # the whole dimension, not its padded copy (one more step for the same work)
        values.discard(padded)
        values.add(dim)
    return sorted(values)


def row_values(m: int, peer: str) -> list[int]:
    lowest = 128 if peer == "megablox" else 64
    return [v for v in (lowest * 2 ** i for i in range(8)) if v <= min(m, 1024) and (peer != "megablox" or m % v == 0)]


def search_space(peer: str, m: int, k: int, n: int) -> tuple[list[int], ...]:
    axes = (row_values(m, peer), axis_values(k), axis_values(n))
    return axes + (([2, 3, 4],) if peer == "tokamax" else ())


def nearest(values: list[int], v: int) -> int:
    """The largest value <= v (the smallest value if none is)."""
    below = [x for x in values if x <= v]
    return below[-1] if below else values[0]


def clip(config: tuple[int, ...], space) -> tuple[int, ...]:
    return tuple(nearest(axis, v) for axis, v in zip(space, config))


def neighbours(config: tuple[int, ...], space) -> list[tuple[int, ...]]:
    """One step along one axis of the space (a value off the axis, such as
    our rule's balanced 1536-wide tile, steps to the axis values either side)."""
    out = []
    for axis, values in enumerate(space):
        values = sorted(set(values) | {config[axis]})
        i = values.index(config[axis])
        for j in (i - 1, i + 1):
            if 0 <= j < len(values):
                out.append(config[:axis] + (values[j],) + config[axis + 1:])
    return out


def combined_step(config: tuple[int, ...], tried: dict, space) -> tuple[int, ...]:
    """Every axis moved to its best neighbour where that beat ``config``: one
    step of all the axes that helped (costs that are nearly separable per
    axis reach their minimum in fewer rounds)."""
    here = tried[config]
    out = list(config)
    for axis in range(len(space)):
        better = {c: t for c, t in tried.items() if isinstance(t, float) and t < here
                  and c[:axis] + c[axis + 1:] == config[:axis] + config[axis + 1:]}
        if better:
            out[axis] = min(better, key=better.get)[axis]
    return tuple(out)


def tuned_table_seeds(k: int, n: int) -> list[tuple[int, ...]]:
    """tokamax's tuned (tm, tk, tn, buffers) for the same weight shape, at any M."""
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tk

    return [(tm, tk_, tn, buffers) for (_, kk, nn, _, quantized), ((tm, tk_, tn), buffers)
            in tk.GMM_TILING_TUNED_LUT.items() if (kk, nn) == (k, n) and not quantized]


def seeds(peer: str, m: int, k: int, n: int, groups: int, generation: str) -> list[tuple[int, ...]]:
    from moe_experts_tpu.gmm import tiling

    ours = tiling.choose_tiling(m, k, n, groups, lhs_itemsize=2, rhs_itemsize=2, out_itemsize=4,
                                generation=generation).as_tuple()
    starts = [MAXTEXT_MEGABLOX, ours] + [s[:3] for s in tuned_table_seeds(k, n)]
    if peer == "tokamax":
        starts = [s + (2,) for s in starts[:2]] + tuned_table_seeds(k, n)
    elif peer == OURS:  # the rule first: the walk then shows how far its best is from it
        starts = [ours] + starts
    space = search_space(peer, m, k, n)
    return list(dict.fromkeys(clip(s, space) for s in starts))


def estimator_version() -> str:
    """A digest of the estimator's sources: entries written by another
    version chose configs but their figures are not comparable."""
    import hashlib

    here = pathlib.Path(__file__).parent
    return hashlib.sha256(b"".join((here / f).read_bytes() for f in ("tpu_estimator.py", "tpu_schedule.py"))
                          ).hexdigest()[:10]


class Record:
    """The JSON-lines record of every config estimated."""

    def __init__(self, path: pathlib.Path = RECORD):
        self.path = path
        self.entries: dict[tuple, float | str] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                e = json.loads(line)
                key = self.key(e["chip"], e["peer"], e["model"], e["tokens"], e["matmul"], tuple(e["config"]))
                self.entries[key] = e["us"] if "us" in e else e["error"]
                if e.get("mxu_regions_unmatched"):
                    UNMATCHED.add(key)

    @staticmethod
    def key(chip, peer, model, tokens, matmul, config):
        return (chip, peer, model, int(tokens), matmul, tuple(config))

    def get(self, *key):
        return self.entries.get(self.key(*key))

    def add(self, chip, peer, model, tokens, matmul, config, result):
        self.entries[self.key(chip, peer, model, tokens, matmul, config)] = result
        entry = dict(chip=chip, peer=peer, model=model, tokens=int(tokens), matmul=matmul, config=list(config),
                     estimator=estimator_version())
        entry["us" if isinstance(result, float) else "error"] = result
        if self.key(chip, peer, model, tokens, matmul, config) in UNMATCHED:
            entry["mxu_regions_unmatched"] = True
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    def tried(self, chip, peer, model, tokens, matmul) -> dict[tuple, float | str]:
        return {k[-1]: v for k, v in self.entries.items() if k[:5] == (chip, peer, model, int(tokens), matmul)}

    def best(self, chip, peer, model, tokens, matmul) -> tuple[tuple[int, ...], float] | None:
        timed = {c: t for c, t in self.tried(chip, peer, model, tokens, matmul).items() if isinstance(t, float)}
        if not timed:
            return None
        config = min(timed, key=timed.get)
        return config, timed[config]


def matmul_shape(model: str, tokens: int, matmul: str):
    from bench_tpu_estimates import MODELS

    hidden, inter, experts, top_k, _ = MODELS[model]
    m = tokens * top_k
    return (m, hidden, 2 * inter, experts) if matmul == "up" else (m, inter, hidden, experts)


def peer_matmul(peer: str, config: tuple[int, ...], generation: str | None = None):
    """``fn(x, w, group_sizes)``: one grouped matmul of the peer at ``config``,
    f32 out (ours takes ``w`` as ``[E, N, K]``, Transformers' layout, and is
    compiled for ``generation``: its row chunk and VMEM limit follow the chip;
    the peers take ``[E, K, N]``)."""
    import jax.numpy as jnp

    if peer == OURS:
        from moe_experts_tpu.gmm import pallas_gmm

        return lambda x, w, gs: pallas_gmm.gmm(x, w, gs, rhs_layout="nk", out_dtype=jnp.float32,
                                               tiling=config[:3], generation=generation)

    if peer == "tokamax":
        from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tk

        tm, tk_, tn, buffers = config
        op = tk.PallasMosaicTpuRaggedDot(config=tk.Config(tile_m=tm, tile_k=tk_, tile_n=tn,
                                                          input_buffer_count=buffers))
        return lambda x, w, gs: op(x, w, group_sizes=gs, preferred_element_type=jnp.float32)
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    return lambda x, w, gs: gmm(x, w, gs, preferred_element_type=jnp.float32, tiling=config[:3])


def estimate_peer(peer: str, fn, args, chip: str, **kw):
    """``tpu_estimator.estimate`` of a peer's program; tokamax runs its grid
    inside a gridless kernel, so its grid is replayed from what it recorded."""
    import tpu_estimator

    if peer != "tokamax":
        return tpu_estimator.estimate(fn, args, chip, **kw)
    from calibrate_tpu_estimator import PipelineRecorder

    with PipelineRecorder() as recorder:
        return tpu_estimator.estimate(fn, args, chip, replay_for=recorder.replay_for(), **kw)


def estimate_matmul(chip: str, peer: str, model: str, tokens: int, matmul: str, config) -> float | str:
    """Estimated microseconds of one matmul, or why it cannot run."""
    import jax
    import jax.numpy as jnp

    from bench_tpu_estimates import problem_size

    m, k, n, experts = matmul_shape(model, tokens, matmul)
    gs, _, _ = problem_size(model, tokens)
    weight = (experts, n, k) if peer == OURS else (experts, k, n)
    args = [jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct(weight, jnp.bfloat16), gs]
    flops = 2.0 * m * k * n
    used = int((gs > 0).sum())
    min_bytes = 2.0 * (m * k + used * k * n) + 4.0 * m * n
    try:
        est = estimate_peer(peer, peer_matmul(peer, config, chip), args, chip, flops=flops, min_bytes=min_bytes)
    except Exception as exc:  # noqa: BLE001 -- a config the peer or the compiler refuses is recorded
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    if not all(kern.regions_matched for kern in est.kernels):
        UNMATCHED.add((chip, peer, model, int(tokens), matmul, tuple(config)))
    return est.seconds * 1e6


def sweep(chip: str, peer: str, model: str, tokens: int, matmul: str, record: Record, log=sys.stderr,
          start_from: str | None = None, estimate=None, starts=None, follow: str | None = None,
          max_rounds: int | None = None):
    """The best (config, us) of one matmul by the walk of the module
    docstring; every estimate goes to ``record`` (configs already there are
    not re-run). ``start_from``: another chip whose recorded best joins the
    starts, and the walk takes one round only (a cheaper sweep for the chips
    after the first). ``follow``: another peer already swept on this chip and
    shape: its best tiles at every buffer count of this peer's space join the
    starts, and there is no walk (tokamax and megablox run the same tiles
    within 1-2% of each other). ``max_rounds`` overrides the rounds of the
    walk (0: the starts only). ``estimate`` / ``starts``: the estimator and
    the starts (default: ``estimate_matmul`` and ``seeds``)."""
    m, k, n, experts = matmul_shape(model, tokens, matmul)
    space = search_space(peer, m, k, n)
    if not space[0]:
        return None
    estimate = estimate or estimate_matmul
    starts = list(starts) if starts is not None else seeds(peer, m, k, n, experts, chip)
    rounds = MAX_ROUNDS
    if start_from:
        other = record.best(start_from, peer, model, tokens, matmul)
        starts = ([other[0]] if other else []) + starts
        rounds = 1
    if follow and record.best(chip, follow, model, tokens, matmul):
        tiles = record.best(chip, follow, model, tokens, matmul)[0][:3]
        starts = [tiles + (b,) for b in space[3]] if len(space) > 3 else [tiles]
        if peer == "tokamax":
            starts += [clip(s, space) for s in tuned_table_seeds(k, n)]
        rounds = 0
    if max_rounds is not None:
        rounds = max_rounds

    def run(config):
        if record.get(chip, peer, model, tokens, matmul, config) is None:
            t0 = time.time()
            result = estimate(chip, peer, model, tokens, matmul, config)
            record.add(chip, peer, model, tokens, matmul, config, result)
            shown = f"{result:.1f} us" if isinstance(result, float) else result
            print(f"[{chip}] {peer} {model} {tokens} {matmul} {config}: {shown} ({time.time() - t0:.0f} s)",
                  file=log, flush=True)

    for config in dict.fromkeys(starts):
        run(config)
    if follow and record.best(chip, peer, model, tokens, matmul) is None:
        # the other peer's tiles do not run here: this peer's own starts and one round
        for config in seeds(peer, m, k, n, experts, chip):
            run(config)
        rounds = 1
    for _ in range(rounds):
        best = record.best(chip, peer, model, tokens, matmul)
        if best is None:
            return None
        for config in neighbours(best[0], space):
            run(config)
        run(combined_step(best[0], record.tried(chip, peer, model, tokens, matmul), space))
        if record.best(chip, peer, model, tokens, matmul)[0] == best[0]:
            break
    return record.best(chip, peer, model, tokens, matmul)


def best_contender(chip: str, peer: str, model: str, tokens: int, record: Record | None = None,
                   start_from: str | None = None, follow: str | None = None,
                   max_rounds: int | None = None) -> str | None:
    """``peer@up_config/down_config``: the best configs the record holds for
    the shape (a matmul the record lacks is swept first), or None when the
    peer runs no config of the shape."""
    record = record or Record()
    configs = []
    for matmul in MATMULS:
        best = record.best(chip, peer, model, tokens, matmul)
        if not record.tried(chip, peer, model, tokens, matmul):
            best = sweep(chip, peer, model, tokens, matmul, record,
                         start_from=None if start_from == chip else start_from,
                         follow=None if follow == peer else follow, max_rounds=max_rounds)
        if best is None:
            return None
        configs.append(",".join(map(str, best[0])))
    return f"{peer}@{'/'.join(configs)}"


def main(argv=None):
    import argparse

    from absl import flags

    from bench_tpu_estimates import MODELS
    from common import use_shipped_packages

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chips", nargs="+", default=["v6e"])
    ap.add_argument("--models", nargs="+", default=[m for m in MODELS if m != "deepseek-v3"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[64, 512, 4096])
    ap.add_argument("--peers", nargs="+", default=list(PEERS), help=f"peers to sweep, or {OURS!r} (our kernel)")
    ap.add_argument("--start-from", default=None,
                    help="a chip already swept: its best joins the starts and the walk takes one round")
    ap.add_argument("--follow", default=None,
                    help="a peer already swept here: its best tiles (every buffer count) and tokamax's table, no walk")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of the walk (default: MAX_ROUNDS)")
    args = ap.parse_args(argv)
    flags.FLAGS(sys.argv[:1], known_only=True)  # tokamax reads absl flags
    use_shipped_packages()
    record = Record()
    for chip in args.chips:
        for model in args.models:
            for tokens in args.tokens:
                for peer in args.peers:
                    for matmul in MATMULS:
                        best = sweep(chip, peer, model, tokens, matmul, record,
                                     start_from=None if args.start_from == chip else args.start_from,
                                     follow=None if args.follow == peer else args.follow, max_rounds=args.rounds)
                        print(f"best {chip} {peer} {model} {tokens} {matmul}: {best}", flush=True)


if __name__ == "__main__":
    main()
