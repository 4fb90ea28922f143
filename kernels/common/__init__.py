"""The shared toolkit of every Hub kernel in this tree (not a Hub kernel itself).

The build copies this folder into each Hub package as the subpackage
``common`` (see the manifests in ``hub_manifests/``), so a kernel reaches it
with ``from ..common import ...``. Modules:

* ``tpu_generations``: per-chip facts (VMEM, scoped VMEM limit, MXU width)
  and which chip this process runs on;
* ``pallas_helpers``: tile arithmetic, the f32-accumulating dot, row masks,
  Mosaic compiler parameters, the poisoning interpreter;
* ``jax_bridge``: importing jax lazily, torch <-> JAX arrays through DLPack;
* ``torch_ops``: torch op schemas declared once, with the host, fake and TPU
  (``torch_tpu`` ``jax_op``) registrations derived from the declaration;
* ``validation``: the argument-error helpers;
* ``aot`` (development only, not shipped): ahead-of-time compiles for a TPU
  generation through libtpu, used by the tests and benchmarks.
"""
