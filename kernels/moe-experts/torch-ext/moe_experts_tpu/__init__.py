"""moe-experts-tpu: Transformers mixture-of-experts layers on TPU, through Pallas kernels.

``register(name="moe_experts_tpu")`` adds ``experts_forward`` to Transformers'
``ALL_EXPERTS_FUNCTIONS`` and returns the name to pass as
``experts_implementation=``. ``ragged_dot`` is the grouped matmul underneath.
``fused_experts_forward_interpret`` runs the TPU program on CPU in Pallas
interpret mode (a correctness check, not fast).
``quantize_experts(model, "int8" | "fp8" | "mxfp4")`` quantizes a model's
experts modules in place; ``load_quantized_experts(model, checkpoint_dir)``
loads them from a pre-quantized checkpoint (gpt-oss MXFP4, FP8 block-scaled).
``expert_parallel_experts_forward(module, hidden_states, top_k_index,
top_k_weights, mesh=, axis=, tokens=)`` runs the layer as one SPMD program
with its experts split over a mesh axis (a ``jax_op`` with a mesh on TPU; JAX
CPU devices in interpret mode on CPU).

Assembled by build/hub.py (hub_manifests/moe-experts-tpu.toml): this module,
``experts/`` (this kernel's sources), ``gmm/`` (from ragged-dot) and
``common/`` (the shared toolkit).
"""

try:
    from .experts.expert_parallel_torch import expert_parallel_experts_forward
    from .experts.forward import experts_forward, fused_experts_forward_interpret
    from .experts.quantize import load_quantized_experts, quantize_experts
except ImportError as e:
    if e.name is None or not e.name.startswith(f"{__name__}."):
        raise
    raise ImportError(
        f"{__name__}: the shared sources (subpackages `gmm`, `common`) are missing: {e}. This package is "
        "assembled by build/hub.py; load a build instead, e.g. `python build/hub.py build --out dist/hub`, "
        "then kernels.get_local_kernel(Path('dist/hub/moe-experts-tpu'))."
    ) from None

from ._ops import NAMESPACE
from .experts.registration import DEFAULT_NAME, register
from .gmm.ops import ragged_dot

__all__ = [
    "DEFAULT_NAME", "NAMESPACE", "expert_parallel_experts_forward", "experts_forward",
    "fused_experts_forward_interpret", "load_quantized_experts", "quantize_experts", "ragged_dot", "register",
]
