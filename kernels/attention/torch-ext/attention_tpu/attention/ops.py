"""The attention op: declaration, CPU native / interpret / TPU paths, the public ``attention``.

* CPU, ``impl="native"`` (default): ``cpu_native.attention``, plain torch ops
  on the dense mask (any mask), differentiable and ``torch.compile``-able;
* CPU, ``impl="interpret"``: the Pallas kernel in interpret mode, through a
  host custom op with a fake kernel (correctness checks of the TPU code);
* TPU: the Pallas kernel through ``torch_tpu``'s ``jax_op`` (one compile per
  static shape).

The Pallas paths take the mask as one key range per query (``masks``): the
mask's own ranges, or the causal / window rule's without a mask; on the host
the ranges are checked to reproduce the given mask.
Both have a backward: the Pallas backward kernels (dq, dk, dv and the sinks'
gradient), from the forward's log-sum-exp, declared as a second op.
"""

from __future__ import annotations

import functools

import torch

from ..common import jax_bridge, torch_ops
from ..common.torch_ops import OpDecl
from . import blocks, cpu_native, masks, validation

FUNCTION = "attention"
IMPLS = ("native", "interpret")

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
TPU_FLASH_ATTENTION = FLASH_ATTENTION.extended("flash_attention_tpu")
TPU_FLASH_ATTENTION_BWD = FLASH_ATTENTION_BWD.extended("flash_attention_bwd_tpu")
STATIC_NAMES = tuple(name for name, _ in _STATIC)


def _kernel_kwargs(causal, window, softcap, scale, block_q, block_k, kv_splits, backward=False):
    """Kernel keywords from the op's statics (0: the rule decides); the backward
    has no KV splits (it walks KV blocks in parallel already)."""
    kwargs = dict(causal=bool(causal), window=window, softcap=softcap, scale=scale,
                  block_sizes=None if (block_q, block_k) == (0, 0) else (block_q, block_k))
    return kwargs if backward else dict(kwargs, kv_splits=kv_splits or None)


@functools.lru_cache(maxsize=None)
def _interpreted(kernel: str, **static):
    jax = jax_bridge.import_jax(FUNCTION, "call attention(..., impl='native') on CPU")
    from ..common import pallas_helpers
    from . import pallas_flash

    return jax.jit(functools.partial(getattr(pallas_flash, kernel), interpret=pallas_helpers.interpret_params(),
                                     **static))


def _run_interpreted(kernel, tensors, static):
    j = jax_bridge.to_jax
    backward = kernel == "flash_attention_backward"
    with jax_bridge.INTERPRET_LOCK:
        outs = _interpreted(kernel, **_kernel_kwargs(**static, backward=backward))(*(j(t) for t in tensors))
        return tuple(jax_bridge.to_torch(o) for o in outs)


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


def _tpu_flash(q, k, v, key_bounds, sinks, **static):
    from ..common.tpu_generations import current_generation
    from . import pallas_flash

    return pallas_flash.flash_attention_with_lse(q, k, v, key_bounds, sinks,
                                                 generation=current_generation(), **_kernel_kwargs(**static))


def _tpu_flash_bwd(q, k, v, out, lse, dout, key_bounds, sinks, **static):
    from ..common.tpu_generations import current_generation
    from . import pallas_flash

    return pallas_flash.flash_attention_backward(q, k, v, out, lse, dout, key_bounds, sinks,
                                                 generation=current_generation(),
                                                 **_kernel_kwargs(**static, backward=True))


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
    torch_ops.refuse_double_backward(
        backward_op, "attention: double backward (a gradient of the attention gradient) is not supported")


host_flash_attention, host_flash_attention_bwd = torch_ops.register_host_pair(
    FLASH_ATTENTION, _host_flash, _fake_flash, FLASH_ATTENTION_BWD, _host_flash_bwd, _fake_flash_bwd,
    _register_autograd)

TPU_OPS = torch_ops.TpuOpRegistry(FUNCTION)
TPU_OPS.declare_with_backward(TPU_FLASH_ATTENTION, _tpu_flash, TPU_FLASH_ATTENTION_BWD, _tpu_flash_bwd,
                              _register_autograd)
if torch_ops.tpu_available():
    TPU_OPS.register_all()


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
    b, hq, sq, _ = query.shape
    skv = key.shape[2]
    mask = None if attention_mask is None else masks.as_bool_mask(attention_mask)
    device = query.device.type
    # A float mask's biases: refused on the host, poisoned rows where that needs a sync.
    biased = None
    if mask is not None and attention_mask.dtype != torch.bool:
        if device == "cpu" and not torch.compiler.is_compiling():
            masks.check_no_bias(attention_mask)
        else:
            biased = masks.float_mask_bias_rows(attention_mask)
    impl = "native" if impl == "auto" and device == "cpu" else impl
    if device == "cpu" and impl == "native":
        if mask is None:
            full = torch.full((b,), skv, dtype=torch.int32)
            mask = masks.rule_mask(torch.zeros_like(full), full, sq, skv, causal=causal, window=window)
        out = cpu_native.attention(query, key, value, mask, softcap=float(softcap), sinks=sinks, scale=float(scale))
        return out if biased is None else masks.poison_rows(out, biased)
    if device == "cpu" and impl != "interpret":
        raise ValueError(f"attention: impl must be 'auto' or one of {IMPLS} on CPU, got {impl!r}")
    if device not in ("cpu", "tpu"):
        raise ValueError(f"attention: tensors must be on a 'cpu' or 'tpu' device, got {query.device}")
    if device == "tpu" and impl != "auto":
        raise ValueError(f"attention: impl={impl!r} is a CPU implementation; use 'auto' on a TPU")
    if mask is None:
        full = torch.full((b,), skv, dtype=torch.int32, device=query.device)
        bounds = masks.rule_key_bounds(torch.zeros_like(full), full, sq, skv, causal=causal, window=window)
    else:
        bounds = masks.key_bounds(mask)
        if device == "cpu":
            masks.check_expressible(mask, bounds)
    block_q, block_k = block_sizes or (0, 0)
    if block_sizes is not None:
        blocks.check_blocks(block_q, block_k, (hq // key.shape[1]) * sq, skv)
    params = dict(q=query, k=key, v=value, key_bounds=bounds,
                  sinks=None if sinks is None else sinks.float(), causal=int(bool(causal)), window=window,
                  softcap=float(softcap), scale=float(scale), block_q=block_q, block_k=block_k,
                  kv_splits=kv_splits or 0)
    if device == "tpu":
        out = TPU_OPS.get(TPU_FLASH_ATTENTION.name)(*TPU_FLASH_ATTENTION.args(params))[0]
        if mask is None:
            return out
        return masks.poison_where_not_expressible(out, mask, bounds, biased)
    out = host_flash_attention(*FLASH_ATTENTION.args(params))[0]
    return out if biased is None else masks.poison_rows(out, biased)
