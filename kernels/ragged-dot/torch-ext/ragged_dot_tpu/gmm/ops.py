"""The ragged dot as torch ops: its backends declared once, its routes, autograd.

``RAGGED_DOT_OP`` declares every backend (``common.torch_ops.OpBackends``):

* the host op (CPU tensors), with two implementations picked by ``impl``:
  ``"native"`` (torch matmuls per group) and ``"interpret"`` (the Pallas
  kernels in interpret mode through DLPack, to check the TPU code on a CPU);
* the TPU op through ``torch_tpu``'s ``jax_op`` (registered in the package's
  ``TPU_OPS`` on first use), given the chip's generation;
* the backward: ``d_lhs = ragged_dot(d_out, rhs)`` with the other weight
  layout (the same weights read transposed, never copied) and ``d_rhs[g] =
  lhs_g^T @ d_out_g`` (the transposed grouped matmul), one formula for the
  host and the TPU pair. Double backward is refused: the weight gradient op
  has no derivative.

``ragged_dot`` checks its arguments and hands the call to ``DISPATCH``
(``common.dispatch``): Pallas on a TPU; on CPU eager inference skips the
custom op (``native_eager``), autograd and ``torch.compile`` go through it.
"""

from __future__ import annotations

import torch

from ..common import dispatch, jax_bridge, torch_ops
from ..common.torch_ops import OpDecl
from . import cpu_native, layouts, validation

FUNCTION_NAME = "ragged_dot"
HOST_IMPLS = ("native", "interpret")
# tm = tk = tn = 0 in a schema: tiles chosen by the rule of tiling.py.
RULE_TILES = {"tm": 0, "tk": 0, "tn": 0}
_TILES = (("tm", "int"), ("tk", "int"), ("tn", "int"))

RAGGED_DOT = OpDecl("ragged_dot", (
    ("lhs", "Tensor"), ("rhs", "Tensor"), ("group_sizes", "Tensor"), ("rhs_layout", "str"),
    ("group_offset", "int"), ("out_dtype", "ScalarType"), *_TILES,
))
WEIGHT_GRAD = OpDecl("ragged_dot_weight_grad", (
    ("lhs", "Tensor"), ("dout", "Tensor"), ("group_sizes", "Tensor"), ("num_local_groups", "int"),
    ("rhs_layout", "str"), ("group_offset", "int"), ("out_dtype", "ScalarType"), *_TILES,
))


def _tiling(tm: int, tk: int, tn: int):
    return None if (tm, tk, tn) == (0, 0, 0) else (tm, tk, tn)


# ----------------------------------------------------------------------------
# Host (CPU) ops: "native" (torch) or "interpret" (the Pallas kernel in interpret mode)
# ----------------------------------------------------------------------------


def _interpret(kernel: str, x, y, group_sizes, **static):
    return jax_bridge.run_interpreted(FUNCTION_NAME, (f"{__package__}.pallas_gmm", kernel),
                                      (x, y, group_sizes.to(torch.int32)), dict(static, generation=None),
                                      cpu_alternative="call ragged_dot(..., impl='native') on CPU")


def _host_ragged_dot(lhs, rhs, group_sizes, rhs_layout, group_offset, out_dtype, tm, tk, tn, impl):
    validation.check_group_size_values(group_sizes, lhs.shape[0])
    if impl == "interpret":
        return _interpret("gmm", lhs, rhs, group_sizes, rhs_layout=rhs_layout, group_offset=group_offset,
                          out_dtype=jax_bridge.jax_dtype(out_dtype), tiling=_tiling(tm, tk, tn))
    return cpu_native.ragged_dot(lhs, rhs, group_sizes, rhs_layout, group_offset, out_dtype)


def _fake_ragged_dot(lhs, rhs, group_sizes, rhs_layout, group_offset, out_dtype, tm, tk, tn, impl):
    return lhs.new_empty((lhs.shape[0], layouts.out_features(rhs.shape, rhs_layout)), dtype=out_dtype)


def _host_weight_grad(lhs, dout, group_sizes, num_local_groups, rhs_layout, group_offset, out_dtype,
                      tm, tk, tn, impl):
    validation.check_group_size_values(group_sizes, lhs.shape[0])
    if impl == "interpret":
        return _interpret("tgmm", lhs, dout, group_sizes, num_local_groups=num_local_groups,
                          rhs_layout=rhs_layout, group_offset=group_offset,
                          out_dtype=jax_bridge.jax_dtype(out_dtype), tiling=_tiling(tm, tk, tn))
    return cpu_native.ragged_dot_weight_grad(lhs, dout, group_sizes, num_local_groups, rhs_layout,
                                             group_offset, out_dtype)


def _fake_weight_grad(lhs, dout, group_sizes, num_local_groups, rhs_layout, group_offset, out_dtype,
                      tm, tk, tn, impl):
    return lhs.new_empty(layouts.weight_shape(num_local_groups, lhs.shape[1], dout.shape[1], rhs_layout),
                         dtype=out_dtype)


# ----------------------------------------------------------------------------
# TPU programs (torch_tpu's jax_op; generation: the chip traced for)
# ----------------------------------------------------------------------------


def _tpu_ragged_dot(lhs, rhs, group_sizes, rhs_layout, group_offset, out_dtype, tm, tk, tn, generation):
    from . import pallas_gmm

    return pallas_gmm.gmm(lhs, rhs, group_sizes.astype("int32"), rhs_layout=rhs_layout,
                          group_offset=group_offset, out_dtype=jax_bridge.jax_dtype(out_dtype),
                          tiling=_tiling(tm, tk, tn), generation=generation)


def _tpu_weight_grad(lhs, dout, group_sizes, num_local_groups, rhs_layout, group_offset, out_dtype, tm, tk, tn,
                     generation):
    from . import pallas_gmm

    return pallas_gmm.tgmm(lhs, dout, group_sizes.astype("int32"), num_local_groups=num_local_groups,
                           rhs_layout=rhs_layout, group_offset=group_offset,
                           out_dtype=jax_bridge.jax_dtype(out_dtype), tiling=_tiling(tm, tk, tn),
                           generation=generation)


# ----------------------------------------------------------------------------
# Autograd (one formula for the host and the TPU ops)
# ----------------------------------------------------------------------------


def _register_autograd(forward_op, forward_decl: OpDecl, weight_grad_op, weight_grad_decl: OpDecl):
    # Parameters a family adds to the shared ones (the host's ``impl``) pass
    # through to the backward ops unchanged.
    family = [p for p in forward_decl.names if p not in RAGGED_DOT.names]

    def setup_context(ctx, inputs, output):
        params = forward_decl.bind(inputs)
        ctx.save_for_backward(params["lhs"], params["rhs"], params["group_sizes"])
        ctx.rhs_layout, ctx.group_offset = params["rhs_layout"], params["group_offset"]
        ctx.family = {p: params[p] for p in family}

    def backward(ctx, dout):
        lhs, rhs, group_sizes = ctx.saved_tensors
        dout = dout.to(rhs.dtype)
        d_lhs = d_rhs = None
        if ctx.needs_input_grad[0]:
            d_lhs = forward_op(*forward_decl.args(dict(
                lhs=dout, rhs=rhs, group_sizes=group_sizes, rhs_layout=layouts.OTHER_LAYOUT[ctx.rhs_layout],
                group_offset=ctx.group_offset, out_dtype=lhs.dtype, **RULE_TILES, **ctx.family)))
        if ctx.needs_input_grad[1]:
            d_rhs = weight_grad_op(*weight_grad_decl.args(dict(
                lhs=lhs, dout=dout, group_sizes=group_sizes, num_local_groups=rhs.shape[0],
                rhs_layout=ctx.rhs_layout, group_offset=ctx.group_offset, out_dtype=rhs.dtype,
                **RULE_TILES, **ctx.family)))
        return forward_decl.grads(lhs=d_lhs, rhs=d_rhs)

    forward_op.register_autograd(backward, setup_context=setup_context)


RAGGED_DOT_OP = torch_ops.DeclaredOp(torch_ops.OpBackends(
    RAGGED_DOT, host=_host_ragged_dot, fake=_fake_ragged_dot, host_impls=HOST_IMPLS, tpu=_tpu_ragged_dot,
    backward=torch_ops.OpBackends(WEIGHT_GRAD, host=_host_weight_grad, fake=_fake_weight_grad,
                                  host_impls=HOST_IMPLS, tpu=_tpu_weight_grad),
    autograd=_register_autograd,
    double_backward_message="ragged_dot: double backward (a gradient of the weight gradient) is not supported"))
TPU_OPS = RAGGED_DOT_OP.registry
host_ragged_dot = RAGGED_DOT_OP.host_op


# ----------------------------------------------------------------------------
# Routes and the public entry point
# ----------------------------------------------------------------------------


def _run_native_eager(params):
    # Eager inference: skip the custom-op dispatch (~0.3 ms per call,
    # measured at decode sizes, 8% of a gate_up projection).
    validation.check_group_size_values(params["group_sizes"], params["lhs"].shape[0])
    return cpu_native.ragged_dot(params["lhs"], params["rhs"], params["group_sizes"], params["rhs_layout"],
                                 params["group_offset"], params["out_dtype"])


def _run_tpu(params):
    # No value checks on TPU (they would need a host sync).
    return RAGGED_DOT_OP.call("tpu", {**params, "group_sizes": params["group_sizes"].to(torch.int32)})


DISPATCH = dispatch.Dispatcher(FUNCTION_NAME, (
    dispatch.Route("pallas", "tpu", "pallas", _run_tpu),
    dispatch.Route("native_eager", "cpu", "native", _run_native_eager, when=dispatch.EAGER),
    dispatch.Route("native_op", "cpu", "native", lambda params: RAGGED_DOT_OP.call("cpu", params, "native")),
    dispatch.Route("interpret_op", "cpu", "interpret", lambda params: RAGGED_DOT_OP.call("cpu", params, "interpret")),
), defaults={"tpu": "pallas", "cpu": "native"})


def ragged_dot(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    group_sizes: torch.Tensor,
    *,
    rhs_layout: str = "nk",
    group_offset: int | None = None,
    out_dtype: torch.dtype | None = None,
    tiling: tuple[int, int, int] | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Grouped matmul: rows of group ``g`` of ``lhs`` times expert ``g`` of ``rhs``.

    Args:
      lhs: ``[M, K]``, rows sorted by group.
      rhs: ``[G, N, K]`` (``rhs_layout="nk"``, Transformers' ``[E, out, in]``)
        or ``[G, K, N]`` (``"kn"``); float32 or bfloat16, same dtype as lhs.
        Any strides (views, expanded or permuted tensors) are accepted.
      group_sizes: ``[G_total]`` int32 or int64 rows per group, ``sum <= M``.
      group_offset: ``None`` if ``rhs`` holds every group; else the first
        group ``rhs`` holds (expert parallelism: rows of other groups are 0).
      out_dtype: output dtype (default ``lhs.dtype``); accumulation is f32 and
        the result is rounded once.
      tiling: ``(tm, tk, tn)`` replacing the tile rule of ``tiling.py`` (all
        three or none), checked for TPU legality on every path.
      impl: ``"auto"`` (Pallas on TPU, native on CPU), ``"pallas"`` on TPU,
        or on CPU ``"native"`` or ``"interpret"`` (the Pallas kernels in
        interpret mode: a correctness check, not fast). Which route runs is
        ``common.dispatch``'s rule.

    Returns ``[M, N]``; rows past ``sum(group_sizes)`` are zero.
    """
    validation.check_ragged_dot_args(lhs, rhs, group_sizes, rhs_layout, group_offset, out_dtype)
    t = validation.check_tiling(tiling, lhs.shape[0], lhs.shape[1], layouts.out_features(rhs.shape, rhs_layout))
    tiles = dict(zip(("tm", "tk", "tn"), t.as_tuple())) if t is not None else RULE_TILES
    # group_sizes keep their dtype on CPU: the host ops check the values in
    # it (an int64 size of 2**32 + 3 must not be read as 3 after a cast).
    params = dict(lhs=lhs, rhs=rhs, group_sizes=group_sizes, rhs_layout=rhs_layout, group_offset=group_offset or 0,
                  out_dtype=out_dtype or lhs.dtype, **tiles)
    return DISPATCH(dispatch.Call.of(lhs.device, impl, (lhs, rhs)), params)
