"""Transformers' continuous batching (``generate_batch``, the continuous-batching
manager) with our attention.

What Transformers 5.25 does: ``generate_batch`` runs only ``"paged|eager"``,
``"sdpa"`` or a flash implementation (any other name raises "Implementation
... is not supported for continuous batching"); the paged cache is updated in
the modeling code (``PagedAttentionCache.update``), which, for every
implementation but CUDA/XPU flash attention, gathers each scheduled request's
keys and values out of the pages. The attention function then gets all
requests packed into one row: ``query [1, Hq, total_q, D]``, ``key / value [1,
Hkv, total_k, D]`` and, for ``"paged|eager"`` and ``"sdpa"``, a float
block-diagonal causal mask ``[1, 1, total_q, total_k]`` (each query one
contiguous key range: what our kernel takes). Flash implementations get
``attention_mask=None`` with ``cu_seq_lens_q / cu_seq_lens_k`` instead, and
on their decode fast path no gathered K/V at all but ``block_table``,
``k_cache`` and ``v_cache`` (the pages).

``register_continuous_batching()`` puts our attention in the ``"paged|eager"``
slot, so the first form reaches it; ``check_paged_call`` refuses the other
two with an error naming what is missing.
"""

from __future__ import annotations

CONTINUOUS_BATCHING_NAME = "paged|eager"


def register_continuous_batching(*, interpret: bool = False) -> str:
    """Register our attention as ``"paged|eager"`` (replacing Transformers' own
    eager paged function in this process) and return that name, for
    ``model.set_attn_implementation(name)`` before ``generate_batch``."""
    from transformers import AttentionInterface

    from . import transformers_api

    function = transformers_api.attention_forward_interpret if interpret else transformers_api.attention_forward
    AttentionInterface.register(CONTINUOUS_BATCHING_NAME, function)
    return CONTINUOUS_BATCHING_NAME


def check_paged_call(attention_mask, kwargs: dict) -> None:
    """Raise unless the call carries K/V and a mask the kernel can take.

    Called by ``attention_forward`` before the kernel: a block-table call (K/V
    left in the pages) or packed requests without a mask would otherwise be
    computed as one sequence, attending across requests."""
    if kwargs.get("block_table") is not None and kwargs.get("k_cache") is not None:
        raise NotImplementedError(
            "attention_forward: continuous batching's block-table decode (block_table=, k_cache=, v_cache=: keys "
            "and values left in the paged cache) needs a paged attention kernel, which attention-tpu does not "
            "have; run generate_batch with register_continuous_batching() (keys and values gathered, with a mask)")
    cu_seq_lens_q = kwargs.get("cu_seq_lens_q")
    if attention_mask is None and cu_seq_lens_q is not None and cu_seq_lens_q.numel() > 2:
        raise NotImplementedError(
            f"attention_forward: {cu_seq_lens_q.numel() - 1} requests packed in one row (cu_seq_lens_q=) with "
            "attention_mask=None: the kernel needs the block-diagonal mask that separates them; run generate_batch "
            "with register_continuous_batching(), whose 'paged|eager' slot gets that mask")
