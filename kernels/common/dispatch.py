"""Which implementation a call runs: one resolution rule for every op.

Each public function (``ragged_dot``, ``attention``, ``experts_forward``)
declares its routes once, as a ``Dispatcher`` of ``Route`` s, and calls
``dispatch``. A route is one implementation family on one device: its
``impl`` name (the value a caller may pass as ``impl=``), the conditions
under which it may run, and optionally an ``accepts`` check that can refuse
an input it cannot express.

The rule (``Dispatcher.resolve``), the same for every op:

1. The device of the call's tensors picks the family: ``"tpu"`` or
   ``"cpu"``; any other device is a ValueError naming the devices.
2. ``impl="auto"`` takes the device's default (Pallas on a TPU, the native
   torch path on CPU); any other value must be one of the device's impls
   (ValueError naming them), e.g. ``"interpret"`` (the Pallas kernels in
   interpret mode on CPU).
3. Among the routes of that device and impl, in declaration order, the first
   whose condition holds: ``EAGER`` routes run only without gradients and
   outside ``torch.compile`` tracing (fast paths that skip autograd and the
   custom-op dispatch), ``NO_GRAD`` routes only without gradients (programs
   with no autograd formula), ``ANY`` routes always. A route whose
   ``accepts`` raises NotImplementedError is passed over; the next one runs
   after a warning (once per reason) saying what was refused and what runs
   instead.

What a route runs is the op's own business: host custom ops, ``jax_op``
TPU ops and their backward are declared once per op in ``torch_ops``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import torch

AUTO = "auto"
EAGER, NO_GRAD, ANY = "eager", "no_grad", "any"
CONDITIONS = (EAGER, NO_GRAD, ANY)


def needs_grad(*tensors) -> bool:
    """True when autograd records an op on any of ``tensors`` (None skipped)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@dataclasses.dataclass(frozen=True)
class Call:
    """What the rule reads of one call."""

    device: str
    impl: str = AUTO
    grad: bool = False
    compiling: bool = False

    @classmethod
    def of(cls, device: torch.device | str, impl: str = AUTO, grad_tensors=()) -> "Call":
        """The call's facts: its device type, ``impl``, whether any of
        ``grad_tensors`` needs a gradient, and whether torch.compile traces it."""
        device_type = device.type if isinstance(device, torch.device) else str(device)
        return cls(device_type, impl, needs_grad(*grad_tensors), torch.compiler.is_compiling())


@dataclasses.dataclass(frozen=True)
class Route:
    """One implementation: ``run(*args, **kwargs)`` (``run(*args, accepted=...,
    **kwargs)`` when ``accepts`` is given: what ``accepts(*args, **kwargs)``
    returned). ``name`` is what ``resolve`` reports; ``description`` what a
    fallback warning says runs instead."""

    name: str
    device: str
    impl: str
    run: Callable[..., Any]
    when: str = ANY
    accepts: Callable[..., Any] | None = None
    description: str = ""

    def __post_init__(self):
        if self.when not in CONDITIONS:
            raise ValueError(f"Route {self.name}: when must be one of {CONDITIONS}, got {self.when!r}")

    def allowed(self, call: Call) -> bool:
        if self.when == EAGER:
            return not call.grad and not call.compiling
        if self.when == NO_GRAD:
            return not call.grad
        return True


@dataclasses.dataclass(frozen=True)
class Resolved:
    route: Route
    accepted: Any = None

    @property
    def name(self) -> str:
        return self.route.name


class Dispatcher:
    """The routes of one public function, and the rule that picks one (module docstring)."""

    def __init__(self, function: str, routes: tuple[Route, ...], defaults: dict[str, str]):
        self.function = function
        self.routes = tuple(routes)
        self.defaults = dict(defaults)
        # Reasons already warned about (one warning per reason and process).
        self.warned: set[str] = set()
        for device, impl in self.defaults.items():
            if impl not in self.impls(device):
                raise ValueError(f"{function}: default impl {impl!r} of {device!r} has no route")

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.device for r in self.routes))

    def impls(self, device: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.impl for r in self.routes if r.device == device))

    def _check(self, call: Call) -> str:
        if call.device not in self.devices:
            raise ValueError(f"{self.function}: tensors must be on a "
                             f"{' or '.join(repr(d) for d in self.devices)} device, got {call.device!r}")
        impl = self.defaults[call.device] if call.impl == AUTO else call.impl
        if impl not in self.impls(call.device):
            raise ValueError(f"{self.function}: impl must be {AUTO!r} or one of {self.impls(call.device)} on "
                             f"{call.device!r} tensors, got {call.impl!r}")
        return impl

    def resolve(self, call: Call, *args, **kwargs) -> Resolved:
        """The route ``call`` takes (``args`` / ``kwargs`` go to ``accepts``)."""
        impl = self._check(call)
        refused = None
        excluded = []
        for route in self.routes:
            if route.device != call.device or route.impl != impl:
                continue
            if not route.allowed(call):
                excluded.append(route.when)
                continue
            if route.accepts is None:
                resolved = Resolved(route)
            else:
                try:
                    resolved = Resolved(route, route.accepts(*args, **kwargs))
                except NotImplementedError as e:
                    refused = str(e)
                    continue
            if refused is not None and refused not in self.warned:
                self.warned.add(refused)
                warnings.warn(f"{refused}; {route.description or route.name} instead", stacklevel=4)
            return resolved
        if refused is not None:
            raise NotImplementedError(f"{self.function}: {refused} (impl={impl!r} on {call.device!r} tensors has "
                                      "no other implementation)")
        needs = ("no gradients (call it under torch.no_grad())" if NO_GRAD in excluded
                 else "no gradients and no torch.compile tracing")
        raise RuntimeError(f"{self.function}: impl={impl!r} on {call.device!r} tensors runs with {needs}")

    def __call__(self, call: Call, *args, **kwargs):
        """Resolve ``call`` and run its route on ``args`` / ``kwargs``."""
        resolved = self.resolve(call, *args, **kwargs)
        if resolved.route.accepts is None:
            return resolved.route.run(*args, **kwargs)
        return resolved.route.run(*args, accepted=resolved.accepted, **kwargs)
