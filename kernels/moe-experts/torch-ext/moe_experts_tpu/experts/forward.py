"""``experts_forward``: the Transformers experts implementation, and its routes.

``experts_forward(module, hidden_states [T, H], top_k_index [T, K],
top_k_weights [T, K])`` follows the contract of Transformers'
``@use_experts_implementation`` (``module_layout`` reads the layout flags).
Four implementations of the same math, routed by ``DISPATCH`` (the rule of
``common.dispatch``; ``choose_path`` names the route a call takes):

* ``"tpu_program"``: TPU inference, the whole layer as one ``jax_op``
  (``program.experts_forward``: routing, fused or two grouped matmuls, gate,
  weighting, combine), static shapes, one compile per token count;
* ``"cpu_chunked"``: CPU eager inference (``cpu_path.cpu_inference_forward``);
* ``"composed"``: gradients, ``torch.compile``, and TPU layers the program
  cannot express: the module's own code between ``ragged_dot`` ops (autograd,
  fake kernels), with a one-time warning naming what the program refused;
* ``"interpret_program"`` (``fused_experts_forward_interpret``): the TPU
  program on CPU in Pallas interpret mode.

A module quantized by ``quantize.py`` (int8, fp8, mxfp4 values and scales)
takes the same routes: the program gets the values, scales and format; the
CPU chunks and the composed path dequantize in torch (the chunks only their
own experts); values or scales that require a gradient are refused.
"""

from __future__ import annotations

import torch

from ..common import dispatch, jax_bridge, torch_ops, transformers_interface
from ..common.torch_ops import OpDecl
from ..gmm.ops import ragged_dot
from . import cpu_path, module_layout, quantize, routing, validation

FUNCTION = "experts_forward"
# The routed tokens, then module_layout.ProgramArgs by name.
EXPERTS_PROGRAM = OpDecl(FUNCTION, (
    ("hidden_states", "Tensor"), ("top_k_index", "Tensor"), ("top_k_weights", "Tensor"),
    ("up_weight", "Tensor"), ("down_weight", "Tensor"), ("up_bias", "Tensor?"), ("down_bias", "Tensor?"),
    ("up_scales", "Tensor?"), ("down_scales", "Tensor?"),
    ("gate", "str"), ("alpha", "float"), ("limit", "float"), ("rhs_layout", "str"),
    # "" for float weights, else a common.quant_formats name (then up/down_weight are the values).
    ("weight_format", "str"),
))


def program_call(hidden_states, top_k_index, top_k_weights, up_weight, down_weight, up_bias=None, down_bias=None,
                 up_scales=None, down_scales=None, *, weight_format="", **static):
    """``program.experts_forward`` with the op's parameters (JAX arrays): the
    scales and format passed only for quantized weights, so a float layer is
    the same call as before quantization existed."""
    from . import program

    quantized = dict(up_scales=up_scales, down_scales=down_scales, weight_format=weight_format) if weight_format else {}
    return program.experts_forward(hidden_states, top_k_index, top_k_weights, up_weight, down_weight,
                                   up_bias, down_bias, **quantized, **static)


def _tpu_program(hidden_states, top_k_index, top_k_weights, up_weight, down_weight, up_bias, down_bias,
                 up_scales, down_scales, gate, alpha, limit, rhs_layout, weight_format, generation):
    return program_call(hidden_states, top_k_index, top_k_weights, up_weight, down_weight, up_bias, down_bias,
                        up_scales, down_scales, weight_format=weight_format,
                        gate=gate, alpha=alpha, limit=limit, rhs_layout=rhs_layout, generation=generation)


# A TPU op only: on CPU the program runs in interpret mode without an op (no autograd, no fake needed).
EXPERTS_PROGRAM_OP = torch_ops.DeclaredOp(torch_ops.OpBackends(EXPERTS_PROGRAM, tpu=_tpu_program))
TPU_OPS = EXPERTS_PROGRAM_OP.registry


def program_params(args: module_layout.ProgramArgs, hidden_states, top_k_index, top_k_weights) -> dict:
    """``{parameter of EXPERTS_PROGRAM: value}``: the routed tokens and the module's ``args``."""
    return dict(hidden_states=hidden_states, top_k_index=top_k_index,
                top_k_weights=top_k_weights.to(hidden_states.dtype), **args._asdict())


def _run_tpu_program(module, hidden_states, top_k_index, top_k_weights, *, accepted):
    return EXPERTS_PROGRAM_OP.call("tpu", program_params(accepted, hidden_states, top_k_index, top_k_weights))


def _run_interpret_program(module, hidden_states, top_k_index, top_k_weights, *, accepted):
    params = program_params(accepted, hidden_states, top_k_index, top_k_weights)
    tensors = [params.pop(name) for name in EXPERTS_PROGRAM.names if name not in STATIC_PARAMS]
    return jax_bridge.run_interpreted(FUNCTION, (__name__, "program_call"), tensors, params)


def _run_cpu_chunked(module, hidden_states, top_k_index, top_k_weights):
    return cpu_path.cpu_inference_forward(module, hidden_states, top_k_index, top_k_weights)


def _run_composed(module, hidden_states, top_k_index, top_k_weights):
    return composed_experts_forward(module, hidden_states, top_k_index, top_k_weights)


def _program_args(module, *tokens):
    return module_layout.program_args(module)


STATIC_PARAMS = ("gate", "alpha", "limit", "rhs_layout", "weight_format")
# The parameters only a quantized module's program takes.
QUANTIZED_PARAMS = ("up_scales", "down_scales", "weight_format")
COMPOSED = "running the module's own code between grouped matmul ops"
DISPATCH = dispatch.Dispatcher(FUNCTION, (
    # TPU inference: the whole layer as one jax_op (static shapes, one compile per token count).
    dispatch.Route("tpu_program", "tpu", "pallas", _run_tpu_program, when=dispatch.NO_GRAD, accepts=_program_args),
    # Gradients, and layers the program cannot express: ragged_dot ops with autograd and fake kernels.
    dispatch.Route("composed", "tpu", "pallas", _run_composed, description=COMPOSED),
    dispatch.Route("cpu_chunked", "cpu", "native", _run_cpu_chunked, when=dispatch.EAGER),
    dispatch.Route("composed", "cpu", "native", _run_composed, description=COMPOSED),
    # The TPU program on CPU, Pallas in interpret mode (a correctness check, not fast).
    dispatch.Route("interpret_program", "cpu", "interpret", _run_interpret_program, when=dispatch.NO_GRAD,
                   accepts=_program_args),
), defaults={"tpu": "pallas", "cpu": "native"})
# Reasons a fallback has been warned about (once each per process).
_WARNED_FALLBACK = DISPATCH.warned


def choose_path(module, device_type: str, grad: bool, compiling: bool, impl: str = dispatch.AUTO):
    """``(route name, ProgramArgs or None)`` the dispatcher picks (see ``DISPATCH``)."""
    resolved = DISPATCH.resolve(dispatch.Call(device_type, impl, grad, compiling), module)
    return resolved.name, resolved.accepted


def _experts_call(module, hidden_states, top_k_index, top_k_weights, impl: str):
    module_layout.check_module(module)
    if quantize.is_quantized(module):
        quantize.check_frozen(module)
    compiling = torch.compiler.is_compiling()
    validation.check_experts_args(hidden_states, top_k_index, top_k_weights, module.num_experts,
                                  module_layout.hidden_size(module),
                                  check_values=hidden_states.device.type == "cpu" and not compiling)
    call = dispatch.Call.of(hidden_states.device, impl, (hidden_states, top_k_weights, *module.parameters()))
    return DISPATCH(call, module, hidden_states, top_k_index, top_k_weights)


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Transformers experts function (``@use_experts_implementation``'s
    contract): ``DISPATCH`` says which implementation runs."""
    return _experts_call(self, hidden_states, top_k_index, top_k_weights, dispatch.AUTO)


def fused_experts_forward_interpret(self, hidden_states, top_k_index, top_k_weights):
    """The JAX program of the TPU path, run on CPU in Pallas interpret mode (a
    correctness check, not fast; inference only)."""
    return _experts_call(self, hidden_states, top_k_index, top_k_weights, "interpret")


# register() may replace a function carrying this tag (see common/transformers_interface.py).
transformers_interface.mark_ours(experts_forward)
transformers_interface.mark_ours(fused_experts_forward_interpret)


def composed_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Every step a torch op with autograd and a fake kernel (training,
    ``torch.compile``, and the TPU path when gradients are needed)."""
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    num_experts = self.num_experts
    layout = module_layout.rhs_layout(self)

    sorted_ids, order, group_sizes = routing.route(top_k_index, num_experts)
    safe_ids = sorted_ids.clamp(max=num_experts - 1)  # keeps bias gathers in bounds

    def project(x, weight, bias):
        if isinstance(weight, quantize.QuantizedWeight):
            weight = quantize.dequantize(weight)  # frozen: activations still get their gradients
        out = ragged_dot(x.to(weight.dtype), weight, group_sizes, rhs_layout=layout)
        return out if bias is None else out + bias[safe_ids].to(out.dtype)

    out = module_layout.expert_mlp(self, hidden_states[order // top_k], project)
    weights = top_k_weights.reshape(-1)[order].to(out.dtype).unsqueeze(-1)
    # Remote picks contribute nothing, whatever their weight (even NaN) and
    # whatever a bias or norm made of their (zero) rows: the same rule as the
    # CPU chunks (which never touch them) and the TPU program.
    out = torch.where(routing.remote_rows(sorted_ids, num_experts), torch.zeros_like(out), out * weights)
    # Un-sort with a static-shape scatter; summing over top_k per token.
    combined = torch.zeros(num_tokens * top_k, hidden, dtype=out.dtype, device=out.device)
    combined = combined.index_copy(0, order, out)
    return combined.view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)
