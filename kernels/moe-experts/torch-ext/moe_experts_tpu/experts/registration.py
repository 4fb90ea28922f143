"""``register()``: make ``experts_forward`` selectable in Transformers by name."""

from __future__ import annotations

from ..common import transformers_interface

DEFAULT_NAME = "moe_experts_tpu"
RESERVED = {"eager": ("is Transformers' reference implementation (the module's own forward); registering under it "
                      "would replace the reference")}


def register(name: str = DEFAULT_NAME, *, override: bool = False) -> str:
    """Register ``experts_forward`` in Transformers' ``ALL_EXPERTS_FUNCTIONS`` as ``name``.

    Returns ``name``, the value for ``from_pretrained(..., experts_implementation=name)``
    or ``model.set_experts_implementation(name)``. The registration is process
    wide. Refused (ValueError) unless ``override=True``: the rules of
    ``common.transformers_interface`` (not an identifier, ``eager`` or a
    built-in implementation's name in any case, a name registered to a
    function that is not one of ours). Transformers is imported here, not
    when the kernel is loaded.
    """
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:
        raise ImportError(
            "register() needs Transformers with pluggable experts implementations "
            "(transformers.integrations.moe.ExpertsInterface; checked with 5.22.2 and 5.25.0): "
            "`pip install -U transformers`. Without it, call experts_forward directly."
        ) from e

    from .forward import experts_forward

    return transformers_interface.register_function(ExpertsInterface, name, experts_forward, override=override,
                                                    reserved=RESERVED)
