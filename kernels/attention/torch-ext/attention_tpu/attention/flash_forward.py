"""Flash attention forward for TPU in Pallas: online softmax, f32 accumulation.

Layout. ``q [B, Hq, Sq, D]``, ``k [B, Hkv, Skv, D]``, ``v [B, Hkv, Skv, Dv]``
with ``Hq = G * Hkv`` (GQA / MQA; K and V are never repeated). The wrapper
views q as ``[B, Hkv, G * Sq, D]`` (a free reshape: the G query heads of a KV
head are adjacent in memory), so one grid step multiplies the queries of a
whole head group by one K/V block: K and V are read once per group, and one
decode token of G heads is a G-row block, not a padded 128-row one.

Which keys a row sees and which tiles are skipped: ``key_ranges`` (a key
range per query, the visit table). A causal prefill does about half of the
dense work, a windowed one ``~window / Skv`` of it, and decode against a
static cache reads only the filled part.

Features: an arbitrary ``scale`` (applied before soft-capping), logit
soft-capping ``cap * tanh(s / cap)``, attention sinks (one logit per query
head that joins the softmax denominator only: applied after the kernel from
the log-sum-exp it returns), ``Dv != D``, lengths that are not multiples of
the blocks (tails masked; padded K/V rows zeroed, since ``0 * NaN`` is NaN).
Rows that see no key at all come out as zeros.

Dtypes: float32, bfloat16 and float16, accumulated in f32, results in the
input dtype. float16 enters the kernels as its uint16 bits (Mosaic loads no
float16 vector) and is decoded to f32 in VMEM (``pallas_helpers.load``): its
tiles then compute and store as the f32 kernel does (full-precision dots, f32
blocks sized by the rule), cast back to float16 in XLA.

The backward is ``flash_backward``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common.pallas_helpers import as_kernel_operand, compiler_params, dot_f32, kernel_dtype, load, out_struct
from ..common.tile_math import cdiv
from . import blocks as blocks_lib
from . import key_ranges as kr

LOG2_E = 1.4426950408889634
STAT_LANES = 128  # row statistics are kept replicated over one vreg's lanes


def _lanes(stat, width: int):
    """A ``[rows, STAT_LANES]`` lane-replicated statistic as ``[rows, width]``.
    Whole-vreg copies (concatenation) for multiples of 128 lanes and a lane
    slice below: neither needs the cross-lane unit, unlike broadcasting a
    ``[rows, 1]`` column, which costs one XLU broadcast per vreg row and was
    what bounded a tile's schedule."""
    if width == STAT_LANES:
        return stat
    if width % STAT_LANES == 0:
        return jnp.concatenate([stat] * (width // STAT_LANES), axis=1)
    if width < STAT_LANES:
        return stat[:, :width]
    return jnp.broadcast_to(stat[:, :1], (stat.shape[0], width))


def _online_softmax_step(s, v, m_ref, l_ref, acc_ref, *, masked: bool, exp):
    """Fold one tile of scores ``s [block_q, block_k]`` into the running max,
    denominator and accumulator (``exp``: ``jnp.exp``, or ``jnp.exp2`` when the
    scores are in base 2). ``masked``: ``s`` may hold ``-inf`` (a row may have
    seen no key yet), so the max is made safe before ``exp``."""
    m_prev = m_ref[...]  # [block_q, STAT_LANES]
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
    p = exp(s - _lanes(shift, s.shape[1]))
    alpha = exp(m_prev - shift)
    l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
    acc_ref[...] = _lanes(alpha, acc_ref.shape[1]) * acc_ref[...] + dot_f32(p.astype(v.dtype), v, 1, 0)
    m_ref[...] = m_new


def _flash_kernel(table_ref, steps_ref, start_ref, end_ref, q_ref, k_ref, v_ref, bounds_ref, o_ref, lse_ref, m_ref,
                  l_ref, acc_ref, *, block_q: int, block_k: int, skv: int, softcap: float, scale: float,
                  num_q_blocks: int, rule: kr.KernelRule):
    b, split, q_block, step = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    entry = functools.partial(kr.table_entry, table_ref, b, q_block, num_q_blocks=num_q_blocks)
    kv_block = kr.kv_block_of_step(entry, split, step, pl.num_programs(4))
    live, whole = kr.tile_kinds(table_ref, b, q_block, kv_block, num_q_blocks=num_q_blocks)

    @pl.when(step == 0)
    def _init():
        m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    # Without soft-capping the scores are kept in base 2: log2(e) joins the
    # scale on q (a [block_q, D] product, not a [block_q, block_k] one) and
    # exp2 needs no multiply of its own.
    base2 = not softcap
    exp = jnp.exp2 if base2 else jnp.exp

    def scores():
        q = load(q_ref)
        if base2:
            q = (q.astype(jnp.float32) * (scale * LOG2_E)).astype(q.dtype)
            return dot_f32(q, load(k_ref), 1, 1)  # [block_q, block_k]
        s = dot_f32(q, load(k_ref), 1, 1) * scale
        return softcap * jnp.tanh(s / softcap)

    @pl.when(live & whole)
    def _interior():  # every row sees every key of the block: no mask at all
        _online_softmax_step(scores(), load(v_ref), m_ref, l_ref, acc_ref, masked=False, exp=exp)

    def edge(lo, hi):
        keys = kv_block * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        s = jnp.where((keys >= lo) & (keys < hi), scores(), -jnp.inf)
        v = load(v_ref)
        if skv % block_k:  # the tail block holds rows past Skv: garbage, zeroed (0 * NaN is NaN)
            key_rows = kv_block * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
            v = jnp.where(key_rows < skv, v.astype(jnp.float32), 0.0).astype(v.dtype)
        _online_softmax_step(s, v, m_ref, l_ref, acc_ref, masked=True, exp=exp)

    kr.masked_regions(live & jnp.logical_not(whole), entry(kr.RULE) == 1, edge, rule=rule, start_ref=start_ref,
                      end_ref=end_ref, bounds_ref=bounds_ref, b=b, q_block=q_block)

    @pl.when(step == pl.num_programs(4) - 1)
    def _finish():
        l = l_ref[...]
        seen = l > 0
        inv = _lanes(jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0), acc_ref.shape[1])
        o_ref[...] = (acc_ref[...] * inv).astype(o_ref.dtype)
        m = m_ref[...][:, :1] / LOG2_E if base2 else m_ref[...][:, :1]  # lse is natural-log
        lse_ref[...] = jnp.where(seen[:, :1], m + jnp.log(jnp.where(seen[:, :1], l[:, :1], 1.0)), -jnp.inf)


def shapes_and_blocks(rule, q, v, block_sizes, causal, window, generation):
    """``(batch, hq, hkv, sq, skv, d, dv, rows, BlockSizes)``: the blocks given,
    or those of ``rule`` (a ``blocks.choose_*blocks``), checked against the
    call's rows and keys (every path into the kernels passes here)."""
    batch, hq, sq, d = q.shape
    _, hkv, skv, dv = v.shape
    rows = hq // hkv * sq
    chosen = block_sizes or rule(rows, skv, head_dim=d, v_dim=dv, itemsize=kernel_dtype(q.dtype).itemsize,
                                 window=window if causal else 0, generation=generation)
    return batch, hq, hkv, sq, skv, d, dv, rows, blocks_lib.BlockSizes.of(chosen).check_fits(rows, skv)


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
    rows: int
    block_q: int
    block_k: int
    num_q_blocks: int
    num_kv_blocks: int
    splits: int


def forward_plan(q, k, v, block_sizes, kv_splits, generation, causal, window) -> ForwardPlan:
    """The forward's blocks, block counts and KV splits for these operands."""
    batch, _, hkv, sq, skv, _, _, rows, (block_q, block_k) = shapes_and_blocks(
        blocks_lib.choose_blocks, q, v, block_sizes, causal, window, generation)
    num_q_blocks, num_kv_blocks = cdiv(rows, block_q), cdiv(skv, block_k)
    expected = kr.expected_kv_steps(num_kv_blocks, block_q=block_q, block_k=block_k, sq=sq, causal=causal,
                                    window=window)
    splits = kv_splits or blocks_lib.choose_kv_splits(batch * hkv, num_q_blocks, expected, generation)
    return ForwardPlan(rows, block_q, block_k, num_q_blocks, num_kv_blocks, max(1, min(splits, expected)))


def merge_splits(out_splits, lse_splits):
    """One softmax from per-split partial ones: ``out [.., S, rows, Dv]`` (each
    normalised over its split's keys) and ``lse [.., S, rows, 1]`` -> the
    attention over all keys and its log-sum-exp (splits that saw no key have
    ``lse = -inf`` and weigh nothing)."""
    top = lse_splits.max(axis=-3, keepdims=True)
    shift = jnp.where(top == -jnp.inf, 0.0, top)
    weight = jnp.exp(lse_splits - shift)
    total = weight.sum(axis=-3)
    seen = total > 0
    out = (weight * out_splits).sum(axis=-3) / jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, shift[..., 0, :, :] + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    return out, lse


def flash_attention_with_lse(q, k, v, key_bounds, sinks=None, *, causal: bool = True, window: int = 0,
                             softcap: float = 0.0, scale: float | None = None, block_sizes=None,
                             kv_splits: int | None = None, generation: str | None = None, interpret=False):
    """``(out [B, Hq, Sq, Dv], lse [B, Hkv, G * Sq, 1])``: the attention and the
    log-sum-exp of each row's softmax, sinks included (what the backward needs).

    ``key_bounds``: int32 ``[B, Sq, 2]``, the keys ``[lo, hi)`` of each query
    (``key_ranges.rule_key_bounds``, or a mask's ranges); ``causal`` /
    ``window`` choose the blocks. ``block_sizes``: ``(block_q, block_k)`` or a
    ``blocks.BlockSizes`` (checked here), None for the rule. ``kv_splits``:
    split the keys into that many parallel parts whose partial softmaxes are
    merged afterwards (``blocks.choose_kv_splits`` when None)."""
    batch, hq, sq, d = q.shape
    _, hkv, skv, dv = v.shape
    scale = d ** -0.5 if scale is None else scale
    rows = hq // hkv * sq
    if 0 in (batch, hq, sq, dv) or skv == 0:
        lse = jnp.full((batch, hkv, rows, 1), -jnp.inf, jnp.float32)
        if sinks is not None:  # no key: the sink alone
            lse = per_row(sinks.astype(jnp.float32), batch, hkv, hq // hkv, sq)
        return jnp.zeros((batch, hq, sq, dv), q.dtype), lse
    plan = forward_plan(q, k, v, block_sizes, kv_splits, generation, causal, window)
    bounds, start, end, table = kr.ranges_and_table(key_bounds, hq // hkv, sq=sq, skv=skv, causal=causal,
                                                    window=window, num_q_blocks=plan.num_q_blocks,
                                                    block_q=plan.block_q, block_k=plan.block_k)
    block_q, block_k, splits = plan.block_q, plan.block_k, plan.splits
    per_split = kr.kv_steps(table, num_kv_blocks=plan.num_kv_blocks, splits=splits)  # traced: a dynamic grid axis
    where = dict(num_q_blocks=plan.num_q_blocks, num_kv_blocks=plan.num_kv_blocks)

    def kv_at(b, h, split, qb, step, table_ref, steps_ref, *_):
        entry = functools.partial(kr.table_entry, table_ref, b, qb, num_q_blocks=plan.num_q_blocks)
        kv_block = kr.kv_block_of_step(entry, split, step, steps_ref[0])
        return b, h, kr.clamped_kv_index(table_ref, b, qb, kv_block, **where), 0

    def rows_at(b, h, split, qb, step, *_):
        return b, h, qb, 0

    def bounds_at(b, h, split, qb, step, *_):
        return b, qb, 0

    def split_rows_at(b, h, split, qb, step, *_):
        return b, h, split, qb, 0

    kernel = functools.partial(_flash_kernel, block_q=block_q, block_k=block_k, skv=skv, softcap=float(softcap),
                               scale=float(scale), num_q_blocks=plan.num_q_blocks,
                               rule=kr.KernelRule(block_q, sq, skv, causal, window))
    # One split: the final output in the kernel's dtype of q; several: f32 partials to merge.
    out_dtype = kernel_dtype(q.dtype) if splits == 1 else jnp.float32
    operands = (q, k, v, key_bounds)
    out, lse = pl.pallas_call(
        kernel,
        out_shape=(out_struct((batch, hkv, splits, rows, dv), out_dtype, *operands),
                   out_struct((batch, hkv, splits, rows, 1), jnp.float32, *operands)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(batch, hkv, splits, plan.num_q_blocks, per_split),
            in_specs=[pl.BlockSpec((None, None, block_q, d), rows_at),
                      pl.BlockSpec((None, None, block_k, d), kv_at),
                      pl.BlockSpec((None, None, block_k, dv), kv_at),
                      pl.BlockSpec((None, block_q, 2), bounds_at)],
            out_specs=[pl.BlockSpec((None, None, None, block_q, dv), split_rows_at),
                       pl.BlockSpec((None, None, None, block_q, 1), split_rows_at)],
            scratch_shapes=[pltpu.VMEM((block_q, STAT_LANES), jnp.float32),
                            pltpu.VMEM((block_q, STAT_LANES), jnp.float32),
                            pltpu.VMEM((block_q, dv), jnp.float32)],
        ),
        compiler_params=compiler_params(generation, ("parallel",) * 4 + ("arbitrary",)),
        interpret=interpret,
        name="flash_attention_fwd",
    )(table, per_split.reshape(1), start, end, *map(as_kernel_operand, (q.reshape(batch, hkv, rows, d), k, v)), bounds)
    if splits == 1:
        out, lse = out[:, :, 0], lse[:, :, 0]
    else:
        out, lse = merge_splits(out, lse)
    if sinks is not None:
        # softmax over [scores, sink] = softmax(scores) * 1 / (1 + exp(sink - lse))
        sink_rows = per_row(sinks.astype(jnp.float32), batch, hkv, hq // hkv, sq)
        out = out.astype(jnp.float32) * jax.nn.sigmoid(lse - sink_rows)
        lse = jnp.logaddexp(lse, sink_rows)
    return out.astype(q.dtype).reshape(batch, hq, sq, dv), lse


def per_row(per_head, batch, hkv, group, sq):
    """``[Hq]`` values as ``[B, Hkv, G * Sq, 1]``, the kernel's row layout."""
    return jnp.broadcast_to(per_head.reshape(1, hkv, group, 1, 1), (batch, hkv, group, sq, 1)).reshape(
        batch, hkv, group * sq, 1)


def flash_attention(q, k, v, key_bounds, sinks=None, **kwargs):
    """``softmax(mask(cap(scale * q k^T))) v`` per head; see the module docstring.

    ``key_bounds``: int32 ``[B, Sq, 2]``. ``sinks``: ``[Hq]`` logits or None.
    Returns ``[B, Hq, Sq, Dv]`` in q's dtype. Inputs are assumed valid.
    """
    return flash_attention_with_lse(q, k, v, key_bounds, sinks, **kwargs)[0]
