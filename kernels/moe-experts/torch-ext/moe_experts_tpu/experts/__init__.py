"""The MoE experts component: copied as ``experts/`` into moe-experts-tpu and
ragged-dot-tpu (whose ``experts_forward`` v1 API it serves).

* ``module_layout``: what a Transformers experts module is (flags, weights,
  the gate recognised by what it computes, ``ProgramArgs``), the expert MLP
  written once for every torch path;
* ``routing``: sort by expert, rows per expert (static shapes);
* ``validation``: argument checks of ``experts_forward``;
* ``cpu_path``: CPU inference in chunks of sorted rows;
* ``quantize``: quantized expert weights (int8, fp8, mxfp4): ``quantize_experts``,
  ``load_quantized_experts``, the torch quantizers and dequantizer;
* ``gates``: the gates of the TPU program, in JAX;
* ``pallas_fused_experts``: the fused gate_up -> gate -> down Pallas kernel;
* ``program``: the whole layer as one JAX program (the TPU inference path);
* ``forward``: ``experts_forward``, its routes (``DISPATCH``), the composed path;
* ``registration``: ``register()`` into Transformers' ``ALL_EXPERTS_FUNCTIONS``.
* ``expert_parallel``: the layer as one SPMD program over a mesh axis (JAX);
* ``expert_parallel_torch``: ``expert_parallel_experts_forward``, that program
  from a torch module (a ``jax_op`` with a mesh on TPU, JAX CPU devices on CPU).
"""
