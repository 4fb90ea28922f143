"""In-kernel pieces of the online softmax, shared by the forward's grid kernel
(``flash_forward``) and the decode kernel (``flash_decode``): a tile's scores,
folding a tile into the running statistics, and the finished rows.

Without soft-capping the scores are kept in base 2: log2(e) joins the scale
on q (a ``[rows, D]`` product, not a ``[rows, keys]`` one) and ``exp2``
needs no multiply of its own; the log-sum-exp returned is natural-log.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..common.pallas_helpers import dot_f32

LOG2_E = 1.4426950408889634
STAT_LANES = 128  # row statistics are kept replicated over one vreg's lanes


def lanes(stat, width: int):
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


def tile_scores(q, k, *, softcap: float, scale: float):
    """``[rows, keys]`` f32 scores of ``q [rows, D]`` against ``k [keys, D]``:
    base 2 without soft-capping, else ``softcap * tanh(scale * q k^T / softcap)``."""
    if not softcap:
        q = (q.astype(jnp.float32) * (scale * LOG2_E)).astype(q.dtype)
        return dot_f32(q, k, 1, 1)
    s = dot_f32(q, k, 1, 1) * scale
    return softcap * jnp.tanh(s / softcap)


def online_softmax_step(s, v, m_ref, l_ref, acc_ref, *, masked: bool, exp, sum_on_mxu: bool = False):
    """Fold one tile of scores ``s [rows, keys]`` into the running max,
    denominator and accumulator (``exp``: ``jnp.exp``, or ``jnp.exp2`` when the
    scores are in base 2). ``masked``: ``s`` may hold ``-inf`` (a row may have
    seen no key yet), so the max is made safe before ``exp``. ``sum_on_mxu``:
    the rows' sums of ``p`` come from the P V product, as the products with a
    block of ones appended to ``v`` (lane-replicated, as the statistics are
    kept), instead of a cross-lane reduction (``blocks.row_sums_on_mxu``)."""
    m_prev = m_ref[...]  # [rows, STAT_LANES]
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
    p = exp(s - lanes(shift, s.shape[1]))
    alpha = exp(m_prev - shift)
    if sum_on_mxu:
        dv = acc_ref.shape[1]
        ones = jnp.ones((v.shape[0], STAT_LANES), v.dtype)
        pv = dot_f32(p.astype(v.dtype), jnp.concatenate([v, ones], axis=1), 1, 0)
        l_ref[...] = alpha * l_ref[...] + pv[:, dv:]
        acc_ref[...] = lanes(alpha, dv) * acc_ref[...] + pv[:, :dv]
    else:
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
        acc_ref[...] = lanes(alpha, acc_ref.shape[1]) * acc_ref[...] + dot_f32(p.astype(v.dtype), v, 1, 0)
    m_ref[...] = m_new


def finished_rows(m, l, acc, *, base2: bool):
    """``(out [rows, Dv] f32, lse [rows, 1])`` from the running statistics: rows
    that saw no key come out as zeros with lse ``-inf``."""
    seen = l > 0
    inv = lanes(jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0), acc.shape[1])
    m = m[:, :1] / LOG2_E if base2 else m[:, :1]
    lse = jnp.where(seen[:, :1], m + jnp.log(jnp.where(seen[:, :1], l[:, :1], 1.0)), -jnp.inf)
    return acc * inv, lse
