"""Run by test_shard_map.py in a fresh process with 4 CPU devices.

1. Numerics: the Pallas kernels in interpret mode under jax.shard_map against
   float64 references. These run with check_vma=False: jax 0.10.2's Pallas
   interpreters evaluate index maps with vma checks and fail inside JAX
   ("Primitive dynamic_slice requires varying manual axes to match": a grid
   index is unvarying, a prefetched visit array varies), whatever the kernel.
2. Validity with the default check_vma=True: the same programs traced and
   compiled ahead of time for a v6e:2x4 slice (8 chips) through libtpu.

Prints one line `RESULT {json}`."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, sys.argv[1])  # the dev tree

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import reference  # noqa: E402
from attention_tpu.attention import flash_backward, flash_forward, key_ranges  # noqa: E402
from moe_experts_tpu.experts import pallas_fused_experts  # noqa: E402
from ragged_dot_tpu.common.pallas_helpers import interpret_params  # noqa: E402
from ragged_dot_tpu.gmm import pallas_gmm  # noqa: E402

mesh = jax.make_mesh((4,), ("x",))
rng = np.random.default_rng(int(sys.argv[2]))
interpret = True  # pltpu.InterpretParams() fails the same way (its own "eq" vma check)
errors = {}
CHECK_VMA = False  # see the module docstring; the AOT part below runs with the default True


def shard(fn, in_specs, out_specs, mesh=mesh, check_vma=None):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=CHECK_VMA if check_vma is None else check_vma))


def put(a, spec):
    return jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))


# Expert parallelism: 8 experts, 2 per device; every device sees every row and
# computes its window (traced group offset); the sum over devices is the result.
m, k, n, e = 40, 16, 24, 8
sizes = reference.random_group_sizes(rng, e, m, "with_zeros").astype(np.int32)
lhs = rng.standard_normal((m, k)).astype(np.float32)
rhs = rng.standard_normal((e, n, k)).astype(np.float32)
dout = rng.standard_normal((m, n)).astype(np.float32)


def ep_gmm(x, w, s):
    offset = jax.lax.axis_index("x") * w.shape[0]
    return jax.lax.psum(pallas_gmm.gmm(x, w, s, group_offset=offset, interpret=interpret), "x")


def ep_tgmm(x, dy, s):
    offset = jax.lax.axis_index("x") * (e // 4)
    return pallas_gmm.tgmm(x, dy, s, num_local_groups=e // 4, group_offset=offset, interpret=interpret)


out = shard(ep_gmm, (P(), P("x"), P()), P())(
    put(lhs, P()), put(rhs, P("x")), put(sizes, P()))
errors["gmm_expert_parallel"] = float(np.abs(np.asarray(out) - reference.ragged_dot(lhs, rhs, sizes)).max())
grad = shard(ep_tgmm, (P(), P(), P()), P("x"))(
    put(lhs, P()), put(dout, P()), put(sizes, P()))
errors["tgmm_expert_parallel"] = float(np.abs(np.asarray(grad) - reference.weight_grad(lhs, dout, sizes, e)).max())

# The fused experts kernel, data parallel: each device its own rows and routing.
h, inter = 16, 8
x = rng.standard_normal((4, 12, h)).astype(np.float32)
gate_up = (rng.standard_normal((e, 2 * inter, h)) * 0.3).astype(np.float32)
down = (rng.standard_normal((e, h, inter)) * 0.3).astype(np.float32)
dp_sizes = np.stack([reference.random_group_sizes(rng, e, 12, "random") for _ in range(4)]).astype(np.int32)


def dp_fused(xs, gu, dn, s):
    return pallas_fused_experts.fused_glu_experts(xs[0], gu, dn, s[0], gate="glu_silu", tm=8,
                                                  interpret=interpret)[None]


fused = np.asarray(shard(dp_fused, (P("x"), P(), P(), P("x")), P("x"))(
    put(x, P("x")), put(gate_up, P()), put(down, P()), put(dp_sizes, P("x"))))
worst = 0.0
for d in range(4):
    g = reference.ragged_dot(x[d], gate_up[:, :inter], dp_sizes[d])
    u = reference.ragged_dot(x[d], gate_up[:, inter:], dp_sizes[d])
    act = g / (1 + np.exp(-g)) * u
    worst = max(worst, float(np.abs(fused[d] - reference.ragged_dot(act, down, dp_sizes[d])).max()))
errors["fused_experts_data_parallel"] = worst

# Attention, heads split over devices (tensor parallel): forward and backward.
b, hq, hkv, sq, skv, dh = 2, 8, 4, 5, 11, 16
q = rng.standard_normal((b, hq, sq, dh)).astype(np.float32)
kk = rng.standard_normal((b, hkv, skv, dh)).astype(np.float32)
vv = rng.standard_normal((b, hkv, skv, dh)).astype(np.float32)
start, end = np.array([0, 2], np.int32), np.array([11, 11], np.int32)


def tp_attention(q, k, v, s, t):
    bounds = key_ranges.rule_key_bounds(s, t, sq=q.shape[2], skv=k.shape[2], causal=True, window=0)
    out, lse = flash_forward.flash_attention_with_lse(q, k, v, bounds, causal=True, interpret=interpret)
    grads = flash_backward.flash_attention_backward(q, k, v, out, lse, jnp.ones_like(out), bounds, causal=True,
                                                    interpret=interpret)
    return out, grads[0]


heads = P(None, "x")
out, dq = shard(tp_attention, (heads, heads, heads, P(), P()), (heads, heads))(
    put(q, heads), put(kk, heads), put(vv, heads), put(start, P()), put(end, P()))
visible = reference.attention_rule_mask(start, end, sq, skv, causal=True, window=0)
errors["attention_tensor_parallel"] = float(np.abs(np.asarray(out) - reference.attention(
    q, kk, vv, visible, scale=dh ** -0.5)).max())
errors["attention_backward_finite"] = float(np.isfinite(np.asarray(dq)).all())
# 2. The same programs, with check_vma=True, compiled for an 8-chip v6e slice.
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

slice_mesh = Mesh(np.array(topologies.get_topology_desc(platform="tpu", topology_name="v6e:2x4").devices), ("x",))
interpret = False


def spec(shape, dtype, p):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(slice_mesh, p))


bf16, i32 = jnp.bfloat16, jnp.int32
compiled = {}
for name, fn, in_specs, out_specs, args in [
    ("gmm_expert_parallel", ep_gmm, (P(), P("x"), P()), P(),
     (spec((512, 2048), bf16, P()), spec((128, 1536, 2048), bf16, P("x")), spec((128,), i32, P()))),
    ("fused_experts_data_parallel", dp_fused, (P("x"), P(), P(), P("x")), P("x"),
     (spec((8, 64, h), bf16, P("x")), spec((e, 2 * inter, h), bf16, P()), spec((e, h, inter), bf16, P()),
      spec((8, e), i32, P("x")))),
    ("attention_tensor_parallel", tp_attention, (heads, heads, heads, P(), P()), (heads, heads),
     (spec((2, 32, 256, 128), bf16, heads), spec((2, 8, 256, 128), bf16, heads),
      spec((2, 8, 256, 128), bf16, heads), spec((2,), i32, P()), spec((2,), i32, P()))),
]:
    shard(fn, in_specs, out_specs, mesh=slice_mesh, check_vma=True).lower(*args).compile()
    compiled[name] = True
print("RESULT " + json.dumps({"errors": errors, "compiled_with_check_vma": compiled}))
