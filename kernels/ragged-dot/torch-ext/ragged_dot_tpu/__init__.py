"""ragged-dot-tpu: a Pallas grouped matmul (ragged dot) for TPUs, usable from torch.

``ragged_dot(lhs, rhs, group_sizes)`` runs the Mosaic kernel on ``tpu``
tensors and a torch-native path (or the Pallas kernel in interpret mode) on
CPU. ``experts_forward`` is the Transformers experts implementation built on
it (the moe-experts component, also shipped as moe-experts-tpu). jax is
imported only when a Pallas path runs.

Assembled by build/hub.py (hub_manifests/ragged-dot-tpu.toml): this module,
``gmm/`` (the grouped matmul), ``experts/`` (the experts layer) and
``common/`` (the shared toolkit).
"""

from ._ops import NAMESPACE
from .experts.forward import experts_forward
from .experts.quantize import load_quantized_experts, quantize_experts
from .gmm.ops import TPU_OPS, ragged_dot
from .gmm.tiling import Tiling, choose_tiling

__all__ = ["NAMESPACE", "TPU_OPS", "Tiling", "choose_tiling", "experts_forward", "load_quantized_experts",
           "quantize_experts", "ragged_dot"]
