"""The TPU program of experts_forward on quantized experts modules, run on CPU
in Pallas interpret mode (``fused_experts_forward_interpret``): the values,
scales and format reach ``program.experts_forward`` through the op's
parameters, and its output matches the CPU path (which dequantizes in torch).
Needs the quantized program (the kernels side of issue 23)."""

import os

import numpy as np
import pytest
import torch

import moe_experts_tpu
import tiny_experts
from moe_experts_tpu.experts import forward, quantize

SEED = int(os.environ.get("TEST_SEED", np.random.SeedSequence().entropy % (2**31)))
SIZES = dict(intermediate_size=32, moe_intermediate_size=32)


@pytest.mark.parametrize("kind", ["gpt_oss", "qwen3_moe"])
@pytest.mark.parametrize("fmt", ["int8", "fp8", "mxfp4"])
def test_interpreted_program_matches_the_cpu_path(kind, fmt):
    module = quantize.quantize_experts(tiny_experts.build(kind, SEED, **SIZES), fmt)
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(11, tiny_experts.HIDDEN, generator=gen)
    weights, index = torch.topk(torch.randn(11, module.num_experts, generator=gen).softmax(-1), 2)
    assert forward.choose_path(module, "cpu", False, False, "interpret")[0] == "interpret_program"
    with torch.no_grad():
        expected = moe_experts_tpu.experts_forward(module, x, index, weights)
        out = moe_experts_tpu.fused_experts_forward_interpret(module, x, index, weights)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_the_tpu_op_infers_the_shape_of_a_quantized_layer():
    """The jax_op of EXPERTS_PROGRAM with int8 values and scales, under fake tensors
    (a fresh interpreter: torch_tpu may abort a CPU host)."""
    import subprocess
    import sys
    import textwrap

    from conftest import DEV_TREE

    code = """
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from moe_experts_tpu.experts import forward
        experts_op = forward.TPU_OPS.get("experts_forward_tpu")
        with FakeTensorMode():
            out = experts_op(
                torch.empty(4, 64, dtype=torch.bfloat16), torch.empty(4, 2, dtype=torch.int64),
                torch.empty(4, 2, dtype=torch.bfloat16), torch.empty(8, 64, 64, dtype=torch.int8),
                torch.empty(8, 64, 32, dtype=torch.int8), None, None, torch.empty(8, 64, dtype=torch.float32),
                torch.empty(8, 64, dtype=torch.float32), "glu_silu", 0.0, 0.0, "nk", "int8")
        print("experts", tuple(out.shape), out.dtype)
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=dict(os.environ, PYTHONPATH=str(DEV_TREE)),
                            capture_output=True, text=True, timeout=300)
    if result.returncode != 0 and "TPU_LIBRARY_PATH" in result.stderr:
        pytest.skip("torch_tpu aborted on this CPU host (docs/ARCHITECTURE.md)")
    assert "experts (4, 64) torch.bfloat16" in result.stdout, result.stderr[-3000:]
