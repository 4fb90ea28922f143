"""The attention component: copied as ``attention/`` into attention-tpu.

* ``blocks``: block sizes by a documented rule, ``BlockSizes``;
* ``key_ranges``: which keys each query sees (the rule, once), the visit table, the walk plans;
* ``flash_forward``: the Pallas flash attention forward kernel;
* ``flash_backward``: the Pallas dk-dv and dq backward kernels;
* ``masks``: dense masks <-> key ranges plus the causal / window rule;
* ``cpu_native``: the torch-native CPU path;
* ``validation``: argument checks;
* ``ops``: the op declaration, CPU / interpret / TPU paths, ``attention``;
* ``transformers_api``: ``attention_forward``, ``register``, the Hub string route.
"""
