"""The Pallas kernels under jax.shard_map (expert-, data- and tensor-parallel
layouts): interpret-mode numerics over 4 CPU devices, and AOT compiles for a
v6e:2x4 slice with the default check_vma=True (shard_map_check.py says why the
numerics run without it). In a fresh process: the device count is fixed when
JAX starts."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np

from conftest import DEV_TREE

SEED = int(os.environ.get("TEST_SEED", np.random.SeedSequence().entropy % (2**31)))


def test_kernels_under_shard_map_with_vma_checks():
    here = pathlib.Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=str(here))
    proc = subprocess.run([sys.executable, str(here / "shard_map_check.py"), str(DEV_TREE), str(SEED)], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    errors = result["errors"]
    assert errors.pop("attention_backward_finite") == 1.0
    assert all(err < 1e-4 for err in errors.values()), (errors, SEED)
    assert result["compiled_with_check_vma"] == {"gmm_expert_parallel": True, "fused_experts_data_parallel": True,
                                                 "attention_tensor_parallel": True}
