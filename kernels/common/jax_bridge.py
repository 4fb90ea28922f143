"""torch <-> JAX: importing jax lazily, and handing CPU tensors over by DLPack.

jax (and on a TPU host torch_tpu) are not declared as Hub ``python-depends``
(the kernels library rejects them), so they are imported at first use, with
an error that says what to install.
"""

from __future__ import annotations

import functools
import importlib
import threading

import torch

JAX_PIN = "jax==0.10.2 jaxlib==0.10.2"
TORCH_TPU_PIN = "torch-tpu==0.2.0"

# The Pallas TPU interpreter keeps global state (its simulated memories): two
# threads interpreting at once corrupt each other ("Revisited block").
# Every interpret-mode call holds this lock.
INTERPRET_LOCK = threading.Lock()

TORCH_TO_JAX_DTYPE = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}


def import_jax(caller: str = "this kernel", cpu_alternative: str = ""):
    """``jax``, or an ImportError naming the package to install."""
    try:
        import jax
        import jax.numpy  # noqa: F401
    except ImportError as e:  # exercised in a subprocess test
        hint = f", or {cpu_alternative}" if cpu_alternative else ""
        raise ImportError(
            f"{caller}: the Pallas kernels need the 'jax' package, which is not installed ({e}). "
            f"Install it with `pip install {JAX_PIN}` (and libtpu on a TPU host){hint}."
        ) from e
    return jax


def import_torch_tpu(caller: str = "this kernel"):
    try:
        import torch_tpu
    except ImportError as e:
        raise ImportError(
            f"{caller}: tensors on a 'tpu' device need the 'torch-tpu' package "
            f"(pip install {TORCH_TPU_PIN}), which failed to import: {e}"
        ) from e
    return torch_tpu


def jax_dtype(dtype) -> str:
    """JAX dtype name of a torch dtype (or of what jax_op turned it into)."""
    if isinstance(dtype, torch.dtype):
        return TORCH_TO_JAX_DTYPE[dtype]
    import numpy as np

    return np.dtype(dtype).name


def to_jax(t: torch.Tensor | None):
    """View of a CPU tensor as a jax.Array (no copy when it is contiguous); None stays None."""
    if t is None:
        return None
    return import_jax().dlpack.from_dlpack(t.detach().contiguous())


def to_torch(a) -> torch.Tensor:
    return torch.from_dlpack(a)


@functools.lru_cache(maxsize=None)
def _interpreted(module: str, name: str, static: tuple):
    from . import pallas_helpers

    fn = getattr(importlib.import_module(module), name)
    return import_jax().jit(functools.partial(fn, interpret=pallas_helpers.interpret_params(), **dict(static)))


def run_interpreted(caller: str, kernel: tuple[str, str], tensors, static: dict, cpu_alternative: str = ""):
    """``kernel(*tensors, **static)`` (``kernel``: a module's absolute name and
    a JAX function in it, imported after jax) jitted in Pallas interpret mode,
    with poisoned memory, on CPU tensors (None passes as None); torch outputs,
    a tuple where the kernel returns one. One jit per kernel and statics; one
    interpreter at a time (``INTERPRET_LOCK``)."""
    import_jax(caller, cpu_alternative)
    fn = _interpreted(*kernel, tuple(sorted(static.items())))
    with INTERPRET_LOCK:
        out = fn(*(to_jax(t) for t in tensors))
        return tuple(to_torch(o) for o in out) if isinstance(out, (tuple, list)) else to_torch(out)
