"""The attention op: declaration, CPU native / interpret / TPU paths, the public ``attention``.

* CPU, ``impl="native"`` (default): ``cpu_native.attention``, plain torch ops
  on the dense mask (any mask), differentiable and ``torch.compile``-able;
* CPU, ``impl="interpret"``: the Pallas kernel in interpret mode, through a
  host custom op with a fake kernel (correctness checks of the TPU code);
* TPU: the Pallas kernel through ``torch_tpu``'s ``jax_op`` (one compile per
  static shape).

The Pallas paths take the mask as key ranges plus the causal / window rule
(``masks``); on the host the ranges are checked to reproduce the given mask.
Their backward is not implemented yet: a gradient through them raises a clear
error (the native CPU path has gradients).
"""

from __future__ import annotations

import functools

import torch

from ..common import jax_bridge, torch_ops
from ..common.torch_ops import OpDecl
from . import blocks, cpu_native, masks, validation

FUNCTION = "attention"
IMPLS = ("native", "interpret")

FLASH_ATTENTION = OpDecl("flash_attention", (
    ("q", "Tensor"), ("k", "Tensor"), ("v", "Tensor"), ("kv_start", "Tensor"), ("kv_end", "Tensor"),
    ("sinks", "Tensor?"), ("causal", "int"), ("window", "int"), ("softcap", "float"), ("scale", "float"),
    ("block_q", "int"), ("block_k", "int"),
))
TPU_FLASH_ATTENTION = FLASH_ATTENTION.extended("flash_attention_tpu")


def _blocks(block_q: int, block_k: int):
    return None if (block_q, block_k) == (0, 0) else (block_q, block_k)


@functools.lru_cache(maxsize=None)
def _jitted(interpret: bool, generation, **static):
    jax = jax_bridge.import_jax(FUNCTION, "call attention(..., impl='native') on CPU")
    from ..common import pallas_helpers
    from . import pallas_flash

    return jax.jit(functools.partial(pallas_flash.flash_attention, generation=generation,
                                     interpret=pallas_helpers.interpret_params() if interpret else False, **static))


def _static(causal, window, softcap, scale, block_q, block_k):
    return dict(causal=bool(causal), window=window, softcap=softcap, scale=scale,
                block_sizes=_blocks(block_q, block_k))


def _host_flash(q, k, v, kv_start, kv_end, sinks, causal, window, softcap, scale, block_q, block_k):
    j = jax_bridge.to_jax
    with jax_bridge.INTERPRET_LOCK:
        fn = _jitted(True, None, **_static(causal, window, softcap, scale, block_q, block_k))
        return jax_bridge.to_torch(fn(j(q), j(k), j(v), j(kv_start), j(kv_end), j(sinks)))


def _fake_flash(q, k, v, kv_start, kv_end, sinks, causal, window, softcap, scale, block_q, block_k):
    return q.new_empty((*q.shape[:3], v.shape[-1]))


def _tpu_flash(q, k, v, kv_start, kv_end, sinks, causal, window, softcap, scale, block_q, block_k):
    from ..common.tpu_generations import current_generation
    from . import pallas_flash

    return pallas_flash.flash_attention(q, k, v, kv_start, kv_end, sinks, generation=current_generation(),
                                        **_static(causal, window, softcap, scale, block_q, block_k))


def _no_backward(op):
    def backward(ctx, grad):
        raise NotImplementedError(
            "attention: the backward of the Pallas kernel (TPU, impl='interpret') is not implemented yet; "
            "on CPU, gradients run through impl='native'")

    op.register_autograd(backward, setup_context=lambda ctx, inputs, output: None)


host_flash_attention = torch_ops.register_host_op(FLASH_ATTENTION, _host_flash, _fake_flash)
_no_backward(host_flash_attention)

TPU_OPS = torch_ops.TpuOpRegistry(FUNCTION)
TPU_OPS.declare(TPU_FLASH_ATTENTION, _tpu_flash, after=lambda ops: _no_backward(ops[TPU_FLASH_ATTENTION.name]))
if torch_ops.tpu_available():
    TPU_OPS.register_all()


def attention(query, key, value, *, attention_mask=None, causal: bool = True, window: int = 0,
              softcap: float = 0.0, sinks=None, scale: float | None = None, block_sizes=None,
              impl: str = "auto") -> torch.Tensor:
    """Scaled dot-product attention with GQA: ``[B, Hq, Sq, D] x [B, Hkv, Skv, D]
    x [B, Hkv, Skv, Dv] -> [B, Hq, Sq, Dv]``.

    Which keys a query sees: ``attention_mask`` (bool ``[B, 1 or Hq, Sq, Skv]``,
    True = attend; or additive float) when given, else the rule: every key,
    restricted by ``causal`` (queries aligned to the end of the keys) and a
    sliding ``window`` (keys ``> position - window``). The Pallas paths need the
    mask to be that rule on a key range per batch row (padding, a static
    cache); other masks raise there and run on the native path.
    ``scale`` defaults to ``D ** -0.5`` and is applied before ``softcap``
    (``cap * tanh(s / cap)``); ``sinks [Hq]`` join each softmax's denominator.
    ``block_sizes=(block_q, block_k)`` replaces the rule of ``blocks.py``.
    """
    scale = query.shape[-1] ** -0.5 if scale is None and isinstance(query, torch.Tensor) else scale
    softcap = softcap or 0.0
    validation.check_attention_args(query, key, value, attention_mask, sinks, window=window, softcap=softcap,
                                    scale=scale)
    b, hq, sq, _ = query.shape
    skv = key.shape[2]
    mask = None if attention_mask is None else masks.as_bool_mask(attention_mask)
    device = query.device.type
    impl = "native" if impl == "auto" and device == "cpu" else impl
    if device == "cpu" and impl == "native":
        if mask is None:
            full = torch.full((b,), skv, dtype=torch.int32)
            mask = masks.rule_mask(torch.zeros_like(full), full, sq, skv, causal=causal, window=window)
        return cpu_native.attention(query, key, value, mask, softcap=float(softcap), sinks=sinks, scale=float(scale))
    if device == "cpu" and impl != "interpret":
        raise ValueError(f"attention: impl must be 'auto' or one of {IMPLS} on CPU, got {impl!r}")
    if device not in ("cpu", "tpu"):
        raise ValueError(f"attention: tensors must be on a 'cpu' or 'tpu' device, got {query.device}")
    if device == "tpu" and impl != "auto":
        raise ValueError(f"attention: impl={impl!r} is a CPU implementation; use 'auto' on a TPU")
    if mask is None:
        kv_start = torch.zeros((b,), dtype=torch.int32, device=query.device)
        kv_end = torch.full((b,), skv, dtype=torch.int32, device=query.device)
    else:
        kv_start, kv_end = masks.key_ranges(mask)
        if device == "cpu":
            masks.check_expressible(mask, kv_start, kv_end, causal=causal, window=window)
    block_q, block_k = block_sizes or (0, 0)
    if block_sizes is not None:
        blocks.check_blocks(block_q, block_k, (hq // key.shape[1]) * sq, skv)
    params = dict(q=query, k=key, v=value, kv_start=kv_start, kv_end=kv_end,
                  sinks=None if sinks is None else sinks.float(), causal=int(bool(causal)), window=window,
                  softcap=float(softcap), scale=float(scale), block_q=block_q, block_k=block_k)
    if device == "tpu":
        return TPU_OPS.get(TPU_FLASH_ATTENTION.name)(*TPU_FLASH_ATTENTION.args(params))
    return host_flash_attention(*FLASH_ATTENTION.args(params))
