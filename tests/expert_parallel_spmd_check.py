"""Run by test_expert_parallel_spmd.py in a fresh process with 4 CPU devices.

1. Numerics: ``expert_parallel_forward`` (experts split over 4 devices, the
   Pallas kernels in interpret mode, check_vma=False as shard_map_check.py
   explains) against a float64 loop, tokens replicated and sharded, a Qwen3-style
   GLU layer (fused kernel) and a gpt-oss-style one (biases, two grouped
   matmuls), with picks of every rank and ids already remote.
2. Validity: the SPMD layer compiled ahead of time for a v6e:2x4 slice (8 chips)
   with the default check_vma=True, at Qwen3-30B-A3B 1 / 64 / 512 tokens and
   gpt-oss-20b 64 tokens.

Prints one line `RESULT {json}`."""

import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, sys.argv[1])  # the dev tree

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import reference  # noqa: E402
from moe_experts_tpu.experts import expert_parallel  # noqa: E402

rng = np.random.default_rng(int(sys.argv[2]))
mesh = jax.make_mesh((4,), ("ep",))
errors = {}


def routing(tokens, experts, top_k):
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    ids[0, -1] = experts  # an id that was remote already (Transformers' own EP sentinel)
    weights = rng.random((tokens, top_k)).astype(np.float32)
    return ids, weights


def layer(experts, hidden, inter, gate, biases):
    up = (rng.standard_normal((experts, 2 * inter, hidden)) * 0.3).astype(np.float32)
    down = (rng.standard_normal((experts, hidden, inter)) * 0.3).astype(np.float32)
    if not biases:
        return up, down, None, None
    return up, down, rng.standard_normal((experts, 2 * inter)).astype(np.float32), \
        rng.standard_normal((experts, hidden)).astype(np.float32)


for name, gate, biases in (("glu_silu", "glu_silu", False), ("gpt_oss", "gpt_oss", True)):
    experts, hidden, inter, top_k, tokens = 8, 16, 8, 3, 12
    up, down, up_b, down_b = layer(experts, hidden, inter, gate, biases)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids, weights = routing(tokens, experts, top_k)
    want = reference.moe_experts(x, ids, weights, up, down, gate=gate, up_bias=up_b, down_bias=down_b)
    for mode in expert_parallel.TOKEN_MODES:
        args = [x, ids, weights, up, down] + ([up_b, down_b] if biases else [])
        in_specs, _ = expert_parallel.partition_specs("ep", mode, biases)
        placed = [jax.device_put(jnp.asarray(a), NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]
        fn = jax.jit(lambda *a, mode=mode: expert_parallel.expert_parallel_forward(
            *a, mesh=mesh, axis="ep", tokens=mode, check_vma=False, gate=gate, interpret=True))
        got = np.asarray(fn(*placed))
        errors[f"{name}_{mode}"] = float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))

# 2. AOT for an 8-chip v6e slice, real model shapes, bf16.
from jax.experimental import topologies  # noqa: E402

slice_mesh = Mesh(np.array(topologies.get_topology_desc(platform="tpu", topology_name="v6e:2x4").devices), ("ep",))
MODELS = {  # experts, hidden, intermediate, top_k, gate, biases
    "qwen3-30b-a3b": (128, 2048, 768, 8, "glu_silu", False),
    "gpt-oss-20b": (32, 2880, 2880, 4, "gpt_oss", True),
}
compiled = {}
# Each token mode once (the per-rank kernels at every token count compile on one chip in test_aot_tpu.py;
# the slice adds the collectives).
for model, tokens, mode in (("qwen3-30b-a3b", 512, "sharded"), ("gpt-oss-20b", 64, "replicated")):
    experts, hidden, inter, top_k, gate, biases = MODELS[model]
    in_specs, _ = expert_parallel.partition_specs("ep", mode, biases)
    shapes = [((tokens, hidden), jnp.bfloat16), ((tokens, top_k), jnp.int32), ((tokens, top_k), jnp.bfloat16),
              ((experts, 2 * inter, hidden), jnp.bfloat16), ((experts, hidden, inter), jnp.bfloat16)]
    shapes += [((experts, 2 * inter), jnp.bfloat16), ((experts, hidden), jnp.bfloat16)] if biases else []
    specs = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(slice_mesh, p)) for (s, d), p in zip(shapes, in_specs)]
    start = time.perf_counter()
    jax.jit(lambda *a, mode=mode, gate=gate: expert_parallel.expert_parallel_forward(
        *a, mesh=slice_mesh, axis="ep", tokens=mode, gate=gate, generation="v6e")).lower(*specs).compile()
    compiled[f"{model} {tokens} {mode}"] = round(time.perf_counter() - start, 1)
print("RESULT " + json.dumps({"errors": errors, "compiled_seconds": compiled}))
