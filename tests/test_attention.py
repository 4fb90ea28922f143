"""attention-tpu on CPU: the Pallas kernel in interpret mode and the native path
against a float64 loop, masks and block skipping, the torch op, errors."""

import functools
import itertools
import os
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import attention_tpu
import reference
from attention_tpu.attention import blocks, flash_forward, masks
from attention_tpu.attention import key_ranges as kr
from attention_tpu.common import tpu_generations

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
from attention_visit_plan import kv_block_plan  # noqa: E402

SEED = int(os.environ.get("TEST_SEED", np.random.SeedSequence().entropy % (2**31)))
IMPLS = ["native", "interpret"]
# Forward rtol = atol, about twice the error of rounding the exact output once to
# the dtype (bf16 7.8e-3, f16 9.7e-4: bench/attention_dtype_error.py).
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
# Gradients (rtol, atol) of out.square().sum(): float16 gradients are their
# float32 values rounded once (measured max error 2.9e-2 at gradients up to 68),
# except that the kernels' backward rounds P and dS to float16 before their
# dots (sums over up to Skv products), so an element's error follows its
# tensor's scale, not its own value: float16's atol is times max(1, max |grad|)
# (seed 688330596: interpret dk 3.6e-3 at an element of 0.46 in a tensor reaching
# 6.8, 5.3e-4 of its scale; the element-wise bound was 2.9e-3).
GRAD_TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (2e-3, 2e-3)}

# (batch, q heads, kv heads, Sq, Skv, D, Dv): MHA, GQA, MQA, decode, Dv != D, tails.
SHAPES = {
    "mha": (2, 2, 2, 9, 9, 16, 16),
    "gqa_prefill_tails": (2, 4, 2, 13, 13, 32, 32),
    "mqa_decode": (2, 8, 1, 1, 37, 16, 16),
    "few_tokens_long_cache": (1, 4, 2, 3, 300, 16, 16),
    "dv_differs": (1, 4, 2, 6, 11, 16, 8),
}
FEATURES = {
    "plain_causal": dict(causal=True),
    "not_causal": dict(causal=False),
    "window": dict(causal=True, window=4),
    "softcap": dict(causal=True, softcap=5.0),
    "sinks": dict(causal=True, sinks=True),
    "all": dict(causal=True, window=3, softcap=5.0, sinks=True, scale=0.37),
}


def _inputs(shape, dtype, seed):
    b, hq, hkv, sq, skv, d, dv = shape
    gen = torch.Generator().manual_seed(SEED + seed)
    q = torch.randn(b, hq, sq, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, skv, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, skv, dv, generator=gen).to(dtype)
    sinks = torch.randn(hq, generator=gen)
    return q, k, v, sinks


def _padded_ranges(b, skv):
    """Batch row 0 uses every key, row 1 is left-padded and its cache is not full."""
    start = np.array([0, min(2, skv - 1)][:b], dtype=np.int32)
    end = np.array([skv, max(skv - 1, start[-1] + 1)][:b], dtype=np.int32)
    return start, end


def _check(got, want, dtype, what):
    got = got.detach().to(torch.float64).numpy()
    assert not np.isnan(got).any(), f"{what}: NaN (unwritten or unmasked) elements, seed={SEED}"
    np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype], err_msg=f"{what} seed={SEED}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_matches_float64_loop(impl, feature, shape):
    opts = dict(FEATURES[feature])
    use_sinks = opts.pop("sinks", False)
    q, k, v, sinks = _inputs(SHAPES[shape], torch.float32, seed=len(shape) + len(feature))
    b, _, _, sq, skv, d, _ = SHAPES[shape]
    start, end = _padded_ranges(b, skv)
    visible = reference.attention_rule_mask(start, end, sq, skv, causal=opts.get("causal", True),
                                            window=opts.get("window", 0))
    scale = opts.get("scale", d ** -0.5)
    got = attention_tpu.attention(q, k, v, attention_mask=torch.from_numpy(visible),
                                  sinks=sinks if use_sinks else None, impl=impl, **opts)
    want = reference.attention(q, k, v, visible, scale=scale, softcap=opts.get("softcap", 0.0),
                               sinks=sinks.numpy() if use_sinks else None)
    assert got.shape == (*q.shape[:3], v.shape[-1]) and got.dtype == q.dtype
    _check(got, want, torch.float32, f"{impl} {shape} {feature}")


# 16-bit dtypes: every feature on GQA prefill with tails, and decode, a long
# cache with a window over several key blocks, Dv != D.
HALF_CASES = [("gqa_prefill_tails", feature) for feature in sorted(FEATURES)] + [
    ("mqa_decode", "sinks"), ("few_tokens_long_cache", "window"), ("dv_differs", "all")]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape,feature", HALF_CASES, ids=[f"{s}-{f}" for s, f in HALF_CASES])
def test_16_bit_dtypes_match_float64_loop(shape, feature, dtype, impl):
    """bfloat16 and float16 in, the same dtype out, within about twice the error
    of rounding the exact attention once (f32 accumulation on every path)."""
    opts = dict(FEATURES[feature])
    use_sinks = opts.pop("sinks", False)
    q, k, v, sinks = _inputs(SHAPES[shape], dtype, seed=3 + len(feature))
    b, _, _, sq, skv, d, _ = SHAPES[shape]
    start, end = _padded_ranges(b, skv)
    visible = reference.attention_rule_mask(start, end, sq, skv, causal=opts.get("causal", True),
                                            window=opts.get("window", 0))
    blocks_ = (8, 128) if skv > 128 else None  # several key blocks with a tail
    got = attention_tpu.attention(q, k, v, attention_mask=torch.from_numpy(visible),
                                  sinks=sinks if use_sinks else None, block_sizes=blocks_, impl=impl, **opts)
    want = reference.attention(q.float(), k.float(), v.float(), visible, scale=opts.get("scale", d ** -0.5),
                               softcap=opts.get("softcap", 0.0), sinks=sinks.numpy() if use_sinks else None)
    assert got.dtype == dtype and got.shape == (*q.shape[:3], v.shape[-1])
    _check(got, want, dtype, f"{impl} {dtype} {shape} {feature}")


@pytest.mark.parametrize("block_sizes", [(8, 128), (16, 128), (24, 256)])
def test_several_blocks_with_tails_and_skipping(block_sizes):
    """Keys and rows span several blocks (tails in both), blocks are skipped by the
    causal and window rules; the interpreter poisons what is never written."""
    q, k, v, sinks = _inputs((2, 4, 2, 20, 300, 16, 16), torch.float32, seed=5)
    start, end = np.array([0, 37], np.int32), np.array([300, 290], np.int32)
    for causal, window in ((True, 0), (True, 50), (False, 0)):
        visible = reference.attention_rule_mask(start, end, 20, 300, causal=causal, window=window)
        got = attention_tpu.attention(q, k, v, attention_mask=torch.from_numpy(visible), causal=causal,
                                      window=window, block_sizes=block_sizes, impl="interpret")
        want = reference.attention(q, k, v, visible, scale=0.25)
        _check(got, want, torch.float32, f"blocks {block_sizes} causal={causal} window={window}")


def test_forward_tiles_computed_in_key_sub_blocks():
    """Prefill tiles of 1024 keys computed in pieces: interior tiles in 256-key
    folds, masked ones in 512-key sub-blocks; a tail block (2100 keys) whose
    garbage rows are zeroed per sub-block, windows and left padding; poisoned
    outputs."""
    assert blocks.compute_block_k(136, 1024) == blocks.COMPUTE_BLOCK_K == 256
    assert blocks.forward_compute_blocks(136, 1024) == (136, blocks.FORWARD_COMPUTE_KEYS) == (136, 512)
    assert blocks.compute_block_k(8, 4096) == 4096  # decode tiles stay whole
    assert blocks.compute_block_k(1024, 512) == 512  # window tiles too
    assert blocks.compute_block_k(1024, 2048, 512) == 512  # folds as wide as V where it is wider
    q, k, v, sinks = _inputs((2, 4, 2, 80, 2100, 16, 16), torch.float32, seed=21)
    start, end = np.array([0, 300], np.int32), np.array([2100, 1900], np.int32)
    for causal, window in ((True, 0), (True, 700), (False, 0)):
        visible = reference.attention_rule_mask(start, end, 80, 2100, causal=causal, window=window)
        got = attention_tpu.attention(q, k, v, attention_mask=torch.from_numpy(visible), causal=causal, window=window,
                                      sinks=sinks, softcap=20.0 if window else 0.0, block_sizes=(136, 1024),
                                      impl="interpret")
        want = reference.attention(q, k, v, visible, scale=0.25, softcap=20.0 if window else 0.0, sinks=sinks.numpy())
        _check(got, want, torch.float32, f"sub-blocks causal={causal} window={window}")


@pytest.mark.parametrize("row_sums", ["mxu", "reduced"])
@pytest.mark.parametrize("ranges", ["rule", "random"])
def test_forward_masked_blocks_computed_in_sub_tiles(ranges, row_sums, monkeypatch):
    """Masked blocks cut in sub-tiles of rows and keys (16 x 128 here: 3 x 4 per
    48 x 512 block, the rule's being 512 x 512 of 2048 x 2048), each skipped,
    unmasked or masked on its own: rule ranges with offsets, windows and
    soft-capping (ranges rebuilt from iotas), random per-query ranges (read),
    padding rows in the last query block, a tail key block; poisoned outputs.
    The softmax's row sums taken from the MXU (v6e at 128-wide V rows; the
    interpreter's default generation) or by a reduction (everywhere else)."""
    assert blocks.row_sums_on_mxu("v6e", 128) and not blocks.row_sums_on_mxu("v5e", 128)
    assert not blocks.row_sums_on_mxu("v6e", 64)
    monkeypatch.setattr(blocks, "ROW_SUMS_ON_MXU", frozenset({"v6e"} if row_sums == "mxu" else ()))
    monkeypatch.setattr(blocks, "ROW_SUMS_V_DIM", 16)  # this test's V rows
    assert blocks.forward_compute_blocks(2048, 2048) == (blocks.FORWARD_COMPUTE_ROWS, blocks.FORWARD_COMPUTE_KEYS)
    assert blocks.forward_compute_blocks(512, 512) == (512, 512)  # window tiles stay whole
    assert blocks.forward_compute_blocks(8, 4096) == (8, 4096)  # decode tiles too
    monkeypatch.setattr(blocks, "FORWARD_COMPUTE_ROWS", 16)
    monkeypatch.setattr(blocks, "FORWARD_COMPUTE_KEYS", 128)
    monkeypatch.setattr(blocks, "COMPUTE_BLOCK_K", 128)
    monkeypatch.setattr(blocks, "DECODE_MAX_ROWS", 8)  # 48-row tiles count as prefill tiles
    assert blocks.forward_compute_blocks(48, 512) == (16, 128)
    rng = np.random.default_rng(SEED + 23)
    q, k, v, sinks = _inputs((2, 4, 2, 70, 1100, 16, 16), torch.float32, seed=23)
    if ranges == "random":
        cases = [(torch.from_numpy(_ranges_mask(_random_ranges(rng, 2, 70, 1100), 1100)), True, 0, 0.0)]
    else:
        start, end = np.array([0, 400], np.int32), np.array([1100, 1000], np.int32)
        cases = [(torch.from_numpy(reference.attention_rule_mask(start, end, 70, 1100, causal=causal, window=window)),
                  causal, window, softcap) for causal, window, softcap in ((True, 0, 0.0), (True, 30, 20.0),
                                                                           (False, 0, 0.0))]
    for visible, causal, window, softcap in cases:
        got = attention_tpu.attention(q, k, v, attention_mask=visible, causal=causal, window=window, sinks=sinks,
                                      softcap=softcap, block_sizes=(48, 512), impl="interpret")
        want = reference.attention(q, k, v, visible.numpy(), scale=0.25, softcap=softcap, sinks=sinks.numpy())
        _check(got, want, torch.float32, f"sub-tiles {ranges} causal={causal} window={window}")


@pytest.mark.parametrize("block_k, window, row_sums", [(128, 0, "mxu"), (256, 0, "reduced"), (128, 24, "reduced"),
                                                       (256, 24, "mxu")])
def test_forward_static_sub_tiles_in_one_region(block_k, window, row_sums, monkeypatch):
    """A tile whose sub-tiles' kinds are static (the first query on a key at a
    whole query block's offset: a causal diagonal, a short window's tiles)
    computes them in one region, skipping those no row sees and masking only
    those the diagonal or the window's edge crosses; 128-row blocks of 32 x 32
    sub-tiles here (other masked tiles: 64 x 64), square or twice as wide
    (2048-blocks of 256 (512) on a TPU), whole 128-blocks of a 24-key window
    (512 of 256 for gpt-oss's 128) and 128 x 256 ones split in pieces (the
    rule's 2048 blocks of a window). Batch rows: a prefill (aligned),
    one whose keys start inside a diagonal tile (that tile takes the sub-tile
    path, the next diagonal is aligned), one offset by 60 keys (never
    aligned), one left-padded and offset by two blocks (aligned) but with one
    query off the rule (its block must read its ranges); soft-capping;
    poisoned outputs."""
    monkeypatch.setattr(blocks, "ROW_SUMS_ON_MXU", frozenset({"v6e"} if row_sums == "mxu" else ()))
    monkeypatch.setattr(blocks, "ROW_SUMS_V_DIM", 16)
    monkeypatch.setattr(blocks, "FORWARD_COMPUTE_ROWS", 64)  # the other masked tiles' sub-tiles
    whole_window_tiles = window and block_k == 128  # tiles not split in pieces: the window's own sub-tile rule
    monkeypatch.setattr(blocks, "FORWARD_COMPUTE_KEYS", 128 if whole_window_tiles else 64)
    monkeypatch.setattr(blocks, "COMPUTE_BLOCK_K", 32)  # interior folds
    monkeypatch.setattr(blocks, "DIAGONAL_SUB_TILE", 32)
    monkeypatch.setattr(blocks, "WINDOW_SUB_TILE", 32)
    monkeypatch.setattr(blocks, "DECODE_MAX_ROWS", 8)
    assert blocks.static_sub_tile(128, block_k, window, 16) == 32 and blocks.static_sub_tile(80, 128, window, 16) == 0
    assert blocks.static_sub_tile(128, 256, 0, 64) == 64  # at least as wide as V
    sq, skv = 384, 640
    if window and not whole_window_tiles:  # the window's tiles and the one before them, the diagonal's sub-tiles
        assert kr.static_offsets(128, 256, 32, sq=sq, causal=True, window=window) == (0, 4, 8)
    elif window:
        assert blocks.forward_compute_blocks(128, block_k) == (128, 128)
        assert blocks.static_sub_tile(128, 128, 40, 16) == 0  # a window longer than a sub-tile: tiles stay whole
        assert kr.static_offsets(128, 128, 32, sq=sq, causal=True, window=window) == (0, 4)
        assert list(kr.static_sub_tiles(4, 4, 4, 32, window)) == [(0, 3, True)]
    else:
        assert blocks.forward_compute_blocks(128, block_k) == (64, 64)
        assert kr.static_offsets(128, 128, 32, sq=sq, causal=True, window=0) == (0,)
        assert kr.static_offsets(128, 256, 32, sq=sq, causal=True, window=0) == (0, 4)
        assert kr.static_offsets(256, 128, 32, sq=sq, causal=True, window=0) == ()
        assert kr.static_offsets(128, 128, 128, sq=sq, causal=True, window=0) == ()
        assert kr.static_offsets(128, 128, 32, sq=sq + 8, causal=True, window=0) == ()
        assert list(kr.static_sub_tiles(2, 2, 0, 32, 0)) == [(0, 0, True), (1, 0, False), (1, 1, True)]
    start, end = np.array([0, 140, 0, 5], np.int32), np.array([384, 512, 444, 640], np.int32)
    aligned = functools.partial(kr.aligned_tile, True, block_q=128, block_k=block_k, size=32, sq=sq, skv=skv)
    if block_k == 128:
        assert bool(aligned(start[0], end[0], 0, 0, 0)) and bool(aligned(start[3], end[3], 0, 2, 0))
        assert not bool(aligned(start[1], end[1], 0, 1, 0)) and bool(aligned(start[1], end[1], 1, 2, 0))
    else:
        assert bool(aligned(start[0], end[0], 1, 0, 4)) and bool(aligned(start[3], end[3], 0, 1, 0))
        assert not bool(aligned(start[1], end[1], 0, 0, 4)) and bool(aligned(start[1], end[1], 1, 1, 0))
    assert not any(bool(aligned(start[2], end[2], qb, kb, o)) for qb in range(3) for kb in range(5) for o in range(5))
    q, k, v, sinks = _inputs((4, 2, 1, sq, skv, 16, 16), torch.float32, seed=31)
    visible = reference.attention_rule_mask(start, end, sq, skv, causal=True, window=window)
    visible[3, ..., 40, 280:] = False  # one query of row 3 off the rule, in its diagonal tile: the tile reads ranges
    for softcap in (0.0, 20.0):
        got = attention_tpu.attention(q, k, v, attention_mask=torch.from_numpy(visible), causal=True, window=window,
                                      sinks=sinks, softcap=softcap, block_sizes=(128, block_k), impl="interpret")
        want = reference.attention(q, k, v, visible, scale=0.25, softcap=softcap, sinks=sinks.numpy())
        _check(got, want, torch.float32, f"static sub-tiles block_k={block_k} window={window} softcap={softcap}")


@pytest.mark.parametrize("kv_splits", [2, 3, 5])
def test_kv_splits_merge_to_one_softmax(kv_splits):
    """Keys split in parts whose partial softmaxes are merged: splits that see no
    key (left padding, a short cache) weigh nothing; sinks join after the merge."""
    q, k, v, sinks = _inputs((3, 8, 2, 2, 700, 16, 16), torch.float32, seed=12)
    start, end = np.array([0, 5, 600], np.int32), np.array([700, 333, 640], np.int32)
    for causal, window in ((True, 0), (True, 90), (False, 0)):
        visible = reference.attention_rule_mask(start, end, 2, 700, causal=causal, window=window)
        got = attention_tpu.attention(q, k, v, attention_mask=torch.from_numpy(visible), causal=causal,
                                      window=window, sinks=sinks, block_sizes=(16, 128), kv_splits=kv_splits,
                                      impl="interpret")
        want = reference.attention(q, k, v, visible, scale=0.25, sinks=sinks.numpy())
        _check(got, want, torch.float32, f"kv_splits={kv_splits} causal={causal} window={window}")


def _random_ranges(rng, b, sq, skv):
    """int32 ``[B, Sq, 2]`` key ranges of every kind a mask gives: empty rows,
    right-padding-like long rows, short ones, packed-document-like starts."""
    lo = rng.integers(0, skv + 1, (b, sq))
    hi = np.minimum(skv, lo + rng.integers(-3, skv + 1, (b, sq)))
    return np.stack([lo, hi], axis=-1).astype(np.int32)


def _ranges_mask(bounds, skv):
    """``[B, 1, Sq, Skv]`` from per-query ranges, one entry at a time."""
    b, sq, _ = bounds.shape
    out = np.zeros((b, 1, sq, skv), dtype=bool)
    for i in range(b):
        for j in range(sq):
            out[i, 0, j, bounds[i, j, 0]:max(bounds[i, j, 0], bounds[i, j, 1])] = True
    return out


def _brute_force_table(visible, *, rows, skv, block_q, block_k):
    """Per (batch, query block): the KV blocks any real row sees, and the blocks
    every real row sees whole, from a dense ``[B, 1, Sq, Skv]`` mask."""
    by_row = np.concatenate([visible[:, 0]] * (rows // visible.shape[2]), axis=1)  # rows = (head, query)
    out = []
    for b in range(len(visible)):
        for r0 in range(0, rows, block_q):
            block = by_row[b, r0:r0 + block_q]
            blocks_seen = [kb for kb in range(-(-skv // block_k)) if block[:, kb * block_k:(kb + 1) * block_k].any()]
            whole = [kb for kb in range(-(-skv // block_k))
                     if (kb + 1) * block_k <= skv and block[:, kb * block_k:(kb + 1) * block_k].all()]
            out.append((blocks_seen, whole))
    return out


@pytest.mark.parametrize("trial", range(6))
def test_visit_table_matches_the_dense_mask(trial):
    """The per-call table the kernel walks by, from rule ranges (even trials) or
    arbitrary ones (odd): every visible block is inside [FIRST, LAST], the ends
    are visible, and exactly the whole blocks skip the mask."""
    rng = np.random.default_rng(SEED + trial)
    b, group, sq, skv = 3, int(rng.integers(1, 4)), int(rng.integers(1, 40)), int(rng.integers(1, 700))
    block_q, block_k = int(rng.choice([8, 16, 24])), int(rng.choice([128, 256]))
    causal, window = bool(rng.integers(0, 2)), int(rng.choice([0, 1, 50, 300]))
    if trial % 2:
        bounds = _random_ranges(rng, b, sq, skv)
        visible = _ranges_mask(bounds, skv)
    else:
        start = rng.integers(0, skv, b).astype(np.int32)
        end = np.minimum(skv, start + rng.integers(0, skv, b)).astype(np.int32)
        bounds = kr.rule_key_bounds(start, end, sq=sq, skv=skv, causal=causal, window=window)
        visible = reference.attention_rule_mask(start, end, sq, skv, causal=causal, window=window)
    rows = group * sq
    start, end, fits = kr.rule_fit(jnp.asarray(bounds), sq=sq, skv=skv, causal=causal, window=window)
    table = np.asarray(kr.visit_table(kr.row_bounds(bounds, group),
                                      num_q_blocks=-(-rows // block_q), block_q=block_q, block_k=block_k,
                                      rows=rows, fits=jnp.tile(fits, (1, group))))
    table = table.reshape(b, -1, kr.TABLE_COLUMNS)
    want = _brute_force_table(visible, rows=rows, skv=skv, block_q=block_q, block_k=block_k)
    # The rule the kernel rebuilds from iotas where a block's RULE entry is set.
    by_rule = np.concatenate([reference.attention_rule_mask(np.asarray(start), np.asarray(end), sq, skv,
                                                            causal=causal, window=window)[:, 0]] * group, axis=1)
    by_row = np.concatenate([visible[:, 0]] * group, axis=1)
    for (bi, qb), (first, last, full_first, full_last, rule), (seen, whole) in zip(
            np.ndindex(table.shape[:2]), table.reshape(-1, kr.TABLE_COLUMNS), want):
        if seen:
            assert (first, last) == (seen[0], seen[-1]), (first, last, seen)
        else:
            assert last < first
        assert list(range(full_first, full_last + 1)) == whole, (full_first, full_last, whole)
        rows_of_block = slice(qb * block_q, (qb + 1) * block_q)
        assert rule == np.array_equal(by_rule[bi, rows_of_block], by_row[bi, rows_of_block]), (bi, qb)
        assert rule or trial % 2  # rule ranges: every block rebuilds its ranges from the rule


@pytest.mark.parametrize("trial", range(4))
def test_decode_chunk_spans_match_the_dense_mask(trial):
    """The decode kernel's table: per batch row exactly the first and last chunk
    any query sees (an extra chunk would be read for nothing yet masked, so
    only this test sees it) and the end of the keys any sees (copies stop
    there), ``last < first`` for a row that sees no key; from
    arbitrary ranges (some past the keys, clipped) and ranges ending on chunk
    edges."""
    rng = np.random.default_rng(SEED + 100 + trial)
    b, sq, chunk = 4, int(rng.integers(1, 9)), int(rng.choice([128, 256]))
    skv = chunk * int(rng.integers(1, 6)) + int(rng.choice([0, 128]))
    bounds = _random_ranges(rng, b, sq, skv)
    bounds[0] = [0, 0]  # sees nothing
    bounds[1, :, 1] = np.clip(bounds[1, :, 0] // chunk * chunk + chunk, 0, skv)  # ends on a chunk edge
    bounds[2, 0] = [-5, skv + 300]  # outside the keys: clipped to all of them
    spans = np.asarray(kr.decode_chunk_spans(jnp.asarray(bounds), skv=skv, chunk=chunk)).reshape(b, kr.SPAN_COLUMNS)
    visible = _ranges_mask(np.clip(bounds, 0, skv), skv)[:, 0].any(axis=1)  # [B, Skv]: keys any query sees
    for row, (first, last, end) in enumerate(spans):
        seen = [c for c in range(-(-skv // chunk)) if visible[row, c * chunk:(c + 1) * chunk].any()]
        if seen:
            assert (first, last) == (seen[0], seen[-1]), (row, first, last, seen)
            assert end == np.flatnonzero(visible[row])[-1] + 1, (row, end)  # the copies stop there
        else:
            assert last < first, (row, first, last)


def _packed_and_right_padded_mask(b, sq, window=0):
    """Batch row 0: three packed documents (6, 9 and the rest of the tokens);
    row 1: right padding after 7 tokens (padding queries see the real keys);
    row 2: the plain rule (its blocks rebuild their ranges from iotas).
    Causal within a document, and a sliding ``window`` when given."""
    mask = np.zeros((b, 1, sq, sq), dtype=bool)
    starts = [0, 6, 15]
    for i in range(sq):
        doc = max(s for s in starts if s <= i)
        mask[0, 0, i, max(doc, i - window + 1 if window else 0):i + 1] = True
        if b > 1:
            mask[1, 0, i, max(0, i - window + 1 if window else 0):min(i, 6) + 1] = True
        if b > 2:
            mask[2, 0, i, max(0, i - window + 1 if window else 0):i + 1] = True
    return mask


@pytest.mark.parametrize("block_sizes", [None, (16, 128)])
def test_packed_sequences_and_right_padding_on_the_pallas_path(block_sizes):
    """Masks that are one key range per query but no rule over a range per batch
    row: packed documents, right padding. Forward and gradients equal float64."""
    q, k, v, sinks = _inputs((3, 4, 2, 40, 40, 16, 16), torch.float32, seed=16)
    for window in (0, 5):
        visible = _packed_and_right_padded_mask(3, 40, window)
        got = attention_tpu.attention(q, k, v, attention_mask=torch.from_numpy(visible), window=window,
                                      sinks=sinks, block_sizes=block_sizes, impl="interpret")
        want = reference.attention(q, k, v, visible, scale=0.25, sinks=sinks.numpy())
        _check(got, want, torch.float32, f"packed/right-padded window={window} blocks={block_sizes}")
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    mask = torch.from_numpy(_packed_and_right_padded_mask(3, 40))
    attention_tpu.attention(*leaves[:3], attention_mask=mask, sinks=leaves[3], block_sizes=block_sizes,
                            impl="interpret").square().sum().backward()
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    _f64_loss(*ref_leaves, mask, 0.0, 0.25).backward()
    for name, got, want in zip("q k v sinks".split(), leaves, ref_leaves):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-5, msg=f"d{name} seed={SEED}")


def test_arbitrary_ranges_are_exact_even_against_the_window_hint():
    """``causal`` / ``window`` only choose blocks and walks: random per-query
    ranges, far wider than the window named, still give the exact attention and
    gradients (the grids are sized from the data, not from the window)."""
    rng = np.random.default_rng(SEED + 17)
    q, k, v, _ = _inputs((2, 4, 2, 256, 300, 16, 16), torch.float32, seed=17)
    visible = torch.from_numpy(_ranges_mask(_random_ranges(rng, 2, 256, 300), 300))
    walk = kr.query_walk(16, group=2, block_q=32, block_k=128, sq=256, causal=True, window=8)
    assert walk.relative  # the dk/dv kernel takes its window walk
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention_tpu.attention(*leaves, attention_mask=visible, window=8, block_sizes=(32, 128), impl="interpret")
    _check(out, reference.attention(q, k, v, visible.numpy(), scale=0.25), torch.float32, "random ranges")
    out.square().sum().backward()
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    no_sink = torch.full((4,), -1e4, dtype=torch.float64)  # weighs exactly nothing in float64
    _f64_loss(*ref_leaves, no_sink, visible, 0.0, 0.25).backward()
    for name, got, want in zip("q k v".split(), leaves, ref_leaves):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-5, msg=f"d{name} seed={SEED}")


def test_sliding_window_grid_walks_only_the_window():
    """A causal window shrinks the KV grid axis to the window's blocks, counted
    from each query block's first visible block; numerics unchanged."""
    q, k, v, _ = _inputs((2, 4, 2, 64, 1100, 16, 16), torch.float32, seed=13)
    start, end = np.array([0, 100], np.int32), np.array([1100, 1000], np.int32)
    plan = kv_block_plan(start, end, rows=128, sq=64, skv=1100, causal=True, window=100, block_sizes=(32, 128))
    assert plan.grid_steps <= plan.dense // 3 and plan.live <= plan.grid_steps
    visible = reference.attention_rule_mask(start, end, 64, 1100, causal=True, window=100)
    got = attention_tpu.attention(q, k, v, attention_mask=torch.from_numpy(visible), window=100,
                                  block_sizes=(32, 128), impl="interpret")
    _check(got, reference.attention(q, k, v, visible, scale=0.25), torch.float32, "window-relative grid")


def test_mask_none_means_the_rule_over_every_key():
    q, k, v, _ = _inputs(SHAPES["few_tokens_long_cache"], torch.float32, seed=6)
    for causal, window in ((True, 0), (True, 40), (False, 0)):
        visible = reference.attention_rule_mask([0], [300], 3, 300, causal=causal, window=window)
        want = reference.attention(q, k, v, visible, scale=0.25)
        for impl in IMPLS:
            got = attention_tpu.attention(q, k, v, causal=causal, window=window, impl=impl)
            _check(got, want, torch.float32, f"{impl} causal={causal} window={window}")


def test_rows_that_see_no_key_are_zero():
    q, k, v, _ = _inputs((1, 2, 2, 4, 8, 16, 16), torch.float32, seed=7)
    # Keys [6, 8), queries at positions 4..7, causal: rows 0 and 1 see nothing.
    visible = torch.from_numpy(reference.attention_rule_mask([6], [8], 4, 8, causal=True, window=0))
    assert not visible[0, 0, :2].any() and visible[0, 0, 2:].any()
    for impl in IMPLS:
        out = attention_tpu.attention(q, k, v, attention_mask=visible, impl=impl)
        assert (out[:, :, :2] == 0).all() and (out[:, :, 2:] != 0).any()


def test_additive_float_mask_and_per_head_mask():
    q, k, v, _ = _inputs(SHAPES["mha"], torch.float32, seed=8)
    visible = reference.attention_rule_mask([0, 2], [9, 9], 9, 9, causal=True, window=0)
    additive = torch.where(torch.from_numpy(visible), 0.0, torch.finfo(torch.float32).min)
    per_head = torch.from_numpy(visible).expand(2, 2, 9, 9)
    want = reference.attention(q, k, v, visible, scale=0.25)
    for impl in IMPLS:
        _check(attention_tpu.attention(q, k, v, attention_mask=additive, impl=impl), want, torch.float32, impl)
        _check(attention_tpu.attention(q, k, v, attention_mask=per_head, impl=impl), want, torch.float32, impl)


def _unexpressible_masks():
    """A query whose keys are not one range (every other key), and heads that
    see different keys."""
    causal = reference.attention_rule_mask([0, 0], [9, 9], 9, 9, causal=True, window=0)
    strided = causal.copy()
    strided[1, 0, 6, 1::2] = False
    per_head = np.concatenate([causal, causal], axis=1)
    per_head[0, 1, 4, 0] = False
    return {"strided": strided, "per_head": per_head}


@pytest.mark.parametrize("kind", ["strided", "per_head"])
def test_a_mask_the_kernel_cannot_express_is_refused_on_its_path_and_exact_on_native(kind):
    q, k, v, _ = _inputs(SHAPES["mha"], torch.float32, seed=9)
    mask = torch.from_numpy(_unexpressible_masks()[kind])
    with pytest.raises(ValueError, match="attention_mask is not expressible by the Pallas kernel"):
        attention_tpu.attention(q, k, v, attention_mask=mask, impl="interpret")
    want = reference.attention(q, k, v, mask.numpy(), scale=0.25)
    _check(attention_tpu.attention(q, k, v, attention_mask=mask), want, torch.float32, f"native {kind}")


def test_tpu_guard_turns_unexpressible_batch_rows_to_nan():
    """What the TPU path does with a mask its ranges cannot reproduce (no host
    sync to refuse it there): that batch row is NaN, the other rows are
    untouched; packed and padded masks pass the guard."""
    out = torch.ones(2, 2, 9, 5)
    for kind, bad_row in (("strided", 1), ("per_head", 0)):
        mask = torch.from_numpy(_unexpressible_masks()[kind])
        guarded = masks.poison_where_not_expressible(out, mask, masks.key_bounds(mask))
        assert torch.isnan(guarded[bad_row]).all() and torch.equal(guarded[1 - bad_row], out[1 - bad_row]), kind
    for visible in (_packed_and_right_padded_mask(2, 9, window=3),
                    reference.attention_rule_mask([0, 2], [9, 8], 9, 9, causal=True, window=3)):
        mask = torch.from_numpy(visible)
        assert torch.equal(masks.poison_where_not_expressible(out, mask, masks.key_bounds(mask)), out)
    # A float mask holding a bias (here -1e4 in batch row 1) poisons its row on TPU.
    additive = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    additive[1, 0, 0, 8] = -1e4
    biased = masks.float_mask_bias_rows(additive)
    assert biased.tolist() == [False, True]
    guarded = masks.poison_where_not_expressible(out, mask, masks.key_bounds(mask), biased)
    assert torch.isnan(guarded[1]).all() and torch.equal(guarded[0], out[0])


def test_key_bounds_of_padding_static_cache_and_rule():
    visible = torch.from_numpy(reference.attention_rule_mask([3, 0], [7, 10], 2, 12, causal=True, window=0))
    bounds = masks.key_bounds(visible)
    assert bounds.tolist() == [[[3, 6], [3, 7]], [[0, 9], [0, 10]]]
    masks.check_expressible(visible, bounds)
    rule = masks.rule_key_bounds(torch.tensor([3, 0]), torch.tensor([7, 10]), 2, 12, causal=True, window=0)
    assert torch.equal(rule, bounds) and torch.equal(masks.bounds_mask(rule, 12), visible)
    nothing = torch.zeros(1, 1, 2, 5, dtype=torch.bool)
    assert masks.key_bounds(nothing).tolist() == [[[0, 0], [0, 0]]]
    assert masks.key_bounds(torch.zeros(2, 1, 3, 0, dtype=torch.bool)).shape == (2, 3, 2)  # no keys at all


def test_ranges_outside_the_keys_are_clipped_not_read():
    """A direct kernel call with ranges past both ends of the keys computes the
    clipped ranges: no block index below 0, no unmasked tail rows."""
    q, k, v, _ = _inputs((1, 2, 1, 4, 200, 16, 16), torch.float32, seed=18)
    from attention_tpu.common import jax_bridge, pallas_helpers

    wide = np.array([[[-5, 205], [-1, 3], [150, 900], [7, 7]]], np.int32)
    clipped = np.clip(wide, 0, 200)
    outs = [np.asarray(flash_forward.flash_attention(*(jax_bridge.to_jax(t) for t in (q, k, v)), bounds,
                                                     causal=False, block_sizes=(8, 128),
                                                     interpret=pallas_helpers.interpret_params()))
            for bounds in (wide, clipped)]
    want = reference.attention(q, k, v, _ranges_mask(clipped, 200), scale=0.25)
    np.testing.assert_allclose(outs[0], want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("sq,skv,causal,window,live_at_most", [
    (8192, 8192, True, 0, 0.55),  # causal prefill: about half of the dense blocks
    (8192, 8192, True, 128, 0.13),  # gpt-oss sliding window of 128
    (1, 32768, True, 0, 0.04),  # decode against a static cache filled to 1000 keys
])
def test_masked_blocks_cost_no_compute_and_no_dma(sq, skv, causal, window, live_at_most):
    kv_end = 1000 if sq == 1 else skv
    plan = kv_block_plan([0], [kv_end], rows=4 * sq, sq=sq, skv=skv, causal=causal, window=window,
                         block_sizes=(min(4 * sq, 512), 512))
    assert plan.live <= live_at_most * plan.dense
    assert plan.fetched <= plan.live + 1  # a skipped step re-uses the block in VMEM
    if sq > 1 and not window:  # the grid walks only the live (query block, KV block) pairs: no empty step
        assert plan.grid_steps == plan.live
    if window:  # the grid itself spans only the window's blocks
        assert plan.grid_steps <= 3 * plan.dense // (skv // 512)
    if sq == 1:  # and only the filled part of a static cache: 2 blocks of 512 for 1000 keys
        assert plan.grid_steps == 2


def test_compact_walk_takes_each_live_pair_once_in_query_block_order():
    """The forward's compacted walk, on the host: per batch row every query
    block's visible KV blocks in order (one step for a block that sees none),
    then padding pairs on the row's last query block that reach no block."""
    rows, sq, skv, block_q, block_k = 512, 256, 256, 32, 64
    start, end = np.array([0, 40, 0], np.int32), np.array([256, 200, 0], np.int32)  # row 2 sees no key
    key_bounds = kr.rule_key_bounds(start, end, sq=sq, skv=skv, causal=True, window=0)
    nq, nkv = rows // block_q, -(-skv // block_k)
    _, _, _, table = kr.ranges_and_table(key_bounds, rows // sq, sq=sq, skv=skv, causal=True, window=0,
                                         num_q_blocks=nq, block_q=block_q, block_k=block_k)
    walk_q, walk_step, length = (np.asarray(x) for x in kr.compact_walk(table, num_q_blocks=nq, num_kv_blocks=nkv))
    entries = np.asarray(table).reshape(len(start), nq, kr.TABLE_COLUMNS)
    expected = [[(qb, step) for qb in range(nq)
                 for step in range(max(1, min(nkv, e[qb, kr.LAST] - e[qb, kr.FIRST] + 1)))] for e in entries]
    assert int(length) == max(map(len, expected)) < nq * nkv
    for b, pairs in enumerate(expected):
        got = list(zip(walk_q[b * nq * nkv:][:int(length)].tolist(), walk_step[b * nq * nkv:][:int(length)].tolist()))
        assert got[:len(pairs)] == pairs, b
        assert all(p == (nq - 1, nkv) for p in got[len(pairs):]), b
    assert len(expected[2]) == nq and len(expected[1]) < len(expected[0])


@pytest.mark.parametrize("first, count", [(0, 4), (2, 2)], ids=["all", "some"])
def test_compact_key_walk_takes_each_live_pair_once_in_key_block_order(first, count):
    """The backward dk/dv kernel's compacted walk over KV blocks ``[first, first
    + count)``, on the host: per batch row each KV block's query blocks that
    see it in order (a KV block none sees: one pair, on the last query block),
    then padding pairs naming KV block ``count`` on the row's last pair's query
    block. Query blocks of two heads: a KV block's live ones are not one run."""
    rows, sq, skv, block_q, block_k = 512, 256, 256, 32, 64
    start, end = np.array([0, 40, 0], np.int32), np.array([256, 130, 0], np.int32)  # row 2 sees no key
    key_bounds = kr.rule_key_bounds(start, end, sq=sq, skv=skv, causal=True, window=0)
    nq = rows // block_q
    _, _, _, table = kr.ranges_and_table(key_bounds, rows // sq, sq=sq, skv=skv, causal=True, window=0,
                                         num_q_blocks=nq, block_q=block_q, block_k=block_k)
    walk_kv, walk_q, length = (np.asarray(x) for x in kr.compact_key_walk(table, num_q_blocks=nq,
                                                                          first_kv_block=first, count=count))
    entries = np.asarray(table).reshape(len(start), nq, kr.TABLE_COLUMNS)
    expected = []
    for e in entries:
        pairs = []
        for kv in range(first, first + count):
            seen_by = [qb for qb in range(nq) if e[qb, kr.FIRST] <= kv <= e[qb, kr.LAST]]
            pairs += [(kv - first, qb) for qb in seen_by or [nq - 1]]
        expected.append(pairs)
    assert int(length) == max(map(len, expected)) < count * nq
    for b, pairs in enumerate(expected):
        at = b * count * nq
        got = list(zip(walk_kv[at:at + int(length)].tolist(), walk_q[at:at + int(length)].tolist()))
        assert got[:len(pairs)] == pairs, b
        assert all(p == (count, pairs[-1][1]) for p in got[len(pairs):]), b
    assert expected[2] == [(kv, nq - 1) for kv in range(count)]  # no key seen: one pair per KV block
    assert any(b - a > 1 for (ka, a), (kb, b) in zip(expected[0], expected[0][1:]) if ka == kb)  # two heads' runs
    # Row 1's keys end at 130: KV block 3 is seen by none.
    assert [p for p in expected[1] if p[0] == 3 - first] == [(3 - first, nq - 1)]


def test_rectangular_grid_past_the_walk_cap_matches_float64(monkeypatch):
    """Past ``COMPACT_WALK_MAX_PAIRS`` the grid stays rectangular (every query
    block takes the most steps any takes): same results, more grid steps."""
    monkeypatch.setattr(kr, "COMPACT_WALK_MAX_PAIRS", 0)
    q, k, v, _ = _inputs((2, 4, 2, 200, 300, 16, 16), torch.float32, seed=21)
    start, end = np.array([0, 60], np.int32), np.array([300, 250], np.int32)
    plan = kv_block_plan(start, end, rows=400, sq=200, skv=300, causal=True, window=0, block_sizes=(64, 128))
    assert plan.grid_steps > plan.live
    visible = reference.attention_rule_mask(start, end, 200, 300, causal=True, window=0)
    got = attention_tpu.attention(q, k, v, attention_mask=torch.from_numpy(visible), block_sizes=(64, 128),
                                  impl="interpret")
    _check(got, reference.attention(q, k, v, visible, scale=0.25), torch.float32, "rectangular grid")


def test_a_call_where_no_row_sees_a_key_still_writes_zeros():
    """The KV grid axis is sized by the data; with nothing visible anywhere it
    keeps one step, so every output is still initialised and stored."""
    q, k, v, _ = _inputs((2, 4, 2, 3, 300, 16, 16), torch.float32, seed=14)
    empty = torch.zeros(2, 1, 3, 300, dtype=torch.bool)
    empty[1, 0, 2, 299] = True  # one key for one query of one batch row
    got = attention_tpu.attention(q, k, v, attention_mask=empty[:1].expand(2, 1, 3, 300), impl="interpret")
    assert (got == 0).all()
    want = reference.attention(q, k, v, empty.numpy(), scale=0.25)
    _check(attention_tpu.attention(q, k, v, attention_mask=empty, impl="interpret", block_sizes=(8, 128)), want,
           torch.float32, "one visible key")


def test_block_rule_and_overrides():
    assert blocks.choose_blocks(8, 32768) == (8, blocks.DECODE_BLOCK_K)  # decode: 8 rows, long key blocks
    assert blocks.choose_blocks(8, 3000) == (8, 3000)  # all keys in one block
    assert blocks.choose_blocks(32768, 100) == (blocks.PREFILL_BLOCK, 100)
    assert blocks.choose_blocks(32768, 32768) == (blocks.PREFILL_BLOCK,) * 2
    assert blocks.choose_blocks(32768, 32768, window=128) == (blocks.PREFILL_BLOCK,) * 2  # windows: static sub-tiles
    assert blocks.choose_blocks(200, 32768) == (200, blocks.PREFILL_BLOCK)
    # VMEM decides: head_dim 512 decode blocks shrink on v4 (12 MiB budget), not on v6e.
    assert blocks.choose_blocks(4, 32768, head_dim=512, generation="v4")[1] < blocks.DECODE_BLOCK_K
    assert blocks.choose_blocks(4, 32768, head_dim=512, generation="v6e")[1] == blocks.DECODE_BLOCK_K
    for gen in ("v4", "v5e", "v5p", "v6e"):
        for rows, d in ((4, 512), (32768, 256), (64, 128)):
            bq, bk = blocks.choose_blocks(rows, 32768, head_dim=d, generation=gen)
            assert blocks.working_set_bytes(bq, bk, d, d, 2) <= tpu_generations.get_generation(gen).vmem_budget
    # Splits: only where a second TensorCore would otherwise idle.
    assert blocks.choose_kv_splits(1, 1, 8, "v5p") == 2 and blocks.choose_kv_splits(1, 1, 8, "v4") == 2
    assert blocks.choose_kv_splits(1, 1, 8, "v6e") == 1 and blocks.choose_kv_splits(8, 1, 8, "v5p") == 1
    assert blocks.choose_kv_splits(1, 4, 8, "v5p") == 1  # prefill: query blocks are the parallel work
    q, k, v, _ = _inputs(SHAPES["mha"], torch.float32, seed=10)
    with pytest.raises(ValueError, match="block_k must be a multiple of 128"):
        attention_tpu.attention(q, k, v, block_sizes=(8, 100), impl="interpret")
    with pytest.raises(ValueError, match="block_q must be a multiple of 8"):
        attention_tpu.attention(q, k, v, block_sizes=(5, 128), impl="interpret")


def test_block_sizes_are_checked_where_the_kernels_are_entered():
    """Direct kernel calls (no torch op in between) refuse illegal blocks as the op does."""
    import dataclasses

    from attention_tpu.attention import flash_backward

    with pytest.raises(ValueError, match="block_q must be a positive int"):
        blocks.BlockSizes(0, 128)
    with pytest.raises(ValueError, match="a \\(block_q, block_k\\) pair"):
        blocks.BlockSizes.of((8,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        blocks.BlockSizes(8, 128).block_q = 16
    q = jnp.zeros((1, 2, 9, 16), jnp.float32)
    bounds = kr.rule_key_bounds([0], [9], sq=9, skv=9, causal=True, window=0)
    with pytest.raises(ValueError, match="block_q must be a multiple of 8"):
        flash_forward.flash_attention(q, q, q, bounds, block_sizes=(5, 128))
    lse = jnp.zeros((1, 2, 9, 1), jnp.float32)
    with pytest.raises(ValueError, match="block_k must be a multiple of 128"):
        flash_backward.flash_attention_backward(q, q, q, q, lse, q, bounds, block_sizes=(8, 100))


BAD = [
    ("query must be 4-D", lambda q, k, v: ((q[0], k, v), {})),
    ("multiple of key/value heads", lambda q, k, v: ((torch.cat([q, q[:, :1]], 1), k, v), {})),
    ("head_dim 8 differs", lambda q, k, v: ((q, k[..., :8], v), {})),
    ("share heads and length", lambda q, k, v: ((q, k, v[:, :, :5]), {})),
    ("one dtype", lambda q, k, v: ((q, k.bfloat16(), v), {})),
    ("dtype must be one of", lambda q, k, v: ((q.double(), k.double(), v.double()), {})),
    ("attention_mask must be", lambda q, k, v: ((q, k, v), {"attention_mask": torch.ones(2, 1, 9, 8, dtype=torch.bool)})),
    ("a float attention_mask must hold 0 .* it holds -10000",
     lambda q, k, v: ((q, k, v), {"attention_mask": torch.full((2, 1, 9, 9), -1e4).tril()})),
    ("sinks \\(s_aux\\) must be", lambda q, k, v: ((q, k, v), {"sinks": torch.zeros(3)})),
    ("window must be", lambda q, k, v: ((q, k, v), {"window": -1})),
    ("softcap must be", lambda q, k, v: ((q, k, v), {"softcap": float("inf")})),
    ("one device", lambda q, k, v: ((q, k, v.to("meta")), {})),
    ("impl must be", lambda q, k, v: ((q, k, v), {"impl": "cuda"})),
    ("kv_splits must be a positive int", lambda q, k, v: ((q, k, v), {"kv_splits": 0})),
]


@pytest.mark.parametrize("message,make", BAD, ids=[m for m, _ in BAD])
def test_bad_input_raises_clear_error(message, make):
    q, k, v, _ = _inputs(SHAPES["mha"], torch.float32, seed=11)
    args, kwargs = make(q, k, v)
    with pytest.raises(ValueError, match="attention: .*" + message):
        attention_tpu.attention(*args, **kwargs)


def _f64_loss(q, k, v, sinks, visible, softcap, scale):
    return reference.attention_autograd(q, k, v, sinks, visible, softcap=softcap, scale=scale).square().sum()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("case", [
    ("gqa_prefill_tails", True, 5, 4.0, None),
    ("mqa_decode", True, 0, 0.0, None),
    ("dv_differs", False, 0, 0.0, None),
    ("few_tokens_long_cache", True, 40, 0.0, (8, 128)),  # several key blocks, skipped ones
])
def test_gradients_match_float64_autograd(impl, dtype, case):
    shape, causal, window, softcap, block_sizes = case
    q, k, v, sinks = _inputs(SHAPES[shape], dtype, seed=12)
    b, _, _, sq, skv, d, _ = SHAPES[shape]
    start, end = _padded_ranges(b, skv)
    visible = torch.from_numpy(reference.attention_rule_mask(start, end, sq, skv, causal=causal, window=window))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    attention_tpu.attention(*leaves[:3], attention_mask=visible, sinks=leaves[3], causal=causal, window=window,
                            softcap=softcap, block_sizes=block_sizes, impl=impl).square().sum().backward()
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    _f64_loss(*ref_leaves, visible, softcap, d ** -0.5).backward()
    rtol, atol = GRAD_TOL[dtype]
    for name, got, want in zip("q k v sinks".split(), leaves, ref_leaves):
        assert not torch.isnan(got.grad).any(), f"{impl} d{name}: NaN, seed={SEED}"
        assert got.grad.dtype == got.dtype  # sinks are float32 whatever the inputs
        scale = max(1.0, float(want.grad.abs().max())) if dtype == torch.float16 else 1.0
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=rtol, atol=atol * scale,
                                   msg=f"{impl} {dtype} d{name} seed={SEED}")


@pytest.fixture(params=["fused", "fused_calls", "separate"])
def dq_kernel(request, monkeypatch):
    """The backward's ways to dq: inside the dk/dv kernel (each key block's part,
    summed over the query blocks that see it), in one call or one call per key
    block (the rule's split past ``blocks.FUSED_DQ_MAX_BYTES`` of parts), or a
    kernel of its own. Caches cleared so that jitted calls retrace with the choice."""
    from attention_tpu.common import jax_bridge

    if request.param == "separate":
        monkeypatch.setattr(blocks, "FUSED_DQ_MAX_BYTES", 0)
    else:  # these tests' key blocks are short
        monkeypatch.setattr(blocks, "FUSED_DQ_MIN_BLOCK_K", 0)
    if request.param == "fused_calls":
        monkeypatch.setattr(blocks, "fused_dq_blocks_per_call", lambda part_bytes, num_kv_blocks: 1)
    jax_bridge._interpreted.cache_clear()
    yield request.param
    jax_bridge._interpreted.cache_clear()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
def test_backward_runs_the_dq_kernel_only_past_the_byte_cap(fused, monkeypatch):
    """At key blocks of ``FUSED_DQ_MIN_BLOCK_K`` and one key block's part of dq
    within ``FUSED_DQ_MAX_BYTES`` the backward has no dq kernel (one dk/dv call
    per key block when the cap holds one part); past the cap, it has."""
    import jax
    from attention_tpu.attention import flash_backward

    b, h, s, d = 1, 2, 256, 16
    q = k = v = jnp.zeros((b, h, s, d), jnp.float32)
    lse = jnp.zeros((b, h, s, 1), jnp.float32)
    bounds = kr.rule_key_bounds(np.zeros(b, np.int32), np.full(b, s, np.int32), sq=s, skv=s, causal=True, window=0)
    part_bytes = b * h * s * d * 4  # one key block's (of two)
    monkeypatch.setattr(blocks, "FUSED_DQ_MAX_BYTES", part_bytes if fused else part_bytes - 1)
    monkeypatch.setattr(blocks, "FUSED_DQ_MIN_BLOCK_K", 128)
    text = str(jax.make_jaxpr(functools.partial(flash_backward.flash_attention_backward, block_sizes=(128, 128),
                                                generation="v6e"))(q, k, v, q, lse, q, bounds))
    # Fused: one dk/dv call per key block (the cap holds one block's part); else one call and the dq kernel.
    assert text.count("name=flash_attention_bwd_dkv") == (2 if fused else 1)
    assert ("flash_attention_bwd_dq" in text) != fused


def test_backward_fuses_dq_by_the_rule():
    """The rule at the benchmark's shapes (bf16, v6e): Llama-3-8B causal 8k
    (2048-key blocks, 128 MiB a block's part) fuses in one call, 32k (512 MiB a
    part, 8 GiB in all) in calls of two key blocks, a window of 512 keys (its
    2048-key blocks) in one; a wider window's 512-key blocks and v4's (its
    VMEM) do not; one key block does."""
    def fused(rows, skv, d, window=0, generation="v6e", hkv=8):
        """Key blocks per fused call, 0: two kernels."""
        bq, bk = blocks.choose_backward_blocks(rows, skv, head_dim=d, window=window, generation=generation)
        nq, nk = -(-rows // bq), -(-skv // bk)
        part = hkv * nq * bq * d * 4
        working_set = blocks.backward_working_set_bytes(bq, bk, d, d, 2, fused_dq=True, window=window)
        if not blocks.fuses_dq(part, working_set, block_k=bk, num_kv_blocks=nk, generation=generation):
            return 0
        return blocks.fused_dq_blocks_per_call(part, nk)

    assert fused(4 * 8192, 8192, 128) == 4
    assert fused(4 * 8192, 8192, 128, generation="tpu7x") == fused(4 * 8192, 8192, 128, generation="v5e") == 4
    assert fused(4 * 32768, 32768, 128) == 2
    assert fused(2 * 8192, 8192, 256, window=512, hkv=4) == 4
    assert not fused(2 * 8192, 8192, 256, window=1024, hkv=4)
    assert fused(4 * 512, 512, 128)  # one key block: no parts to sum
    assert not fused(4 * 8192, 8192, 128, generation="v4")


# dq in several dk/dv calls (the carried sum) without a window; windows with dq fused in one call, the
# separate dq kernel's window walk at the wider window.
@pytest.mark.parametrize("window, dq_kernel", [(0, "fused"), (0, "fused_calls"), (0, "separate"), (20, "fused"),
                                               (40, "fused"), (40, "separate")],
                         indirect=["dq_kernel"])
def test_gradients_over_many_blocks_and_window_walks(window, dq_kernel):
    """Many query and key blocks, causal, with left padding; without a window
    the dk/dv and dq grids walk only the live pairs (compacted), with one
    (query blocks aligned to heads) the dk/dv kernel walks only the window's
    query blocks of each head and the dq kernel only the window's key blocks
    (both grids shorter than dense). Gradients equal float64 autograd, with dq
    in the dk/dv kernel and in its own."""
    q, k, v, sinks = _inputs((2, 4, 2, 256, 256, 16, 16), torch.float32, seed=15)
    # Row 1 ends at key 120: its second key block is seen by no query (its dk / dv still stored as zeros), and
    # without a window its compacted walks have fewer pairs than row 0's (padding pairs).
    start, end = np.array([0, 30], np.int32), np.array([256, 120], np.int32)
    walk = kr.query_walk(16, group=2, block_q=32, block_k=128, sq=256, causal=True, window=window)
    bounds = kr.row_bounds(kr.rule_key_bounds(start, end, sq=256, skv=256, causal=True, window=window), 2)
    table = kr.visit_table(bounds, num_q_blocks=16, block_q=32, block_k=128, rows=512)
    _, steps = kr.walk_plan(table, walk, num_q_blocks=16, num_kv_blocks=2)
    assert walk.relative == bool(window) and (not window or int(steps) < walk.blocks_per_head)
    visible = torch.from_numpy(reference.attention_rule_mask(start, end, 256, 256, causal=True, window=window))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    attention_tpu.attention(*leaves[:3], attention_mask=visible, sinks=leaves[3], window=window,
                            block_sizes=(32, 128), impl="interpret").square().sum().backward()
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    _f64_loss(*ref_leaves, visible, 0.0, 0.25).backward()
    for name, got, want in zip("q k v sinks".split(), leaves, ref_leaves):
        assert not torch.isnan(got.grad).any(), f"d{name}: NaN, seed={SEED}"
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-5, msg=f"d{name} seed={SEED}")


def test_pallas_double_backward_is_refused_clearly():
    q, k, v, _ = _inputs(SHAPES["mha"], torch.float32, seed=13)
    q.requires_grad_()
    out = attention_tpu.attention(q, k, v, impl="interpret")
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward .* is not supported"):
        dq.sum().backward()


def test_torch_compile_fullgraph_native_and_interpret_op():
    q, k, v, sinks = _inputs(SHAPES["gqa_prefill_tails"], torch.float32, seed=14)
    for impl in IMPLS:
        fn = torch.compile(lambda a, b, c, s: attention_tpu.attention(a, b, c, sinks=s, window=4, impl=impl),
                           fullgraph=True, dynamic=False)
        torch.testing.assert_close(fn(q, k, v, sinks), attention_tpu.attention(q, k, v, sinks=sinks, window=4),
                                   rtol=1e-5, atol=1e-5)


def test_float_mask_biases_poison_their_rows_under_torch_compile():
    """Under torch.compile the host cannot refuse a biased float mask without a
    graph break: those batch rows come out NaN, the others exact."""
    q, k, v, _ = _inputs(SHAPES["mha"], torch.float32, seed=19)
    visible = torch.from_numpy(reference.attention_rule_mask([0, 0], [9, 9], 9, 9, causal=True, window=0))
    additive = torch.where(visible, 0.0, torch.finfo(torch.float32).min)
    additive[1, 0, 3, 0] = -1e4
    fn = torch.compile(lambda a, b, c, m: attention_tpu.attention(a, b, c, attention_mask=m), fullgraph=True)
    out = fn(q, k, v, additive)
    assert torch.isnan(out[1]).all()
    _check(out[:1], reference.attention(q[:1], k[:1], v[:1], visible[:1].numpy(), scale=0.25), torch.float32,
           "unbiased row under compile")


# The decode kernel (flash_decode): its own copies of the chunks some row sees.
# Chunks of 128 keys here (the rule's are 1024) so that small caches span many.
DECODE_CASES = {
    # (batch, q heads, kv heads, Sq, Skv, D, Dv), starts, ends, features
    "gqa_static_caches": ((3, 8, 2, 1, 640, 32, 16), [0, 37, 300], [640, 290, 301], dict(causal=True)),
    "few_tokens_window_softcap": ((2, 4, 4, 3, 384, 16, 16), [0, 0], [384, 200],
                                  dict(causal=True, window=100, softcap=5.0)),
    "sinks_scale_not_causal": ((2, 6, 3, 2, 512, 16, 16), [5, 0], [512, 129], dict(causal=False, scale=0.3)),
    "nine_heads_empty_row": ((2, 9, 9, 1, 256, 16, 16), [0, 0], [256, 0], dict(causal=True)),
}


@pytest.mark.parametrize("kv_splits", [None, 3])
@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_decode_kernel_matches_float64_loop(case, kv_splits, monkeypatch):
    """Static caches filled to any length (chunks read partly, the last one
    overlapping the one before when the keys are not a multiple of the chunk:
    640 = 2.5 chunks of 256), windows, soft-capping, sinks, more KV heads than
    one group computes at once (9: a group of 8 and a tail; with splits, groups
    of 4), a batch row that sees no key; splits merged; the
    interpreter poisons every output element the kernel never writes."""
    from attention_tpu.attention import flash_decode
    from attention_tpu.common import jax_bridge, pallas_helpers

    shape, start, end, opts = DECODE_CASES[case]
    chunk = 256 if case == "gqa_static_caches" else 128
    monkeypatch.setitem(blocks.DECODE_CHUNKS, "v6e", chunk)
    if case == "nine_heads_empty_row" and kv_splits:  # heads in a rolled loop of two groups of 4, then a tail of 1
        monkeypatch.setattr(flash_decode, "HEADS_PER_GROUP", 4)
    calls = []
    monkeypatch.setattr(flash_decode, "decode_attention_with_lse",
                        _recording(flash_decode.decode_attention_with_lse, calls))
    b, hq, hkv, sq, skv, d, dv = shape
    q, k, v, sinks = _inputs(shape, torch.float32, seed=40 + len(case))
    use_sinks = "sinks" in case
    start, end = np.array(start, np.int32), np.array(end, np.int32)
    causal, window = opts["causal"], opts.get("window", 0)
    bounds = kr.rule_key_bounds(start, end, sq=sq, skv=skv, causal=causal, window=window)
    out, lse = flash_forward.flash_attention_with_lse(
        *(jax_bridge.to_jax(t) for t in (q, k, v)), bounds, jax_bridge.to_jax(sinks) if use_sinks else None,
        kv_splits=kv_splits, generation="v6e", interpret=pallas_helpers.interpret_params(), **opts)
    assert calls, "the decode kernel did not run"
    visible = reference.attention_rule_mask(start, end, sq, skv, causal=causal, window=window)
    want = reference.attention(q, k, v, visible, scale=opts.get("scale", d ** -0.5), softcap=opts.get("softcap", 0.0),
                               sinks=sinks.numpy() if use_sinks else None)
    got = np.asarray(out)
    assert not np.isnan(got).any(), f"{case}: NaN (unwritten) elements, seed={SEED}"
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"{case} seed={SEED}")
    if case == "nine_heads_empty_row":  # no key: zeros and lse -inf
        assert (got[1] == 0).all() and np.isneginf(np.asarray(lse)[1]).all()


def _recording(fn, calls):
    def wrapped(*args, **kwargs):
        calls.append(kwargs.get("chunk"))
        return fn(*args, **kwargs)
    return wrapped


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_decode_kernel_16_bit_dtypes(dtype, monkeypatch):
    """bfloat16 decodes in the decode kernel; float16 on the grid kernel (its
    bits decoded per tile cost more in the decode kernel's head loop)."""
    from attention_tpu.attention import flash_decode
    from attention_tpu.common import jax_bridge, pallas_helpers

    monkeypatch.setitem(blocks.DECODE_CHUNKS, "v6e", 128)
    calls = []
    monkeypatch.setattr(flash_decode, "decode_attention_with_lse",
                        _recording(flash_decode.decode_attention_with_lse, calls))

    q, k, v, _ = _inputs((2, 8, 2, 1, 384, 32, 32), dtype, seed=47)
    start, end = np.array([0, 3], np.int32), np.array([384, 131], np.int32)
    bounds = kr.rule_key_bounds(start, end, sq=1, skv=384, causal=True, window=0)
    got = flash_forward.flash_attention(*(jax_bridge.to_jax(t) for t in (q, k, v)), bounds, generation="v6e",
                                        interpret=pallas_helpers.interpret_params())
    visible = reference.attention_rule_mask(start, end, 1, 384, causal=True, window=0)
    want = reference.attention(q.float(), k.float(), v.float(), visible, scale=32 ** -0.5)
    _check(jax_bridge.to_torch(got), want, dtype, f"decode kernel {dtype}")
    assert bool(calls) == (dtype == torch.bfloat16)


def test_decode_chunk_rule():
    """v5e, v6e and tpu7x decode with the decode kernel at 1024-key chunks; other generations,
    prefills, key counts that are not multiples of 128 or below one chunk run
    the grid kernel; many KV heads or wide heads halve the chunk to fit VMEM."""
    assert blocks.choose_decode_chunk(4, 32768, kv_heads=8, generation="v6e") == 1024
    assert blocks.choose_decode_chunk(4, 32768, kv_heads=2, head_dim=512, generation="v6e") == 1024
    assert blocks.choose_decode_chunk(4, 32768, kv_heads=64, head_dim=128, generation="v6e") == 256
    assert blocks.choose_decode_chunk(4, 32768, kv_heads=8, generation="v5e") == 1024
    assert blocks.choose_decode_chunk(4, 32768, kv_heads=8, generation="tpu7x") == 1024
    for gen in ("v4", "v5p"):
        assert blocks.choose_decode_chunk(4, 32768, kv_heads=8, generation=gen) is None
    assert blocks.choose_decode_chunk(256, 32768, kv_heads=8, generation="v6e") is None  # not a decode
    assert blocks.choose_decode_chunk(4, 32768 + 64, kv_heads=8, generation="v6e") is None
    assert blocks.choose_decode_chunk(4, 896, kv_heads=8, generation="v6e") is None
    for heads, d in ((8, 128), (2, 512), (64, 128), (32, 256)):
        chunk = blocks.choose_decode_chunk(4, 32768, kv_heads=heads, head_dim=d, generation="v6e")
        assert 2 * heads * chunk * 2 * d * 2 <= tpu_generations.get_generation("v6e").vmem_budget * 3 // 4
    assert blocks.choose_decode_chunk(4, 32768, kv_heads=256, head_dim=256, generation="v6e") is None


def test_decode_kernel_refuses_chunks_it_cannot_copy():
    from attention_tpu.attention import flash_decode

    q, k, v = jnp.zeros((1, 1, 4, 16)), jnp.zeros((1, 1, 200, 16)), jnp.zeros((1, 1, 200, 16))
    with pytest.raises(ValueError, match="chunk 128 must be a multiple of 128 and at most the 200 keys"):
        flash_decode.decode_attention_with_lse(q, k, v, None, None, chunk=128, splits=1, softcap=0.0, scale=1.0,
                                               generation="v6e")


SUB_TILE_CASES = [
    ("rule", True, 0, 0.0, False),
    ("rule", True, 40, 5.0, True),  # window walk, softcap, sinks
    ("rule", False, 0, 0.0, True),
    ("ranges", True, 0, 0.0, False),  # arbitrary per-query ranges: sub-tiles read them
]


# Every case with dq fused in one call; in several calls (the carried sum) the causal ones; the separate dq
# kernel on the cases without a window (its window walk: test_gradients_over_many_blocks_and_window_walks).
@pytest.mark.parametrize("case, dq_kernel", [
    pytest.param(case, dq, id=f"{case[0]}-{'causal' if case[1] else 'full'}-window{case[2]}-{dq}")
    for case in SUB_TILE_CASES for dq in ("fused", "fused_calls", "separate")
    if (dq != "fused_calls" or (case[1] and not case[2])) and (dq != "separate" or not case[2])],
    indirect=["dq_kernel"])
def test_backward_sub_tiles_match_float64_autograd(case, dq_kernel):
    """Backward blocks computed as sub-tiles (``compute_blocks``, what the rule
    takes at 2048-wide blocks) at lengths that are no multiple of a sub-tile:
    the last query block holds a partly padded sub-tile and an all-padding one,
    the key block a partly past-the-end sub-tile; sub-tiles no row sees are
    skipped, masked ones masked exactly (rule and read ranges). Gradients
    equal float64 autograd."""
    from attention_tpu.attention import flash_backward
    from attention_tpu.common import pallas_helpers

    kind, causal, window, softcap, use_sinks = case
    b, hq, hkv, sq, skv, d = 2, 4, 2, 100, 200, 16  # rows = 200 = 3 blocks of 64 + 8; keys: one 256-key block
    q, k, v, sinks = _inputs((b, hq, hkv, sq, skv, d, d), torch.float32, seed=16)
    if kind == "rule":
        start, end = _padded_ranges(b, skv)
        bounds = np.asarray(kr.rule_key_bounds(start, end, sq=sq, skv=skv, causal=causal, window=window))
        visible = reference.attention_rule_mask(start, end, sq, skv, causal=causal, window=window)
    else:
        bounds = _random_ranges(np.random.default_rng(SEED + 16), b, sq, skv)
        visible = _ranges_mask(bounds, skv)
    jq, jk, jv = (jnp.asarray(t.numpy()) for t in (q, k, v))
    jsinks = jnp.asarray(sinks.numpy()) if use_sinks else None
    opts = dict(causal=causal, window=window, softcap=softcap, interpret=pallas_helpers.interpret_params())
    out, lse = flash_forward.flash_attention_with_lse(jq, jk, jv, jnp.asarray(bounds), jsinks,
                                                      block_sizes=(64, 256), **opts)
    grads = flash_backward.flash_attention_backward(jq, jk, jv, out, lse, 2 * out, jnp.asarray(bounds), jsinks,
                                                    block_sizes=(64, 256), compute_blocks=(32, 128), **opts)
    ref_sinks = sinks if use_sinks else torch.full((hq,), -1e9)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v, ref_sinks)]
    _f64_loss(*ref_leaves, torch.from_numpy(visible), softcap, d ** -0.5).backward()
    for name, got, want in zip("q k v sinks".split(), grads, ref_leaves[:3] + [ref_leaves[3]] * use_sinks):
        got = np.asarray(got, np.float64)
        assert not np.isnan(got).any(), f"{case} d{name}: NaN, seed={SEED}"
        np.testing.assert_allclose(got, want.grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=f"{case} d{name} seed={SEED}")


# Causal: every way to dq; a window (the rule's 2048 blocks in 512 sub-tiles, scaled down) with dq fused.
@pytest.mark.parametrize("window, dq_kernel", [(0, "fused"), (0, "fused_calls"), (0, "separate"), (100, "fused")],
                         indirect=["dq_kernel"])
def test_backward_whole_and_causal_diagonal_tiles_in_one_region(window, dq_kernel):
    """Backward tiles whose sub-tiles all run in one region: tiles every row
    sees whole, and causal diagonals whose first query sits on their first
    key (unmasked below the diagonal, masked on it, skipped above), or under
    a window the sub-tiles it reaches (the diagonal's and the one below it,
    masked; the rest skipped); 256 x 256 blocks of 128 x 128 sub-tiles here.
    Batch rows as in the forward's test (aligned prefill, keys starting
    inside a diagonal tile, an unaligned offset, left padding with one query
    off the rule in its diagonal tile). Gradients equal float64 autograd."""
    from attention_tpu.attention import flash_backward
    from attention_tpu.common import pallas_helpers

    b, hq, hkv, sq, skv, d = 4, 2, 1, 512, 768, 16
    q, k, v, _ = _inputs((b, hq, hkv, sq, skv, d, d), torch.float32, seed=32)
    start, end = np.array([0, 280, 0, 5], np.int32), np.array([512, 768, 572, 768], np.int32)
    bounds = np.array(kr.rule_key_bounds(start, end, sq=sq, skv=skv, causal=True, window=window))
    bounds[3, 40, 1] = max(280, bounds[3, 40, 0] + 1)  # off the rule, inside the tile (q block 0, kv block 1)
    jq, jk, jv = (jnp.asarray(t.numpy()) for t in (q, k, v))
    opts = dict(causal=True, window=window, interpret=pallas_helpers.interpret_params())
    out, lse = flash_forward.flash_attention_with_lse(jq, jk, jv, jnp.asarray(bounds), block_sizes=(256, 256),
                                                      **opts)
    grads = flash_backward.flash_attention_backward(jq, jk, jv, out, lse, 2 * out, jnp.asarray(bounds),
                                                    block_sizes=(256, 256), compute_blocks=(128, 128), **opts)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v, torch.full((hq,), -1e9))]
    _f64_loss(*ref_leaves, torch.from_numpy(_ranges_mask(bounds, skv)), 0.0, d ** -0.5).backward()
    for name, got, want in zip("q k v".split(), grads, ref_leaves):
        got = np.asarray(got, np.float64)
        assert not np.isnan(got).any(), f"{dq_kernel} d{name}, seed={SEED}"
        np.testing.assert_allclose(got, want.grad.numpy(), rtol=1e-4, atol=1e-5,
                                   err_msg=f"{dq_kernel} d{name} seed={SEED}")


def test_backward_over_key_blocks_with_a_tail(dq_kernel):
    """Three key blocks, the last partly past Skv (300 keys in 128-key blocks),
    rows padded in the last query block: with dq fused, per call of one key
    block (the last call's dk / dv rows shorter) or in one call, and with the
    dq kernel. Gradients equal float64 autograd."""
    from attention_tpu.attention import flash_backward
    from attention_tpu.common import pallas_helpers

    b, hq, hkv, sq, skv, d = 1, 4, 2, 150, 300, 16  # rows = 300: 5 blocks of 64, the last 44 rows
    q, k, v, sinks = _inputs((b, hq, hkv, sq, skv, d, d), torch.float32, seed=17)
    start, end = _padded_ranges(b, skv)
    bounds = np.asarray(kr.rule_key_bounds(start, end, sq=sq, skv=skv, causal=True, window=0))
    visible = reference.attention_rule_mask(start, end, sq, skv, causal=True, window=0)
    jq, jk, jv = (jnp.asarray(t.numpy()) for t in (q, k, v))
    opts = dict(causal=True, window=0, interpret=pallas_helpers.interpret_params())
    out, lse = flash_forward.flash_attention_with_lse(jq, jk, jv, jnp.asarray(bounds), block_sizes=(64, 128), **opts)
    grads = flash_backward.flash_attention_backward(jq, jk, jv, out, lse, 2 * out, jnp.asarray(bounds),
                                                    block_sizes=(64, 128), **opts)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v, torch.full((hq,), -1e9))]
    _f64_loss(*ref_leaves, torch.from_numpy(visible), 0.0, d ** -0.5).backward()
    for name, got, want in zip("q k v".split(), grads, ref_leaves):
        got = np.asarray(got, np.float64)
        assert got.shape == tuple(want.shape) and not np.isnan(got).any(), f"{dq_kernel} d{name}, seed={SEED}"
        np.testing.assert_allclose(got, want.grad.numpy(), rtol=1e-4, atol=1e-5,
                                   err_msg=f"{dq_kernel} d{name} seed={SEED}")


def test_backward_compute_blocks_rule_and_checks():
    size = blocks.BACKWARD_COMPUTE_BLOCK
    # 2048 blocks in 1024 sub-tiles where they fit the large budget (bf16 and
    # float32 head_dim 128, bf16 up to 512 on v6e; not v4's 12 MiB); a window
    # of at most 512 keys takes them in 512 sub-tiles (2-byte tiles), a wider one
    # or 4-byte tiles, and lengths 1024 does not divide (1500: sub-tiles of all
    # rows) keep the smaller blocks.
    assert blocks.choose_backward_blocks(32768, 8192, generation="v6e") == (blocks.BACKWARD_BLOCK,) * 2
    assert blocks.choose_backward_blocks(32768, 8192, itemsize=4, generation="v6e") == (blocks.BACKWARD_BLOCK,) * 2
    assert blocks.choose_backward_blocks(16384, 4096, head_dim=512, generation="v6e") == (blocks.BACKWARD_BLOCK,) * 2
    # tpu7x's 36 MiB: 1024 blocks at head_dim 512; at 256, 2048 blocks fit but
    # only 1024 ones fit with dq fused, which wins
    assert blocks.choose_backward_blocks(16384, 4096, head_dim=512, generation="tpu7x") == (size, size)
    assert blocks.choose_backward_blocks(16384, 4096, head_dim=256, generation="tpu7x") == (size, size)
    assert blocks.choose_backward_blocks(16384, 4096, head_dim=256, generation="v6e") == (blocks.BACKWARD_BLOCK,) * 2
    window_sub = blocks.BACKWARD_WINDOW_SUB_TILE
    for window in (128, window_sub):
        assert blocks.choose_backward_blocks(32768, 8192, window=window, generation="v6e") == (blocks.BACKWARD_BLOCK,) * 2
        assert blocks.backward_compute_blocks(2048, 2048, window) == (window_sub, window_sub)
    assert blocks.choose_backward_blocks(32768, 8192, window=window_sub + 1, generation="v6e") == (blocks.WINDOW_BLOCK,) * 2
    assert blocks.choose_backward_blocks(32768, 8192, window=128, itemsize=4, generation="v6e") == (blocks.WINDOW_BLOCK,) * 2
    assert blocks.backward_compute_blocks(2048, 2048, window_sub + 1) == (size, size)
    assert blocks.choose_backward_blocks(1500, 1500, generation="v6e") == (size, size)
    assert blocks.choose_backward_blocks(32768, 8192, generation="v4")[0] <= size
    for gen in ("v4", "v5e", "v5p", "v6e", "tpu7x"):
        chip = tpu_generations.get_generation(gen)
        for (itemsize, d), window in itertools.product(((2, 128), (4, 128), (2, 256), (2, 512), (4, 512)), (0, 128)):
            bq, bk = blocks.choose_backward_blocks(32768, 8192, head_dim=d, itemsize=itemsize, window=window,
                                                   generation=gen)
            working_set = blocks.backward_working_set_bytes(bq, bk, d, d, itemsize, window=window)
            assert working_set <= chip.large_vmem_budget, (gen, itemsize, d, window)
            # past the default budget the kernels ask for the large limit
            assert blocks.backward_needs_large_vmem(working_set, gen) == (working_set > chip.vmem_budget)
    assert blocks.backward_compute_blocks(2 * size, 2 * size) == (size, size)
    assert blocks.backward_compute_blocks(size, 3000) == (size, 3000)  # a side it does not divide stays whole
    assert blocks.check_compute_blocks((32, 128), 64, 256) == (32, 128)
    with pytest.raises(ValueError, match="compute block_q must divide"):
        blocks.check_compute_blocks((48, 128), 64, 256)
    with pytest.raises(ValueError, match="compute block_k must divide"):
        blocks.check_compute_blocks((32, 64), 64, 256)
