"""What a Transformers experts module is, read once from its attributes.

``@use_experts_implementation`` modules carry the layout as flags:
``is_transposed`` ("kn" weights ``[E, in, out]``, else "nk"), ``has_gate``
(``gate_up_proj`` + ``_apply_gate``, or ``up_proj`` + ``act_fn``),
``has_bias`` and ``has_post_expert_norm``. ``check_module`` refuses a module
without them with a TypeError naming what is missing; ``gate_of_module``
names the gate for the TPU program (an overridden ``_apply_gate`` by what it
computes) or raises NotImplementedError naming what it cannot express;
``program_args`` is what the program takes from the module, by name.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from ..gmm import layouts
from . import quantize

_GELU_TANH = {"GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "GELUPytorchTanh"}
ACTIVATION_NAMES = {
    "SiLU": "silu", "SiLUActivation": "silu", "ReLU": "relu", "GELUActivation": "gelu",
    "ReLUSquaredActivation": "relu2",
    **{name: "gelu_tanh" for name in _GELU_TANH},
}
GLU_GATES = tuple(f"glu_{name}" for name in dict.fromkeys(ACTIVATION_NAMES.values()))


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
    """The up (gate_up) weight: its values when the module is quantized."""
    return module.gate_up_proj if getattr(module, "has_gate", True) else module.up_proj


def weight_format(module) -> str:
    """The quantized format of the module's expert weights (``quantize.py``), "" for float weights."""
    return getattr(module, quantize.FORMAT_ATTRIBUTE, None) or ""


def compute_dtype(module) -> torch.dtype:
    """The dtype the expert MLP computes in: the weights' own, or the dtype they had before quantization."""
    return getattr(module, quantize.DTYPE_ATTRIBUTE) if weight_format(module) else module.down_proj.dtype


def projection_weight(module, name: str):
    """``module.<name>`` as the torch paths' ``project`` receives it: the float
    tensor, or a ``quantize.QuantizedWeight`` for a quantized module."""
    if weight_format(module):
        return quantize.quantized_weight(module, name)
    return getattr(module, name)


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


class ProgramArgs(NamedTuple):
    """What the TPU program takes from an experts module (the parameters of
    ``forward.EXPERTS_PROGRAM`` after the routed tokens), passed by name."""

    up_weight: torch.Tensor
    down_weight: torch.Tensor
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    gate: str
    alpha: float
    limit: float
    rhs_layout: str
    # Quantized modules (``quantize.py``): up/down_weight are the values; "" and None for float weights.
    up_scales: torch.Tensor | None = None
    down_scales: torch.Tensor | None = None
    weight_format: str = ""


def _default_gate(module) -> bool:
    return type(module)._apply_gate.__qualname__ == "_default_apply_gate"


def _gate_candidates(module, gates) -> list[tuple[str, float, float]]:
    """The program's gates an overridden ``_apply_gate`` may compute: what the
    model's recogniser reads from its constants (``gates.RECOGNISERS``, for
    the overrides Transformers ships), gpt-oss's clamped, interleaved SwiGLU
    with the module's own ``alpha`` and ``limit`` when it has both as numbers,
    and every GLU."""
    candidates = []
    recognise = gates.RECOGNISERS.get(type(module)._apply_gate.__qualname__)
    if recognise is not None:
        try:
            candidates.append(recognise(module))
        except (AttributeError, NotImplementedError):
            pass
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if isinstance(alpha, (int, float)) and isinstance(limit, (int, float)):
        candidates.append(("gpt_oss", float(alpha), float(limit)))
    return candidates + [(gate, 0.0, 0.0) for gate in GLU_GATES]


def _probe_gate(module) -> tuple[str, float, float]:
    """The gate an overridden ``_apply_gate`` computes, recognised by what it
    does: the first candidate equal to the module's own code on a probe
    (``gates.gate_matches_module``: values past any clamp limit, both signs).
    NotImplementedError names the override when none matches."""
    from ..common import jax_bridge

    jax_bridge.import_jax("experts_forward (fused TPU program)")
    from . import gates

    qualname = type(module)._apply_gate.__qualname__
    candidates = _gate_candidates(module, gates)
    for gate, alpha, limit in candidates:
        try:
            if gates.gate_matches_module(module, gate, alpha, limit):
                return gate, alpha, limit
        except Exception as e:  # noqa: BLE001 - an override the probe cannot run is one the program cannot express
            raise NotImplementedError(
                f"experts_forward (fused TPU program): {type(module).__name__} overrides _apply_gate ({qualname}), "
                f"which failed on a probe input ({type(e).__name__}: {e})") from None
    raise NotImplementedError(
        f"experts_forward (fused TPU program): {type(module).__name__} overrides _apply_gate ({qualname}), "
        f"which computes none of the program's gates ({', '.join(dict.fromkeys(g for g, _, _ in candidates))})")


_RECOGNISED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def gate_of_module(module) -> tuple[str, float, float]:
    """Names the module's gate for the TPU program: ``(gate, alpha, limit)``
    (see ``gates.py``), or raises NotImplementedError rather than computing
    something else. The default ``_apply_gate`` is read from ``act_fn``; an
    override (gpt-oss's, or any model's) is recognised by what it computes
    (``_probe_gate``, once per module and attribute values)."""
    if not getattr(module, "has_gate", True):
        return activation_name(module), 0.0, 0.0
    if _default_gate(module):
        return "glu_" + activation_name(module), 0.0, 0.0
    key = (type(module), getattr(module, "alpha", None), getattr(module, "limit", None))
    cached = _RECOGNISED.get(module)
    if cached is None or cached[0] != key:
        try:
            cached = (key, _probe_gate(module))
        except NotImplementedError as e:
            cached = (key, e)
        _RECOGNISED[module] = cached
    if isinstance(cached[1], NotImplementedError):
        raise cached[1]
    return cached[1]


def program_args(module) -> ProgramArgs:
    """What the TPU program takes from the module; NotImplementedError for a
    layer it cannot express."""
    if getattr(module, "has_post_expert_norm", False):
        raise NotImplementedError(f"experts_forward (fused TPU program): post-expert norm of {type(module).__name__}")
    gate, alpha, limit = gate_of_module(module)
    fmt = weight_format(module)
    up_name = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    return ProgramArgs(up_weight=up_weight(module), down_weight=module.down_proj, up_bias=up_bias(module),
                       down_bias=down_bias(module), gate=gate, alpha=alpha, limit=limit,
                       rhs_layout=rhs_layout(module),
                       up_scales=getattr(module, up_name + quantize.SCALES_SUFFIX) if fmt else None,
                       down_scales=module.down_proj_scales if fmt else None, weight_format=fmt)


def expert_mlp(module, x, project):
    """The module's expert MLP on sorted rows ``x``: up (or gate_up) projection,
    its own gate or activation, down projection, optional post-expert norm.
    ``project(x, weight, bias_or_None)`` is the grouped matmul (plus bias),
    ``weight`` a tensor or a ``quantize.QuantizedWeight`` (``projection_weight``);
    every path (CPU chunks, composed ops) runs the layers through this one
    function, so the module's own code decides the math."""
    if getattr(module, "has_gate", True):
        h = module._apply_gate(project(x, projection_weight(module, "gate_up_proj"), up_bias(module)))
    else:
        h = module.act_fn(project(x, projection_weight(module, "up_proj"), up_bias(module)))
    out = project(h, projection_weight(module, "down_proj"), down_bias(module))
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    return out
