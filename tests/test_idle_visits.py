"""Expert parallelism reads only the weights of experts that have rows: a visit
of the zero prefix or suffix (other ranks' experts, rows past the sum) keeps the
block already in VMEM, in the grouped matmul and in the fused experts kernel.
Counted from the kernels' own visit plan (`forward_visits`), no TPU needed."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from ragged_dot_tpu.gmm import pallas_gmm, tiling

SEED = int(os.environ.get("TEST_SEED", np.random.SeedSequence().entropy % (2**31)))
EXPERTS, TOP_K = 128, 8  # Qwen3-30B-A3B routing


def _weight_fetches(sizes, offset, num_local, m, tm):
    """Weight blocks the forward kernel's grid fetches along the visits (one
    column of output tiles): a fetch whenever the block index changes."""
    seg, _, num_visits, _, _, group = pallas_gmm.forward_visits(
        jnp.asarray(sizes, jnp.int32), offset, num_local, m=m, tm=tm)
    group = np.asarray(group)[: int(num_visits)]
    return 1 + int(np.count_nonzero(group[1:] != group[:-1])) if len(group) else 0


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_weight_reads_per_rank_are_the_minimum(ranks, tokens):
    rng = np.random.default_rng(SEED)
    num_local, m = EXPERTS // ranks, tokens * TOP_K
    tm = tiling.choose_tiling(m, 2048, 1536, num_local, lhs_itemsize=2, rhs_itemsize=2, out_itemsize=2,
                              generation="v6e").tm
    extra = 0
    for _ in range(20):
        picks = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(tokens)])
        sizes = np.bincount(picks.ravel(), minlength=EXPERTS)
        for rank in range(ranks):
            local = sizes[rank * num_local:(rank + 1) * num_local]
            live = int(np.count_nonzero(local))
            fetches = _weight_fetches(sizes, rank * num_local, num_local, m, tm)
            # A rank with no rows still streams its first block once: the
            # pipeline fetches step 0's inputs before it knows there is nothing to do.
            assert fetches == max(live, 1), (rank, local.tolist(), fetches, SEED)
            extra += fetches - live
    assert extra <= 20 * ranks  # at most one idle fetch per rank without rows


def test_idle_visits_keep_the_resident_group():
    # Rows: 3 of a remote expert before the window, 2 in local group 1, 5 past the window.
    seg, _, num_visits, _, _, group = pallas_gmm.forward_visits(
        jnp.asarray([3, 0, 2, 0, 5], jnp.int32), 1, 3, m=10, tm=8)
    seg, group = np.asarray(seg)[: int(num_visits)], np.asarray(group)[: int(num_visits)]
    assert (group == 1).all(), (seg, group)  # prefix and suffix visits read group 1, the only live one


def _resident_groups_reference(seg, num_local):
    """Plain loop: the nearest visit of a local group before each visit, else after it."""
    seg = [int(s) for s in seg]
    local = [i for i, s in enumerate(seg) if 0 < s <= num_local]
    out = []
    for i in range(len(seg)):
        before = [j for j in local if j <= i]
        after = [j for j in local if j >= i]
        source = before[-1] if before else (after[0] if after else len(seg) - 1)
        out.append(min(max(seg[source] - 1, 0), num_local - 1))
    return out


@pytest.mark.parametrize("tokens", [0, 1, 8, 64])
def test_resident_groups_match_a_plain_loop(tokens):
    # routing whose local window may be empty, first, last or in the middle of the experts
    rng = np.random.default_rng(SEED)
    for _ in range(10):
        sizes = np.bincount(rng.integers(0, EXPERTS, tokens * TOP_K), minlength=EXPERTS) if tokens else \
            np.zeros(EXPERTS, int)
        num_local = int(rng.choice([8, 16, 32]))
        offset = int(rng.integers(0, EXPERTS // num_local)) * num_local
        m = max(tokens * TOP_K, 8)
        seg, *_ = pallas_gmm.forward_visits(jnp.asarray(sizes, jnp.int32), offset, num_local, m=m, tm=16)
        got = np.asarray(pallas_gmm.resident_groups(seg, num_local))
        assert got.tolist() == _resident_groups_reference(np.asarray(seg), num_local)


def _visits_reference(seg_starts, seg_ends, tm, tiles_m, visit_empty):
    """Plain loop: per segment in order, every row tile it touches (an empty
    one: one visit of its clipped first tile, if ``visit_empty``), then the
    sentinels (segment -1, the last visit's tile) up to the static bound + 1."""
    seg, tile = [], []
    for s, (a, b) in enumerate(zip(seg_starts, seg_ends)):
        first = min(max(a // tm, 0), tiles_m - 1)
        if b > a:
            last = min(max((b - 1) // tm, first), tiles_m - 1)
            tiles = range(first, last + 1)
        else:
            tiles = [first] if visit_empty else []
        for t in tiles:
            seg.append(s)
            tile.append(t)
    bound = tiles_m + len(seg_starts) - (0 if visit_empty else 1)
    count = len(seg)
    while len(seg) < bound + 1:
        seg.append(-1)
        tile.append(tile[count - 1] if count else 0)
    return seg, tile, count


@pytest.mark.parametrize("visit_empty", [False, True])
def test_visits_match_a_plain_loop(visit_empty):
    """The visit list (segment and row tile of each visit) against a loop, on
    random ragged segments with empty ones and tiles that split them."""
    rng = np.random.default_rng(SEED)
    for _ in range(20):
        num_segments = int(rng.integers(1, 12))
        sizes = rng.integers(0, 40, num_segments) * (rng.random(num_segments) < 0.7)
        ends = np.cumsum(sizes)
        starts = ends - sizes
        tm = int(rng.choice([8, 16, 32]))
        m = max(int(ends[-1]), 1)
        tiles_m = -(-m // tm)
        seg, tile, count = pallas_gmm.make_visits(jnp.asarray(starts, jnp.int32), jnp.asarray(ends, jnp.int32),
                                                  tm=tm, tiles_m=tiles_m, visit_empty=visit_empty)
        want_seg, want_tile, want_count = _visits_reference(starts.tolist(), ends.tolist(), tm, tiles_m, visit_empty)
        assert int(count) == want_count
        assert np.asarray(seg).tolist() == want_seg, (sizes, tm)
        assert np.asarray(tile)[:want_count].tolist() == want_tile[:want_count], (sizes, tm)
        if want_count:  # sentinels keep the last visit's block
            assert set(np.asarray(tile)[want_count:].tolist()) <= {want_tile[want_count - 1]}
