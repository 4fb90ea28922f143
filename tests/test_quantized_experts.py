"""Quantized expert weights, torch side: the quantizers against a float64
reference (each format's rounding rule and scale rule written independently,
extremes included), and quantized experts modules on every torch path of
experts_forward (CPU chunks, composed, torch.compile, gradients to the
activations, refusals, bytes)."""

import os

import numpy as np
import pytest
import torch

import moe_experts_tpu
import tiny_experts
from moe_experts_tpu.common import quant_formats
from moe_experts_tpu.experts import cpu_path, forward, module_layout, quantize

SEED = int(os.environ.get("TEST_SEED", np.random.SeedSequence().entropy % (2**31)))
# In-features divisible by 32 (mxfp4 blocks) for both projections.
SIZES = dict(intermediate_size=32, moe_intermediate_size=32)
# Relative (Frobenius) error of a quantized layer's output against its bf16 layer, random
# N(0, 0.2) weights (measured: int8 ~0.011, fp8 ~0.05, mxfp4 ~0.18); the bounds leave ~2x margin.
LAYER_ERROR = {"int8": 0.03, "fp8": 0.1, "mxfp4": 0.35}


# --- float64 reference ---------------------------------------------------------------------------


def _nearest_even(a, grid):
    """Index into the ascending magnitudes ``grid`` nearest to each ``a``; ties to the even
    index (the even mantissa: index parity is the mantissa's last bit in e2m1 and e4m3)."""
    d = np.abs(a[..., None] - grid)
    tied = d == d.min(-1, keepdims=True)
    even = tied & (np.arange(len(grid)) % 2 == 0)
    return np.where(even.any(-1), even.argmax(-1), tied.argmax(-1))


def _round_to_grid(x, grid):
    a = np.minimum(np.abs(x), grid[-1])
    return np.sign(x) * grid[_nearest_even(a, grid)]


def _near_tie(x, grid, rel=1e-5):
    """Values within ``rel`` of a midpoint of ``grid``: f32 and f64 may round them apart."""
    mids = (grid[1:] + grid[:-1]) / 2
    a = np.abs(x)
    return (np.abs(a[..., None] - mids) <= rel * np.maximum(mids, 1e-30)).any(-1)


E4M3_GRID = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64).numpy()
E2M1_GRID = np.array(quant_formats.E2M1_VALUES[:8])


def reference_int8(w):
    scale = np.abs(w).max(-1, keepdims=True) / 127
    scaled = np.divide(w, scale, out=np.zeros_like(w), where=scale > 0)
    return np.round(scaled) * scale, scaled, np.arange(0.0, 128.0)  # np.round: halves to even; ties at k + 0.5


def reference_fp8(w):
    e, n, k = w.shape
    scale = np.zeros_like(w)
    for i in range(0, n, 128):
        for j in range(0, k, 128):
            scale[:, i:i + 128, j:j + 128] = np.abs(w[:, i:i + 128, j:j + 128]).max(axis=(1, 2), keepdims=True) / 448
    scaled = np.divide(w, scale, out=np.zeros_like(w), where=scale > 0)
    return _round_to_grid(scaled, E4M3_GRID) * scale, scaled, E4M3_GRID


def reference_mxfp4(w):
    e, n, k = w.shape
    blocks = w.reshape(e, n, k // 32, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        exponent = np.where(amax > 0, np.floor(np.log2(amax)) - 2, -127)
    scale = 2.0 ** np.clip(exponent, -127, 127)
    scaled = blocks / scale
    return (_round_to_grid(scaled, E2M1_GRID) * scale).reshape(w.shape), scaled.reshape(w.shape), E2M1_GRID


REFERENCES = {"int8": reference_int8, "fp8": reference_fp8, "mxfp4": reference_mxfp4}


def roundtrip(w, fmt):
    values, scales = quantize.quantize(torch.from_numpy(w).to(torch.float32), fmt)
    weight = quantize.QuantizedWeight(values, scales, fmt, torch.float32)
    return quantize.dequantize(weight, dtype=torch.float64).numpy(), values, scales


def check_against_reference(w, fmt):
    w = w.astype(np.float32).astype(np.float64)
    ours, values, scales = roundtrip(w, fmt)
    expected, scaled, grid = REFERENCES[fmt](w)
    assert values.dtype == getattr(torch, quant_formats.FORMATS[fmt].values_dtype)
    assert tuple(scales.shape) == quant_formats.FORMATS[fmt].scales_shape(*w.shape)
    assert np.isfinite(ours).all()
    mismatch = ~np.isclose(ours, expected, rtol=1e-6, atol=0)
    assert not (mismatch & ~_near_tie(scaled, grid)).any(), f"{fmt}: {mismatch.sum()} values off the reference"
    return ours


@pytest.mark.parametrize("fmt", ["int8", "fp8", "mxfp4"])
@pytest.mark.parametrize("trial", range(3))
def test_quantizer_matches_float64_reference(fmt, trial):
    rng = np.random.default_rng(SEED + trial)
    shape = (2, 130, 288) if fmt == "fp8" else (3, 7, 96)  # fp8: blocks cut at both edges
    w = rng.normal(0, 1, shape) * 10.0 ** rng.uniform(-3, 3, (shape[0], shape[1], 1))
    w[0, 0, :] = 0.0  # an all-zero row / block
    check_against_reference(w, fmt)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "mxfp4"])
def test_roundtrip_error_within_the_format_bound(fmt):
    rng = np.random.default_rng(SEED)
    w = rng.normal(0, 1, (2, 64, 256))
    ours = check_against_reference(w, fmt)
    w = w.astype(np.float32).astype(np.float64)
    err = np.abs(ours - w)
    if fmt == "int8":  # half a step of amax / 127, plus float32 rounding: the quantizer divides and rounds in
        # float32, so a value within a few float32 ulps of a tie may round either way (ulps of amax, not of w)
        amax = np.abs(w).max(-1, keepdims=True)
        assert (err <= amax / 254 + amax * 2.0**-20).all()
    elif fmt == "fp8":  # 3 mantissa bits: half an ulp is 2^-4 relative (normals), 2^-10 * scale (subnormals)
        scale = np.abs(w).max() / 448
        assert (err <= np.maximum(np.abs(w) * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)).all()
    else:  # e2m1: half a step is 1/4 of the magnitude; saturation in [6, 8) * scale costs up to 1/4 of 8
        amax = np.abs(w.reshape(2, 64, 8, 32)).max(-1, keepdims=True)
        scale = np.repeat(2.0 ** (np.floor(np.log2(amax)) - 2), 32, -1).reshape(w.shape)
        assert (err <= np.maximum(np.abs(w) / 4, scale / 4) * (1 + 1e-6) + 2 * scale * (np.abs(w) > 6 * scale)).all()


@pytest.mark.parametrize("fmt", ["int8", "fp8", "mxfp4"])
def test_zeros_and_the_extremes_of_a_block_are_exact(fmt):
    w = np.zeros((1, 2, 128))
    w[0, 1, 5], w[0, 1, 6] = 3.0, -3.0  # +-amax
    ours = check_against_reference(w, fmt)
    assert (ours[0, 0] == 0).all()
    assert ours[0, 1, 5] == 3.0 and ours[0, 1, 6] == -3.0  # amax lands on the grid's largest value


def test_fp8_subnormals_ties_and_saturation():
    # One block with amax 448: scale 1, so the values are e4m3's own.
    sub = 2.0**-9  # smallest subnormal
    row = [448.0, -448.0, sub, sub / 2, 3 * sub / 2, 5 * sub / 2, -sub, 240.0]
    w = np.zeros((1, 1, 16))
    w[0, 0, :len(row)] = row
    ours = check_against_reference(w, "fp8")[0, 0]
    # halves go to the even code: sub/2 -> 0, 3sub/2 -> 2sub, 5sub/2 -> 2sub; 240 is exact
    assert list(ours[:8]) == [448.0, -448.0, sub, 0.0, 2 * sub, 2 * sub, -sub, 240.0]
    values, _ = quantize.quantize_fp8(torch.tensor([[[1000.0, 1.0]]]))
    assert not torch.isnan(values.to(torch.float32)).any()  # the amax saturates to 448, never NaN


def test_mxfp4_e8m0_limits_and_saturation():
    w = np.zeros((1, 4, 32))
    w[0, 0, 0] = np.finfo(np.float32).max  # largest exponent the rule can produce
    w[0, 1, 0] = 1e-44  # f32 subnormal: exponent clamps to -127 (code 0), the value rounds to 0
    w[0, 2, :2] = [7.9, 1.0]  # amax/2^e in [4, 8): 7.9 saturates to 6
    ours = check_against_reference(w, "mxfp4")
    _, scales = quantize.quantize_mxfp4(torch.from_numpy(w).float())
    assert scales[0, :, 0].tolist() == [127 + 127 - 2, 0, 127 + 2 - 2, 0]  # all-zero block: code 0
    assert ours[0, 2, 0] == 6.0 and ours[0, 1, 0] == 0.0 and (ours[0, 3] == 0).all()
    # Dequantizing e8m0 at its ends (codes 0 and 254) against float64.
    # bytes 0x21, 0x31: e2m1 codes 1, 2, 1, 3 (0.5, 1, 0.5, 1.5; 2^127 * 1.5 is still a finite f32)
    codes = torch.tensor([[[0x21, 0x31]]], dtype=torch.uint8).repeat(1, 2, 8)
    for code in (0, 254):
        weight = quantize.QuantizedWeight(codes, torch.full((1, 2, 1), code, dtype=torch.uint8), "mxfp4",
                                          torch.float32)
        expected = np.tile([0.5, 1.0, 0.5, 1.5], 8) * 2.0 ** (code - 127)
        np.testing.assert_allclose(quantize.dequantize(weight, dtype=torch.float64).numpy()[0, 0], expected,
                                   rtol=1e-6, atol=0)


def test_bad_format_and_shape_are_refused():
    with pytest.raises(ValueError, match="weight format must be one of"):
        quantize.quantize(torch.zeros(1, 2, 32), "int4")
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize.quantize(torch.zeros(1, 2, 24), "mxfp4")
    with pytest.raises(ValueError, match="experts, out, in"):
        quantize.quantize(torch.zeros(2, 32), "int8")


# --- quantized modules on the torch paths ---------------------------------------------------------


def dequantized_copy(module, quantized):
    """The float module whose weights are ``quantized``'s dequantized ones (same layout as ``module``)."""
    copy = tiny_experts.build(KIND_OF[type(module).__name__], 0, dtype=module.down_proj.dtype, **SIZES)
    copy.load_state_dict(module.state_dict())
    with torch.no_grad():
        for name in quantize.projection_names(quantized):
            w = quantize.dequantize(quantize.quantized_weight(quantized, name))
            getattr(copy, name).copy_(w.transpose(1, 2) if getattr(copy, "is_transposed", False) else w)
    return copy


KIND_OF = {"GptOssExperts": "gpt_oss", "Qwen3MoeExperts": "qwen3_moe"}


def tokens(module, num_tokens, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, tiny_experts.HIDDEN, generator=gen).to(dtype)
    scores = torch.randn(num_tokens, module.num_experts, generator=gen)
    weights, index = torch.topk(scores.softmax(-1), 2)
    return x, index, weights


def rel_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("kind", ["gpt_oss", "qwen3_moe"])
@pytest.mark.parametrize("fmt", ["int8", "fp8", "mxfp4"])
def test_cpu_path_equals_the_dequantized_module_and_stays_within_the_format_error(kind, fmt):
    module = tiny_experts.build(kind, SEED, dtype=torch.bfloat16, **SIZES)
    x, index, weights = tokens(module, 13, SEED)
    with torch.no_grad():
        bf16 = forward.composed_experts_forward(module, x, index, weights)
        quantized = moe_experts_tpu.quantize_experts(tiny_experts.build(kind, SEED, dtype=torch.bfloat16, **SIZES),
                                                     fmt)
        assert forward.choose_path(quantized, "cpu", False, False)[0] == "cpu_chunked"
        out = moe_experts_tpu.experts_forward(quantized, x, index, weights)
        expected = dequantized_copy(module, quantized)(x, index, weights)  # the module's own eager loop
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert rel_error(out, bf16) < LAYER_ERROR[fmt]


def test_cpu_chunks_dequantize_only_their_own_experts(monkeypatch):
    module = quantize.quantize_experts(tiny_experts.build("qwen3_moe", SEED, dtype=torch.bfloat16, **SIZES), "int8")
    x, index, weights = tokens(module, 40, SEED)
    seen, real = [], quantize.dequantize

    def recording(weight, experts=slice(None), dtype=None):
        out = real(weight, experts, dtype)
        seen.append(out.shape[0])
        return out

    monkeypatch.setattr(quantize, "dequantize", recording)
    with torch.no_grad():
        chunked = cpu_path.cpu_inference_forward(module, x, index, weights, chunk_rows=8)
    assert seen and max(seen) < module.num_experts
    monkeypatch.setattr(quantize, "dequantize", real)
    with torch.no_grad():
        whole = forward.composed_experts_forward(module, x, index, weights)
    torch.testing.assert_close(chunked.float(), whole.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_torch_compile_fullgraph_and_activation_gradients(fmt):
    module = quantize.quantize_experts(tiny_experts.build("gpt_oss", SEED, dtype=torch.float32, **SIZES), fmt)
    reference = dequantized_copy(tiny_experts.build("gpt_oss", SEED, dtype=torch.float32, **SIZES), module)
    x, index, weights = tokens(module, 9, SEED, dtype=torch.float32)
    compiled = torch.compile(moe_experts_tpu.experts_forward, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(module, x, index, weights), reference(x, index, weights),
                                   rtol=1e-4, atol=1e-4)
    xq, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    assert forward.choose_path(module, "cpu", True, False)[0] == "composed"
    moe_experts_tpu.experts_forward(module, xq, index, weights).square().sum().backward()
    reference(xr, index, weights).square().sum().backward()
    torch.testing.assert_close(xq.grad, xr.grad, rtol=1e-4, atol=1e-4)
    # The biases stay trainable parameters; the quantized tensors are buffers without gradients.
    assert module.gate_up_proj_bias.grad is not None
    assert {name for name, _ in module.named_parameters()} == {"gate_up_proj_bias", "down_proj_bias"}


def test_training_the_quantized_tensors_is_refused():
    module = quantize.quantize_experts(tiny_experts.build("qwen3_moe", SEED, **SIZES), "fp8")
    x, index, weights = tokens(module, 4, SEED, dtype=torch.float32)
    module.down_proj_scales.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"Qwen3MoeExperts\.down_proj_scales holds fp8 .*cannot be trained"):
        moe_experts_tpu.experts_forward(module, x, index, weights)


def test_a_cast_of_the_quantized_values_is_refused():
    module = quantize.quantize_experts(tiny_experts.build("qwen3_moe", SEED, **SIZES), "fp8")
    module.to(torch.bfloat16)  # casts floating buffers, e4m3 values included
    x, index, weights = tokens(module, 4, SEED)
    with pytest.raises(RuntimeError, match=r"gate_up_proj of a fp8 module must be torch.float8_e4m3fn"):
        moe_experts_tpu.experts_forward(module, x, index, weights)


def test_quantize_experts_refusals():
    module = quantize.quantize_experts(tiny_experts.build("qwen3_moe", SEED, **SIZES), "int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize.quantize_experts(module, "fp8")
    with pytest.raises(ValueError, match="no Transformers experts module"):
        quantize.quantize_experts(torch.nn.Linear(2, 2), "int8")
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize.quantize_experts(tiny_experts.build("qwen3_moe", SEED), "mxfp4")  # intermediate 24


@pytest.mark.parametrize("fmt", ["int8", "fp8", "mxfp4"])
def test_memory_is_the_quantized_bytes(fmt):
    module = quantize.quantize_experts(tiny_experts.build("gpt_oss", SEED, dtype=torch.bfloat16, **SIZES), fmt)
    e, h, i = module.num_experts, tiny_experts.HIDDEN, 32
    held = sum(b.numel() * b.element_size() for b in module.buffers())
    spec = quant_formats.FORMATS[fmt]
    assert held == spec.hbm_bytes(e, 2 * i, h) + spec.hbm_bytes(e, h, i)
    assert held < e * (2 * i * h + h * i) * 2 * (0.6 if fmt == "mxfp4" else 0.65)


def test_program_args_carry_the_values_scales_and_format():
    module = quantize.quantize_experts(tiny_experts.build("gpt_oss", SEED, **SIZES), "mxfp4")
    args = module_layout.program_args(module)
    assert args.weight_format == "mxfp4" and args.rhs_layout == "nk"
    assert args.up_weight is module.gate_up_proj and args.up_scales is module.gate_up_proj_scales
    assert args.down_weight is module.down_proj and args.down_scales is module.down_proj_scales
    assert forward.choose_path(module, "tpu", False, False)[0] == "tpu_program"
    x, index, weights = tokens(module, 3, SEED, dtype=torch.float32)
    params = forward.program_params(args, x, index, weights)
    assert set(params) == set(forward.EXPERTS_PROGRAM.names)
    bf16 = module_layout.program_args(tiny_experts.build("gpt_oss", SEED, **SIZES))
    assert (bf16.weight_format, bf16.up_scales, bf16.down_scales) == ("", None, None)


def test_quantizing_frees_the_float_weights():
    import gc
    import weakref

    module = tiny_experts.build("gpt_oss", SEED, dtype=torch.bfloat16, **SIZES)
    old = [weakref.ref(module.gate_up_proj), weakref.ref(module.down_proj)]
    quantize.quantize_experts(module, "mxfp4")
    gc.collect()
    assert all(ref() is None for ref in old)


def test_expert_parallel_refuses_a_quantized_module():
    import jax

    module = quantize.quantize_experts(tiny_experts.build("qwen3_moe", SEED, **SIZES), "int8")
    x, index, weights = tokens(module, 4, SEED, dtype=torch.float32)
    mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices("cpu")[:1])
    with pytest.raises(ValueError, match="holds int8 quantized weights, which the SPMD program does not take"):
        moe_experts_tpu.expert_parallel_experts_forward(module, x, index, weights, mesh=mesh, axis="ep")
