"""attention-tpu: flash attention for PyTorch on TPU, written in Pallas, with a CPU path.

``attention(q, k, v, ...)`` runs the Mosaic kernel on ``tpu`` tensors and a
torch-native path on CPU (``impl="interpret"``: the Pallas kernel in
interpret mode). ``register()`` makes it a Transformers attention
implementation; ``attn_implementation="<org>/attention-tpu"`` works too
(``flash_attn_forward`` and ``supports_flash_attn`` are what Transformers
looks for).

Assembled by build/hub.py (hub_manifests/attention-tpu.toml): this module,
``attention/`` and ``common/`` (the shared toolkit).
"""

from ._ops import NAMESPACE
from .attention.ops import TPU_OPS, attention
from .attention.paged import register_continuous_batching
from .attention.transformers_api import (DEFAULT_NAME, attention_forward, attention_forward_interpret,
                                         flash_attn_forward, register, supports_flash_attn)

__all__ = ["DEFAULT_NAME", "NAMESPACE", "TPU_OPS", "attention", "attention_forward", "attention_forward_interpret",
           "flash_attn_forward", "register", "register_continuous_batching", "supports_flash_attn"]
