"""ragged-dot-tpu: a Pallas grouped matmul (ragged dot) for TPUs, usable from torch.

``ragged_dot(lhs, rhs, group_sizes)`` runs the Mosaic kernel on ``tpu``
tensors and a torch-native path (or the Pallas kernel in interpret mode) on
CPU. jax is imported only when a Pallas path runs.
"""

from ._ops import NAMESPACE
from . import experts
from .experts import experts_forward
from .ops import ragged_dot, register_tpu_ops
from .tiling import Tiling, choose_tiling

__all__ = [
    "NAMESPACE", "Tiling", "choose_tiling", "experts_forward", "ragged_dot", "register_tpu_ops",
]
