"""``expert_parallel_experts_forward``: the SPMD experts layer (``expert_parallel``) called from torch.

``expert_parallel_experts_forward(module, hidden_states, top_k_index,
top_k_weights, mesh=, axis="ep", tokens="replicated" | "sharded")`` reads the
layer from a Transformers experts module as the single-device TPU path does
(``module_layout.program_args``) and runs ``expert_parallel_forward`` over the
mesh axis ``axis``: experts split over it, remote picks skipped, partial sums
combined with ``psum`` (or all-gathered tokens and ``psum_scatter``).

Every argument is what the calling process holds of the mesh's arrays (JAX's
process-local data): experts split along ``axis``, tokens split along it in
``"sharded"`` mode and whole in ``"replicated"`` mode, expert ids always global
(``[0, E]``, ``E`` the sentinel of a pick that was remote already: the router's
own ids, not the local ids of Transformers' expert-parallel router). So:

* ``tpu`` tensors (``torch_tpu``, one process per chip, e.g. ``torchrun``; the
  mesh from ``torch.tpu.pallas.get_pallas_mesh((axis,))``): each rank passes
  its shards, a module holding its ``E / W`` experts (rank ``r``: experts
  ``[r E / W, (r + 1) E / W)``, the block Transformers' expert parallelism
  gives it, as plain tensors: the local shard of its DTensors), its ``T / W``
  tokens when sharded, and gets its part of the output.
  The call is one ``torch.tpu.pallas.jax_op`` built with ``mesh=``,
  ``input_partition_specs=`` and ``output_partition_specs=`` (``tpu_op``; one
  op per mesh, axis and token mode, one compile per shape);
* ``cpu`` tensors: one process drives every device of a mesh of JAX CPU
  devices (e.g. ``jax.make_mesh((4,), ("ep",))`` with
  ``XLA_FLAGS=--xla_force_host_platform_device_count=4``), so it passes the
  whole arrays: the module with all ``E`` experts, all ``T`` tokens. The same
  program runs there, its Pallas kernels in interpret mode (a check of the
  SPMD program, not fast).

Inference only (no autograd formula). Layers the program cannot express
(a post-expert norm, an overridden gate, an unsupported activation) are
refused with a ValueError: there is no other SPMD implementation to fall back to.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..common import dispatch, jax_bridge, torch_ops, validation
from . import forward, module_layout
from .validation import check_experts_args

FUNCTION = "expert_parallel_experts_forward"
FLOAT_DTYPES = (torch.float32, torch.bfloat16)
# The parameters of the single-device program for float weights (quantized modules are
# refused: the SPMD program does not take them yet), under this op's name.
PROGRAM = dataclasses.replace(
    forward.EXPERTS_PROGRAM, name="expert_parallel_experts_forward_tpu",
    params=tuple(p for p in forward.EXPERTS_PROGRAM.params if p[0] not in forward.QUANTIZED_PARAMS))


def _fail(message: str, error: type[Exception] = ValueError):
    validation.fail(FUNCTION, message, error)


def _check_mesh(mesh, axis: str, tokens: str):
    jax = jax_bridge.import_jax(FUNCTION)
    if not isinstance(mesh, jax.sharding.Mesh):
        _fail(f"mesh must be a jax.sharding.Mesh (on TPU torch.tpu.pallas.get_pallas_mesh(({axis!r},)), on CPU "
              f"jax.make_mesh over JAX CPU devices), got {type(mesh).__name__}", TypeError)
    from .expert_parallel import TOKEN_MODES

    if axis not in mesh.axis_names:
        _fail(f"axis {axis!r} is not an axis of mesh (axes {tuple(mesh.axis_names)})")
    if tokens not in TOKEN_MODES:
        _fail(f"tokens must be one of {TOKEN_MODES}, got {tokens!r}")
    return mesh.shape[axis]


def _program_args(module):
    """``module_layout.program_args``; a ValueError for a layer the program cannot express."""
    if module_layout.weight_format(module):
        _fail(f"module ({type(module).__name__}) holds {module_layout.weight_format(module)} quantized weights, "
              "which the SPMD program does not take yet")
    try:
        return module_layout.program_args(module)
    except NotImplementedError as e:
        _fail(f"module ({type(module).__name__}) is a layer the SPMD program cannot express: {e}")


def program_params(module, hidden_states, top_k_index, top_k_weights) -> dict:
    """``{parameter of PROGRAM: value}`` for ``module`` and the routed tokens
    (checked by ``expert_parallel_experts_forward`` first)."""
    return forward.program_params(_program_args(module), hidden_states, top_k_index.to(torch.int32), top_k_weights)


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(t, DTensor)


def _check_arguments(module, hidden_states, top_k_index, top_k_weights, world: int, axis: str, tokens: str) -> str:
    """All argument checks; returns the device type ("cpu" or "tpu")."""
    module_layout.check_module(module, function=FUNCTION)
    _program_args(module)
    up_name = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    weights = {name: t for name, t in (
        (f"module.{up_name}", module_layout.up_weight(module)), ("module.down_proj", module.down_proj),
        (f"module.{up_name}_bias", module_layout.up_bias(module)),
        ("module.down_proj_bias", module_layout.down_bias(module))) if t is not None}
    held = module_layout.up_weight(module).shape[0]  # the experts this process holds
    validation.check_tensors(FUNCTION, hidden_states=hidden_states)
    device_type = hidden_states.device.type
    if device_type not in ("cpu", "tpu"):
        _fail(f"hidden_states must be on 'tpu' (torch_tpu) or 'cpu', got {hidden_states.device}")
    # Values only on the host: global ids in [0, held], held marking a pick that was remote already.
    check_experts_args(hidden_states, top_k_index, top_k_weights, held, module_layout.hidden_size(module),
                       check_values=device_type == "cpu", function=FUNCTION)
    validation.check_dtype(FUNCTION, "hidden_states", hidden_states, FLOAT_DTYPES)
    for name, t in weights.items():
        validation.check_dtype(FUNCTION, name, t, FLOAT_DTYPES)
        if _is_dtensor(t):
            _fail(f"{name} is a DTensor (Transformers' expert-parallel sharding splits dim 0 so): pass a module "
                  "holding plain tensors, this process's experts (on TPU its local shard, .to_local())", TypeError)
    validation.check_one_device(FUNCTION, hidden_states=hidden_states, **weights)
    if dispatch.needs_grad(hidden_states, top_k_weights, *weights.values()):
        _fail("inference only (the SPMD program has no autograd formula): call it under torch.no_grad() or "
              "torch.inference_mode()", RuntimeError)
    if device_type == "cpu":  # this process holds every shard: whole arrays
        if held % world:
            _fail(f"module holds {held} experts, which do not split over the {world} devices of mesh axis {axis!r}")
        if tokens == "sharded" and hidden_states.shape[0] % world:
            _fail(f"tokens='sharded' needs a token count that divides by the {world} devices of mesh axis {axis!r}; "
                  f"hidden_states has {hidden_states.shape[0]} rows")
    return device_type


def expert_parallel_experts_forward(module, hidden_states, top_k_index, top_k_weights, *, mesh, axis: str = "ep",
                                    tokens: str = "replicated"):
    """``[T, H]`` (this process's rows) from the experts layer run as one SPMD
    program over ``mesh``'s ``axis``; see the module docstring for what each
    process passes on TPU and on CPU."""
    world = _check_mesh(mesh, axis, tokens)
    device_type = _check_arguments(module, hidden_states, top_k_index, top_k_weights, world, axis, tokens)
    params = program_params(module, hidden_states, top_k_index, top_k_weights)
    if device_type == "tpu":
        return tpu_op(mesh, axis, tokens)(*PROGRAM.args(params))
    if any(d.platform != "cpu" for d in mesh.devices.flat):
        _fail(f"cpu tensors run over a mesh of JAX CPU devices; mesh holds "
              f"{sorted({d.platform for d in mesh.devices.flat})} devices")
    return cpu_devices_forward(params, mesh=mesh, axis=axis, tokens=tokens)


def _mesh_generation(mesh) -> str:
    """The TPU generation of the mesh's chips (get_pallas_mesh records their kind)."""
    from ..common import tpu_generations

    device = mesh.devices.flat[0]
    if getattr(device, "platform", None) == "tpu":
        return tpu_generations.generation_from_device_kind(getattr(device, "device_kind", None))
    return tpu_generations.current_generation()


def _tpu_program(*, mesh, axis, tokens, generation, hidden_states, top_k_index, top_k_weights, up_weight,
                 down_weight, up_bias, down_bias, gate, alpha, limit, rhs_layout):
    from . import expert_parallel

    return expert_parallel.expert_parallel_forward(
        hidden_states, top_k_index, top_k_weights, up_weight, down_weight, up_bias, down_bias, mesh=mesh,
        axis=axis, tokens=tokens, gate=gate, alpha=alpha, limit=limit, rhs_layout=rhs_layout, generation=generation)


def tpu_op(mesh, axis: str, tokens: str):
    """The ``jax_op`` running ``expert_parallel_forward`` over ``mesh`` (one
    per mesh, axis and token mode, in the package's ``TPU_OPS``): parameters
    of ``PROGRAM``, each tensor this rank's shard (``input_partition_specs``
    from ``expert_parallel.partition_specs``), output this rank's rows."""
    jax_bridge.import_jax(FUNCTION)
    from jax.sharding import PartitionSpec

    from . import expert_parallel

    in_specs, out_spec = expert_parallel.partition_specs(axis, tokens, with_biases=True)
    # One spec per parameter: torch_tpu pairs them with the arguments
    # positionally (static ones and absent biases ignore theirs).
    in_specs = tuple(in_specs) + (PartitionSpec(),) * (len(PROGRAM.params) - len(in_specs))
    impl = functools.partial(_tpu_program, mesh=mesh, axis=axis, tokens=tokens)
    return torch_ops.TPU_OPS.variant(PROGRAM, (axis, tokens), impl, lambda: _mesh_generation(mesh),
                                     mesh=mesh, input_partition_specs=in_specs,
                                     output_partition_specs=[out_spec])


@functools.cache
def _cpu_program():
    """The SPMD program for meshes of JAX CPU devices, Pallas in interpret
    mode. The mesh and the gate are static arguments: jax's own jit cache
    (bounded) holds each compiled mesh, not a cache of ours."""
    jax = jax_bridge.import_jax(FUNCTION)
    from ..common import pallas_helpers
    from . import expert_parallel

    # check_vma=False: the Pallas interpreters fail jax's vma checks inside
    # shard_map (tests/shard_map_check.py); the TPU op keeps the default.
    return jax.jit(functools.partial(expert_parallel.expert_parallel_forward, check_vma=False,
                                     interpret=pallas_helpers.interpret_params()),
                   static_argnames=("mesh", "axis", "tokens", "gate", "alpha", "limit", "rhs_layout"))


def cpu_devices_forward(params: dict, *, mesh, axis: str, tokens: str) -> torch.Tensor:
    """``PROGRAM``'s parameters (CPU tensors, whole arrays) -> the SPMD
    program over a mesh of JAX CPU devices, Pallas in (NaN-poisoning)
    interpret mode -> a CPU tensor."""
    jax = jax_bridge.import_jax(FUNCTION)
    from jax.sharding import NamedSharding

    from . import expert_parallel

    with_biases = params["up_bias"] is not None
    in_specs, _ = expert_parallel.partition_specs(axis, tokens, with_biases)
    names = ("hidden_states", "top_k_index", "top_k_weights", "up_weight", "down_weight")
    names += ("up_bias", "down_bias") if with_biases else ()
    arrays = [jax.device_put(jax_bridge.to_jax(params[n]), NamedSharding(mesh, s)) for n, s in zip(names, in_specs)]
    statics = {name: params[name] for name in forward.STATIC_PARAMS if name in PROGRAM.names}
    with jax_bridge.INTERPRET_LOCK:
        out = _cpu_program()(*arrays, mesh=mesh, axis=axis, tokens=tokens, **statics)
        # One device's copy of the whole [T, H] (gathered when tokens are sharded).
        out = jax.device_put(out, mesh.devices.flat[0]).block_until_ready()
    return jax_bridge.to_torch(out)
