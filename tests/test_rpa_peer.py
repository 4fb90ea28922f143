"""The paged batch the attention benchmark hands tpu-inference's ragged paged
attention (bench/tpu_inference_peers.py): block table, lengths and the
decode / mixed split, against a plain loop; vLLM's default page size."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import tpu_inference_peers as peers  # noqa: E402


def _expected_table(kv_lens, page_size, max_model_len):
    """Sequence by sequence, page by page: the pages each one fills, numbered
    on from the previous sequence's; the rest of its row 0."""
    width = -(-max_model_len // page_size)
    table, next_page = [], 0
    for kv_len in kv_lens:
        row = [0] * width
        for j in range(-(-kv_len // page_size)):
            row[j] = next_page
            next_page += 1
        table.append(row)
    return np.array(table, np.int32), next_page


@pytest.mark.parametrize("kv_lens, q_lens, page_size, max_model_len", [
    ([2048] * 8, [1] * 8, 16, 32768),  # decode, 2k of a 32k cache
    ([3000] * 8, [1] * 8, 256, 8192),  # pages not filled to the end
    ([5, 17, 4096, 33], [1, 1, 64, 33], 16, 4096),  # decode then mixed, one page partly filled
    ([8192], [8192], 256, 8192),  # one prefill
])
def test_paged_batch_matches_a_plain_loop(kv_lens, q_lens, page_size, max_model_len):
    batch = peers.paged_batch(kv_lens, q_lens, page_size, max_model_len)
    table, pages = _expected_table(kv_lens, page_size, max_model_len)
    np.testing.assert_array_equal(batch.page_indices, table.reshape(-1))
    assert batch.page_indices.dtype == batch.kv_lens.dtype == batch.cu_q_lens.dtype == np.int32
    assert batch.total_pages == pages
    np.testing.assert_array_equal(batch.kv_lens, kv_lens)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    np.testing.assert_array_equal(batch.cu_q_lens, starts)
    decodes = sum(1 for q in q_lens if q == 1)
    np.testing.assert_array_equal(batch.distribution, [decodes, decodes, len(q_lens)])


def test_paged_batch_rejects_bad_batches_naming_the_argument():
    with pytest.raises(ValueError, match="kv_lens"):
        peers.paged_batch([10, 10], [1], 16, 64)
    with pytest.raises(ValueError, match="q_lens"):
        peers.paged_batch([10], [11], 16, 64)
    with pytest.raises(ValueError, match="max_model_len"):
        peers.paged_batch([100], [1], 16, 64)
    with pytest.raises(ValueError, match="decode-only"):
        peers.paged_batch([10, 10], [2, 1], 16, 64)


def test_page_size_is_vllm_tpu_default():
    # above 8192 tokens 16; else the length's power of two / 16 within [16, 256]
    assert [peers.rpa_page_size(n) for n in (32768, 131072, 8192, 4096, 2048, 1000, 100)] == \
        [16, 16, 256, 256, 128, 64, 16]
