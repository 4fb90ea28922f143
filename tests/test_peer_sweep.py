"""The peers' tile sweep (bench/peer_sweep.py): its search space, its walk on
a cost whose minimum is known, and its record (resumed, never re-run)."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import peer_sweep  # noqa: E402


def test_axis_values_powers_of_two_halvings_and_the_whole_dimension():
    # K = 2880 (gpt-oss): not a multiple of 128, so the whole 2880 replaces its padded 2944
    assert peer_sweep.axis_values(2880) == [128, 256, 512, 1024, 2048, 2880]
    # N = 1536 (Qwen3's 2 x 768): 1536 halved is 768 and 384
    assert peer_sweep.axis_values(1536) == [128, 256, 384, 512, 768, 1024, 1536]


def test_row_values_megablox_divides_m_tokamax_from_64():
    assert peer_sweep.row_values(1536, "megablox") == [128, 256, 512]  # 1024 does not divide 1536
    assert peer_sweep.row_values(4096, "tokamax") == [64, 128, 256, 512, 1024]
    assert peer_sweep.row_values(64, "megablox") == []  # fewer rows than its smallest tile
    assert peer_sweep.row_values(1536, "ours") == [64, 128, 256, 512, 1024]  # any M, like tokamax


def test_our_space_has_no_buffer_axis_and_our_walk_starts_at_the_rule(monkeypatch):
    """Our kernel is swept to check its tile rule: the rule's tiles are its first start."""
    from moe_experts_tpu.gmm import tiling

    # tokamax (its tuned table) is a benchmark-only dependency, absent from the test env
    monkeypatch.setattr(peer_sweep, "tuned_table_seeds", lambda k, n: [])

    assert len(peer_sweep.search_space("ours", 2048, 2880, 5760)) == 3
    rule = tiling.choose_tiling(2048, 2880, 5760, 32, lhs_itemsize=2, rhs_itemsize=2, out_itemsize=4,
                                generation="v6e").as_tuple()
    starts = peer_sweep.seeds("ours", 2048, 2880, 5760, 32, "v6e")
    assert starts[0] == peer_sweep.clip(rule, peer_sweep.search_space("ours", 2048, 2880, 5760))
    assert peer_sweep.MAXTEXT_MEGABLOX in starts


def test_neighbours_one_step_along_one_axis_and_clip():
    space = ([128, 256, 512], [512, 1024], [768, 1536], [2, 3, 4])
    assert sorted(peer_sweep.neighbours((256, 512, 1536, 3), space)) == sorted([
        (128, 512, 1536, 3), (512, 512, 1536, 3), (256, 1024, 1536, 3), (256, 512, 768, 3),
        (256, 512, 1536, 2), (256, 512, 1536, 4)])
    # a recorded config off the axis (our rule's balanced tile): the axis values either side
    assert {(256, 512, 768, 3), (256, 512, 1536, 3)} <= set(peer_sweep.neighbours((256, 512, 1024, 3), space))
    assert peer_sweep.clip((1024, 700, 4096, 2), space) == (512, 512, 1536, 2)
    assert peer_sweep.clip((64, 128, 128, 2), space) == (128, 512, 768, 2)  # nothing below: the smallest


def _walk(tmp_path, cost, starts, **kw):
    record = peer_sweep.Record(tmp_path / "sweep.jsonl")
    calls = []

    def estimate(chip, peer, model, tokens, matmul, config):
        calls.append(config)
        return cost(config)

    best = peer_sweep.sweep("v6e", "megablox", "qwen3-30b-a3b", 4096, "up", record, log=open("/dev/null", "w"),
                            estimate=estimate, starts=starts, **kw)
    return best, calls, record


def test_walk_reaches_the_minimum_of_a_separable_cost_and_records_every_config(tmp_path):
    # Qwen3 up at 4096 tokens: M 32768, K 2048, N 1536; cost minimal at (256, 2048, 768)
    target = (256, 2048, 768)
    space = peer_sweep.search_space("megablox", 32768, 2048, 1536)

    def cost(config):
        return float(sum(abs(axis.index(v) - axis.index(t)) for axis, v, t in zip(space, config, target)))

    best, calls, record = _walk(tmp_path, cost, [(512, 1024, 1024)])
    assert best == (target, 0.0)
    assert len(calls) == len(set(calls))  # no config estimated twice
    assert set(record.tried("v6e", "megablox", "qwen3-30b-a3b", 4096, "up")) == set(calls)
    # the record is read back: a second walk re-runs nothing
    again = peer_sweep.Record(tmp_path / "sweep.jsonl")
    assert again.best("v6e", "megablox", "qwen3-30b-a3b", 4096, "up") == (target, 0.0)
    best2, calls2, _ = _walk(tmp_path, cost, [(512, 1024, 1024)])
    assert calls2 == [] and best2 == best


def test_walk_skips_configs_that_cannot_run(tmp_path):
    def cost(config):
        return "VMEM OOM" if config[0] >= 512 else float(1000 - config[2])

    best, calls, record = _walk(tmp_path, cost, [(512, 2048, 768), (256, 2048, 768)])
    assert best[0][0] < 512 and best[0][2] == 1536  # the widest N that runs
    assert record.get("v6e", "megablox", "qwen3-30b-a3b", 4096, "up", (512, 2048, 768)) == "VMEM OOM"


def test_follow_takes_the_other_peers_best_tiles_at_every_buffer_count_without_a_walk(tmp_path, monkeypatch):
    record = peer_sweep.Record(tmp_path / "sweep.jsonl")
    record.add("v6e", "megablox", "qwen3-30b-a3b", 4096, "up", (256, 2048, 768), 900.0)
    record.add("v6e", "megablox", "qwen3-30b-a3b", 4096, "up", (512, 2048, 768), 950.0)
    calls = []

    def estimate(chip, peer, model, tokens, matmul, config):
        calls.append(config)
        return 1000.0 - config[3]

    monkeypatch.setattr(peer_sweep, "tuned_table_seeds", lambda k, n: [])  # tokamax: bench-only, not here
    best = peer_sweep.sweep("v6e", "tokamax", "qwen3-30b-a3b", 4096, "up", record, log=open("/dev/null", "w"),
                            estimate=estimate, starts=[], follow="megablox")
    assert calls == [(256, 2048, 768, 2), (256, 2048, 768, 3), (256, 2048, 768, 4)]
    assert best == ((256, 2048, 768, 4), 996.0)


def test_balanced_routing_splits_rows_evenly_and_keeps_the_others_random():
    """bench_tpu_estimates' routings: "balanced" (the layer without boundary
    visits) gives every expert the same rows, the remainder one each to the
    first experts; uniform and skewed stay top-k draws of distinct experts."""
    import numpy as np
    import pytest

    import bench_tpu_estimates

    sizes = bench_tpu_estimates.routing_group_sizes(4096, 32, 4, np.random.default_rng(0), "balanced")
    assert sizes.tolist() == [512] * 32
    sizes = bench_tpu_estimates.routing_group_sizes(7, 4, 2, np.random.default_rng(0), "balanced")
    assert sizes.tolist() == [4, 4, 3, 3]
    for routing in ("uniform", "skewed"):
        sizes = bench_tpu_estimates.routing_group_sizes(64, 8, 2, np.random.default_rng(1), routing)
        assert sizes.sum() == 128 and sizes.max() <= 64  # each token picks two distinct experts
        assert len(set(sizes.tolist())) > 1  # random draws, not an even split
    with pytest.raises(ValueError, match="routing"):
        bench_tpu_estimates.routing_group_sizes(8, 4, 1, np.random.default_rng(0), "hot")
