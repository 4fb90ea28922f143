"""The grouped matmul (ragged dot) component: copied as ``gmm/`` into every Hub
kernel that needs it (ragged-dot-tpu, moe-experts-tpu).

* ``layouts``: the two weight layouts ("nk" ``[G, N, K]``, "kn" ``[G, K, N]``);
* ``tiling``: tile sizes per TPU generation, by a documented rule;
* ``pallas_gmm``: the Pallas kernels (forward ``gmm``, weight gradient ``tgmm``);
* ``cpu_native``: the torch-native CPU implementation;
* ``validation``: argument checks with clear errors;
* ``ops``: the torch ops (CPU, interpret, TPU via ``jax_op``), autograd and the
  public ``ragged_dot``.
"""
