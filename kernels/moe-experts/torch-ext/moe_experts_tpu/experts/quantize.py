"""Quantized expert weights on the torch side: quantizers, dequantizers, and
``quantize_experts`` / ``load_quantized_experts`` (docs/quantized_torch.md).

The formats are ``common.quant_formats`` (int8 per output channel, fp8 e4m3
with 128 x 128 block scales, mxfp4 with e8m0 scales per 32 along K), always
stored "nk" (``[E, out, in]``).

A quantized module stays the Transformers experts module it was (same class,
so ``experts_implementation=`` keeps dispatching to ``experts_forward``):

* ``gate_up_proj`` (``up_proj`` without a gate) and ``down_proj`` become
  *buffers* holding the values: not parameters, so no optimizer, ``.grad``
  or ``requires_grad_()`` on ``model.parameters()`` ever reaches them, and
  they still follow ``model.to(device)`` and ``state_dict``;
* ``gate_up_proj_scales`` (``up_proj_scales``) and ``down_proj_scales``:
  buffers of the scales;
* ``weight_format``: the format's name; ``dequantized_dtype``: the dtype the
  weights had (what every path computes in);
* ``is_transposed = False`` on the instance: the values are "nk" whatever
  the module's bf16 layout was (gpt-oss's "kn" weights are transposed once).

Biases stay parameters (trainable). Training the values or scales themselves
is refused (``check_frozen``): a quantized weight has no gradient.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import torch

from ..common import quant_formats

FORMAT_ATTRIBUTE = "weight_format"
DTYPE_ATTRIBUTE = "dequantized_dtype"
SCALES_SUFFIX = "_scales"
FP8_BLOCK = quant_formats.FORMATS["fp8"].block_n
MX_BLOCK = quant_formats.FORMATS["mxfp4"].block_k
_TORCH_VALUES_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "mxfp4": torch.uint8}
_TORCH_SCALES_DTYPES = {"int8": torch.float32, "fp8": torch.float32, "mxfp4": torch.uint8}


class QuantizedWeight(NamedTuple):
    """One quantized projection of all experts: what the torch paths dequantize."""

    values: torch.Tensor
    scales: torch.Tensor
    format: str
    dtype: torch.dtype


# --- quantizers: a float [E, N, K] tensor -> (values, scales) ------------------------------------


def _safe(scale: torch.Tensor) -> torch.Tensor:
    """Divisor for ``scale``: 1 where a block is all zero (its values are 0 whatever the scale)."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _expand_blocks(scales: torch.Tensor, n: int, k: int, block_n: int, block_k: int) -> torch.Tensor:
    """Block scales ``[E, N/bn, K/bk]`` repeated to ``[E, N, K]`` (cut at unaligned edges)."""
    return scales.repeat_interleave(block_n, 1)[:, :n].repeat_interleave(block_k, 2)[:, :, :k]


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.to(torch.float32)
    scales = w.abs().amax(dim=-1) / quant_formats.INT8_MAX
    q = torch.round(w / _safe(scales)[..., None]).clamp(-quant_formats.INT8_MAX, quant_formats.INT8_MAX)
    return q.to(torch.int8), scales


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.to(torch.float32)
    e, n, k = w.shape
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = torch.zeros(e, nb * FP8_BLOCK, kb * FP8_BLOCK, dtype=torch.float32, device=w.device)
    padded[:, :n, :k] = w
    amax = padded.abs().view(e, nb, FP8_BLOCK, kb, FP8_BLOCK).amax(dim=(2, 4))
    scales = amax / quant_formats.FP8_E4M3_MAX
    scaled = w / _expand_blocks(_safe(scales), n, k, FP8_BLOCK, FP8_BLOCK)
    # Saturate: an e4m3fn cast past 448 would give NaN (it has no infinity).
    scaled = scaled.clamp(-quant_formats.FP8_E4M3_MAX, quant_formats.FP8_E4M3_MAX)
    return scaled.to(torch.float8_e4m3fn), scales


# |value| * 2 -> e2m1 magnitude code (0, 0.5, 1, 1.5, 2, 3, 4, 6 -> codes 0..7)
_E2M1_CODE_OF_TWICE = {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 6: 5, 8: 6, 12: 7}


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the e2m1 grid (saturating at 6); the 4-bit codes as uint8."""
    a = x.abs().clamp(max=6.0)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    magnitude = torch.round(a / step) * step  # torch.round: halves to even, i.e. to the even mantissa
    table = torch.zeros(13, dtype=torch.uint8, device=x.device)
    for twice, code in _E2M1_CODE_OF_TWICE.items():
        table[twice] = code
    codes = table[(magnitude * 2).to(torch.int64)]
    return torch.where((x < 0) & (codes > 0), codes | 8, codes)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX: per 32 values along K the shared exponent floor(log2(amax)) - 2
    (e2m1's largest exponent), clamped to e8m0's range; values RNE onto e2m1."""
    w = w.to(torch.float32)
    e, n, k = w.shape
    quant_formats.FORMATS["mxfp4"].check_shape(k)
    blocks = w.view(e, n, k // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # floor(log2(amax)) exactly, from the float's own exponent (f32 log2 rounds 2^128 - ulp up to 128).
    floor_log2 = (torch.frexp(amax).exponent - 1).to(torch.float32)
    exponent = torch.where(amax > 0, floor_log2 - 2, torch.full_like(amax, -quant_formats.E8M0_BIAS))
    exponent = exponent.clamp(-quant_formats.E8M0_BIAS, quant_formats.E8M0_BIAS)
    codes = _e2m1_codes(blocks / torch.exp2(exponent)[..., None]).view(e, n, k)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # even k in the low nibble
    return packed, (exponent + quant_formats.E8M0_BIAS).to(torch.uint8)


QUANTIZERS = {"int8": quantize_int8, "fp8": quantize_fp8, "mxfp4": quantize_mxfp4}


def quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)`` of an "nk" float tensor ``[E, N, K]`` in format ``fmt``."""
    quant_formats.weight_format(fmt)
    if w.dim() != 3:
        raise ValueError(f"quantize: the weight must be [experts, out, in], got shape {tuple(w.shape)}")
    return QUANTIZERS[fmt](w)


# --- dequantizer ----------------------------------------------------------------------------------


def dequantize(weight: QuantizedWeight, experts: slice = slice(None), dtype: torch.dtype | None = None):
    """``weight[experts]`` as ``dtype`` (default: the module's own) ``[e, N, K]``, "nk"."""
    values, scales = weight.values[experts], weight.scales[experts]
    dtype = dtype or weight.dtype
    if weight.format == "int8":
        w = values.to(torch.float32) * scales[..., None]
    elif weight.format == "fp8":
        n, k = values.shape[1:]
        w = values.to(torch.float32) * _expand_blocks(scales, n, k, FP8_BLOCK, FP8_BLOCK)
    elif weight.format == "mxfp4":
        lut = torch.tensor(quant_formats.E2M1_VALUES, dtype=torch.float32, device=values.device)
        low, high = lut[(values & 0x0F).to(torch.int64)], lut[(values >> 4).to(torch.int64)]
        w = torch.stack((low, high), dim=-1).flatten(-2)  # even k from the low nibble
        exponent = scales.to(torch.float32) - quant_formats.E8M0_BIAS
        w = w * torch.exp2(exponent).repeat_interleave(MX_BLOCK, -1)
    else:
        quant_formats.weight_format(weight.format)
    return w.to(dtype)


# --- modules --------------------------------------------------------------------------------------


def is_quantized(module) -> bool:
    return bool(getattr(module, FORMAT_ATTRIBUTE, None))


def _up_name(module) -> str:
    return "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"


def projection_names(module) -> tuple[str, str]:
    return _up_name(module), "down_proj"


def quantized_weight(module, name: str) -> QuantizedWeight:
    return QuantizedWeight(getattr(module, name), getattr(module, name + SCALES_SUFFIX),
                           getattr(module, FORMAT_ATTRIBUTE), getattr(module, DTYPE_ATTRIBUTE))


def check_frozen(module) -> None:
    """RuntimeError when a quantized module's values or scales require a gradient, or
    have lost their format's dtype (e.g. ``model.to(torch.bfloat16)`` cast fp8 values)."""
    fmt = getattr(module, FORMAT_ATTRIBUTE)
    for name in projection_names(module):
        for tensor_name, expected in ((name, _TORCH_VALUES_DTYPES[fmt]),
                                      (name + SCALES_SUFFIX, _TORCH_SCALES_DTYPES[fmt])):
            t = getattr(module, tensor_name)
            if t.requires_grad:
                raise RuntimeError(
                    f"experts_forward: {type(module).__name__}.{tensor_name} holds {fmt} quantized weights, which "
                    "cannot be trained (no gradient through quantized values or scales); train the bf16 module "
                    "before quantize_experts, or keep the quantized tensors frozen (requires_grad=False)")
            if t.dtype != expected:
                raise RuntimeError(
                    f"experts_forward: {type(module).__name__}.{tensor_name} of a {fmt} module must be {expected}, "
                    f"got {t.dtype} (cast by model.to(dtype)? cast the model before quantize_experts)")


def _is_experts_module(module) -> bool:
    down = getattr(module, "down_proj", None)
    up = getattr(module, _up_name(module), None)
    return (hasattr(module, "num_experts") and isinstance(down, torch.Tensor) and isinstance(up, torch.Tensor)
            and down.dim() == 3 and up.dim() == 3)


def experts_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every Transformers experts module in ``model`` (itself included)."""
    return [(name, m) for name, m in model.named_modules() if _is_experts_module(m)]


def _set_quantized(module, name: str, values: torch.Tensor, scales: torch.Tensor) -> None:
    if name in module._parameters:
        del module._parameters[name]
    elif name in module._buffers:
        del module._buffers[name]
    module.register_buffer(name, values)
    module.register_buffer(name + SCALES_SUFFIX, scales)


def _mark(module, fmt: str, dtype: torch.dtype) -> None:
    setattr(module, FORMAT_ATTRIBUTE, fmt)
    setattr(module, DTYPE_ATTRIBUTE, dtype)
    module.is_transposed = False  # values are "nk" whatever the bf16 layout was


def quantize_module(module, fmt: str) -> None:
    """One experts module in place (see the module docstring); one expert at a
    time, so the f32 intermediates stay one expert's size."""
    if is_quantized(module):
        raise ValueError(f"quantize_experts: {type(module).__name__} is already quantized "
                         f"({getattr(module, FORMAT_ATTRIBUTE)})")
    transposed = getattr(module, "is_transposed", False)
    dtype = module.down_proj.dtype
    for name in projection_names(module):
        weight = getattr(module, name)
        parts = [quantize(w.detach().unsqueeze(0).transpose(1, 2) if transposed else w.detach().unsqueeze(0), fmt)
                 for w in weight]
        values = torch.cat([p[0] for p in parts])
        scales = torch.cat([p[1] for p in parts])
        del weight, parts
        _set_quantized(module, name, values, scales)
    _mark(module, fmt, dtype)


def quantize_experts(model, fmt: str):
    """Quantizes every Transformers experts module of ``model`` (or ``model`` itself)
    in place to ``fmt`` ("int8", "fp8", "mxfp4"); returns ``model``. ValueError when
    there is none, or when a module's in-features do not fit the format."""
    quant_formats.weight_format(fmt)
    modules = experts_modules(model)
    if not modules:
        raise ValueError(f"quantize_experts: {type(model).__name__} has no Transformers experts module")
    for _, module in modules:
        quantize_module(module, fmt)
    return model


# --- pre-quantized checkpoints --------------------------------------------------------------------


def _checkpoint_files(checkpoint_dir) -> list[str]:
    index = os.path.join(checkpoint_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted({os.path.join(checkpoint_dir, v) for v in json.load(f)["weight_map"].values()})
    files = sorted(os.path.join(checkpoint_dir, f) for f in os.listdir(checkpoint_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"load_quantized_experts: no .safetensors file in {checkpoint_dir}")
    return files


class _Checkpoint:
    """Lazy tensor reader over a checkpoint's safetensors files (one tensor read at a time)."""

    def __init__(self, checkpoint_dir):
        from safetensors import safe_open

        self._handles, self._where = [], {}
        for path in _checkpoint_files(checkpoint_dir):
            handle = safe_open(path, framework="pt")
            self._handles.append(handle)
            for key in handle.keys():
                self._where[key] = handle

    def keys(self):
        return self._where.keys()

    def get(self, key: str) -> torch.Tensor:
        try:
            return self._where[key].get_tensor(key)
        except KeyError:
            raise KeyError(f"load_quantized_experts: the checkpoint has no tensor {key!r}") from None


_FP8_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _candidate_prefixes(name: str) -> list[str]:
    """The checkpoint key prefixes of a model's module ``name`` (with and without a
    leading component, e.g. ``model.layers.0.mlp.experts`` of a *ForCausalLM)."""
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))]


def _load_mxfp4(module, ckpt: _Checkpoint, prefix: str) -> bool:
    """gpt-oss's ``{proj}_blocks`` ``[E, N, K/32, 16]`` and ``{proj}_scales``
    ``[E, N, K/32]``: already "nk" with our packing (gate and up interleaved
    along N as the module's ``_apply_gate`` reads them); biases as they are."""
    up, down = projection_names(module)
    if f"{prefix}.{up}_blocks" not in ckpt.keys():
        return False
    dtype = module.down_proj.dtype
    for name in (up, down):
        blocks = ckpt.get(f"{prefix}.{name}_blocks")
        scales = ckpt.get(f"{prefix}.{name}_scales")
        e, n, groups, per_group = blocks.shape
        if per_group * 2 != MX_BLOCK or scales.shape != (e, n, groups):
            raise ValueError(f"load_quantized_experts: {prefix}.{name}_blocks {tuple(blocks.shape)} / _scales "
                             f"{tuple(scales.shape)} are not gpt-oss MXFP4 ([E, N, K/32, 16] and [E, N, K/32])")
        _set_quantized(module, name, blocks.reshape(e, n, groups * per_group).contiguous(), scales.contiguous())
        bias_key = f"{prefix}.{name}_bias"
        if bias_key in ckpt.keys() and getattr(module, name + "_bias", None) is not None:
            module.register_parameter(name + "_bias", torch.nn.Parameter(ckpt.get(bias_key).to(dtype)))
    _mark(module, "mxfp4", dtype)
    return True


def _load_fp8(module, ckpt: _Checkpoint, prefix: str) -> bool:
    """Per-expert Linear weights ``{prefix}.{e}.{gate,up,down}_proj.weight`` (e4m3,
    ``[out, in]``) with ``weight_scale_inv`` 128 x 128 block multipliers
    (Qwen3-FP8, DeepSeek-V3; Mixtral's w1 / w3 / w2), stacked; gate and up
    concatenated along out (gate first), as Transformers merges them."""
    for gate, up, down in _FP8_EXPERT_NAMES:
        if f"{prefix}.0.{down}.weight_scale_inv" in ckpt.keys():
            break
    else:
        return False
    experts = module.num_experts

    def stack(proj):
        values = torch.stack([ckpt.get(f"{prefix}.{e}.{proj}.weight") for e in range(experts)])
        scales = torch.stack([ckpt.get(f"{prefix}.{e}.{proj}.weight_scale_inv") for e in range(experts)])
        if values.dtype != torch.float8_e4m3fn:
            raise ValueError(f"load_quantized_experts: {prefix}.0.{proj}.weight must be float8_e4m3fn, got "
                             f"{values.dtype}")
        return values, scales.to(torch.float32)

    dtype = module.down_proj.dtype
    if getattr(module, "has_gate", True):
        (gv, gs), (uv, us) = stack(gate), stack(up)
        if gv.shape[1] % FP8_BLOCK:
            raise ValueError(f"load_quantized_experts: {prefix}: gate and up ({gv.shape[1]} rows each) concatenate "
                             f"into one fp8 block grid only when the rows are a multiple of {FP8_BLOCK}")
        up_values, up_scales = torch.cat((gv, uv), dim=1), torch.cat((gs, us), dim=1)
        up_name = "gate_up_proj"
    else:
        up_values, up_scales = stack(up)
        up_name = "up_proj"
    _set_quantized(module, up_name, up_values, up_scales)
    _set_quantized(module, "down_proj", *stack(down))
    _mark(module, "fp8", dtype)
    return True


def load_quantized_experts(model, checkpoint_dir) -> list[str]:
    """Loads every experts module of ``model`` (built from the checkpoint's config,
    e.g. on the meta device or with random weights) from the quantized tensors of
    ``checkpoint_dir``'s safetensors files, never as bf16: gpt-oss MXFP4
    (``*_blocks`` / ``*_scales``) or FP8 block-scaled per-expert Linears
    (``weight`` + ``weight_scale_inv``). The rest of the model is not touched
    (load it with Transformers). Returns the names of the modules loaded;
    ValueError naming a module the checkpoint has no quantized experts for."""
    ckpt = _Checkpoint(checkpoint_dir)
    loaded = []
    for name, module in experts_modules(model):
        for prefix in _candidate_prefixes(name):
            if _load_mxfp4(module, ckpt, prefix) or _load_fp8(module, ckpt, prefix):
                loaded.append(name)
                break
        else:
            raise ValueError(f"load_quantized_experts: no MXFP4 (*_blocks/*_scales) or FP8 (*.weight_scale_inv) "
                             f"expert tensors for module {name!r} in {checkpoint_dir}")
    if not loaded:
        raise ValueError(f"load_quantized_experts: {type(model).__name__} has no Transformers experts module")
    return loaded
