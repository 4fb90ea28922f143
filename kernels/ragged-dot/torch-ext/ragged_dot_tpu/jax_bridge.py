"""Running the Pallas kernels from torch: imports, DLPack hand-off, caching.

jax (and on a TPU host torch_tpu) are not declared as Hub ``python-depends``
(the kernels library rejects them), so they are imported here, at first use,
with an error that says what to install.
"""

from __future__ import annotations

import functools

import torch

JAX_PIN = "jax==0.10.2 jaxlib==0.10.2"


def import_jax():
    try:
        import jax  # noqa: F401
        import jax.numpy  # noqa: F401
    except ImportError as e:  # pragma: no cover - exercised in a subprocess test
        raise ImportError(
            "ragged_dot_tpu: the Pallas kernels need the 'jax' package, which is not "
            f"installed ({e}). Install it with `pip install {JAX_PIN}` (and libtpu on a "
            "TPU host), or call ragged_dot(..., impl='native') on CPU."
        ) from e
    return jax


def pallas_module():
    import_jax()
    from . import pallas_gmm

    return pallas_gmm


TORCH_TO_JAX_DTYPE = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
}


def jax_dtype(dtype) -> str:
    """JAX dtype name of a torch dtype (or of what jax_op turned it into)."""
    if isinstance(dtype, torch.dtype):
        return TORCH_TO_JAX_DTYPE[dtype]
    import numpy as np

    return np.dtype(dtype).name


def to_jax(t: torch.Tensor):
    """Zero-copy view of a CPU tensor as a jax.Array."""
    jax = import_jax()
    return jax.dlpack.from_dlpack(t.detach().contiguous())


def to_torch(a) -> torch.Tensor:
    return torch.from_dlpack(a)


def tiling_arg(tm: int, tk: int, tn: int):
    """``0, 0, 0`` in an op schema means: choose by the documented rule."""
    if tm == 0 and tk == 0 and tn == 0:
        return None
    if 0 in (tm, tk, tn):
        raise ValueError(f"tiling: give all of (tm, tk, tn) or none, got {(tm, tk, tn)}")
    return (tm, tk, tn)


def interpret_params():
    """TPU interpreter with poisoned memory: every output element the kernel
    fails to write, and every out-of-bounds read, comes back as NaN."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(out_of_bounds_reads="uninitialized", uninitialized_memory="nan")


@functools.lru_cache(maxsize=None)
def jitted_gmm(rhs_layout: str, group_offset: int, out_dtype: str, tiling, generation, interpret):
    jax = import_jax()
    kernels = pallas_module()
    return jax.jit(
        functools.partial(
            kernels.gmm, rhs_layout=rhs_layout, group_offset=group_offset,
            out_dtype=out_dtype, tiling=tiling, generation=generation,
            interpret=interpret_params() if interpret else False,
        )
    )


@functools.lru_cache(maxsize=None)
def jitted_tgmm(num_local_groups: int, rhs_layout: str, group_offset: int, out_dtype: str,
                tiling, generation, interpret):
    jax = import_jax()
    kernels = pallas_module()
    return jax.jit(
        functools.partial(
            kernels.tgmm, num_local_groups=num_local_groups, rhs_layout=rhs_layout,
            group_offset=group_offset, out_dtype=out_dtype, tiling=tiling,
            generation=generation, interpret=interpret_params() if interpret else False,
        )
    )
