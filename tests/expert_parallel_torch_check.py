"""Run by test_expert_parallel_torch.py in a fresh process with 4 CPU devices.

``moe_experts_tpu.expert_parallel_experts_forward`` (torch tensors and a
Transformers experts module in, the SPMD layer over a 4-device JAX CPU mesh,
Pallas in NaN-poisoning interpret mode) on a tiny Qwen3-MoE experts module
(GLU, SiLU, fused kernel) and a gpt-oss one (transposed, biased, clamped gate,
two grouped matmuls), tokens replicated and sharded, against a float64 loop
(``reference.moe_experts``). Picks of every rank, picks that were remote
already (id ``E``) and a token whose picks are all remote. Then the errors
only a multi-device mesh can raise (experts or tokens that do not split), and
the refusal of a module holding DTensors (in this fresh process: it starts a
one-process gloo group).

argv: dev tree, seed. Prints one line `RESULT {json}`."""

import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, sys.argv[1])  # the dev tree

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import moe_experts_tpu  # noqa: E402
import reference  # noqa: E402
import tiny_experts  # noqa: E402

seed = int(sys.argv[2])
rng = np.random.default_rng(seed)
mesh = jax.make_mesh((4,), ("ep",))
EXPERTS, TOKENS, TOP_K = 8, 12, 3
forward = moe_experts_tpu.expert_parallel_experts_forward
result = {"cases": {}, "errors": {}, "seconds": {}}


def routing(experts):
    ids = np.stack([rng.choice(experts, TOP_K, replace=False) for _ in range(TOKENS)])
    ids[:4, 0] = [0, 2, 4, 6]  # every rank's experts are picked (2 per rank)
    ids[5, -1] = experts  # a pick that was remote already (Transformers' own EP sentinel)
    ids[7, :] = experts  # a token with nothing local anywhere: its row must be exactly zero
    weights = rng.random((TOKENS, TOP_K)).astype(np.float32)
    weights[5, -1] = np.nan  # a remote pick's weight must never be read
    return ids, weights


def reference_args(module, kind):
    """The module as ``reference.moe_experts`` reads it: "nk" weights, named gate."""
    n = lambda t: t.detach().double().numpy()  # noqa: E731
    if kind == "gpt_oss":
        return dict(up=n(module.gate_up_proj).transpose(0, 2, 1), down=n(module.down_proj).transpose(0, 2, 1),
                    gate="gpt_oss", up_bias=n(module.gate_up_proj_bias), down_bias=n(module.down_proj_bias),
                    alpha=module.alpha, limit=module.limit)
    return dict(up=n(module.gate_up_proj), down=n(module.down_proj), gate="glu_silu")


configs = {"qwen3_moe": dict(num_experts=EXPERTS), "gpt_oss": dict(num_local_experts=EXPERTS)}
for kind, config in configs.items():
    module = tiny_experts.build(kind, seed, **config)
    ids, weights = routing(EXPERTS)
    hidden = rng.standard_normal((TOKENS, tiny_experts.HIDDEN)).astype(np.float32)
    ref = reference_args(module, kind)
    want = reference.moe_experts(hidden, ids, np.nan_to_num(weights), ref.pop("up"), ref.pop("down"), **ref)
    id_dtype = torch.int64 if kind == "qwen3_moe" else torch.int32  # Transformers' routers give int64
    for mode in ("replicated", "sharded"):
        start = time.perf_counter()
        with torch.no_grad():
            out = forward(module, torch.from_numpy(hidden), torch.from_numpy(ids).to(id_dtype),
                          torch.from_numpy(weights), mesh=mesh, axis="ep", tokens=mode)
        result["seconds"][f"{kind}_{mode}"] = round(time.perf_counter() - start, 1)
        got = out.double().numpy()
        scale = np.abs(want).max()
        result["cases"][f"{kind}_{mode}"] = {
            "shape": list(out.shape), "dtype": str(out.dtype), "device": str(out.device),
            "max_rel_error": float(np.abs(got - want).max() / scale),
            # Elementwise: f32 1e-5 relative (with a floor of 1e-5 of the output's scale).
            "elementwise_ok": bool(np.allclose(got, want, rtol=1e-5, atol=1e-5 * scale)),
            "finite": bool(np.isfinite(got).all()),
            "nonzero_rows": int((np.abs(got).max(axis=1) > 0).sum()),
            "want_nonzero_rows": int((np.abs(want).max(axis=1) > 0).sum()),
            "all_remote_row_zero": bool((got[7] == 0).all()),
        }


def error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    return "no error"


nine = tiny_experts.build("qwen3_moe", seed)  # 9 experts: they do not split 4 ways
x, ids, w = torch.zeros(TOKENS, tiny_experts.HIDDEN), torch.zeros(TOKENS, 2, dtype=torch.int64), torch.ones(TOKENS, 2)
module = tiny_experts.build("qwen3_moe", seed, num_experts=EXPERTS)
with torch.no_grad():
    result["errors"]["experts_do_not_split"] = error_of(lambda: forward(nine, x, ids, w, mesh=mesh, axis="ep"))
    result["errors"]["tokens_do_not_split"] = error_of(
        lambda: forward(module, x[:10], ids[:10], w[:10], mesh=mesh, axis="ep", tokens="sharded"))
    result["errors"]["id_out_of_range"] = error_of(
        lambda: forward(module, x, ids + EXPERTS + 1, w, mesh=mesh, axis="ep"))

# Transformers' expert parallelism leaves DTensors on the module: refused, naming the weight.
import socket  # noqa: E402

import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh  # noqa: E402

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
sharded = tiny_experts.build("qwen3_moe", seed, num_experts=EXPERTS)
sharded.gate_up_proj = torch.nn.Parameter(distribute_tensor(sharded.gate_up_proj.data, init_device_mesh("cpu", (1,)),
                                                            [Shard(0)]), requires_grad=False)
with torch.no_grad():
    result["errors"]["dtensor"] = error_of(lambda: forward(sharded, x, ids, w, mesh=mesh, axis="ep"))
dist.destroy_process_group()
print("RESULT " + json.dumps(result))
