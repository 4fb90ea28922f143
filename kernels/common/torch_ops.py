"""Torch ops declared once; host, fake, TPU and autograd registrations derived from the declaration.

An ``OpDecl`` lists an op's parameters in order, each with a schema type
(``Tensor``, ``Tensor?``, ``int``, ``float``, ``str``, ``ScalarType``).
An ``OpBackends`` names every backend of one op in one place: the CPU body
and its fake (shape) kernel, the JAX program of its TPU twin, and its
backward op with the autograd formula. ``DeclaredOp(backends)`` registers it:

* the host op now: a ``torch.library.custom_op`` for CPU tensors whose
  schema the declaration writes, with the fake kernel, so it works under
  ``torch.compile(fullgraph=True)``;
* the TPU op in ``TPU_OPS``, the package's one registry of ``jax_op`` ops,
  on first use (``torch_tpu`` is imported only then: on a host without a TPU
  it is not always safe to import). The JAX program is given the parameters
  by name and the chip's ``generation``. SPMD programs get one op per mesh
  (``TpuOpRegistry.variant``), held only while the mesh lives;
* ``bind`` / ``args`` / ``grads``: autograd code reads and passes parameters by
  name, never by position.

Which of an op's backends a call takes is ``dispatch``'s rule. Every op is
registered under the build's namespace (``_ops.op_name``), so two Hub kernels
that share this code load side by side.
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


def _current_generation() -> str:
    from .tpu_generations import current_generation

    return current_generation()


def make_tpu_op(decl: OpDecl, jax_impl: Callable, generation: Callable[[], str] = _current_generation,
                **jax_op_options):
    """The TPU op ``decl`` through ``jax_op``; ``jax_impl(**params,
    generation=...)`` is the JAX program, given the generation of the chip it
    is traced for (``generation()``, called at trace time).

    Tensor parameters arrive as ``jax.Array``; the others are static, so each
    combination of them compiles once (cached by torch_tpu). ``jax_op_options``
    go to ``jax_op`` as they are: ``mesh=``, ``input_partition_specs=`` (one
    per parameter of ``decl``, static ones included) and
    ``output_partition_specs=`` for an SPMD program, whose torch tensors are
    then each rank's shards.
    """

    def program(*args, **kwargs):
        return jax_impl(**decl.bind(args, kwargs), generation=generation())

    program.__signature__ = decl.jax_signature()
    program.__name__ = decl.name
    return torch.tpu.pallas.jax_op(op_name(decl.name), **jax_op_options)(program)


class TpuOpRegistry:
    """The TPU ops of one package (``TPU_OPS`` below), declared at import,
    registered with ``jax_op`` on first use (importing torch_tpu is not always
    safe on a host without a TPU, so never at import).

    ``declare(decl, jax_impl, after=...)`` records an op (``after(ops)`` runs
    once every op exists, with all of them by name, e.g. to register an
    autograd formula that calls a second op); ``get(name)`` imports jax and
    torch_tpu, registers every declared op once, and returns the named one.
    ``variant(decl, key, jax_impl, generation, mesh=...)`` is an op built per mesh and
    key (an SPMD program): made on first use, kept for the process like every
    torch op (a registered op cannot be dropped), one per distinct mesh value
    (equal meshes share it, so a mesh rebuilt per call registers nothing new).
    """

    def __init__(self, caller: str):
        self.caller = caller
        self._declared: dict[str, tuple[OpDecl, Callable, Callable | None]] = {}
        self._ops: dict[str, object] | None = None
        self._variants: dict[tuple, object] = {}

    def declare(self, decl: OpDecl, jax_impl: Callable, after: Callable | None = None) -> None:
        if self._ops is not None:
            raise RuntimeError(f"{self.caller}: TPU op {decl.name} declared after registration")
        if decl.name in self._declared:
            raise RuntimeError(f"{self.caller}: TPU op {decl.name} declared twice")
        self._declared[decl.name] = (decl, jax_impl, after)

    @property
    def registered(self) -> bool:
        return self._ops is not None

    def _import_runtime(self) -> None:
        jax_bridge.import_jax(self.caller)
        jax_bridge.import_torch_tpu(self.caller)

    def register_all(self) -> dict[str, object]:
        if self._ops is None:
            self._import_runtime()
            ops = {name: make_tpu_op(decl, fn) for name, (decl, fn, _) in self._declared.items()}
            for name, (_, _, after) in self._declared.items():
                if after is not None:
                    after(ops)
            self._ops = ops
        return self._ops

    def get(self, name: str):
        return self.register_all()[name]

    def variant(self, decl: OpDecl, key: tuple[str, ...], jax_impl: Callable, generation: Callable[[], str], *,
                mesh, **jax_op_options):
        """The op ``decl`` for ``mesh`` and ``key`` (strings, e.g. axis and
        token mode): ``jax_impl`` run with ``jax_op_options`` (``mesh=``,
        partition specs), named ``<decl.name>_<key[-1]>_<n>``. One registration
        per distinct (mesh, key)."""
        full_key = (decl.name, mesh, *key)
        if full_key not in self._variants:
            self._import_runtime()
            # jax_op names are process-wide: a counter keeps every variant's own.
            name = f"{decl.name}_{key[-1]}_{len(self._variants)}"
            self._variants[full_key] = make_tpu_op(dataclasses.replace(decl, name=name), jax_impl, generation,
                                                   mesh=mesh, **jax_op_options)
        return self._variants[full_key]


TPU_OPS = TpuOpRegistry("tpu_ops")


@dataclasses.dataclass(frozen=True)
class OpBackends:
    """Every backend of one op, declared once.

    * ``host`` / ``fake``: the CPU custom op ``decl.name`` (the body and the
      shape function; ``host_impls`` adds a string parameter ``impl`` naming
      which CPU implementation runs); None for an op with no host twin;
    * ``tpu``: the JAX program of the TPU op ``decl.name + "_tpu"``
      (``jax_op``), called with the parameters and ``generation=``;
    * ``backward`` and ``autograd``: the op the autograd formula calls, and
      ``autograd(forward_op, forward_decl, backward_op, backward_decl)``, which
      registers that formula; the same formula serves the host and the TPU
      pair, and the backward op refuses a double backward.
    """

    decl: OpDecl
    host: Callable | None = None
    fake: Callable | None = None
    host_impls: tuple[str, ...] = ()
    tpu: Callable | None = None
    backward: "OpBackends | None" = None
    autograd: Callable | None = None
    double_backward_message: str = ""

    @property
    def host_decl(self) -> OpDecl:
        return self.decl.extended(self.decl.name, ("impl", "str")) if self.host_impls else self.decl

    @property
    def tpu_decl(self) -> OpDecl:
        return self.decl.extended(self.decl.name + "_tpu")


class DeclaredOp:
    """An ``OpBackends`` registered: the host op now, the TPU op in
    ``registry`` (on first use). ``call(device, params)`` runs the op of the
    device with ``{parameter: value}``."""

    def __init__(self, backends: OpBackends, registry: TpuOpRegistry = TPU_OPS):
        self.backends = backends
        self.registry = registry
        self.host_op = self._register_host(backends)
        if backends.tpu is not None:
            self._declare_tpu(backends, registry)

    @staticmethod
    def _register_host(b: OpBackends):
        if b.host is None:
            return None
        forward = register_host_op(b.host_decl, b.host, b.fake)
        if b.backward is not None:
            backward = register_host_op(b.backward.host_decl, b.backward.host, b.backward.fake)
            b.autograd(forward, b.host_decl, backward, b.backward.host_decl)
            refuse_double_backward(backward, b.double_backward_message)
        return forward

    @staticmethod
    def _declare_tpu(b: OpBackends, registry: TpuOpRegistry) -> None:
        if b.backward is None:
            registry.declare(b.tpu_decl, b.tpu)
            return
        registry.declare(b.backward.tpu_decl, b.backward.tpu)

        def link(ops):
            backward = ops[b.backward.tpu_decl.name]
            b.autograd(ops[b.tpu_decl.name], b.tpu_decl, backward, b.backward.tpu_decl)
            refuse_double_backward(backward, b.double_backward_message)

        registry.declare(b.tpu_decl, b.tpu, after=link)

    def tpu_op(self):
        return self.registry.get(self.backends.tpu_decl.name)

    def call(self, device: str, params: dict, impl: str | None = None):
        """The op on ``device`` ("cpu": the host op, with ``impl`` when it
        takes one; "tpu": the TPU op) with ``params`` by name."""
        if device == "tpu":
            decl = self.backends.tpu_decl
            return self.tpu_op()(*decl.args(params))
        decl = self.backends.host_decl
        if self.backends.host_impls:
            params = {**params, "impl": impl}
        return self.host_op(*decl.args(params))


def tpu_available() -> bool:
    """True when torch's current accelerator is a TPU (never initialises libtpu)."""
    accelerator = getattr(torch, "accelerator", None)
    try:
        device = accelerator.current_accelerator() if accelerator else None
    except Exception:  # noqa: BLE001 - a broken backend means "no TPU"
        return False
    return device is not None and device.type == "tpu"
