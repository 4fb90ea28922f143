"""The attention kernel compiles for real TPU generations (libtpu, no TPU attached)
at the shapes of the models it serves: prefill and decode against static caches,
in bfloat16 and (its bits decoded in the kernel) float16."""

import os

import jax.numpy as jnp
import pytest

from attention_tpu.attention import blocks, flash_backward, flash_forward, key_ranges
from attention_tpu.common import aot, pallas_helpers, tpu_generations

pytest.importorskip("libtpu")

GENERATIONS = ["v4", "v5e", "v5p", "v6e", "tpu7x"]
# name: (batch, q heads, kv heads, Sq, Skv, head_dim, window, softcap, sinks)
CASES = {
    "llama3-8b-prefill-8k": (1, 32, 8, 8192, 8192, 128, 0, 0.0, False),
    "llama3-8b-decode-8k-cache": (8, 32, 8, 1, 8192, 128, 0, 0.0, False),
    "llama3-8b-decode-32k-cache": (1, 32, 8, 1, 32768, 128, 0, 0.0, False),
    "gpt-oss-20b-prefill-sliding": (1, 64, 8, 4096, 4096, 64, 128, 0.0, True),
    "gpt-oss-20b-decode-8k": (4, 64, 8, 1, 8192, 64, 0, 0.0, True),
    "gemma4-sliding-prefill": (1, 8, 4, 4096, 4096, 256, 512, 0.0, False),
    "gemma4-global-decode-32k": (1, 8, 2, 1, 32768, 512, 0, 0.0, False),
    "gemma2-softcap-prefill": (2, 8, 4, 2048, 2048, 256, 0, 50.0, False),
    "gemma4-global-prefill-4k": (1, 8, 2, 4096, 4096, 512, 0, 0.0, False),
}


# float16 compiles (f32 tiles in the kernel) take 3-6x bfloat16's time: CI compiles
# a decode and a sliding-window prefill with sinks, forward and backward, on
# v6e and tpu7x; AOT_ALL_DTYPES=1 compiles float16 at every case and chip.
FLOAT16_CASES = ["llama3-8b-decode-8k-cache", "gpt-oss-20b-prefill-sliding"]
FLOAT16_GENERATIONS = ["v6e", "tpu7x"]
ALL_FLOAT16 = os.environ.get("AOT_ALL_DTYPES") == "1"


def _params(cases, generations):
    """(case, generation, dtype): bfloat16 everywhere, float16 as above."""
    return [(c, g, "bfloat16") for c in cases for g in generations] + [
        (c, g, "float16") for c in cases for g in generations
        if ALL_FLOAT16 or (c in FLOAT16_CASES and g in FLOAT16_GENERATIONS)]


def _vmem_itemsize(dtype) -> int:
    """Bytes an element takes in the kernel's VMEM working set (float16 is decoded to f32 there)."""
    return pallas_helpers.kernel_dtype(dtype).itemsize


# Forward prefills of 2048-row blocks take 0.5-1 minute each: every chip compiles
# Llama-3-8B's (head_dim 128) and Gemma-4 global's (512) but v5p Llama-3's (its
# blocks are v5e's; Gemma-2's and Gemma-4's compile there), Gemma-2's
# soft-capped one on v4, v5p and tpu7x (the cap's tanh is the one difference).
FORWARD_SKIPPED = {("llama3-8b-prefill-8k", "v5p"), ("gemma2-softcap-prefill", "v5e"),
                   ("gemma2-softcap-prefill", "v6e"),
                   # windows at 2048 blocks: gpt-oss's on the published chips, Gemma-4's on every chip
                   ("gpt-oss-20b-prefill-sliding", "v4"), ("gpt-oss-20b-prefill-sliding", "v5p")}


@pytest.mark.parametrize("case,generation,dtype", [
    p for p in _params(sorted(CASES), GENERATIONS) if p[:2] not in FORWARD_SKIPPED])
def test_forward_compiles(generation, case, dtype, record_property):
    b, hq, hkv, sq, skv, d, window, softcap, sinks = CASES[case]
    itemsize = _vmem_itemsize(dtype)
    block_q, block_k = blocks.choose_blocks(hq // hkv * sq, skv, head_dim=d, itemsize=itemsize, window=window,
                                            generation=generation)
    working_set = blocks.working_set_bytes(block_q, block_k, d, d, itemsize)
    assert working_set <= tpu_generations.get_generation(generation).vmem_budget
    record_property("blocks", (block_q, block_k))

    def fn(q, k, v, start, end, *sink):
        bounds = key_ranges.rule_key_bounds(start, end, sq=sq, skv=skv, causal=True, window=window)
        return flash_forward.flash_attention(q, k, v, bounds, sink[0] if sink else None, causal=True,
                                             window=window, softcap=softcap, generation=generation)

    dt = jnp.dtype(dtype)
    inputs = [((b, hq, sq, d), dt), ((b, hkv, skv, d), dt), ((b, hkv, skv, d), dt),
              ((b,), jnp.int32), ((b,), jnp.int32)] + ([((hq,), jnp.float32)] if sinks else [])
    aot.compile_for(generation, fn, *inputs)


BACKWARD_CASES = ["llama3-8b-prefill-8k", "gpt-oss-20b-prefill-sliding", "gemma2-softcap-prefill",
                  "gemma4-global-prefill-4k", "gemma4-sliding-prefill"]


# Skipped backward compiles: v5e and v6e pick the same blocks and sub-tiles for the 2048-row prefills
# (2048 x 2048, 1024 x 1024 sub-tiles), each compile 1-2 minutes: v6e compiles
# Llama-3-8B's and Gemma-4 global's (head_dim 512), Gemma-2's soft-capped one
# compiles on v4 and tpu7x; the windows' 2048 blocks in 512 sub-tiles (0.5-1 minute each;
# v5e, v6e and tpu7x take the same blocks, sub-tiles and fused dq for both cases): Gemma-4's
# on v6e, gpt-oss's on tpu7x (and on v4 at its smaller blocks; its float16 backward, at 512
# blocks, on tpu7x).
BACKWARD_SKIPPED = {("gemma2-softcap-prefill", "v5e"), ("gemma2-softcap-prefill", "v6e"),
                    ("gemma4-global-prefill-4k", "v5e"), ("llama3-8b-prefill-8k", "v5e"),
                    ("gemma4-sliding-prefill", "v5e"), ("gemma4-sliding-prefill", "v4"),
                    ("gemma4-sliding-prefill", "tpu7x"), ("gpt-oss-20b-prefill-sliding", "v5e"),
                    ("gpt-oss-20b-prefill-sliding", "v6e")}


@pytest.mark.parametrize("case,generation,dtype", [
    p for p in _params(BACKWARD_CASES, ["v4", "v5e", "v6e", "tpu7x"]) if p[:2] not in BACKWARD_SKIPPED])
def test_backward_compiles(generation, case, dtype, record_property):
    """The backward at the rule's blocks, dq in the dk/dv kernel where the rule
    fuses it (the property records where: Llama-3-8B's 2048-key blocks, not v4's
    smaller ones)."""
    record_property("fused_dq", _backward_compiles(generation, case, dtype))


@pytest.mark.parametrize("generation", ["v6e"])
def test_backward_with_separate_dq_kernel_compiles(generation, monkeypatch):
    """The two-kernel backward (dq in its own kernel), which the rule takes
    for short key blocks and past ``FUSED_DQ_MAX_BYTES`` (Llama-3-8B at 32k keys),
    at the blocks that would fuse it (v4's backward compiles it at its own,
    shorter key blocks in ``test_backward_compiles``; v5e's blocks are v6e's;
    tpu7x's compiler is v6e's Mosaic, at the same blocks: v6e stands for it)."""
    monkeypatch.setattr(blocks, "FUSED_DQ_MAX_BYTES", 0)
    assert not _backward_compiles(generation, "llama3-8b-prefill-8k", "bfloat16")


@pytest.mark.parametrize("generation", ["v4", "tpu7x"])
def test_backward_with_fused_dq_in_calls_compiles(generation, monkeypatch):
    """dq fused, one dk/dv call per key block: what the rule runs when all the
    key blocks' parts exceed ``FUSED_DQ_MAX_BYTES`` (Llama-3-8B at 32k keys:
    calls of two 2048-key blocks); v5e's and v6e's blocks are tpu7x's."""
    monkeypatch.setattr(blocks, "FUSED_DQ_MIN_BLOCK_K", 0)
    monkeypatch.setattr(blocks, "fused_dq_blocks_per_call", lambda part_bytes, num_kv_blocks: 1)
    assert _backward_compiles(generation, "gemma2-softcap-prefill", "bfloat16")


def _backward_compiles(generation, case, dtype) -> bool:
    """Compiles the case's backward; whether the rule fused dq."""
    b, hq, hkv, sq, skv, d, window, softcap, sinks = CASES[case]
    rows = hq // hkv * sq
    itemsize = _vmem_itemsize(dtype)
    block_q, block_k = blocks.choose_backward_blocks(rows, skv, head_dim=d, itemsize=itemsize, window=window,
                                                     generation=generation)
    assert (blocks.backward_working_set_bytes(block_q, block_k, d, d, itemsize, window=window)
            <= tpu_generations.get_generation(generation).large_vmem_budget)
    num_q_blocks, num_kv_blocks = -(-rows // block_q), -(-skv // block_k)
    fused = blocks.fuses_dq(b * hkv * num_kv_blocks * num_q_blocks * block_q * d * 4,
                            blocks.backward_working_set_bytes(block_q, block_k, d, d, itemsize, fused_dq=True,
                                                              window=window),
                            block_k=block_k, num_kv_blocks=num_kv_blocks, generation=generation)

    def fn(q, k, v, out, lse, dout, start, end, *sink):
        bounds = key_ranges.rule_key_bounds(start, end, sq=sq, skv=skv, causal=True, window=window)
        return flash_backward.flash_attention_backward(q, k, v, out, lse, dout, bounds, sink[0] if sink else None,
                                                       causal=True, window=window, softcap=softcap,
                                                       generation=generation)

    dt = jnp.dtype(dtype)
    inputs = [((b, hq, sq, d), dt), ((b, hkv, skv, d), dt), ((b, hkv, skv, d), dt), ((b, hq, sq, d), dt),
              ((b, hkv, rows, 1), jnp.float32), ((b, hq, sq, d), dt), ((b,), jnp.int32), ((b,), jnp.int32)]
    aot.compile_for(generation, fn, *(inputs + ([((hq,), jnp.float32)] if sinks else [])))
    return fused


def test_f32_and_odd_shapes_compile():
    def fn(q, k, v, bounds):
        return flash_forward.flash_attention(q, k, v, bounds, causal=True, window=7, generation="v5e")

    aot.compile_for("v5e", fn, ((2, 6, 77, 80), jnp.float32), ((2, 3, 300, 80), jnp.float32),
                    ((2, 3, 300, 48), jnp.float32), ((2, 77, 2), jnp.int32))


@pytest.mark.parametrize("generation", ["v5p", "v6e"])
def test_split_kv_decode_compiles(generation):
    """One MQA decode stream (a single parallel (batch, head) pair): the keys split
    in two parts merged after the kernel, the rule's choice on megacore v5p."""
    def fn(q, k, v, start, end):
        bounds = key_ranges.rule_key_bounds(start, end, sq=1, skv=32768, causal=True, window=0)
        return flash_forward.flash_attention(q, k, v, bounds, causal=True, kv_splits=2, generation=generation)

    assert blocks.choose_kv_splits(1, 1, 8, generation) == (2 if generation == "v5p" else 1)
    aot.compile_for(generation, fn, ((1, 8, 1, 128), jnp.bfloat16), ((1, 1, 32768, 128), jnp.bfloat16),
                    ((1, 1, 32768, 128), jnp.bfloat16), ((1,), jnp.int32), ((1,), jnp.int32))


@pytest.mark.parametrize("generation", sorted(blocks.DECODE_CHUNKS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kv_heads,skv", [(8, 8192 + 384), (32, 4096)])
def test_decode_kernel_compiles(generation, dtype, kv_heads, skv):
    """The decode kernel where the rule picks it: a cache that is not a multiple
    of the chunk (its last copy overlaps the one before) and an MHA model with
    more KV heads than one group computes at once (four groups of 8 in a rolled
    loop; the chunk halved to fit VMEM)."""
    chunk = blocks.choose_decode_chunk(32 // kv_heads, skv, kv_heads=kv_heads, itemsize=jnp.dtype(dtype).itemsize,
                                       generation=generation)
    assert chunk is not None and skv % chunk == (384 if kv_heads == 8 else 0)

    def fn(q, k, v, start, end):
        bounds = key_ranges.rule_key_bounds(start, end, sq=1, skv=skv, causal=True, window=0)
        return flash_forward.flash_attention(q, k, v, bounds, causal=True, generation=generation)

    dt = jnp.dtype(dtype)
    aot.compile_for(generation, fn, ((4, 32, 1, 128), dt), ((4, kv_heads, skv, 128), dt),
                    ((4, kv_heads, skv, 128), dt), ((4,), jnp.int32), ((4,), jnp.int32))


@pytest.mark.parametrize("generation", sorted(blocks.DECODE_CHUNKS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_kernel_compiles_at_its_most_rows(generation, dtype):
    """The decode kernel's largest tiles: 128 rows (32 tokens of 4 query heads
    per KV head) of a group of ``HEADS_PER_GROUP`` heads, whose f32 scores are
    all live at once, fit VMEM beside the double-buffered chunks (16 heads per
    group did not on v5e)."""
    from attention_tpu.attention import flash_decode

    skv, hkv, sq = 8192, 16, 32
    rows = 4 * sq
    assert rows == blocks.DECODE_MAX_ROWS and hkv >= flash_decode.HEADS_PER_GROUP
    assert blocks.choose_decode_chunk(rows, skv, kv_heads=hkv, itemsize=jnp.dtype(dtype).itemsize,
                                      generation=generation)

    def fn(q, k, v, start, end):
        bounds = key_ranges.rule_key_bounds(start, end, sq=sq, skv=skv, causal=True, window=0)
        return flash_forward.flash_attention(q, k, v, bounds, causal=True, generation=generation)

    dt = jnp.dtype(dtype)
    aot.compile_for(generation, fn, ((2, 4 * hkv, sq, 128), dt), ((2, hkv, skv, 128), dt),
                    ((2, hkv, skv, 128), dt), ((2,), jnp.int32), ((2,), jnp.int32))
