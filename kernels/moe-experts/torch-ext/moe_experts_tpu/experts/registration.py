"""``register()``: make ``experts_forward`` selectable in Transformers by name."""

from __future__ import annotations

DEFAULT_NAME = "moe_experts_tpu"
# Set on every experts_forward of this project (any build): replacing one of
# ours under the same name (a reload, another version) is allowed.
OWNER_TAG = "_tpu_kernel_hub_experts"


def _refusal(name, existing, builtins) -> str | None:
    if not isinstance(name, str) or not name.isidentifier():
        return f"name must be a Python identifier (letters, digits, '_'), got {name!r}"
    if name.lower() == "eager":
        return ("'eager' is Transformers' reference implementation (the module's own forward); "
                "registering under it would replace the reference")
    if name.lower() in builtins:
        return (f"{name!r} names a built-in Transformers experts implementation; registering would replace "
                "it for the whole process")
    if existing is not None and not getattr(existing, OWNER_TAG, False):
        return f"{name!r} is already registered to another function ({getattr(existing, '__qualname__', existing)!r})"
    return None


def register(name: str = DEFAULT_NAME, *, override: bool = False) -> str:
    """Register ``experts_forward`` in Transformers' ``ALL_EXPERTS_FUNCTIONS`` as ``name``.

    Returns ``name``, the value for ``from_pretrained(..., experts_implementation=name)``
    or ``model.set_experts_implementation(name)``. The registration is process
    wide. Refused (ValueError) unless ``override=True``: a name that is not an
    identifier, ``eager`` or a built-in implementation's name (any case), and
    a name registered to a function that is not one of this project's.
    Transformers is imported here, not when the kernel is loaded.
    """
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface
    except ImportError as e:
        raise ImportError(
            "register() needs Transformers with pluggable experts implementations "
            "(transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS; checked with 5.22.2): "
            "`pip install -U transformers`. Without it, call experts_forward directly."
        ) from e

    from .forward import experts_forward

    builtins = {key.lower() for key, fn in ExpertsInterface._global_mapping.items()
                if getattr(fn, "__module__", "").startswith("transformers.")}
    existing = ALL_EXPERTS_FUNCTIONS.get(name) if isinstance(name, str) else None
    problem = _refusal(name, existing, builtins)
    if problem and not (override and isinstance(name, str) and name):
        raise ValueError(f"register: {problem}. Pick another name, or pass override=True.")
    ALL_EXPERTS_FUNCTIONS.register(name, experts_forward)
    return name
