"""In-kernel pieces every Pallas TPU kernel here is built from: the
f32-accumulating dot, row masks, tail zeroing, float16 operands carried as
their bits, Mosaic compiler parameters and the poisoning interpreter. Imports jax: import it only on a Pallas path
(``tile_math`` holds the pure-Python tile arithmetic).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from . import tpu_generations


def row_mask(shape, tile, tm: int, start, end):
    """True for the rows of block ``tile`` (``tm`` rows each) inside ``[start, end)``."""
    rows = tile * tm + lax.broadcasted_iota(jnp.int32, shape, 0)
    return (rows >= start) & (rows < end)


def zero_past(x, axis: int, valid):
    """Zeros the entries of ``x`` at positions ``>= valid`` along ``axis``.

    The select runs in 32 bits: Mosaic cannot broadcast a mask over packed
    16-bit rows when the block has fewer rows than a native tile (decode).
    """
    idx = lax.broadcasted_iota(jnp.int32, x.shape, axis)
    wide = x.astype(jnp.float32)
    return jnp.where(idx < valid, wide, jnp.zeros_like(wide)).astype(x.dtype)


def dot_f32(x, w, contract_x: int, contract_w: int):
    """``x . w`` over one axis each, accumulated in f32.

    f32 operands take the full-precision MXU passes; 16-bit operands are exact
    in one pass.
    """
    wide = x.dtype == jnp.float32 or w.dtype == jnp.float32
    return lax.dot_general(
        x, w, (((contract_x,), (contract_w,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=lax.Precision.HIGHEST if wide else None,
    )


# float16 operands cross into a kernel as their uint16 bits and are decoded to
# float32 there: Mosaic (libtpu 0.0.52) refuses every float16 vector load
# ("Invalid vector type for load", v4 to tpu7x, even a plain copy) but loads
# uint16. The bitcast is free in XLA: HBM and VMEM still hold 2 bytes an element.
FLOAT16_BITS = jnp.uint16


def as_kernel_operand(x):
    """``x`` as a kernel can load it: float16 as its uint16 bits, anything else unchanged."""
    return lax.bitcast_convert_type(x, FLOAT16_BITS) if x.dtype == jnp.float16 else x


def kernel_dtype(dtype):
    """The dtype a kernel computes and stores an operand of ``dtype`` in: float32
    for float16 (decoded by ``load``), else ``dtype`` itself."""
    return jnp.dtype(jnp.float32) if jnp.dtype(dtype) == jnp.float16 else jnp.dtype(dtype)


def load(ref):
    """``ref[...]``, with float16 bits (``as_kernel_operand``) decoded to float32."""
    x = ref[...]
    return float16_bits_to_float32(x) if x.dtype == FLOAT16_BITS else x


def float16_bits_to_float32(bits):
    """The float32 value of IEEE float16 bit patterns, exactly, from integer ops
    the VPU has: normal numbers re-biased (exponent + 112, mantissa moved up 13
    bits), subnormals as ``mantissa * 2**-24`` (a normal float32: the TPU
    flushes float32 subnormals), infinities and NaNs with exponent 255."""
    h = bits.astype(jnp.int32)
    magnitude = h & 0x7FFF
    exponent = magnitude >> 10
    normal = lax.bitcast_convert_type((magnitude << 13) + (112 << 23), jnp.float32)
    subnormal = (magnitude & 0x3FF).astype(jnp.float32) * jnp.float32(2.0 ** -24)
    special = lax.bitcast_convert_type((magnitude << 13) | (0xFF << 23), jnp.float32)
    value = jnp.where(exponent == 0, subnormal, jnp.where(exponent == 0x1F, special, normal))
    return jnp.where((h & 0x8000) != 0, -value, value)


def compiler_params(generation: str | None, semantics: tuple[str, ...], *, large_vmem: bool = False):
    """Mosaic parameters: grid semantics and the generation's scoped VMEM limit
    (``large_vmem``: the limit of kernels that keep whole weight blocks resident)."""
    gen = tpu_generations.get_generation(generation)
    limit = gen.large_vmem_limit if large_vmem else gen.vmem_limit
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=limit)


def interpret_params():
    """The TPU interpreter with poisoned memory: every output element a kernel
    fails to write, and every out-of-bounds read, comes back as NaN."""
    return pltpu.InterpretParams(out_of_bounds_reads="uninitialized", uninitialized_memory="nan")


def out_struct(shape, dtype, *inputs):
    """The ``out_shape`` of a ``pallas_call``: varying over every manual mesh axis
    any of ``inputs`` varies over. ``jax.shard_map`` with its default
    ``check_vma=True`` refuses an out_shape without that information; outside a
    shard_map the set is empty and changes nothing."""
    mats = [jax.typeof(x).mat for x in inputs]
    varying = frozenset().union(*(m.varying for m in mats))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mats[0].update(varying=varying))
