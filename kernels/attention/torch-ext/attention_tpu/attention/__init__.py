"""The attention component: copied as ``attention/`` into attention-tpu.

* ``blocks``: block sizes by a documented rule;
* ``pallas_flash``: the Pallas flash attention kernels (forward, and the dq / dk-dv backward);
* ``masks``: dense masks <-> key ranges plus the causal / window rule;
* ``cpu_native``: the torch-native CPU path;
* ``validation``: argument checks;
* ``ops``: the op declaration, CPU / interpret / TPU paths, ``attention``;
* ``transformers_api``: ``attention_forward``, ``register``, the Hub string route.
"""
