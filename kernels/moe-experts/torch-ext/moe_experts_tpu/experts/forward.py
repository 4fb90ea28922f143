"""``experts_forward``: the Transformers experts implementation, and which path runs.

``experts_forward(module, hidden_states [T, H], top_k_index [T, K],
top_k_weights [T, K])`` follows the contract of Transformers'
``@use_experts_implementation`` (``module_layout`` reads the layout flags).
Three implementations of the same math, picked by ``choose_path``:

* ``"tpu_program"``: TPU inference, the whole layer as one ``jax_op``
  (``program.experts_forward``: routing, fused or two grouped matmuls, gate,
  weighting, combine), static shapes, one compile per token count;
* ``"cpu_chunked"``: CPU eager inference (``cpu_path.cpu_inference_forward``);
* ``"composed"``: gradients, ``torch.compile``, and TPU layers the program
  cannot express: the module's own code between ``ragged_dot`` ops (autograd,
  fake kernels), with a one-time warning on TPU.
"""

from __future__ import annotations

import warnings

import torch

from ..common import torch_ops
from ..common.torch_ops import OpDecl
from ..gmm.ops import needs_grad, ragged_dot
from . import cpu_path, module_layout, routing, validation

EXPERTS_PROGRAM = OpDecl("experts_forward_tpu", (
    ("hidden_states", "Tensor"), ("top_k_index", "Tensor"), ("top_k_weights", "Tensor"),
    ("up_weight", "Tensor"), ("down_weight", "Tensor"), ("up_bias", "Tensor?"), ("down_bias", "Tensor?"),
    ("gate", "str"), ("alpha", "float"), ("limit", "float"), ("rhs_layout", "str"),
))


def _tpu_program(hidden_states, top_k_index, top_k_weights, up_weight, down_weight, up_bias, down_bias,
                 gate, alpha, limit, rhs_layout):
    from ..common.tpu_generations import current_generation
    from . import program

    return program.experts_forward(
        hidden_states, top_k_index, top_k_weights, up_weight, down_weight, up_bias, down_bias,
        gate=gate, alpha=alpha, limit=limit, rhs_layout=rhs_layout, generation=current_generation())


TPU_OPS = torch_ops.TpuOpRegistry("experts_forward")
TPU_OPS.declare(EXPERTS_PROGRAM, _tpu_program)
if torch_ops.tpu_available():
    TPU_OPS.register_all()

_WARNED_FALLBACK: set[str] = set()


def choose_path(module, device_type: str, grad: bool, compiling: bool):
    """``(path, program_args)``: see the module docstring; ``program_args`` are
    ``module_layout.program_args`` for the TPU program, else None."""
    if device_type == "tpu" and not grad:
        try:
            return "tpu_program", module_layout.program_args(module)
        except NotImplementedError as e:
            key = type(module).__qualname__
            if key not in _WARNED_FALLBACK:
                _WARNED_FALLBACK.add(key)
                warnings.warn(f"{e}; running the module's own code between grouped matmul ops instead",
                              stacklevel=3)
            return "composed", None
    if device_type == "cpu" and not grad and not compiling:
        return "cpu_chunked", None
    return "composed", None


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Transformers experts function; ``choose_path`` says which implementation runs."""
    module_layout.check_module(self)
    compiling = torch.compiler.is_compiling()
    validation.check_experts_args(hidden_states, top_k_index, top_k_weights, self.num_experts,
                                  module_layout.hidden_size(self),
                                  check_values=hidden_states.device.type == "cpu" and not compiling)
    grad = needs_grad(hidden_states, top_k_weights, *self.parameters())
    path, program_args = choose_path(self, hidden_states.device.type, grad, compiling)
    if path == "tpu_program":
        up, down, up_bias, down_bias, gate, alpha, limit, layout = program_args
        params = dict(hidden_states=hidden_states, top_k_index=top_k_index,
                      top_k_weights=top_k_weights.to(hidden_states.dtype), up_weight=up, down_weight=down,
                      up_bias=up_bias, down_bias=down_bias, gate=gate, alpha=alpha, limit=limit,
                      rhs_layout=layout)
        return TPU_OPS.get(EXPERTS_PROGRAM.name)(*EXPERTS_PROGRAM.args(params))
    if path == "cpu_chunked":
        return cpu_path.cpu_inference_forward(self, hidden_states, top_k_index, top_k_weights)
    return composed_experts_forward(self, hidden_states, top_k_index, top_k_weights)


# register() may replace a function carrying this tag (see registration.py).
experts_forward._tpu_kernel_hub_experts = True


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


def fused_experts_forward_interpret(self, hidden_states, top_k_index, top_k_weights):
    """The JAX program of the TPU path, run on CPU in Pallas interpret mode (a
    correctness check, not fast)."""
    from ..common import jax_bridge, pallas_helpers
    from . import program

    up, down, up_bias, down_bias, gate, alpha, limit, layout = module_layout.program_args(self)
    j = jax_bridge.to_jax
    with jax_bridge.INTERPRET_LOCK:
        out = program.experts_forward(
            j(hidden_states), j(top_k_index), j(top_k_weights.to(hidden_states.dtype)), j(up), j(down),
            j(up_bias), j(down_bias), gate=gate, alpha=alpha, limit=limit, rhs_layout=layout,
            interpret=pallas_helpers.interpret_params(),
        )
        return jax_bridge.to_torch(out)
