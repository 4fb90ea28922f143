"""The whole MoE experts forward as one JAX program (the TPU inference path).

routing (sort by expert, rows per expert by counting) -> grouped matmul
(gate_up or up) -> gate / activation -> grouped matmul (down) -> routing
weights -> combine. Every shape is static: one compiled program per
(tokens, top_k, weights) shape, no host sync, decode steps never recompile.

Two ways through the matmuls, chosen by ``fused_kernel_row_tile``: the
fused Pallas kernel (``pallas_fused_experts``: gate_up -> gate -> down per
row tile, the intermediate never written to HBM, each active expert read
once) when the gate is a GLU on concatenated "nk" weights without biases
and a whole expert fits the generation's VMEM budget with some row tile
(Qwen3-30B-A3B, Mixtral-size experts of a few MB); otherwise two grouped
matmuls with the gate between them (gpt-oss: interleaved, biased, 33 MB
experts). There the first grouped matmul applies the gate (and the up bias)
at its store (``gmm(glu=)``: every gate of ``gates.py`` but the ungated
activations and exact GELU, on concatenated "nk" halves or gpt-oss's
interleaved ones) and writes the activation in the weights' dtype: its f32
``[rows, 2I]`` output and an XLA pass over it are not written and read back
(gpt-oss's interleaved gate in XLA reads its halves with strided lane slices,
at about four times the pass's HBM time). Estimated (TPU estimator, v6e,
``bench_tpu_estimates`` layer): Mixtral-8x7B 4096 tokens 6197 -> 5282 us, 512
tokens 2072 -> 1952. Where both apply the fused kernel never moves more bytes and does
the same MXU work, so it is the one taken (the roofline model in
bench/bench_experts.py: equal at decode, 1.1x at 1024 tokens, 1.4x at 4096),
except on v5e from ``TWO_MATMULS_FROM_ROWS_PER_GROUP`` rows a group, where the
estimator has the two matmuls ahead.

Quantized weights (``weight_format`` "int8" | "fp8" | "mxfp4", values in
``up_weight`` / ``down_weight`` stored "nk", scales in ``up_scales`` /
``down_scales``: ``common.quant_formats``) take the fused kernel where it
fits and ``FUSED_QUANTIZED_FROM_ROWS_PER_GROUP`` says so (int8 as it is, fp8
decoded once per expert in VMEM; not mxfp4), else the two grouped matmuls
(int8 in ``pallas_gmm``'s kernel as it is, fp8 / mxfp4 decoded in VMEM by
``pallas_qgmm``), the gate at the up projection's store where
``gated_store_applies`` (int8 always; fp8 / mxfp4 where both halves of a
column tile are in one step: gpt-oss, Qwen3-30B-A3B, not Mixtral-8x7B).
Activations stay in the hidden states' dtype (bf16, or f32 for f32 hidden
states).

The gate is named, not traced from the module, because a JAX program cannot
call the module's torch code: ``module_layout.gate_of_module`` maps the module
to a name of ``gates.py`` or raises NotImplementedError, so nothing silently
differs.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ..common import tpu_generations
from ..gmm import pallas_gmm, pallas_qgmm, tiling
from . import pallas_fused_experts
from .gates import apply_gate, gate_halves, kernel_gate, lowers_in_kernel

def experts_forward(
    hidden_states,  # [T, H]
    top_k_index,  # [T, K], ids >= E mark remote experts
    top_k_weights,  # [T, K]
    up_weight,  # [E, N1, H] ("nk") or [E, H, N1] ("kn")
    down_weight,  # [E, H, I] ("nk") or [E, I, H] ("kn")
    up_bias=None,  # [E, N1]
    down_bias=None,  # [E, H]
    *,
    up_scales=None,
    down_scales=None,
    weight_format: str | None = None,
    gate: str = "glu_silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    rhs_layout: str = "nk",
    fused: bool | None = None,
    generation: str | None = None,
    out_dtype=None,
    group_align: int | None = None,
    interpret=False,
):
    """``[T, H]`` in ``out_dtype`` (default: hidden_states' dtype; expert
    parallelism asks for f32 partial sums). ``group_align``: rows each
    expert's group is aligned to in the sorted layout (None: the rule of
    ``group_alignment``; 1: none)."""
    out_dtype = hidden_states.dtype if out_dtype is None else out_dtype
    top_k = top_k_index.shape[1]
    num_experts = up_weight.shape[0]
    ids = top_k_index.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(ids, stable=True)
    sorted_ids = ids[order]
    group_sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[jnp.clip(ids, 0, num_experts)].add(1)
    group_sizes = group_sizes[:num_experts]
    safe_ids = jnp.minimum(sorted_ids, num_experts - 1)

    if weight_format is not None:
        return _quantized_experts(hidden_states, ids, order, sorted_ids, group_sizes, top_k_weights, top_k,
                                  up_weight, down_weight, up_bias, down_bias, up_scales, down_scales,
                                  weight_format=weight_format, gate=gate, alpha=alpha, limit=limit,
                                  rhs_layout=rhs_layout, fused=fused, generation=generation,
                                  out_dtype=out_dtype, interpret=interpret, group_align=group_align)
    if up_scales is not None or down_scales is not None:
        raise ValueError("up_scales / down_scales given without weight_format ('int8', 'fp8' or 'mxfp4')")
    rows = ids.shape[0]
    fused_tm = fused_kernel_row_tile(rows, up_weight, down_weight, up_bias, down_bias,
                                     gate, rhs_layout, generation)
    if fused is None:
        fused = fused_tm is not None
    if group_align is None:
        group_align = group_alignment(rows, num_experts, fused, generation)
    layout = AlignedRows.of(sorted_ids, group_sizes, group_align)
    x = hidden_states[layout.spread(order // top_k)].astype(up_weight.dtype)
    if fused:
        out = pallas_fused_experts.fused_glu_experts(
            x, up_weight, down_weight, layout.group_sizes, gate=gate, out_dtype=x.dtype,
            tm=fused_tm, generation=generation, interpret=interpret)
    else:
        out = two_matmuls(x, up_weight, down_weight, layout.group_sizes, up_bias=up_bias,
                          safe_ids=layout.spread(safe_ids), gate=gate, alpha=alpha, limit=limit,
                          rhs_layout=rhs_layout, generation=generation, interpret=interpret, out_dtype=x.dtype)
    return _combine(out, layout.rows_of_slots(order), ids, num_experts, top_k_weights, out_dtype, down_bias)


# Group-aligned rows at prefill: each expert's rows start at a multiple of
# GROUP_ALIGN_ROWS in the sorted layout (the rows between are padding, never
# read back), so no row chunk of a kernel holds two experts' rows. A chunk
# shared by two groups is computed once per group (the visits of
# ``pallas_gmm``), about half a 256-row MXU pass lost per boundary; padding
# loses a quarter of a 256-row pass per group on average (64 rows), plus the
# padding rows' gather and the kernels' zero rows past the groups (the static
# row count grows by E x 127). Estimated, the kernels at 4096 tokens on rows
# laid out as the program lays them out (``bench_tpu_estimates``, uniform
# routing), unaligned -> aligned to 128 (/ 256) rows, us: tpu7x Qwen3-30B-A3B
# (256 rows a group) fused 591.4 -> 541.3 (/ 586.6), two matmuls 669.3 ->
# 614.8; Gemma-4-26B-A4B (256) fused 811.6 -> 734.6, two matmuls 983.8 ->
# 889.9; gpt-oss-20b (512, two matmuls) 1349.2 -> 1252.5 (/ 1307.8);
# Mixtral-8x7B (1024) 3262.6 -> 3195.6; Qwen3-30B-A3B at 512 tokens (32 rows a
# group) fused 342.9 -> 397.5. v6e: gpt-oss-20b 1615.7 -> 1557.8 (/ 1653.1),
# but Qwen3-30B-A3B two matmuls 1047.5 -> 1199.5, Gemma-4-26B-A4B 1326.8 ->
# 1521.2, Mixtral-8x7B 4058.3 -> 4138.2 (/ 4116.2); v5e Qwen3-30B-A3B fused
# (128-row tiles without chunks) 2618.3 -> 2796.0. Hence the rule, rows a
# group [from, below) per chip and path; nowhere else.
GROUP_ALIGN_ROWS = 128
GROUP_ALIGN_RULE = {
    "tpu7x": {"fused": (256, 1024), "two matmuls": (256, 1024)},
    "v6e": {"two matmuls": (512, 1024)},
}


def group_alignment(rows: int, num_experts: int, fused: bool, generation: str | None) -> int:
    """Rows each expert's group is aligned to in the sorted layout (1: not
    aligned), by the rule above."""
    paths = GROUP_ALIGN_RULE.get(tpu_generations.get_generation(generation).name, {})
    low, high = paths.get("fused" if fused else "two matmuls", (0, 0))
    return GROUP_ALIGN_ROWS if low * num_experts <= rows < high * num_experts else 1

# Quantized weights take the same rule on the chips listed per format.
# Estimated (``bench_quantized_estimates`` layer), unaligned -> aligned to
# 128, us: tpu7x 4096 tokens int8 (fused) Qwen3-30B-A3B 575.8 -> 507.0,
# Gemma-4-26B-A4B 777.4 -> 684.3, gpt-oss-20b (two matmuls) 1385.4 -> 1291.4;
# fp8 Qwen3 (fused) 797.4 -> 729.4, gpt-oss 1811.7 -> 1702.5; v6e gpt-oss
# int8 1625.8 -> 1526.4. mxfp4 is mixed (tpu7x gpt-oss 2080.7 -> 2043.2 but
# Qwen3 1191.3 -> 1264.1) and stays unaligned, as does v6e fp8 (not measured).
GROUP_ALIGN_QUANTIZED = {"int8": ("tpu7x", "v6e"), "fp8": ("tpu7x",)}


@dataclasses.dataclass(frozen=True)
class AlignedRows:
    """The sorted rows with each group starting at a multiple of ``align``:
    sorted row ``i`` sits at row ``position[i]`` of ``rows`` (static: ``M + E
    x (align - 1)``, enough for any routing); ``group_sizes`` are the aligned
    groups' sizes (padding rows belong to their group, rows of remote experts
    and the slack come after the last group). ``align`` 1 is the plain
    sorted layout."""

    position: jnp.ndarray | None  # [M] int32, None when align is 1
    group_sizes: jnp.ndarray  # [E] int32
    rows: int

    @classmethod
    def of(cls, sorted_ids, group_sizes, align: int) -> "AlignedRows":
        rows, num_experts = sorted_ids.shape[0], group_sizes.shape[0]
        if align <= 1:
            return cls(None, group_sizes, rows)
        aligned = (group_sizes + align - 1) // align * align
        pad_before = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(aligned - group_sizes)])
        position = jnp.arange(rows, dtype=jnp.int32) + pad_before[jnp.clip(sorted_ids, 0, num_experts)]
        return cls(position.astype(jnp.int32), aligned.astype(jnp.int32), rows + num_experts * (align - 1))

    def spread(self, values):
        """Per sorted row -> per row of the layout (padding rows take entry 0's value)."""
        if self.position is None:
            return values
        return jnp.zeros((self.rows,), values.dtype).at[self.position].set(values, unique_indices=True)

    def rows_of_slots(self, order):
        """The layout's row of every (token, pick) slot, flat: ``order[i]``
        is the slot of sorted row ``i``."""
        slots = order.shape[0]
        sorted_row = jnp.zeros((slots,), jnp.int32).at[order].set(jnp.arange(slots, dtype=jnp.int32),
                                                                  unique_indices=True)
        return sorted_row if self.position is None else self.position[sorted_row]


def two_matmuls(x, up_weight, down_weight, group_sizes, *, up_bias=None, safe_ids=None,
                gate: str, alpha: float, limit: float, rhs_layout: str, generation=None, interpret=False,
                up_scales=None, down_scales=None, weight_format: str | None = None, out_dtype=jnp.float32):
    """The unfused way through the matmuls, on rows sorted by expert: ``[M,
    H]`` in ``out_dtype``, without the down bias (``_combine`` adds it). The up bias, where the
    gate is not applied at the store, is gathered per row by ``safe_ids`` (the rows' experts).
    Both matmuls get the chip's tiles and VMEM limit (without generation=, a
    v4 would be given v6e's and overflow its 16 MiB). Quantized weights
    (``weight_format``) come with their scales; the activations then stay in
    ``x``'s dtype."""
    glu, halves = kernel_gate(gate, alpha, limit), gate_halves(gate)
    act_dtype = down_weight.dtype if weight_format is None else x.dtype

    def matmul(lhs, weights, scales, **kw):
        return pallas_gmm.gmm(lhs, weights, group_sizes, rhs_layout=rhs_layout, generation=generation,
                              interpret=interpret, rhs_scales=scales, weight_format=weight_format, **kw)

    if glu is not None and gated_store_applies(x, up_weight, halves, rhs_layout, weight_format, generation):
        # The gate (and the up bias) at the up projection's store: its f32
        # [rows, 2I] output and the gate's pass over it never reach HBM.
        act = matmul(x, up_weight, up_scales, out_dtype=act_dtype, glu=glu, glu_halves=halves, glu_bias=up_bias)
    else:
        h = matmul(x, up_weight, up_scales, out_dtype=jnp.float32)
        if up_bias is not None:
            h = h + up_bias[safe_ids].astype(jnp.float32)
        act = apply_gate(h, gate, alpha, limit).astype(act_dtype)
    return matmul(act, down_weight, down_scales, out_dtype=out_dtype)  # the down bias: in _combine


def gated_store_applies(x, up_weight, halves, rhs_layout, weight_format, generation) -> bool:
    """Whether the up projection can apply the gate at its store (``gmm(glu=)``):
    halves it can split, and for quantized weights a values tile holding both
    halves of its columns (``pallas_qgmm.gated_store_tiling``; Mixtral-8x7B's
    concatenated 2 x 14336 columns do not fit one)."""
    if not pallas_gmm.glu_supported(up_weight.shape, rhs_layout, halves):
        return False
    return weight_format in (None, *pallas_gmm.DIRECT_FORMATS) or pallas_qgmm.gated_store_tiling(
        weight_format, halves, x.shape[0], x.shape[1], up_weight.shape[1], up_weight.shape[0],
        lhs_itemsize=x.dtype.itemsize, out_itemsize=x.dtype.itemsize, generation=generation) is not None


def _quantized_experts(hidden_states, ids, order, sorted_ids, group_sizes, top_k_weights, top_k, up_weight,
                       down_weight, up_bias, down_bias, up_scales, down_scales, *, weight_format, gate, alpha,
                       limit, rhs_layout, fused, generation, out_dtype, interpret, group_align=None):
    """The experts on quantized weights: the fused kernel where
    ``fused_kernel_row_tile`` takes it (or ``fused=True``), else the two
    grouped matmuls (see the module docstring)."""
    if rhs_layout != "nk":
        raise ValueError(f"quantized weights (weight_format={weight_format!r}) are stored \"nk\"; "
                         f"rhs_layout={rhs_layout!r} is not supported")
    num_experts = up_weight.shape[0]
    safe_ids = jnp.minimum(sorted_ids, num_experts - 1)
    act_dtype = jnp.float32 if hidden_states.dtype == jnp.float32 else jnp.bfloat16
    fused_tm = fused_kernel_row_tile(ids.shape[0], up_weight, down_weight, up_bias, down_bias, gate, rhs_layout,
                                     generation, weight_format, jnp.dtype(act_dtype).itemsize)
    if fused and (up_bias is not None or down_bias is not None or not gate.startswith("glu_")
                  or not lowers_in_kernel(gate)):
        raise ValueError(f"fused=True: the fused experts kernel runs GLU gates it lowers in the kernel, without "
                         f"biases, got gate={gate!r}"
                         f"{' with biases' if up_bias is not None or down_bias is not None else ''}; "
                         "leave fused=None")
    fused = fused_tm is not None if fused is None else fused
    if group_align is None:  # bf16's rule where it was measured to hold (GROUP_ALIGN_QUANTIZED)
        chip = tpu_generations.get_generation(generation).name
        group_align = (group_alignment(ids.shape[0], num_experts, fused, generation)
                       if chip in GROUP_ALIGN_QUANTIZED.get(weight_format, ()) else 1)
    layout = AlignedRows.of(sorted_ids, group_sizes, group_align)
    x = hidden_states[layout.spread(order // top_k)].astype(act_dtype)
    if fused:  # the kernel's own row tile when forced past the rule (it refuses an expert that does not fit)
        out = pallas_fused_experts.fused_glu_experts(
            x, up_weight, down_weight, layout.group_sizes, gate=gate, out_dtype=act_dtype, tm=fused_tm,
            generation=generation, interpret=interpret, up_scales=up_scales, down_scales=down_scales,
            weight_format=weight_format)
    else:
        out = two_matmuls(x, up_weight, down_weight, layout.group_sizes, up_bias=up_bias,
                          safe_ids=layout.spread(safe_ids), gate=gate, alpha=alpha, limit=limit,
                          rhs_layout=rhs_layout, generation=generation, interpret=interpret, up_scales=up_scales,
                          down_scales=down_scales, weight_format=weight_format, out_dtype=act_dtype)
    return _combine(out, layout.rows_of_slots(order), ids, num_experts, top_k_weights, out_dtype, down_bias)


# Rows a group from which a generation runs the two grouped matmuls even where
# the fused kernel fits: on v5e the fused kernel's 128-row tiles (one pass of
# its 128-wide MXUs) lose to the matmuls' 512-row tiles in 128-row chunks and
# 2048-wide output tiles once groups are large. TPU estimator, the whole
# program (``bench_experts_program --paths fused two-matmuls``), fused -> two
# matmuls: 4096 tokens (256 rows a group) Qwen3-30B-A3B 3023.4 -> 2920.7 us,
# Gemma-4-26B-A4B 4169.5 -> 4037.0; 2048 tokens (128 rows) Qwen3 1868.0 ->
# 1833.6 but Gemma-4 2606.5 -> 2723.9, 1024 tokens (64 rows) 1639.8 -> 1625.6
# and 2101.1 -> 2139.7: below 256 the fused kernel stays; at 512 tokens a
# wash, at decode the kernels tie within 0.2%.
TWO_MATMULS_FROM_ROWS_PER_GROUP = {"v5e": 256}


# Quantized weights take the fused kernel (``pallas_fused_experts``: int8
# as it is, fp8 decoded once per expert in VMEM) from these rows a group on;
# a generation not named keeps the two grouped matmuls (v4, v5p: not
# measured), and v5e's ``TWO_MATMULS_FROM_ROWS_PER_GROUP`` holds for every
# format. TPU estimator, the layer (``bench_quantized_estimates``, two
# matmuls -> fused, us; Qwen3-30B-A3B / Gemma-4-26B-A4B, 128 experts, top 8):
# - int8, v6e: 8 tokens (0.5 rows an expert on average) 148.9 -> 148.3 / 188.1 -> 186.5,
#   64 tokens (4) 382.2 -> 382.1 / 482.8 -> 507.0, 512 (32) 438.4 -> 436.2 /
#   575.2 -> 582.3, 1024 (64) 527.7 -> 484.5 / 699.0 -> 646.7, 2048 (128)
#   708.4 -> 581.2 / 935.1 -> 775.6, 4096 (256) 897.9 -> 770.7 / 1154.5 ->
#   1029.4. tpu7x: 1 token 18.5 -> 16.6 / 23.7 -> 23.0, 64 tokens 278.5 ->
#   227.8 / 358.2 -> 320.8, 512 349.7 -> 285.5 / 449.0 -> 401.3, 4096 688.6
#   -> 575.8 / 887.9 -> 777.4 (the weights' whole-expert fetch and no
#   intermediate in HBM; tpu7x's two int8 matmuls sit at 1.7x their roofline).
#   v5e: 8 tokens (0.5 rows an expert) 294.5 -> 296.1 / 372.3 -> 372.4, 64 tokens
#   892.7 -> 824.3 / 1188.9 -> 1117.0, 512 1114.0 -> 1023.4 / 1488.1 ->
#   1389.2, 4096 2404.7 -> 2456.8 / 3163.4 -> 3336.1 (its 128-row tiles, as
#   for bf16). fp8 on v5e loses everywhere (8 tokens 292.3 -> 542.6, 4096
#   3099.8 -> 3410.8: v5e's K-sliced path at every size).
# - fp8 (the decode, ~4 us an expert of 4.7 M weights on v6e, is paid once
#   per expert; the K-sliced two matmuls pay per row): v6e 512 tokens 633.2 ->
#   1238.9, 2048 1002.7 -> 1384.9, 4096 1805.2 -> 1576.9 / 2330.7 -> 2060.2;
#   tpu7x 512 416.8 -> 512.6, 2048 650.2 -> 637.8 / 829.1 -> 848.1, 4096
#   878.4 -> 797.4 / 1158.7 -> 1060.6.
FUSED_QUANTIZED_FROM_ROWS_PER_GROUP = {
    "int8": {"v5e": 2, "v6e": 64, "tpu7x": 0},
    "fp8": {"v6e": 256, "tpu7x": 256},
}


def fused_kernel_row_tile(m, up_weight, down_weight, up_bias, down_bias, gate, rhs_layout, generation,
                          weight_format: str | None = None, act_itemsize: int | None = None):
    """The documented rule of the module docstring: the fused kernel's row
    tile, or None when the two grouped matmuls must be used. Quantized
    weights (``weight_format``, rows of ``act_itemsize`` bytes): from
    ``FUSED_QUANTIZED_FROM_ROWS_PER_GROUP`` rows a group, where the expert
    fits at the rule's row tile (not halved to fit)."""
    if up_bias is not None or down_bias is not None or up_weight.dtype != down_weight.dtype:
        return None
    num_experts, two_inter, hidden = up_weight.shape
    chip = tpu_generations.get_generation(generation).name
    rows_per_group = tiling.rows_per_group(m, num_experts)
    two_matmuls_from = TWO_MATMULS_FROM_ROWS_PER_GROUP.get(chip)
    if two_matmuls_from and rows_per_group >= two_matmuls_from:
        return None
    if weight_format is not None:
        fused_from = FUSED_QUANTIZED_FROM_ROWS_PER_GROUP.get(weight_format, {}).get(chip)
        if fused_from is None or rows_per_group < fused_from:
            return None
    # Quantized weights only at the rule's own row tile: DeepSeek-V3's int8
    # expert fits v6e only at 32-row tiles, 21437.4 us against the two
    # matmuls' 9405.9 at 4096 tokens (estimated, the layer).
    return pallas_fused_experts.fused_row_tile(gate, rhs_layout, m, hidden, two_inter // 2, num_experts,
                                               act_itemsize or up_weight.dtype.itemsize, generation,
                                               weight_format, halve=weight_format is None)


def _combine(out, rows, ids, num_experts: int, top_k_weights, dtype, down_bias=None):
    """Each token's ``top_k`` rows of ``out`` (``rows``: the row of every
    (token, pick) slot, flat; ``ids`` its expert, >= E for a remote one,
    which adds zero), plus the expert's down bias, times the pick's routing
    weight, summed in f32. One gather per pick, all in one fusion that reads
    each row once and writes ``[T, H]``: the routing weights applied in sorted
    order, a scatter back to ``[T * top_k, H]`` and a sum were three passes
    over f32 rows (estimated, tpu7x, Qwen3-30B-A3B 4096 tokens: 369 us, the
    fused kernel before them 590). The kernels write their rows in the
    activations' dtype (bf16 for a bf16 model, rounded once, as Transformers'
    eager experts round their down projection): half the bytes of f32 rows,
    written and read back."""
    num_tokens, top_k = top_k_weights.shape
    rows, ids = rows.reshape(num_tokens, top_k), ids.reshape(num_tokens, top_k)
    weights = top_k_weights.astype(jnp.float32)
    total = jnp.zeros((num_tokens, out.shape[1]), jnp.float32)
    for k in range(top_k):
        row = out[rows[:, k]].astype(jnp.float32)
        if down_bias is not None:
            row = row + down_bias[jnp.minimum(ids[:, k], num_experts - 1)].astype(jnp.float32)
        total = total + jnp.where(ids[:, k:k + 1] < num_experts, row * weights[:, k:k + 1], 0.0)
    return total.astype(dtype)
