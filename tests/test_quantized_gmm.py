"""The grouped matmul with quantized weights (int8, fp8, mxfp4) in interpret
mode against dequantize-then-matmul in float64 (tests/reference.py).

Values and scales are drawn over each format's whole range, extremes
included: int8 +-127, fp8 subnormals and +-448, e8m0 codes from 2 to 254
(rows whose products would overflow float32 are kept out by pairing large
scales with small ones along a row). The interpreter poisons memory, so an
unwritten output element or an unmasked tail reads NaN and fails.

Measured error (relative to the output scale ``sqrt(K) * max|w|``): f32 lhs
~1e-7; bf16 lhs int8 / mxfp4 ~1e-6 (the weights are exact in bf16, only
the f32 accumulation rounds: the lhs is bf16 already in the reference), bf16
fp8 ~2e-3 (each weight rounded once to bf16). Tolerances: 1e-5 (f32) and
1e-2 (bf16).
"""

import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import reference
from ragged_dot_tpu.common import pallas_helpers, quant_formats
from ragged_dot_tpu.gmm import pallas_gmm, quantized, tiling

SEED = int(os.environ.get("TEST_SEED", np.random.SeedSequence().entropy % (2**31)))
FORMATS = ["int8", "fp8", "mxfp4"]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def random_weights(rng, fmt_name, e, n, k, extreme="low"):
    """(values, scales) covering the format's range, as numpy arrays. mxfp4's
    output row 0 gets the extreme e8m0 codes: 2-4 (``extreme="low"``) or
    250-254 with magnitudes <= 0.5 (``"high"``: the caller scales lhs down
    so that the f32 sums stay finite)."""
    fmt = quant_formats.weight_format(fmt_name)
    vshape, sshape = fmt.values_shape(e, n, k), fmt.scales_shape(e, n, k)
    if fmt_name == "int8":
        values = rng.integers(-127, 128, size=vshape).astype(np.int8)
        values[..., 0] = 127
        values[..., -1] = -127
        scales = (10.0 ** rng.uniform(-4, 1, size=sshape)).astype(np.float32)
    elif fmt_name == "fp8":
        bits = rng.integers(0, 256, size=vshape).astype(np.uint8)
        bits[(bits & 0x7F) == 0x7F] = 0x7E  # no NaN: +-448, the largest finite
        bits[:, 0, :16] = np.arange(16, dtype=np.uint8) | (0x80 * (np.arange(16) % 2)).astype(np.uint8)  # subnormals
        values = bits.view(ml_dtypes.float8_e4m3fn)
        scales = (2.0 ** rng.uniform(-20, 4, size=sshape)).astype(np.float32)
    else:
        values = rng.integers(0, 256, size=vshape).astype(np.uint8)
        scales = rng.integers(117, 138, size=sshape).astype(np.uint8)
        if extreme == "low":
            # 2 is the smallest code whose every product is a normal float32
            # (0.5 * 2**-125); below it the TPU flushes (quantized.py).
            scales[:, 0, :] = rng.integers(2, 5, size=scales[:, 0, :].shape)
        else:
            scales[:, 0, :] = rng.integers(250, 255, size=scales[:, 0, :].shape)
            nibbles = rng.integers(0, 2, size=(2, *values[:, 0, :].shape)) | (8 * rng.integers(0, 2, size=(2, *values[:, 0, :].shape)))
            values[:, 0, :] = (nibbles[0] | (nibbles[1] << 4)).astype(np.uint8)
    return values, scales


def run_gmm(lhs, values, scales, sizes, fmt_name, dtype, **kw):
    return pallas_gmm.gmm(jnp.asarray(lhs, dtype), jnp.asarray(values), jnp.asarray(sizes),
                          rhs_scales=jnp.asarray(scales), weight_format=fmt_name,
                          interpret=pallas_helpers.interpret_params(), **kw)


def assert_matches(got, lhs, w, sizes, dtype, group_offset=0, what=""):
    want = reference.ragged_dot(lhs, w, sizes, "nk", group_offset)
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), dtype=np.float64)
    assert not np.isnan(got).any(), f"{what}: NaN (unwritten or unmasked) elements, seed={SEED}"
    # Per output column: its weights' magnitude times sqrt(K) (row scales of
    # mxfp4 span 2**-126 .. 2**127, one global scale would hide the small ones).
    col_scale = np.abs(w).max(axis=(0, 2)) * np.abs(lhs).max() * np.sqrt(lhs.shape[1])
    col_scale = np.where(col_scale > 0, col_scale, 1.0)
    err = np.abs(got - want) / col_scale
    assert err.max() <= TOL[dtype], f"{what}: max scaled error {err.max():.3g}, seed={SEED}"
    return err.max()


def inputs(rng, fmt_name, m, k, n, num_groups, kind, dtype, num_local=None, extreme="low"):
    num_local = num_groups if num_local is None else num_local
    sizes = reference.random_group_sizes(rng, num_groups, m, kind).astype(np.int32)
    lhs = rng.standard_normal((m, k)) * (2.0 ** -8 if extreme == "high" else 1.0)
    lhs = np.asarray(jnp.asarray(lhs, dtype).astype(jnp.float32), np.float64)
    values, scales = random_weights(rng, fmt_name, num_local, n, k, extreme)
    return lhs, values, scales, sizes


# (m, k, n, groups, kind, tiling, extreme): whole-K rule tiles, unaligned
# dims, split K and N (tails past K and N).
CASES = {
    "int8": [(37, 200, 136, 4, "with_zeros", None, "low"), (64, 384, 320, 3, "random", (16, 256, 256), "low")],
    "fp8": [(37, 200, 136, 4, "with_zeros", None, "low"), (64, 384, 320, 3, "random", (16, 256, 256), "low")],
    "mxfp4": [(37, 224, 136, 4, "with_zeros", None, "low"), (40, 160, 136, 3, "random", None, "high"),
              (24, 8192 + 64, 130, 2, "random", (16, 4096, 128), "low")],
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_matches_float64_dequantized(fmt_name, dtype):
    rng = np.random.default_rng(SEED)
    for m, k, n, g, kind, t, extreme in CASES[fmt_name]:
        lhs, values, scales, sizes = inputs(rng, fmt_name, m, k, n, g, kind, dtype, extreme=extreme)
        got = run_gmm(lhs, values, scales, sizes, fmt_name, dtype, tiling=t)
        w = reference.dequantize_weights(values, scales, fmt_name)
        assert_matches(got, lhs, w, sizes, dtype, what=f"{fmt_name} {(m, k, n, g, kind, t)}")
