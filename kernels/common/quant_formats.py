"""Quantized expert-weight formats: one definition for the torch side and the kernels.

Pure Python (no torch, no jax) so both sides, the tests and the benchmarks read
the same facts. A quantized weight is a pair of arrays, ``values`` and
``scales``, always stored "nk" (``[E, N, K]``: out features, then in
features), the order of every checkpoint that ships these formats (Linear
weights are ``[out, in]``; gpt-oss's ``*_blocks`` are ``[E, out, in / 32, 16]``).
A module whose bf16 weights are "kn" is transposed once when it is quantized.
The dequantized weight is ``w[e, n, k] = value(e, n, k) * scale(e, n, k)``
where ``scale(e, n, k)`` is the scale of the block holding ``(n, k)``:

* ``int8``: values int8 ``[E, N, K]``; scales float32 ``[E, N]`` (one per
  output channel, symmetric: ``max |w| / 127``).
* ``fp8``: values float8_e4m3fn ``[E, N, K]``; scales float32
  ``[E, ceil(N / 128), ceil(K / 128)]`` (128 x 128 blocks, the multiplier
  Transformers' FineGrainedFP8 calls ``weight_scale_inv``).
* ``mxfp4``: values uint8 ``[E, N, K / 2]``, two e2m1 codes per byte along K,
  the even k in the low nibble (gpt-oss's packing); scales uint8
  ``[E, N, K / 32]``, e8m0 exponents: ``scale = 2 ** (code - 127)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tile_math import cdiv

# e2m1 code -> value (bit 3 is the sign); the table every MXFP4 reader uses.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
FP8_E4M3_MAX = 448.0
INT8_MAX = 127


@dataclass(frozen=True)
class WeightFormat:
    name: str
    values_dtype: str  # numpy / torch / jax dtype name of ``values``
    scales_dtype: str
    values_per_byte: int  # along K
    block_n: int  # rows (out features) sharing one scale; 1 = per channel
    block_k: int  # columns (in features) sharing one scale; 0 = the whole row

    def values_shape(self, e: int, n: int, k: int) -> tuple[int, int, int]:
        return (e, n, k // self.values_per_byte)

    def scales_shape(self, e: int, n: int, k: int) -> tuple[int, ...]:
        if self.block_k == 0:
            return (e, cdiv(n, self.block_n))
        return (e, cdiv(n, self.block_n), cdiv(k, self.block_k))

    def hbm_bytes(self, e: int, n: int, k: int) -> int:
        """Bytes the kernel reads for all ``e`` experts: values plus scales."""
        scale_bytes = 1 if self.scales_dtype == "uint8" else 4
        scales = 1
        for d in self.scales_shape(e, n, k):
            scales *= d
        return e * n * (k // self.values_per_byte) + scales * scale_bytes

    def check_shape(self, k: int) -> None:
        """K must split into whole packed bytes and whole scale blocks where the format needs it."""
        if self.name == "mxfp4" and k % self.block_k:
            raise ValueError(f"mxfp4 weights need in_features divisible by {self.block_k}, got {k}")


FORMATS = {
    "int8": WeightFormat("int8", "int8", "float32", 1, 1, 0),
    "fp8": WeightFormat("fp8", "float8_e4m3fn", "float32", 1, 128, 128),
    "mxfp4": WeightFormat("mxfp4", "uint8", "uint8", 2, 1, 32),
}


def weight_format(name: str) -> WeightFormat:
    """The format called ``name``, or a ValueError naming the accepted ones."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"weight format must be one of {sorted(FORMATS)}, got {name!r}") from None
