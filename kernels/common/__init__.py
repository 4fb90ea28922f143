"""The shared toolkit of every Hub kernel in this tree (not a Hub kernel itself).

The build copies this folder into each Hub package as the subpackage
``common`` (see the manifests in ``hub_manifests/``), so a kernel reaches it
with ``from ..common import ...``. Modules:

* ``tpu_generations``: per-chip facts (VMEM, scoped VMEM limit, MXU width)
  and which chip this process runs on;
* ``pallas_helpers``: tile arithmetic, the f32-accumulating dot, row masks,
  Mosaic compiler parameters, the poisoning interpreter;
* ``jax_bridge``: importing jax lazily, torch <-> JAX arrays through DLPack;
* ``torch_ops``: every backend of an op declared once (``OpBackends``), with
  the host, fake, autograd and TPU (``torch_tpu`` ``jax_op``, one registry per
  package) registrations derived from the declaration;
* ``dispatch``: the one rule that routes a call (device, ``impl``, gradients,
  ``torch.compile``) to an implementation;
* ``transformers_interface``: registering one of our functions in a
  Transformers interface, with one set of refusal rules;
* ``validation``: the argument-error helpers;
* ``quant_formats``: the quantized expert-weight formats (int8, fp8, mxfp4):
  layouts, scale blocks, bytes;
* ``aot`` (development only, not shipped): ahead-of-time compiles for a TPU
  generation through libtpu, used by the tests and benchmarks.
"""
