"""``register()``: make ``experts_forward`` selectable in Transformers by name."""

from __future__ import annotations

DEFAULT_NAME = "moe_experts_tpu"


def register(name: str = DEFAULT_NAME) -> str:
    """Register ``experts_forward`` in Transformers' ``ALL_EXPERTS_FUNCTIONS`` as ``name``.

    Returns ``name``, the value for ``from_pretrained(..., experts_implementation=name)``
    or ``model.set_experts_implementation(name)``. The registration is process
    wide and replaces a function registered earlier under the same name.
    Transformers is imported here, not when the kernel is loaded.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"register: name must be a non-empty string, got {name!r}")
    if name == "eager":
        raise ValueError(
            "register: 'eager' is Transformers' reference implementation (the module's own forward); "
            "registering under it would replace the reference. Pick another name."
        )
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as e:
        raise ImportError(
            "register() needs Transformers with pluggable experts implementations "
            "(transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS; checked with 5.22.2): "
            "`pip install -U transformers`. Without it, call experts_forward directly."
        ) from e

    from ._ragged_dot.experts import experts_forward

    ALL_EXPERTS_FUNCTIONS.register(name, experts_forward)
    return name
