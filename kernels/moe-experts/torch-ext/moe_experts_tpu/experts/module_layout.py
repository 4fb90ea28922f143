"""What a Transformers experts module is, read once from its attributes.

``@use_experts_implementation`` modules carry the layout as flags:
``is_transposed`` ("kn" weights ``[E, in, out]``, else "nk"), ``has_gate``
(``gate_up_proj`` + ``_apply_gate``, or ``up_proj`` + ``act_fn``),
``has_bias`` and ``has_post_expert_norm``. ``check_module`` refuses a module
without them with a TypeError naming what is missing; ``gate_of_module``
names the gate for the TPU program or raises NotImplementedError naming what
it cannot express.
"""

from __future__ import annotations

import torch

from ..gmm import layouts

_GELU_TANH = {"GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "GELUPytorchTanh"}
ACTIVATION_NAMES = {
    "SiLU": "silu", "SiLUActivation": "silu", "ReLU": "relu", "GELUActivation": "gelu",
    "ReLUSquaredActivation": "relu2",
    **{name: "gelu_tanh" for name in _GELU_TANH},
}


def check_module(module, function: str = "experts_forward") -> None:
    """TypeError (naming ``function``) unless ``module`` has what every experts layout needs."""
    has_gate = getattr(module, "has_gate", True)
    needed = ["num_experts", "down_proj", "gate_up_proj" if has_gate else "up_proj"]
    needed.append("_apply_gate" if has_gate else "act_fn")
    missing = [name for name in needed if not hasattr(module, name)]
    if getattr(module, "has_bias", False):
        biases = ["gate_up_proj_bias" if has_gate else "up_proj_bias", "down_proj_bias"]
        missing += [name for name in biases if getattr(module, name, None) is None]
    if getattr(module, "has_post_expert_norm", False) and not hasattr(module, "post_expert_norm"):
        missing.append("post_expert_norm")
    if missing:
        raise TypeError(
            f"{function}: {type(module).__name__} is not a Transformers experts module: it lacks "
            f"{missing} (expected the attributes of a module decorated with @use_experts_implementation)"
        )


def rhs_layout(module) -> str:
    return "kn" if getattr(module, "is_transposed", False) else "nk"


def up_weight(module) -> torch.Tensor:
    return module.gate_up_proj if getattr(module, "has_gate", True) else module.up_proj


def up_bias(module):
    if not getattr(module, "has_bias", False):
        return None
    return module.gate_up_proj_bias if getattr(module, "has_gate", True) else module.up_proj_bias


def down_bias(module):
    return module.down_proj_bias if getattr(module, "has_bias", False) else None


def hidden_size(module) -> int:
    """H, the output features of ``down_proj``."""
    return layouts.out_features(module.down_proj.shape, rhs_layout(module))


def activation_name(module) -> str:
    """The program's name of ``module.act_fn``; NotImplementedError if it has none."""
    act = getattr(module, "act_fn", None)
    name = type(act).__name__
    if isinstance(act, torch.nn.GELU):
        name = "GELUTanh" if act.approximate == "tanh" else "GELUActivation"
    if name not in ACTIVATION_NAMES:
        raise NotImplementedError(
            f"experts_forward (fused TPU program): activation {name} of {type(module).__name__} is "
            f"not supported; supported: {sorted(ACTIVATION_NAMES)}"
        )
    return ACTIVATION_NAMES[name]


def gate_of_module(module) -> tuple[str, float, float]:
    """Names the module's gate for the TPU program: ``(gate, alpha, limit)``
    (see ``gates.py``), or raises NotImplementedError rather than computing
    something else."""
    apply_gate = type(module)._apply_gate
    if type(module).__name__ == "GptOssExperts" or apply_gate.__qualname__ == "GptOssExperts._apply_gate":
        return "gpt_oss", float(module.alpha), float(module.limit)
    if not getattr(module, "has_gate", True):
        return activation_name(module), 0.0, 0.0
    if apply_gate.__qualname__ != "_default_apply_gate":
        raise NotImplementedError(
            f"experts_forward (fused TPU program): {type(module).__name__} overrides _apply_gate "
            f"({apply_gate.__qualname__}), which has no fused equivalent"
        )
    return "glu_" + activation_name(module), 0.0, 0.0


def program_args(module):
    """What the TPU program takes from the module: ``(up, down, up_bias,
    down_bias, gate, alpha, limit, rhs_layout)``; NotImplementedError for a
    layer it cannot express."""
    if getattr(module, "has_post_expert_norm", False):
        raise NotImplementedError(f"experts_forward (fused TPU program): post-expert norm of {type(module).__name__}")
    gate, alpha, limit = gate_of_module(module)
    return (up_weight(module), module.down_proj, up_bias(module), down_bias(module), gate, alpha, limit,
            rhs_layout(module))


def expert_mlp(module, x, project):
    """The module's expert MLP on sorted rows ``x``: up (or gate_up) projection,
    its own gate or activation, down projection, optional post-expert norm.
    ``project(x, weight, bias_or_None)`` is the grouped matmul (plus bias);
    every path (CPU chunks, composed ops) runs the layers through this one
    function, so the module's own code decides the math."""
    if getattr(module, "has_gate", True):
        h = module._apply_gate(project(x, module.gate_up_proj, up_bias(module)))
    else:
        h = module.act_fn(project(x, module.up_proj, up_bias(module)))
    out = project(h, module.down_proj, down_bias(module))
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    return out
