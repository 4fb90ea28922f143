"""Transformers' attention interface: ``attention_forward``, ``register()``, and
the two names the Hub string route looks for.

``attention_forward(module, query [B, Hq, Sq, D], key [B, Hkv, Skv, D], value,
attention_mask, dropout=..., scaling=..., **kwargs)`` returns ``(out [B, Sq,
Hq, Dv], None)``. It reads ``module.is_causal`` (default True), the sliding
window from ``sliding_window=`` or ``module.sliding_window``, soft-capping
from ``softcap=`` (Gemma-2) and sinks from ``s_aux=`` (gpt-oss).

``register(name)`` registers it in ``AttentionInterface`` and Transformers'
``sdpa_mask`` under the same name in ``AttentionMaskInterface`` (without a
mask builder, padded batches would arrive with ``attention_mask=None``).
With ``attn_implementation="<org>/attention-tpu"``, Transformers 5.22.2 loads
the kernel and registers ``flash_attn_forward`` (this function) with
``sdpa_mask`` itself, because the module has ``supports_flash_attn``.
"""

from __future__ import annotations

from ..common import transformers_interface
from . import ops, paged

DEFAULT_NAME = "attention_tpu"


def _attention_forward(impl: str):
    def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                          sliding_window=None, softcap=None, s_aux=None, is_causal=None, **kwargs):
        if dropout:
            raise NotImplementedError(f"attention_forward: dropout={dropout} is not supported (inference and "
                                      "dropout-free training only)")
        paged.check_paged_call(attention_mask, kwargs)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
        out = ops.attention(query, key, value, attention_mask=attention_mask, causal=bool(causal),
                            window=int(window or 0), softcap=float(softcap or 0.0), sinks=s_aux,
                            scale=scaling, impl=impl)
        return out.transpose(1, 2).contiguous(), None

    return transformers_interface.mark_ours(attention_forward)


attention_forward = _attention_forward("auto")
# The Pallas kernel in interpret mode on CPU (tests: the TPU code inside a model).
attention_forward_interpret = _attention_forward("interpret")

# What Transformers' Hub string route (attn_implementation="<org>/attention-tpu") looks for.
flash_attn_forward = attention_forward
supports_flash_attn = True


RESERVED = {
    "eager": "names a built-in Transformers attention implementation",
    "paged_attention": "names a built-in Transformers attention implementation",
    "flex_attention": "names a built-in Transformers attention implementation",
}
FORBIDDEN_WORDS = {
    "flash": "Transformers treats names containing 'flash' as flash attention; choose another name",
    "sdpa": "Transformers refuses 'sdpa' names for some models; choose another name",
}


def register(name: str = DEFAULT_NAME, *, override: bool = False, interpret: bool = False) -> str:
    """Register ``attention_forward`` and its mask builder as ``name``; returns the
    name for ``from_pretrained(..., attn_implementation=name)``. ``interpret=True``
    registers the Pallas kernel in interpret mode (CPU correctness checks).
    Refused (ValueError) unless ``override=True``: the rules of
    ``common.transformers_interface``."""
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
    except ImportError as e:
        raise ImportError("register() needs Transformers with AttentionInterface and AttentionMaskInterface "
                          "(checked with 5.22.2 and 5.25.0): `pip install -U transformers`") from e
    function = attention_forward_interpret if interpret else attention_forward
    transformers_interface.register_function(AttentionInterface, name, function, override=override,
                                             reserved=RESERVED, forbidden_words=FORBIDDEN_WORDS)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
