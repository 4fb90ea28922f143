"""The attention op: its backends declared once, its routes, the public ``attention``.

Routes (``DISPATCH``, the rule of ``common.dispatch``):

* CPU, ``impl="native"`` (default): ``cpu_native.attention``, plain torch ops
  on the dense mask (any mask), differentiable and ``torch.compile``-able;
* CPU, ``impl="interpret"``: the Pallas kernel in interpret mode, through the
  host custom op with its fake kernel (correctness checks of the TPU code);
* TPU (``"pallas"``): the Pallas kernel through ``torch_tpu``'s ``jax_op``
  (one compile per static shape).

``FLASH_ATTENTION_OP`` declares both Pallas ops' backends and the backward
(the dq, dk, dv and sinks' gradient kernels, from the forward's log-sum-exp).
The Pallas routes take the mask as one key range per query (``masks``): the
mask's own ranges, or the causal / window rule's without a mask; on the host
the ranges are checked to reproduce the given mask.
"""

from __future__ import annotations

import torch

from ..common import dispatch, jax_bridge, torch_ops
from ..common.torch_ops import OpDecl
from . import blocks, cpu_native, masks, validation

FUNCTION = "attention"

_STATIC = (("causal", "int"), ("window", "int"), ("softcap", "float"), ("scale", "float"),
           ("block_q", "int"), ("block_k", "int"), ("kv_splits", "int"))
# Forward: (out [B, Hq, Sq, Dv], lse [B, Hkv, G * Sq, 1]); lse is what the backward needs.
FLASH_ATTENTION = OpDecl("flash_attention", (
    ("q", "Tensor"), ("k", "Tensor"), ("v", "Tensor"), ("key_bounds", "Tensor"), ("sinks", "Tensor?"), *_STATIC,
), returns=2)
# Backward: (dq, dk, dv, d_sinks [Hq]).
FLASH_ATTENTION_BWD = OpDecl("flash_attention_bwd", (
    ("q", "Tensor"), ("k", "Tensor"), ("v", "Tensor"), ("out", "Tensor"), ("lse", "Tensor"), ("dout", "Tensor"),
    ("key_bounds", "Tensor"), ("sinks", "Tensor?"), *_STATIC,
), returns=4)
STATIC_NAMES = tuple(name for name, _ in _STATIC)


def _kernel_kwargs(causal, window, softcap, scale, block_q, block_k, kv_splits, backward=False):
    """Kernel keywords from the op's statics (0: the rule decides); the backward
    has no KV splits (it walks KV blocks in parallel already)."""
    kwargs = dict(causal=bool(causal), window=window, softcap=softcap, scale=scale,
                  block_sizes=None if (block_q, block_k) == (0, 0) else (block_q, block_k))
    return kwargs if backward else dict(kwargs, kv_splits=kv_splits or None)


def _run_interpreted(kernel, tensors, static):
    backward = kernel == "flash_attention_backward"
    module = "flash_backward" if backward else "flash_forward"
    return jax_bridge.run_interpreted(FUNCTION, (f"{__package__}.{module}", kernel), tensors,
                                      _kernel_kwargs(**static, backward=backward),
                                      cpu_alternative="call attention(..., impl='native') on CPU")


def _host_flash(q, k, v, key_bounds, sinks, **static):
    return _run_interpreted("flash_attention_with_lse", (q, k, v, key_bounds, sinks), static)


def _fake_flash(q, k, v, key_bounds, sinks, **static):
    rows = q.shape[1] * q.shape[2] // k.shape[1]
    return (q.new_empty((*q.shape[:3], v.shape[-1])),
            q.new_empty((q.shape[0], k.shape[1], rows, 1), dtype=torch.float32))


def _host_flash_bwd(q, k, v, out, lse, dout, key_bounds, sinks, **static):
    return _run_interpreted("flash_attention_backward", (q, k, v, out, lse, dout, key_bounds, sinks), static)


def _fake_flash_bwd(q, k, v, out, lse, dout, key_bounds, sinks, **static):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty((q.shape[1],), dtype=torch.float32))


def _tpu_flash(q, k, v, key_bounds, sinks, generation, **static):
    from . import flash_forward

    return flash_forward.flash_attention_with_lse(q, k, v, key_bounds, sinks, generation=generation,
                                                  **_kernel_kwargs(**static))


def _tpu_flash_bwd(q, k, v, out, lse, dout, key_bounds, sinks, generation, **static):
    from . import flash_backward

    return flash_backward.flash_attention_backward(q, k, v, out, lse, dout, key_bounds, sinks,
                                                   generation=generation, **_kernel_kwargs(**static, backward=True))


def _register_autograd(forward_op, forward_decl: OpDecl, backward_op, backward_decl: OpDecl):
    def setup_context(ctx, inputs, output):
        params = forward_decl.bind(inputs)
        ctx.save_for_backward(params["q"], params["k"], params["v"], params["key_bounds"], params["sinks"], *output)
        ctx.static = {name: params[name] for name in STATIC_NAMES}

    def backward(ctx, dout, dlse):
        q, k, v, key_bounds, sinks, out, lse = ctx.saved_tensors
        dq, dk, dv, d_sinks = backward_op(*backward_decl.args(dict(
            q=q, k=k, v=v, out=out, lse=lse, dout=dout.contiguous(), key_bounds=key_bounds, sinks=sinks,
            **ctx.static)))
        return forward_decl.grads(q=dq, k=dk, v=dv, sinks=d_sinks if sinks is not None else None)

    forward_op.register_autograd(backward, setup_context=setup_context)


FLASH_ATTENTION_OP = torch_ops.DeclaredOp(torch_ops.OpBackends(
    FLASH_ATTENTION, host=_host_flash, fake=_fake_flash, tpu=_tpu_flash,
    backward=torch_ops.OpBackends(FLASH_ATTENTION_BWD, host=_host_flash_bwd, fake=_fake_flash_bwd,
                                  tpu=_tpu_flash_bwd),
    autograd=_register_autograd,
    double_backward_message="attention: double backward (a gradient of the attention gradient) is not supported"))
TPU_OPS = FLASH_ATTENTION_OP.registry


def attention(query, key, value, *, attention_mask=None, causal: bool = True, window: int = 0,
              softcap: float = 0.0, sinks=None, scale: float | None = None, block_sizes=None,
              kv_splits: int | None = None, impl: str = "auto") -> torch.Tensor:
    """Scaled dot-product attention with GQA: ``[B, Hq, Sq, D] x [B, Hkv, Skv, D]
    x [B, Hkv, Skv, Dv] -> [B, Hq, Sq, Dv]``.

    Which keys a query sees: ``attention_mask`` (bool ``[B, 1 or Hq, Sq, Skv]``,
    True = attend; or additive float) when given, else the rule: every key,
    restricted by ``causal`` (queries aligned to the end of the keys) and a
    sliding ``window`` (keys ``> position - window``). With a mask, ``causal``
    and ``window`` only choose the Pallas blocks. The Pallas paths need each
    query's visible keys to be one contiguous range, the same for every head
    (causal, windows, padding on either side, a static cache, packed
    sequences); other masks raise there and run on the native path.
    ``scale`` defaults to ``D ** -0.5`` and is applied before ``softcap``
    (``cap * tanh(s / cap)``); ``sinks [Hq]`` join each softmax's denominator.
    ``block_sizes=(block_q, block_k)`` and ``kv_splits`` (parts the keys are
    split into, partial softmaxes merged) replace the rules of ``blocks.py``.
    """
    scale = query.shape[-1] ** -0.5 if scale is None and isinstance(query, torch.Tensor) else scale
    softcap = softcap or 0.0
    validation.check_attention_args(query, key, value, attention_mask, sinks, window=window, softcap=softcap,
                                    scale=scale)
    if kv_splits is not None:
        blocks.check_kv_splits(kv_splits)
    mask = None if attention_mask is None else masks.as_bool_mask(attention_mask)
    device = query.device.type
    # A float mask's biases: refused on the host, poisoned rows where that needs a sync.
    biased = None
    if mask is not None and attention_mask.dtype != torch.bool:
        if device == "cpu" and not torch.compiler.is_compiling():
            masks.check_no_bias(attention_mask)
        else:
            biased = masks.float_mask_bias_rows(attention_mask)
    call = dispatch.Call.of(query.device, impl, (query, key, value, sinks))
    return DISPATCH(call, query, key, value, mask, biased, causal=causal, window=window, softcap=float(softcap),
                    sinks=sinks, scale=float(scale), block_sizes=block_sizes, kv_splits=kv_splits)


def _native(query, key, value, mask, biased, *, causal, window, softcap, sinks, scale, block_sizes, kv_splits):
    """Plain torch ops on the dense mask (any mask), differentiable and compilable."""
    if mask is None:
        b, skv = query.shape[0], key.shape[2]
        full = torch.full((b,), skv, dtype=torch.int32)
        mask = masks.rule_mask(torch.zeros_like(full), full, query.shape[2], skv, causal=causal, window=window)
    out = cpu_native.attention(query, key, value, mask, softcap=softcap, sinks=sinks, scale=scale)
    return out if biased is None else masks.poison_rows(out, biased)


def _pallas(query, key, value, mask, biased, *, causal, window, softcap, sinks, scale, block_sizes, kv_splits):
    """The flash attention op of the tensors' device (TPU, or CPU in interpret
    mode) on one key range per query."""
    device = query.device.type
    b, hq, sq, _ = query.shape
    skv = key.shape[2]
    if mask is None:
        full = torch.full((b,), skv, dtype=torch.int32, device=query.device)
        bounds = masks.rule_key_bounds(torch.zeros_like(full), full, sq, skv, causal=causal, window=window)
    else:
        bounds = masks.key_bounds(mask)
        if device == "cpu":
            masks.check_expressible(mask, bounds)
    block_q, block_k = (0, 0) if block_sizes is None else blocks.BlockSizes.of(block_sizes).check_fits(
        (hq // key.shape[1]) * sq, skv)
    params = dict(q=query, k=key, v=value, key_bounds=bounds, sinks=None if sinks is None else sinks.float(),
                  causal=int(bool(causal)), window=window, softcap=softcap, scale=scale, block_q=block_q,
                  block_k=block_k, kv_splits=kv_splits or 0)
    out = FLASH_ATTENTION_OP.call(device, params)[0]
    if device == "tpu" and mask is not None:
        # No host sync on a TPU: rows the ranges cannot reproduce become NaN.
        return masks.poison_where_not_expressible(out, mask, bounds, biased)
    return out if biased is None else masks.poison_rows(out, biased)


DISPATCH = dispatch.Dispatcher(FUNCTION, (
    dispatch.Route("pallas", "tpu", "pallas", _pallas),
    dispatch.Route("native", "cpu", "native", _native),
    dispatch.Route("interpret", "cpu", "interpret", _pallas),
), defaults={"tpu": "pallas", "cpu": "native"})
