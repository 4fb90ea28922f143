"""Flash attention forward for TPU in Pallas: online softmax, f32 accumulation.

Layout. ``q [B, Hq, Sq, D]``, ``k [B, Hkv, Skv, D]``, ``v [B, Hkv, Skv, Dv]``
with ``Hq = G * Hkv`` (GQA / MQA; K and V are never repeated). The wrapper
views q as ``[B, Hkv, G * Sq, D]`` (a free reshape: the G query heads of a KV
head are adjacent in memory), so one grid step multiplies the queries of a
whole head group by one K/V block: K and V are read once per group, and one
decode token of G heads is a G-row block, not a padded 128-row one. Row ``r``
is head ``r // Sq`` of the group at query index ``i = r % Sq``.

Which keys a row sees. Per batch row ``b`` the valid keys are ``[kv_start[b],
kv_end[b])`` (scalar-prefetched: left padding, the filled part of a static
cache). Queries are aligned to the end of the valid keys: query ``i`` sits at
position ``p = kv_end[b] - Sq + i``. Then ``causal`` keeps keys ``<= p`` and a
sliding ``window`` keeps keys ``> p - window``.

Skipped work. For each (batch, query block) the kernel computes the range of
KV blocks any of its rows can see; grid steps outside it do no MXU work
(``pl.when``), and their K/V index maps are clamped into the range, so the
block already in VMEM is reused and no DMA starts: a causal prefill does about
half of the dense work, a windowed one ``~window / Skv`` of it, and decode
against a static cache reads only the filled part.

Features: an arbitrary ``scale`` (applied before soft-capping), logit
soft-capping ``cap * tanh(s / cap)``, attention sinks (one logit per query
head that joins the softmax denominator only: applied after the kernel from
the log-sum-exp it returns), ``Dv != D``, lengths that are not multiples of
the blocks (tails masked; padded K/V rows zeroed, since ``0 * NaN`` is NaN).
Rows that see no key at all come out as zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common.pallas_helpers import compiler_params, dot_f32
from ..common.tile_math import cdiv
from . import blocks as blocks_lib


def _visible_keys(kv_start, kv_end, first_pos, last_pos, *, causal: bool, window: int):
    """``[lo, hi)``: keys any query at positions ``[first_pos, last_pos]`` may see."""
    lo, hi = kv_start, kv_end
    if causal:
        hi = jnp.minimum(hi, last_pos + 1)
    if window:
        lo = jnp.maximum(lo, first_pos - window + 1)
    return lo, hi


def _div(a, b):
    """``a // b`` for non-negative ints: lax's truncating division (Mosaic lowers
    Python's floor division through ``sign``, which needs the chip at trace time)."""
    return lax.div(a, jnp.int32(b) if isinstance(b, int) else b)


def _rem(a, b):
    return lax.rem(a, jnp.int32(b) if isinstance(b, int) else b)


def _block_positions(q_block, kv_end, *, block_q: int, sq: int):
    """Smallest and largest query position among the rows of ``q_block``."""
    r0 = q_block * block_q
    r1 = r0 + block_q - 1
    spans_heads = _div(r1, sq) != _div(r0, sq)
    first_i = jnp.where(spans_heads, 0, _rem(r0, sq))
    last_i = jnp.where(spans_heads, sq - 1, _rem(r1, sq))
    return kv_end - sq + first_i, kv_end - sq + last_i


def _kv_block_range(b, q_block, kv_start_ref, kv_end_ref, *, block_q, block_k, sq, causal, window):
    """``[first, last]`` KV blocks that query block ``q_block`` of batch ``b`` needs
    (``last < first`` when it needs none)."""
    start, end = kv_start_ref[b], kv_end_ref[b]
    first_pos, last_pos = _block_positions(q_block, end, block_q=block_q, sq=sq)
    lo, hi = _visible_keys(start, end, first_pos, last_pos, causal=causal, window=window)
    return _div(lo, block_k), _div(jnp.maximum(hi, 0) + block_k - 1, block_k) - 1


def _flash_kernel(kv_start_ref, kv_end_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref, *,
                  block_q: int, block_k: int, sq: int, skv: int, causal: bool, window: int, softcap: float,
                  scale: float, num_kv_blocks: int):
    b, q_block, kv_block = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    first, last = _kv_block_range(b, q_block, kv_start_ref, kv_end_ref, block_q=block_q, block_k=block_k,
                                  sq=sq, causal=causal, window=window)

    @pl.when(kv_block == 0)
    def _init():
        m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when((kv_block >= first) & (kv_block <= last))
    def _accumulate():
        start, end = kv_start_ref[b], kv_end_ref[b]
        q, k, v = q_ref[...], k_ref[...], v_ref[...]
        s = dot_f32(q, k, 1, 1) * scale  # [block_q, block_k]
        if softcap:
            s = softcap * jnp.tanh(s / softcap)
        rows = q_block * block_q + lax.broadcasted_iota(jnp.int32, s.shape, 0)
        keys = kv_block * block_k + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        pos = end - sq + _rem(rows, sq)
        visible = (keys >= start) & (keys < end) & (keys < skv)
        if causal:
            visible &= keys <= pos
        if window:
            visible &= keys > pos - window
        s = jnp.where(visible, s, -jnp.inf)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        safe_m = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw nothing yet
        p = jnp.exp(s - safe_m)
        alpha = jnp.exp(m_prev - safe_m)
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
        if skv % block_k:  # the tail block holds rows past Skv: garbage, zeroed
            key_rows = kv_block * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
            v = jnp.where(key_rows < skv, v.astype(jnp.float32), 0.0).astype(v.dtype)
        acc_ref[...] = alpha * acc_ref[...] + dot_f32(p.astype(v.dtype), v, 1, 0)
        m_ref[...] = m_new

    @pl.when(kv_block == num_kv_blocks - 1)
    def _finish():
        l = l_ref[...]
        seen = l > 0
        o_ref[...] = jnp.where(seen, acc_ref[...] / jnp.where(seen, l, 1.0), 0.0).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(seen, m_ref[...] + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def kv_block_plan(kv_start, kv_end, *, rows: int, sq: int, skv: int, causal: bool, window: int,
                  block_sizes=None):
    """The kernel's own visit plan, for tests and benchmarks: ``(live, fetched)``
    counts of KV block steps that compute, and of K/V block fetches (a fetch
    happens when the clamped block index changes between consecutive steps),
    next to the dense count ``B * q_blocks * kv_blocks``."""
    import numpy as np

    block_q, block_k = block_sizes or blocks_lib.choose_blocks(rows, skv)
    num_q_blocks, num_kv_blocks = cdiv(rows, block_q), cdiv(skv, block_k)
    static = dict(block_q=block_q, block_k=block_k, sq=sq, causal=causal, window=window)
    starts, ends = jnp.asarray(kv_start, jnp.int32), jnp.asarray(kv_end, jnp.int32)
    live = fetched = 0
    for b in range(starts.shape[0]):
        previous = None
        for qb in range(num_q_blocks):
            first, last = (int(x) for x in _kv_block_range(b, qb, starts, ends, **static))
            lo = min(max(first, 0), num_kv_blocks - 1)
            hi = min(max(last, lo), num_kv_blocks - 1)
            for kb in range(num_kv_blocks):
                live += first <= kb <= last
                index = int(np.clip(kb, lo, hi))
                fetched += index != previous
                previous = index
    return live, fetched, starts.shape[0] * num_q_blocks * num_kv_blocks


def flash_attention(q, k, v, kv_start, kv_end, sinks=None, *, causal: bool = True, window: int = 0,
                    softcap: float = 0.0, scale: float | None = None, block_sizes=None,
                    generation: str | None = None, interpret=False):
    """``softmax(mask(cap(scale * q k^T))) v`` per head; see the module docstring.

    ``kv_start``, ``kv_end``: int32 ``[B]``. ``sinks``: ``[Hq]`` logits or None.
    Returns ``[B, Hq, Sq, Dv]`` in q's dtype. Inputs are assumed valid.
    """
    batch, hq, sq, d = q.shape
    _, hkv, skv, dv = v.shape
    group = hq // hkv
    rows = group * sq
    scale = d ** -0.5 if scale is None else scale
    if 0 in (batch, hq, sq, dv) or skv == 0:
        return jnp.zeros((batch, hq, sq, dv), q.dtype)
    block_q, block_k = block_sizes or blocks_lib.choose_blocks(rows, skv)
    num_q_blocks, num_kv_blocks = cdiv(rows, block_q), cdiv(skv, block_k)
    static = dict(block_q=block_q, block_k=block_k, sq=sq, causal=causal, window=window)

    def kv_index(b, h, qb, kb, kv_start_ref, kv_end_ref):
        first, last = _kv_block_range(b, qb, kv_start_ref, kv_end_ref, **static)
        # Outside [first, last] stay on a neighbouring block: no new DMA.
        lo = jnp.clip(first, 0, num_kv_blocks - 1)
        return b, h, jnp.clip(kb, lo, jnp.clip(last, lo, num_kv_blocks - 1)), 0

    q_rows = q.reshape(batch, hkv, rows, d)
    q_spec = pl.BlockSpec((None, None, block_q, d), lambda b, h, qb, kb, *_: (b, h, qb, 0))
    k_spec = pl.BlockSpec((None, None, block_k, d), kv_index)
    v_spec = pl.BlockSpec((None, None, block_k, dv), kv_index)
    o_spec = pl.BlockSpec((None, None, block_q, dv), lambda b, h, qb, kb, *_: (b, h, qb, 0))
    lse_spec = pl.BlockSpec((None, None, block_q, 1), lambda b, h, qb, kb, *_: (b, h, qb, 0))
    kernel = functools.partial(_flash_kernel, skv=skv, softcap=float(softcap), scale=float(scale),
                               num_kv_blocks=num_kv_blocks, **static)
    out, lse = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((batch, hkv, rows, dv), q.dtype),
                   jax.ShapeDtypeStruct((batch, hkv, rows, 1), jnp.float32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, hkv, num_q_blocks, num_kv_blocks),
            in_specs=[q_spec, k_spec, v_spec],
            out_specs=[o_spec, lse_spec],
            scratch_shapes=[pltpu.VMEM((block_q, 1), jnp.float32), pltpu.VMEM((block_q, 1), jnp.float32),
                            pltpu.VMEM((block_q, dv), jnp.float32)],
        ),
        compiler_params=compiler_params(generation, ("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="flash_attention_fwd",
    )(kv_start.astype(jnp.int32), kv_end.astype(jnp.int32), q_rows, k, v)
    out = out.reshape(batch, hq, sq, dv)
    if sinks is not None:
        # softmax over [scores, sink] = softmax(scores) * 1 / (1 + exp(sink - lse))
        lse = lse.reshape(batch, hq, sq, 1)
        keep = jax.nn.sigmoid(lse - sinks.astype(jnp.float32).reshape(1, hq, 1, 1))
        out = (out.astype(jnp.float32) * keep).astype(q.dtype)
    return out
