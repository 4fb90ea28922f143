"""The experts layer as one SPMD program (experts split over a mesh axis):
interpret-mode numerics over 4 CPU devices against a float64 loop, and AOT
compiles for a v6e:2x4 slice at Qwen3-30B-A3B and gpt-oss-20b shapes. In a
fresh process: the device count is fixed when JAX starts."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from conftest import DEV_TREE

SEED = int(os.environ.get("TEST_SEED", np.random.SeedSequence().entropy % (2**31)))


def test_spmd_experts_layer_numerics_and_slice_compiles():
    here = pathlib.Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=str(here), ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    proc = subprocess.run([sys.executable, str(here / "expert_parallel_spmd_check.py"), str(DEV_TREE), str(SEED)],
                          env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert set(result["errors"]) == {"glu_silu_replicated", "glu_silu_sharded", "gpt_oss_replicated",
                                     "gpt_oss_sharded"}
    assert all(err < 1e-5 for err in result["errors"].values()), (result["errors"], SEED)
    assert len(result["compiled_seconds"]) == 2


def test_bad_splits_raise_clear_errors():
    import jax

    from moe_experts_tpu.experts import expert_parallel

    mesh = jax.make_mesh((1,), ("ep",))
    x = np.zeros((3, 4), np.float32)
    ids, w = np.zeros((3, 2), np.int32), np.zeros((3, 2), np.float32)
    up, down = np.zeros((3, 8, 4), np.float32), np.zeros((3, 4, 4), np.float32)
    with pytest.raises(ValueError, match="tokens must be one of"):
        expert_parallel.expert_parallel_forward(x, ids, w, up, down, mesh=mesh, axis="ep", tokens="scattered")
    with pytest.raises(ValueError, match="pass both biases or neither"):
        expert_parallel.expert_parallel_forward(x, ids, w, up, down, np.zeros((3, 8)), mesh=mesh, axis="ep")
    four = jax.sharding.AbstractMesh((4,), ("ep",))
    with pytest.raises(ValueError, match="3 experts do not split over 4 ranks"):
        expert_parallel.expert_parallel_forward(x, ids, w, up, down, mesh=four, axis="ep")
    with pytest.raises(ValueError, match="token count that divides by 4, got 3"):
        expert_parallel.expert_parallel_forward(x, ids, w, np.zeros((4, 8, 4)), np.zeros((4, 4, 4)), mesh=four,
                                                axis="ep", tokens="sharded")
    # Ring all-reduce of the f32 partials: 2 (W - 1) / W of them per rank.
    assert expert_parallel.collective_bytes(1, 2048, 8, 8, "replicated") == int(2 * 7 / 8 * 2048 * 4)
