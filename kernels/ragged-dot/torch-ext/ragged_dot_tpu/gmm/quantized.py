"""Quantized expert weights on the JAX side: argument checks, the XLA
``dequantize`` and the element decoders the Pallas kernel runs in VMEM.

The formats are those of ``common.quant_formats`` (values + scales, always
"nk"). Every decoder here is exact: int8 values, e4m3 values and e2m1 values
times an e8m0 power of two are all representable in bfloat16 and float32,
so a dequantized tile differs from the float64 weight only where a format's
own scale is not (fp8's float32 block scale times the value, rounded once to
the lhs dtype). Products below the smallest normal float32 (2**-126: e8m0
codes 0 and 1 with small e2m1 values, 2**-127 itself) are flushed to zero,
as TPU vector units flush subnormals; no real checkpoint's scale sits there.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..common import quant_formats

ACTIVATION_DTYPES = (jnp.bfloat16, jnp.float32)


def check_quantized_gmm_args(lhs, values, scales, weight_format: str, rhs_layout: str):
    """The format of ``weight_format`` after checking every array against it;
    ``ValueError`` naming the argument at fault otherwise."""
    fmt = quant_formats.weight_format(weight_format)
    if rhs_layout != "nk":
        raise ValueError(f"quantized weights (weight_format={weight_format!r}) are stored \"nk\" "
                         f"([G, N, K]); rhs_layout={rhs_layout!r} is not supported")
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be 2-D [M, K], got shape {tuple(lhs.shape)}")
    if jnp.dtype(lhs.dtype) not in [jnp.dtype(d) for d in ACTIVATION_DTYPES]:
        raise ValueError(f"lhs must be bfloat16 or float32 with quantized weights, got {lhs.dtype}")
    k = lhs.shape[1]
    fmt.check_shape(k)
    if values.ndim != 3:
        raise ValueError(f"rhs ({weight_format} values) must be 3-D [G, N, K/{fmt.values_per_byte}], "
                         f"got shape {tuple(values.shape)}")
    if jnp.dtype(values.dtype) != jnp.dtype(fmt.values_dtype):
        raise ValueError(f"rhs ({weight_format} values) must be {fmt.values_dtype}, got {values.dtype}")
    g, n = values.shape[:2]
    if tuple(values.shape) != fmt.values_shape(g, n, k):
        raise ValueError(f"rhs ({weight_format} values) must have shape {fmt.values_shape(g, n, k)} for "
                         f"lhs.shape[1]={k}, got {tuple(values.shape)}")
    if scales is None:
        raise ValueError(f"rhs_scales is required with weight_format={weight_format!r}")
    if tuple(scales.shape) != fmt.scales_shape(g, n, k) or jnp.dtype(scales.dtype) != jnp.dtype(fmt.scales_dtype):
        raise ValueError(f"rhs_scales must be {fmt.scales_dtype} {fmt.scales_shape(g, n, k)} for "
                         f"{weight_format} weights of shape {tuple(values.shape)}, got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    return fmt


# ----------------------------------------------------------------------------
# Element decoders (jnp: used in XLA and inside the Pallas kernel)
# ----------------------------------------------------------------------------


def e2m1_to_f32(codes):
    """float32 values of e2m1 codes (int32 in [0, 16)), from bits: a
    magnitude code c placed as ``(c << 22) + (126 << 23)`` reads as
    ``2 ** ((c >> 1) - 1) * (1 + (c & 1) / 2)``, right for c >= 2; for c = 0, 1
    it reads 0.5, 0.75 and ``2 x - 1`` gives 0, 0.5 (exact). The sign bit
    moves to bit 31."""
    c3 = codes & 7
    value = lax.bitcast_convert_type((c3 << 22) + (126 << 23), jnp.float32)
    value = jnp.where(c3 < 2, value * 2.0 - 1.0, value)
    sign = (codes & 8) << 28
    return lax.bitcast_convert_type(lax.bitcast_convert_type(value, jnp.int32) | sign, jnp.float32)


def e8m0_to_f32(codes):
    """float32 ``2 ** (code - 127)`` of e8m0 codes (int32), as the exponent
    field; code 0 gives 0 (see the module docstring), 255 gives inf."""
    return lax.bitcast_convert_type(codes << 23, jnp.float32)


def unpack_e2m1(packed):
    """(even-k codes, odd-k codes) of gpt-oss-packed bytes: low nibble first."""
    b = packed.astype(jnp.int32)
    return b & 15, b >> 4


def dequantize(values, scales, weight_format: str, dtype=jnp.bfloat16):
    """The dense ``[E, N, K]`` weight of a quantized one, in ``dtype`` (XLA)."""
    fmt = quant_formats.weight_format(weight_format)
    if weight_format == "int8":
        w = values.astype(jnp.float32) * scales[..., None]
    elif weight_format == "fp8":
        n, k = values.shape[-2:]
        s = jnp.repeat(jnp.repeat(scales, fmt.block_n, axis=-2), fmt.block_k, axis=-1)
        w = values.astype(jnp.float32) * s[..., :n, :k]
    else:
        even, odd = unpack_e2m1(values)
        codes = jnp.stack([even, odd], axis=-1).reshape(*values.shape[:-1], -1)
        s = jnp.repeat(e8m0_to_f32(scales.astype(jnp.int32)), fmt.block_k, axis=-1)
        w = e2m1_to_f32(codes) * s
    return w.astype(dtype)


def split_even_odd(lhs, tk: int, tiles_k: int, half: int):
    """mxfp4's lhs: each K tile ``[x_0 .. x_tk)`` becomes ``[x_0, x_2, ..,
    zeros to half, x_1, x_3, .., zeros to half]`` so that the kernel contracts
    it with the tile's [low nibbles | high nibbles] without interleaving
    lanes. Columns past K are zeros."""
    m, k = lhs.shape
    x = jnp.pad(lhs, ((0, 0), (0, tiles_k * tk - k))).reshape(m, tiles_k, tk)
    # Strided lane slices, not a pair axis moved in front (XLA made three
    # copies of that): estimated v6e, [32768, 2048] bf16, 327 us against 737
    # (x + 1: 245); the mxfp4 layer, Qwen3-30B-A3B 4096 tokens, 3140 -> 2774 us.
    lanes = ((0, 0), (0, 0), (0, half - tk // 2))
    x = jnp.concatenate([jnp.pad(x[:, :, 0::2], lanes), jnp.pad(x[:, :, 1::2], lanes)], axis=2)
    return x.reshape(m, tiles_k * 2 * half)
