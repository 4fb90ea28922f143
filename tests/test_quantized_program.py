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
