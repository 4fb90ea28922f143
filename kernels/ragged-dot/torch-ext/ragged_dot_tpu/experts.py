"""Transformers experts implementation on top of ``ragged_dot``.

``experts_forward(module, hidden_states [T, H], top_k_index [T, K],
top_k_weights [T, K])`` follows the contract of Transformers'
``@use_experts_implementation`` and reads the layout from the module's flags:
``is_transposed`` picks the weight layout ("kn" for ``[E, in, out]``, else
"nk"), ``has_gate`` chooses between ``gate_up_proj`` + the module's own
``_apply_gate`` (so gpt-oss's clamped, interleaved SwiGLU is the model's
code, not a copy) and ``up_proj`` + ``act_fn``; ``has_bias`` adds the
per-expert biases and ``has_post_expert_norm`` applies the module's norm.

Routing has static shapes only (no ``unique``, no host sync): one stable
sort by expert, group sizes by a scatter-add into ``E + 1`` bins (the last
bin takes the expert-parallel sentinel ``E``), one gather back. Picks of a
remote expert sort to the tail, past ``sum(group_sizes)``, where
``ragged_dot`` writes zeros, so they cost no matmul and add nothing.

Three implementations of the same math, picked by ``choose_path``: the TPU
program (one jax_op, ``experts_jax``), the chunked CPU inference path
(``cpu_inference_forward``) and the composed path of torch ops with autograd
and fake kernels (``composed_experts_forward``: training, ``torch.compile``).
"""

from __future__ import annotations

import warnings

import torch

from . import cpu_native, jax_bridge, layouts, validation
from .ops import _needs_grad, ragged_dot, register_tpu_ops

# The CPU chunk rule (``cpu_chunk_rows``): one chunk's activations within
# about an L3 cache (32 MiB on the benchmark host), and a floor under which
# BLAS matmuls lose their efficiency. Measured with ``python
# bench/bench_experts.py --chunk-sweep`` (4096 tokens, 128 to 4096 rows per
# chunk): chunks far below an expert's rows (gpt-oss: 128 vs ~512) or far
# above the cache (4096 rows) cost 15-50% more; between them the times are
# within this host's +-10% noise, and the rule's size was the fastest in two
# of three sweeps (bench/results/experts.md has the last one).
CPU_CHUNK_BYTES = 32 << 20
CPU_MIN_CHUNK_ROWS = 128

_GELU_TANH = {"GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "GELUPytorchTanh"}
_ACTIVATION_NAMES = {
    "SiLU": "silu", "SiLUActivation": "silu", "ReLU": "relu", "GELUActivation": "gelu",
    **{name: "gelu_tanh" for name in _GELU_TANH},
}


def gate_of_module(module) -> tuple[str, float, float]:
    """Names the module's gate for the fused JAX program: ``(gate, alpha, limit)``.

    Raises NotImplementedError for a gate or activation the program cannot
    express, rather than computing something else.
    """
    apply_gate = type(module)._apply_gate
    if type(module).__name__ == "GptOssExperts" or apply_gate.__qualname__ == "GptOssExperts._apply_gate":
        return "gpt_oss", float(module.alpha), float(module.limit)
    act = getattr(module, "act_fn", None)
    act_name = type(act).__name__
    if isinstance(act, torch.nn.GELU):
        act_name = "GELUTanh" if act.approximate == "tanh" else "GELUActivation"
    if act_name not in _ACTIVATION_NAMES:
        raise NotImplementedError(
            f"experts_forward (fused TPU program): activation {act_name} of "
            f"{type(module).__name__} is not supported; supported: {sorted(_ACTIVATION_NAMES)}"
        )
    if not getattr(module, "has_gate", True):
        return _ACTIVATION_NAMES[act_name], 0.0, 0.0
    if apply_gate.__qualname__ != "_default_apply_gate":
        raise NotImplementedError(
            f"experts_forward (fused TPU program): {type(module).__name__} overrides "
            f"_apply_gate ({apply_gate.__qualname__}), which has no fused equivalent"
        )
    return "glu_" + _ACTIVATION_NAMES[act_name], 0.0, 0.0


def _layout(self) -> str:
    return "kn" if getattr(self, "is_transposed", False) else "nk"


def _hidden_size(self) -> int:
    """H, the output features of ``down_proj``."""
    return layouts.out_features(self.down_proj.shape, _layout(self))


def _up_weight(self) -> torch.Tensor:
    return self.gate_up_proj if getattr(self, "has_gate", True) else self.up_proj


def route(top_k_index: torch.Tensor, num_experts: int):
    """Sorted order of the (token, expert) picks and rows per expert."""
    expert_ids = top_k_index.reshape(-1)
    sorted_ids, order = torch.sort(expert_ids, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=expert_ids.device)
    counts.scatter_add_(0, expert_ids.clamp(0, num_experts).long(),
                        torch.ones_like(expert_ids, dtype=torch.int32))
    return sorted_ids, order, counts[:num_experts]


def _expert_mlp(self, x, project):
    """The module's expert MLP on rows ``x``: up (or gate_up) projection, its
    own gate or activation, down projection, optional post-expert norm.
    ``project(x, weight, bias_or_None)`` is the grouped matmul (plus bias)."""
    has_bias = getattr(self, "has_bias", False)
    if getattr(self, "has_gate", True):
        h = self._apply_gate(project(x, self.gate_up_proj, self.gate_up_proj_bias if has_bias else None))
    else:
        h = self.act_fn(project(x, self.up_proj, self.up_proj_bias if has_bias else None))
    out = project(h, self.down_proj, self.down_proj_bias if has_bias else None)
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    return out


def _fused_args(self):
    if getattr(self, "has_post_expert_norm", False):
        raise NotImplementedError(
            f"experts_forward (fused TPU program): post-expert norm of {type(self).__name__}"
        )
    gate, alpha, limit = gate_of_module(self)
    has_gate, has_bias = getattr(self, "has_gate", True), getattr(self, "has_bias", False)
    up = _up_weight(self)
    up_bias = (self.gate_up_proj_bias if has_gate else self.up_proj_bias) if has_bias else None
    down_bias = self.down_proj_bias if has_bias else None
    return up, self.down_proj, up_bias, down_bias, gate, alpha, limit, _layout(self)


def fused_experts_forward_interpret(self, hidden_states, top_k_index, top_k_weights):
    """The fused JAX program of the TPU path, run on CPU in interpret mode (tests)."""
    up, down, up_bias, down_bias, gate, alpha, limit, layout = _fused_args(self)
    from . import experts_jax

    def j(t):
        return None if t is None else jax_bridge.to_jax(t)

    out = experts_jax.experts_forward(
        j(hidden_states), j(top_k_index), j(top_k_weights.to(hidden_states.dtype)), j(up), j(down),
        j(up_bias), j(down_bias), gate=gate, alpha=alpha, limit=limit, rhs_layout=layout,
        interpret=jax_bridge.interpret_params(),
    )
    return jax_bridge.to_torch(out)


def choose_path(self, device_type: str, needs_grad: bool, compiling: bool):
    """Which implementation ``experts_forward`` runs, as ``(path, program_args)``:

    * ``"tpu_program"``: TPU inference, the whole layer as one jax_op
      (``program_args``: the weights and named gate it takes, ``_fused_args``);
    * ``"cpu_chunked"``: CPU eager inference (``cpu_inference_forward``);
    * ``"composed"``: everything else (gradients, ``torch.compile``), and TPU
      layers whose gate or norm the fused program cannot express: those run
      the module's own code between grouped matmul ops, with a warning.
    """
    if device_type == "tpu" and not needs_grad:
        try:
            return "tpu_program", _fused_args(self)
        except NotImplementedError as e:
            key = type(self).__qualname__
            if key not in _WARNED_FALLBACK:
                _WARNED_FALLBACK.add(key)
                warnings.warn(f"{e}; running the module's own code between grouped matmul ops instead",
                              stacklevel=3)
            return "composed", None
    if device_type == "cpu" and not needs_grad and not compiling:
        return "cpu_chunked", None
    return "composed", None


_WARNED_FALLBACK: set[str] = set()


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Transformers experts function; ``choose_path`` says which implementation runs."""
    compiling = torch.compiler.is_compiling()
    validation.check_experts_args(hidden_states, top_k_index, top_k_weights, self.num_experts,
                                  _hidden_size(self), check_values=hidden_states.device.type == "cpu"
                                  and not compiling)
    path, program_args = choose_path(self, hidden_states.device.type,
                                     _needs_grad(hidden_states, top_k_weights, *self.parameters()), compiling)
    if path == "tpu_program":
        up, down, up_bias, down_bias, gate, alpha, limit, layout = program_args
        op = register_tpu_ops()["experts"]
        return op(hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype), up, down,
                  up_bias, down_bias, gate, alpha, limit, layout)
    if path == "cpu_chunked":
        return cpu_inference_forward(self, hidden_states, top_k_index, top_k_weights)
    return composed_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def composed_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Every step a torch op with autograd and a fake kernel (training,
    ``torch.compile``, and the TPU path when gradients are needed)."""
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    num_experts = self.num_experts
    layout = _layout(self)

    sorted_ids, order, group_sizes = route(top_k_index, num_experts)
    safe_ids = sorted_ids.clamp(max=num_experts - 1)  # keeps bias gathers in bounds

    def project(x, weight, bias):
        out = ragged_dot(x.to(weight.dtype), weight, group_sizes, rhs_layout=layout)
        return out if bias is None else out + bias[safe_ids].to(out.dtype)

    out = _expert_mlp(self, hidden_states[order // top_k], project)
    weights = top_k_weights.reshape(-1)[order].to(out.dtype).unsqueeze(-1)
    out = out * weights
    if getattr(self, "has_bias", False) or getattr(self, "has_post_expert_norm", False):
        # Remote picks: ragged_dot left their rows zero, but a bias or norm
        # may have made them non-zero again.
        out = torch.where((sorted_ids >= num_experts).unsqueeze(-1), torch.zeros_like(out), out)
    # Un-sort with a static-shape scatter; summing over top_k per token.
    combined = torch.zeros(num_tokens * top_k, hidden, dtype=out.dtype, device=out.device)
    combined = combined.index_copy(0, order, out)
    return combined.view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


def cpu_chunk_rows(self) -> int:
    """Rows per chunk of the CPU inference path: as many as keep one chunk's
    activations (input, up, gate output, down, f32 copy for the sum) within
    ``CPU_CHUNK_BYTES``, and at least ``CPU_MIN_CHUNK_ROWS`` so each matmul
    stays large enough for BLAS to run near its peak."""
    up = _up_weight(self)
    hidden, up_features = _hidden_size(self), layouts.out_features(up.shape, _layout(self))
    per_row = up.dtype.itemsize * (2 * hidden + 2 * up_features) + 4 * hidden
    return max(CPU_MIN_CHUNK_ROWS, CPU_CHUNK_BYTES // per_row)


def cpu_inference_forward(self, hidden_states, top_k_index, top_k_weights, *, chunk_rows=None):
    """The CPU path without autograd: the same math as ``composed_experts_forward``,
    run chunk by chunk over the sorted rows (``cpu_native.plan_row_chunks``).

    Each chunk goes through gate_up -> gate -> down -> routing weight and is
    added into an f32 ``[T, H]`` output, so the intermediates stay small enough
    to live in cache instead of being written as ``[T*K, 2I]`` tensors, and no
    row past ``sum(group_sizes)`` (remote experts) is touched at all.
    """
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    layout = _layout(self)
    sorted_ids, order, group_sizes = route(top_k_index, self.num_experts)
    token_of_row = order // top_k
    row_weights = top_k_weights.reshape(-1)[order].to(torch.float32).unsqueeze(-1)
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    chunk_rows = chunk_rows or cpu_chunk_rows(self)
    for chunk in cpu_native.plan_row_chunks(group_sizes.tolist(), chunk_rows):
        rows = slice(chunk.row_start, chunk.row_end)
        experts = slice(chunk.first_expert, chunk.first_expert + len(chunk.sizes))

        def project(x, weight, bias, rows=rows, chunk=chunk, experts=experts):
            y = cpu_native.grouped_matmul(x.to(weight.dtype), weight[experts], chunk.sizes, layout, weight.dtype)
            return y if bias is None else y + bias[sorted_ids[rows]].to(y.dtype)

        tokens = token_of_row[rows]
        y = _expert_mlp(self, hidden_states[tokens], project)
        out.index_add_(0, tokens, y * row_weights[rows])  # f32 product: one pass, no bf16 rounding
    return out.to(hidden_states.dtype)
