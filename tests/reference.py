"""Independent float64 references: plain loops over groups in numpy (and the
attention as dense torch ops, for gradients by autograd)."""

import numpy as np


def bounds(group_sizes):
    ends = np.cumsum(np.asarray(group_sizes, dtype=np.int64))
    return ends - np.asarray(group_sizes, dtype=np.int64), ends


def ragged_dot(lhs, rhs, group_sizes, rhs_layout="nk", group_offset=0):
    """out[rows of g] = lhs[rows of g] @ W_g for local g; every other row 0."""
    lhs = np.asarray(lhs, dtype=np.float64)
    rhs = np.asarray(rhs, dtype=np.float64)
    n = rhs.shape[1] if rhs_layout == "nk" else rhs.shape[2]
    out = np.zeros((lhs.shape[0], n))
    starts, ends = bounds(group_sizes)
    for local in range(rhs.shape[0]):
        g = group_offset + local
        w = rhs[local].T if rhs_layout == "nk" else rhs[local]
        for row in range(starts[g], ends[g]):
            out[row] = lhs[row] @ w
    return out


def weight_grad(lhs, dout, group_sizes, num_local, rhs_layout="nk", group_offset=0):
    lhs = np.asarray(lhs, dtype=np.float64)
    dout = np.asarray(dout, dtype=np.float64)
    k, n = lhs.shape[1], dout.shape[1]
    grad = np.zeros((num_local, k, n))
    starts, ends = bounds(group_sizes)
    for local in range(num_local):
        g = group_offset + local
        for row in range(starts[g], ends[g]):
            grad[local] += np.outer(lhs[row], dout[row])
    return grad.transpose(0, 2, 1) if rhs_layout == "nk" else grad


# e2m1 (MXFP4 element) code -> value, bit 3 the sign (OCP MX spec, table 5).
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def dequantize_weights(values, scales, weight_format):
    """The float64 ``[E, N, K]`` weight of quantized ``values`` / ``scales``:
    int8 per output channel, fp8 e4m3 with 128 x 128 block scales, mxfp4
    (two e2m1 codes per byte along K, low nibble first; e8m0 scale per 32)."""
    values, scales = np.asarray(values), np.asarray(scales)
    if weight_format == "int8":
        return values.astype(np.float64) * scales.astype(np.float64)[..., None]
    if weight_format == "fp8":
        import ml_dtypes

        w = values.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        n, k = w.shape[-2:]
        s = scales.astype(np.float64).repeat(128, axis=-2).repeat(128, axis=-1)[..., :n, :k]
        return w * s
    if weight_format == "mxfp4":
        packed = values.astype(np.uint8)
        codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
        scale = 2.0 ** (scales.astype(np.float64) - 127)
        return _E2M1[codes] * scale.repeat(32, axis=-1)
    raise ValueError(weight_format)


def random_group_sizes(rng, num_groups, m, kind):
    """Group sizes for the scenarios the kernels must get right."""
    if kind == "random":
        cuts = np.sort(rng.integers(0, m + 1, size=num_groups - 1))
        return np.diff(np.concatenate([[0], cuts, [rng.integers(cuts[-1] if len(cuts) else 0, m + 1)]]))
    sizes = np.zeros(num_groups, dtype=np.int64)
    if kind == "one_huge":
        sizes[rng.integers(num_groups)] = m
    elif kind == "all_last":
        sizes[-1] = m
    elif kind == "sum_below_m":
        # at most m / 2 rows in all: the first half of the groups, or group 0
        # alone when there are more of them than rows to share
        per_group = m // (2 * max(1, num_groups // 2))
        if per_group:
            sizes[: num_groups // 2] = per_group
        else:
            sizes[0] = m // 2
    elif kind == "all_empty":
        pass
    elif kind == "with_zeros":
        sizes = rng.integers(0, 2 * m // num_groups + 1, size=num_groups)
        sizes[:: 2] = 0
        while sizes.sum() > m:
            sizes[np.argmax(sizes)] -= 1
    else:
        raise ValueError(kind)
    return sizes


def attention(q, k, v, visible, *, scale, softcap=0.0, sinks=None):
    """Attention one query row at a time in float64. ``visible [B, 1 or Hq, Sq, Skv]``
    (True = attend); a row that sees no key is 0; sinks join the denominator."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    visible = np.asarray(visible, dtype=bool)
    b_, hq, sq, _ = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    out = np.zeros((b_, hq, sq, dv))
    for b in range(b_):
        for h in range(hq):
            kh = h // (hq // hkv)
            for i in range(sq):
                vis = visible[b, h if visible.shape[1] > 1 else 0, i]
                if not vis.any():
                    continue
                s = k[b, kh][vis] @ q[b, h, i] * scale
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                logits = s if sinks is None else np.concatenate([s, [float(sinks[h])]])
                w = np.exp(logits - logits.max())
                w /= w.sum()
                out[b, h, i] = w[: vis.sum()] @ v[b, kh][vis]
    return out


def attention_autograd(q, k, v, sinks, visible, *, softcap, scale):
    """The attention as differentiable torch ops (float64 leaves give float64
    gradients), formulated independently of the kernels: K/V repeated, a dense
    softmax over the scores and the sink column (``sinks [Hq]``; no sink: a
    large negative one). ``visible`` bool ``[B, 1 or Hq, Sq, Skv]``."""
    import torch

    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible, float("-inf"))
    s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
    return torch.softmax(s, -1)[..., :-1] @ v


def attention_rule_mask(kv_start, kv_end, sq, skv, *, causal, window):
    """``[B, 1, Sq, Skv]``: keys in [start, end), queries aligned to the end,
    causal and window rules on positions (written independently of the kernel)."""
    out = np.zeros((len(kv_start), 1, sq, skv), dtype=bool)
    for b, (start, end) in enumerate(zip(kv_start, kv_end)):
        for i in range(sq):
            pos = end - sq + i
            for j in range(skv):
                out[b, 0, i, j] = (start <= j < end and (not causal or j <= pos)
                                   and (not window or j > pos - window))
    return out


def moe_experts(x, ids, weights, up, down, *, gate, up_bias=None, down_bias=None, alpha=1.702, limit=7.0):
    """An experts layer one (token, pick) at a time in float64: ``up [E, N1, H]``,
    ``down [E, H, I]`` ("nk"); ``gate`` "glu_silu" (halves) or "gpt_oss"
    (interleaved, clamped); ids outside ``[0, E)`` contribute nothing."""
    x, up, down = (np.asarray(a, np.float64) for a in (x, up, down))
    out = np.zeros((x.shape[0], down.shape[1]))
    for t in range(x.shape[0]):
        for e, w in zip(np.asarray(ids[t]), np.asarray(weights[t], np.float64)):
            if not 0 <= e < up.shape[0]:
                continue
            h = up[e] @ x[t] + (0 if up_bias is None else np.asarray(up_bias[e], np.float64))
            if gate == "gpt_oss":
                g, u = np.minimum(h[::2], limit), np.clip(h[1::2], -limit, limit)
                act = (u + 1) * g / (1 + np.exp(-g * alpha))
            else:
                g, u = np.split(h, 2)
                act = g / (1 + np.exp(-g)) * u
            y = down[e] @ act + (0 if down_bias is None else np.asarray(down_bias[e], np.float64))
            out[t] += w * y
    return out
