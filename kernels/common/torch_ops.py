"""Torch ops declared once; host, fake and TPU registrations derived from the declaration.

An ``OpDecl`` lists an op's parameters in order, each with a schema type
(``Tensor``, ``Tensor?``, ``int``, ``float``, ``str``, ``ScalarType``). From it:

* ``register_host_op``: a ``torch.library.custom_op`` for CPU tensors, with
  its schema written by the declaration and a fake (shape) kernel, so the op
  works under ``torch.compile(fullgraph=True)``;
* ``TpuOpRegistry``: the TPU twins, made with ``torch_tpu``'s ``jax_op`` from a
  JAX function that receives the same parameters by name. The registry is an
  explicit object per package, built on first use (``torch_tpu`` is imported
  only then: on a host without a TPU it is not always safe to import);
* ``bind`` / ``args`` / ``grads``: autograd code reads and passes parameters by
  name, never by position.

Every op is registered under the build's namespace (``_ops.op_name``), so two
Hub kernels that share this code load side by side.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Optional

import torch

from .._ops import op_name
from . import jax_bridge

SCHEMA_TYPES = ("Tensor", "Tensor?", "int", "float", "str", "ScalarType")


def _jax_annotation(schema_type: str):
    """The annotation ``jax_op`` reads to give a JAX function this schema type."""
    import jax

    return {
        "Tensor": jax.Array, "Tensor?": Optional[jax.Array], "int": int, "float": float,
        "str": str, "ScalarType": torch.dtype,
    }[schema_type]


@dataclasses.dataclass(frozen=True)
class OpDecl:
    """Name and ordered ``(parameter, schema type)`` pairs of one op returning
    ``returns`` Tensors (a tuple when more than one)."""

    name: str
    params: tuple[tuple[str, str], ...]
    returns: int = 1

    def __post_init__(self):
        for pname, ptype in self.params:
            if ptype not in SCHEMA_TYPES:
                raise ValueError(f"OpDecl {self.name}: parameter {pname} has type {ptype!r}, "
                                 f"expected one of {SCHEMA_TYPES}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p for p, _ in self.params)

    def extended(self, name: str, *extra: tuple[str, str]) -> "OpDecl":
        """This declaration with parameters appended (e.g. a host-only ``impl``)."""
        return OpDecl(name, self.params + tuple(extra), self.returns)

    def schema(self) -> str:
        out = "Tensor" if self.returns == 1 else "(" + ", ".join(["Tensor"] * self.returns) + ")"
        return "(" + ", ".join(f"{t} {p}" for p, t in self.params) + ") -> " + out

    def bind(self, args: tuple, kwargs: dict | None = None) -> dict:
        """Positional (and keyword) arguments of a call -> ``{parameter: value}``."""
        kwargs = kwargs or {}
        if len(args) > len(self.params):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.params)} parameters")
        values = dict(zip(self.names, args))
        values.update(kwargs)
        missing = [p for p in self.names if p not in values]
        if missing or len(values) != len(self.params):
            raise TypeError(f"{self.name}: missing {missing} or unknown {sorted(set(values) - set(self.names))}")
        return values

    def args(self, values: dict) -> tuple:
        """``{parameter: value}`` -> positional arguments in declaration order."""
        return tuple(values[p] for p in self.names)

    def grads(self, **grads) -> tuple:
        """Backward's return value: the given gradients by name, None for the rest."""
        unknown = set(grads) - set(self.names)
        if unknown:
            raise TypeError(f"{self.name}: gradients for unknown parameters {sorted(unknown)}")
        return tuple(grads.get(p) for p in self.names)

    def jax_signature(self) -> inspect.Signature:
        import jax

        params = [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=_jax_annotation(t))
                  for p, t in self.params]
        out = jax.Array if self.returns == 1 else tuple.__class_getitem__((jax.Array,) * self.returns)
        return inspect.Signature(params, return_annotation=out)


def register_host_op(decl: OpDecl, impl: Callable[..., torch.Tensor], fake: Callable[..., torch.Tensor]):
    """The CPU op ``decl``: ``impl(**params)`` runs it, ``fake(**params)`` gives its output's shape."""

    def run(*args, **kwargs):
        return impl(**decl.bind(args, kwargs))

    op = torch.library.custom_op(op_name(decl.name), run, mutates_args=(), device_types="cpu",
                                 schema=decl.schema())
    op.register_fake(lambda *args, **kwargs: fake(**decl.bind(args, kwargs)))
    return op


def refuse_double_backward(op, message: str) -> None:
    """Give ``op`` (a backward op) an autograd formula that raises ``message``:
    a gradient of a gradient through it is refused clearly, not with torch's
    "no autograd formula registered"."""
    def backward(ctx, *grads):
        raise RuntimeError(message)

    op.register_autograd(backward, setup_context=lambda ctx, inputs, output: None)


def register_host_pair(forward: OpDecl, forward_impl, forward_fake, backward: OpDecl, backward_impl, backward_fake,
                       link: Callable):
    """Host twins of ``declare_with_backward``: both ops, then ``link`` (the autograd formula)."""
    forward_op = register_host_op(forward, forward_impl, forward_fake)
    backward_op = register_host_op(backward, backward_impl, backward_fake)
    link(forward_op, forward, backward_op, backward)
    return forward_op, backward_op


def make_tpu_op(decl: OpDecl, jax_impl: Callable, **jax_op_options):
    """The TPU op ``decl`` through ``jax_op``; ``jax_impl(**params)`` is the JAX program.

    Tensor parameters arrive as ``jax.Array``; the others are static, so each
    combination of them compiles once (cached by torch_tpu). ``jax_op_options``
    go to ``jax_op`` as they are: ``mesh=``, ``input_partition_specs=`` (one
    per parameter of ``decl``, static ones included) and
    ``output_partition_specs=`` for an SPMD program, whose torch tensors are
    then each rank's shards.
    """

    def program(*args, **kwargs):
        return jax_impl(**decl.bind(args, kwargs))

    program.__signature__ = decl.jax_signature()
    program.__name__ = decl.name
    return torch.tpu.pallas.jax_op(op_name(decl.name), **jax_op_options)(program)


class TpuOpRegistry:
    """The TPU ops of one package, declared at import, registered on first use.

    ``declare(decl, jax_impl, after=...)`` records an op (``after(ops)`` runs
    once every op exists, with all of them by name, e.g. to register an
    autograd formula that calls a second op); ``get(name)`` imports jax and
    torch_tpu, registers every declared op once, and returns the named one.
    """

    def __init__(self, caller: str):
        self.caller = caller
        self._declared: dict[str, tuple[OpDecl, Callable, Callable | None]] = {}
        self._ops: dict[str, object] | None = None

    def declare(self, decl: OpDecl, jax_impl: Callable, after: Callable | None = None) -> None:
        if self._ops is not None:
            raise RuntimeError(f"{self.caller}: TPU op {decl.name} declared after registration")
        self._declared[decl.name] = (decl, jax_impl, after)

    def declare_with_backward(self, forward: OpDecl, forward_impl: Callable, backward: OpDecl,
                              backward_impl: Callable, link: Callable) -> None:
        """A forward op and the op its autograd formula calls; once both exist,
        ``link(forward_op, forward, backward_op, backward)`` registers the formula."""
        self.declare(backward, backward_impl)
        self.declare(forward, forward_impl, after=lambda ops: link(ops[forward.name], forward,
                                                                   ops[backward.name], backward))

    @property
    def registered(self) -> bool:
        return self._ops is not None

    def register_all(self) -> dict[str, object]:
        if self._ops is None:
            jax_bridge.import_jax(self.caller)
            jax_bridge.import_torch_tpu(self.caller)
            ops = {name: make_tpu_op(decl, fn) for name, (decl, fn, _) in self._declared.items()}
            for name, (_, _, after) in self._declared.items():
                if after is not None:
                    after(ops)
            self._ops = ops
        return self._ops

    def get(self, name: str):
        return self.register_all()[name]


def tpu_available() -> bool:
    """True when torch's current accelerator is a TPU (never initialises libtpu)."""
    accelerator = getattr(torch, "accelerator", None)
    try:
        device = accelerator.current_accelerator() if accelerator else None
    except Exception:  # noqa: BLE001 - a broken backend means "no TPU"
        return False
    return device is not None and device.type == "tpu"
