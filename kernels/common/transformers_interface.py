"""Registering one of our functions in a Transformers interface, with one set of refusal rules.

Transformers selects attention and experts implementations by name from
process-wide interfaces (``AttentionInterface``, ``ExpertsInterface``, both
``GeneralInterface`` mappings). ``register_function`` puts a function there
and refuses (ValueError, unless ``override=True``) a name that would do harm:

* not a Python identifier;
* a name the interface treats specially (``forbidden_words``: Transformers
  takes any attention name holding "flash" for flash attention), or one it
  reserves (``reserved``: "eager" is the module's own reference code);
* a built-in implementation's name (a function of Transformers' own modules
  registered under it, any case): replacing it would change every model in
  the process;
* a name registered to a function that is not one of ours. Ours, from any
  build of any of our kernels, carries ``OWNER_TAG`` (``mark_ours``), so a
  reload or a newer version may replace it.

The interface is read through its public mapping API (a fresh instance holds
no local overrides, so it shows the process-wide mapping). Transformers is
imported by the caller, never when a kernel is loaded.
"""

from __future__ import annotations

from typing import Callable, Mapping

OWNER_TAG = "_tpu_kernel_hub"
# The per-kernel tags builds before this one set: their functions are ours too.
EARLIER_OWNER_TAGS = ("_tpu_kernel_hub_experts", "_tpu_kernel_hub_attention")


def mark_ours(function: Callable) -> Callable:
    setattr(function, OWNER_TAG, True)
    return function


def is_ours(function) -> bool:
    return any(getattr(function, tag, False) for tag in (OWNER_TAG, *EARLIER_OWNER_TAGS))


def refusal(name, registered: Mapping[str, Callable], *, reserved: Mapping[str, str] = {},
            forbidden_words: Mapping[str, str] = {}) -> str | None:
    """Why ``name`` must not be registered over ``registered`` (the interface's
    mapping), or None. ``reserved``: lower-case names and why; ``forbidden_words``:
    lower-case substrings and why."""
    if not isinstance(name, str) or not name.isidentifier():
        return f"name must be a Python identifier (letters, digits, '_'), got {name!r}"
    lowered = name.lower()
    for word, reason in forbidden_words.items():
        if word in lowered:
            return f"{name!r}: {reason}"
    if lowered in reserved:
        return f"{name!r} {reserved[lowered]}"
    builtins = {key.lower() for key, fn in registered.items()
                if getattr(fn, "__module__", "").startswith("transformers.")}
    if lowered in builtins:
        return (f"{name!r} names a built-in Transformers implementation; registering would replace it for the "
                "whole process")
    existing = registered.get(name)
    if existing is not None and not is_ours(existing):
        return f"{name!r} is already registered to another function ({getattr(existing, '__qualname__', existing)!r})"
    return None


def register_function(interface, name: str, function: Callable, *, override: bool = False,
                      reserved: Mapping[str, str] = {}, forbidden_words: Mapping[str, str] = {}) -> str:
    """Register ``function`` (one of ours) in ``interface`` (a ``GeneralInterface``
    class) as ``name`` unless ``refusal`` objects and ``override`` is False;
    returns ``name``."""
    problem = refusal(name, dict(interface().items()), reserved=reserved, forbidden_words=forbidden_words)
    if problem and not (override and isinstance(name, str) and name):
        raise ValueError(f"register: {problem}. Pick another name, or pass override=True.")
    interface.register(name, function)
    return name
