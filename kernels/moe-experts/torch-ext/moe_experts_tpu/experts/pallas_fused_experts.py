"""Fused gated-MLP experts kernel: gate_up -> act(gate) * up -> down, per row tile.

For each visit (expert ``g``, row tile) the kernel keeps the whole expert in
VMEM (gate rows, up rows and down of ``g``) and writes only the final
``[tm, H]`` rows; the ``[M, 2I]`` intermediate never touches HBM.
Consecutive visits of one expert reuse its weight blocks (same block
index), so every active expert's weights are read exactly once.
On one-TensorCore chips the kernel fetches each expert itself while the
previous expert's visits run (``pallas_gmm.WeightPrefetch``), not during the
one step before.

When it is used (``fused_row_tile``): weights in the "nk" layout (``gate_up
[E, 2I, H]`` with gate then up halves, ``down [E, H, I]``), a named GLU gate,
and the double-buffered expert plus tiles within the grouped matmul's forward
budget (15/16 of the large limit, ``tiling.FORWARD_VMEM_FRACTION``: 90 MiB on
v5e / v6e, 45 on tpu7x; elsewhere ``tpu_generations.large_vmem_budget``); the
3/4 budget (36 MiB) halved Gemma-4-26B-A4B's tpu7x tile to 128 rows, whose
4096-token kernel then took 948 us against 812 at 256 (it compiles). The row
tile starts from the grouped matmul's rule (``tiling.py``), at most one
MXU-wide pass of rows (``chip.mxu``: 128 on v5e, 256 on v6e and tpu7x), and is
halved, down to the sublane minimum, until the working set fits. Why, from
the TPU estimator (``bench/fused_row_tiles.py``, the kernel alone): the kernel
computes whole row tiles (no row chunks; on tpu7x a 256-row tile only the
half holding a visit's rows where the other holds none,
``HALVED_TILE_GENERATIONS``), so rows past a group's end cost MXU time,
while the expert's weights, fetched a run ahead, arrive under any tile's
compute. v6e, tm 128 / 256 / 512: Qwen3-30B-A3B 4096 tokens 1194 /
989 / 1078 us (DMA-bound 982), 512 tokens 769 / 769 / 770; Gemma-4-26B-A4B
(I=704) 64 tokens 914 / 914 / 960, 512 tokens 972 / 972 / 1036, 4096 tokens
1540 / 1275 / 1456 (512 rows, the matmuls' tile, was the best before the
weight prefetch: 1394 / 1282 / 1262 us at Qwen3 4096 tokens, when a step
waited for the expert's fetch). v5e (four 128-wide MXUs) before the prefetch,
Qwen3 4096 tokens: 3281 / 3403 / 4750 us. tpu7x, tm 128 / 256: Qwen3 64
tokens 323.2 / 323.3, 512 tokens 342.9 / 343.3, 4096 tokens - / 603.0;
Gemma-4 512 tokens 433.3 / 458.8, 2048 tokens 631.3 / 611.4, 4096 tokens
948.3 / 811.6: the matmuls' rule (128 rows below 64 rows per group, else 256)
picks the better one. (Before the prefetch tpu7x took 256 rows whatever the
group size, as a step then paid the expert's fetch: Qwen3 512 tokens 394.7 ->
378.0 us.)
Qwen3-30B-A3B (I=768, H=2048, bf16: 9.4 MB per expert) fits; gpt-oss-20b
(I=2880, interleaved) does not and takes the unfused path.
Row visits and segment masking are the ones of ``pallas_gmm``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..common import pallas_helpers, tpu_generations
from ..common.tile_math import sublane
from ..gmm import pallas_gmm, pallas_qgmm, quantized, tiling as tiling_lib
from .gates import glu_activation, lowers_in_kernel

# Quantized weights the kernel reads (``common.quant_formats``): int8 as it
# is (its tile into the dot, the per-column scale on the f32 product, as
# ``pallas_gmm``), fp8 decoded once per expert into a VMEM copy in the rows'
# dtype (``pallas_qgmm.dequantize_fp8_operand``) that the expert's visits
# share. mxfp4 is not read here: its decode pairs the lhs's even and odd K
# columns (``pallas_qgmm``), which the in-kernel intermediate would need too.
QUANTIZED_FORMATS = ("int8", "fp8")


def working_set_bytes(tm: int, hidden: int, inter: int, itemsize: int, out_itemsize: int = 4,
                      weight_format: str | None = None) -> int:
    """Double-buffered expert weights, x and out tiles (out counted as f32,
    the widest the callers ask for), and the f32 temporaries: gate and up, y,
    and the rows kept from the previous visit of the tile. ``itemsize``: the
    rows' (and bf16 weights'); quantized weights take a byte each, fp8 adds
    the decoded expert (in the rows' dtype) and its expanded f32 scales, and
    int8 with f32 rows the f32 copies of its tiles the dots take."""
    weights = 3 * inter * hidden * (itemsize if weight_format is None else 1)  # gate + up + down of one expert
    tiles = tm * hidden * itemsize + tm * hidden * out_itemsize  # x and out
    total = 2 * (weights + tiles) + 2 * tm * hidden * 4 + tm * 2 * inter * 4
    if weight_format == "fp8":
        expanded = [pallas_qgmm.fp8_expanded_scales_shape(n, k) for n, k in ((2 * inter, hidden), (hidden, inter))]
        total += 3 * inter * hidden * itemsize + sum(4 * r * c for r, c in expanded)
    if weight_format == "int8" and itemsize == 4:
        total += 3 * inter * hidden * 4
    return total


def fused_row_tile(gate: str, rhs_layout: str, m: int, hidden: int, inter: int, num_experts: int,
                   itemsize: int, generation: str | None, weight_format: str | None = None,
                   halve: bool = True) -> int | None:
    """Rows per tile for the fused kernel, or None where it cannot be used.
    ``itemsize``: the rows' (bf16 weights are in the rows' dtype). ``halve``:
    whether the tile may be halved until the working set fits (else None
    where the rule's tile does not fit)."""
    if not gate.startswith("glu_") or not lowers_in_kernel(gate) or rhs_layout != "nk":
        return None
    if weight_format is not None and weight_format not in QUANTIZED_FORMATS:
        return None
    # gate / up halves are row blocks of gate_up (in the weights' native tiles)
    if inter % max(sublane(itemsize), sublane(1) if weight_format else 1):
        return None
    tm = tiling_lib.choose_tiling(max(m, 1), hidden, 2 * inter, num_experts, lhs_itemsize=itemsize,
                                  rhs_itemsize=itemsize, out_itemsize=4, generation=generation).tm
    chip = tpu_generations.get_generation(generation)
    tm = min(tm, chip.mxu)  # one MXU-wide pass of rows (module docstring)
    # The working set counts the kernel's f32 temporaries, as the grouped
    # matmul's forward rule does: the same share of the large limit.
    fraction = tiling_lib.FORWARD_VMEM_FRACTION.get(chip.name)
    budget = chip.large_vmem_limit * fraction[0] // fraction[1] if fraction else chip.large_vmem_budget
    while working_set_bytes(tm, hidden, inter, itemsize, weight_format=weight_format) > budget:
        if tm <= sublane(itemsize) or not halve:
            return None
        tm = max(sublane(itemsize), tm // 2)
    return tm


# Where a 256-row tile runs only the half holding a visit's rows when the
# other half holds none (``pallas_gmm.visit_row_chunks``), each half storing
# its own rows; elsewhere the whole tile, merged into the block. Estimated,
# the kernel at 4096 tokens: tpu7x Qwen3-30B-A3B 603 -> 591 us (skewed
# routing 607 -> 601); v6e, DMA-bound there, gains nothing with a uniform
# routing and loses with a skewed one (Qwen3-30B-A3B 1084 -> 1104 us,
# Gemma-4-26B-A4B 1394 -> 1421): the halves' larger step body costs where
# the saved MXU time was hidden anyway. v5e's 128-row tiles lose 1%.
HALVED_TILE_GENERATIONS = ("tpu7x",)


def _kernel(*refs, tm: int, inter: int, num_segments: int, activation, prefetch: pallas_gmm.WeightPrefetch | None,
            masked_store: bool, halves: bool, weight_format: str | None):
    # scalar prefetch (SMEM): the visit arrays (+ weight runs) (+ fp8: the visits that decode); x; the
    # expert's weights (gate, up, down; fp8: gate_up, down; in HBM when prefetched) (+ their scales); out;
    # scratch: the prefetched weight buffers and their semaphores (+ fp8: the decoded expert, expanded scales)
    decodes = weight_format == "fp8"
    num_weights = 2 if decodes else 3
    num_scalars = 5 + (3 if prefetch else 0) + (1 if decodes else 0)
    seg_ref, tile_ref, seg_start_ref, seg_end_ref = refs[:4]
    x_ref = refs[num_scalars]
    weight_refs = refs[num_scalars + 1:num_scalars + 1 + num_weights]
    rest = refs[num_scalars + 1 + num_weights:]
    scale_refs, rest = (rest[:2], rest[2:]) if weight_format else ((), rest)
    out_ref, rest = rest[0], rest[1:]
    if prefetch:  # the expert's weights from the kernel's own pipeline (pallas_gmm.WeightPrefetch)
        bufs, sems, rest = rest[:num_weights], rest[num_weights], rest[num_weights + 1:]
        slot = prefetch.fetch(weight_refs, bufs, sems, *refs[5:8])
        weight_refs = tuple(buf.at[slot] for buf in bufs)
    v = pl.program_id(0)
    if decodes:  # the expert into VMEM in the rows' dtype, at its first visit; its other visits reuse it
        wq_up, wq_down, expanded_up, expanded_down = rest

        @pl.when(refs[num_scalars - 1][v] == 1)
        def _decode():
            pallas_qgmm.dequantize_fp8_operand(weight_refs[0], scale_refs[0], expanded_up, wq_up)
            pallas_qgmm.dequantize_fp8_operand(weight_refs[1], scale_refs[1], expanded_down, wq_down)

        gate_ref, up_ref, down_ref = wq_up.at[pl.ds(0, inter)], wq_up.at[pl.ds(inter, inter)], wq_down
    else:
        gate_ref, up_ref, down_ref = weight_refs
    seg = seg_ref[v]
    is_local = (seg > 0) & (seg < num_segments - 1)
    start, end = seg_start_ref[seg], seg_end_ref[seg]
    tile_row = tile_ref[v] * tm
    act_dtype = x_ref.dtype if weight_format else down_ref.dtype

    def project(x, w_ref, scale=None):
        w = w_ref[...]
        if w.dtype == jnp.int8 and x.dtype == jnp.float32:
            w = w.astype(jnp.float32)  # exact; a bf16 row tile takes the int8 tile as it is (pallas_gmm)
        product = pallas_helpers.dot_f32(x, w, 1, 1)
        return product if scale is None else product * scale  # int8: each output column's scale

    def rows_out(x):
        if weight_format == "int8":
            up_scales = scale_refs[0][...]  # [2, I]: the gate half's, then the up half's
            scales = (up_scales[0:1], up_scales[1:2], scale_refs[1][...])
        else:
            scales = (None, None, None)
        h = activation(project(x, gate_ref, scales[0])) * project(x, up_ref, scales[1])
        return project(h.astype(act_dtype), down_ref, scales[2])

    if not halves:  # the whole tile, merged into the block
        y = jnp.where(is_local, rows_out(x_ref[...]), 0.0)
        pallas_gmm.store_visit_rows(out_ref, y, v, tile_ref, tm, start, end)
        return
    # The tile's rows of the visit's group, or only the half of them that holds
    # such rows (pallas_gmm.visit_row_chunks), each stored straight into its
    # rows of the output block: every row of a tile belongs to one visit.
    for size, first, live in pallas_gmm.visit_row_chunks(tm, tm, start - tile_row, end - tile_row):

        @pl.when(is_local & live)
        def _compute(rows=pl.ds(first, size), first_row=tile_row + first):
            pallas_gmm.store_chunk_rows(out_ref, rows, rows_out(x_ref[rows, :]), first_row, start, end, masked_store)

    @pl.when(jnp.logical_not(is_local))
    def _idle():
        pallas_gmm.store_visit_rows(out_ref, jnp.zeros(out_ref.shape, jnp.float32), v, tile_ref, tm, start, end)


def check_quantized_args(x, gate_up, down, up_scales, down_scales, weight_format: str) -> None:
    """Each array against ``weight_format`` (ValueError naming the argument)."""
    if weight_format not in QUANTIZED_FORMATS:
        raise ValueError(f"weight_format: the fused experts kernel reads {QUANTIZED_FORMATS} weights, got "
                         f"{weight_format!r} (mxfp4: the two grouped matmuls)")
    if gate_up.ndim != 3 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [E, 2I, H] (gate rows, then up rows), got shape {tuple(gate_up.shape)}")
    try:
        quantized.check_quantized_gmm_args(x, gate_up, up_scales, weight_format, "nk")
    except ValueError as e:  # the same checks, named for the gate / up projection
        raise ValueError(f"x / gate_up / up_scales (the [E, 2I, H] gate and up projections): {e}") from None
    inter = gate_up.shape[1] // 2
    try:
        quantized.check_quantized_gmm_args(jax.ShapeDtypeStruct((x.shape[0], inter), x.dtype), down, down_scales,
                                           weight_format, "nk")
    except ValueError as e:  # the same checks, named for the down projection
        raise ValueError(f"down / down_scales (the [E, H, I] down projection): {e}") from None
    if down.shape[:2] != (gate_up.shape[0], x.shape[1]):
        raise ValueError(f"down must be [E, H, I] = [{gate_up.shape[0]}, {x.shape[1]}, {inter}] for gate_up of "
                         f"shape {tuple(gate_up.shape)}, got {tuple(down.shape)}")


def fused_glu_experts(x, gate_up, down, group_sizes, *, gate: str, out_dtype=None,
                      tm: int | None = None, generation: str | None = None, interpret=False,
                      up_scales=None, down_scales=None, weight_format: str | None = None):
    """``down[g] @ (act(gate_up[g][:I] @ x) * (gate_up[g][I:] @ x))`` per row of group g.
    With ``weight_format`` ("int8" | "fp8", ``QUANTIZED_FORMATS``), ``gate_up``
    and ``down`` are that format's values ("nk") and ``up_scales`` /
    ``down_scales`` their scales (``common.quant_formats``); x is bf16 or f32."""
    m, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if weight_format is not None:
        check_quantized_args(x, gate_up, down, up_scales, down_scales, weight_format)
    elif up_scales is not None or down_scales is not None:
        raise ValueError("up_scales / down_scales given without weight_format ('int8' or 'fp8')")
    if m == 0:
        return jnp.zeros((0, hidden), out_dtype)
    if tm is None:  # the kernel's own rule (also where a caller forces this kernel past the program's rule)
        itemsize = x.dtype.itemsize if weight_format else gate_up.dtype.itemsize
        tm = fused_row_tile(gate, "nk", m, hidden, inter, num_experts, itemsize, generation, weight_format)
        if tm is None:
            raise ValueError(f"fused_glu_experts: no row tile runs gate={gate!r} with experts of shape "
                             f"{tuple(gate_up.shape)} ({gate_up.dtype}) on {generation or 'this device'} "
                             "(a whole expert must fit the VMEM budget): use the two grouped matmuls")
    seg, tile, num_visits, seg_starts, seg_ends, weight_group = pallas_gmm.forward_visits(
        group_sizes, 0, num_experts, m=m, tm=tm
    )
    decodes = weight_format == "fp8"

    # Idle visits (rows of remote experts, past the sum) keep the resident expert.
    def expert_block(*index):
        return lambda v, seg, tile, starts, ends, group, *_: (group[v], *index)

    if decodes:  # gate_up whole: a 128 x 128 scale block may straddle its halves (I = 704)
        weight_specs = [pl.BlockSpec((pl.Squeezed(), two_inter, hidden), expert_block(0, 0)),
                        pl.BlockSpec((pl.Squeezed(), hidden, inter), expert_block(0, 0))]
        blocks = (pallas_gmm.WeightBlock("nk", two_inter, two_inter, hidden),
                  pallas_gmm.WeightBlock("nk", hidden, hidden, inter))
    else:
        weight_specs = [pl.BlockSpec((pl.Squeezed(), inter, hidden), expert_block(0, 0)),
                        pl.BlockSpec((pl.Squeezed(), inter, hidden), expert_block(1, 0)),
                        pl.BlockSpec((pl.Squeezed(), hidden, inter), expert_block(0, 0))]
        blocks = (pallas_gmm.WeightBlock("nk", inter, inter, hidden, 0),
                  pallas_gmm.WeightBlock("nk", inter, inter, hidden, 1),
                  pallas_gmm.WeightBlock("nk", hidden, hidden, inter))
    scales, scale_specs = [], []
    if weight_format == "int8":  # per output column: [E, 2, I] (gate half, up half) and [E, 1, H]
        scales = [up_scales.reshape(num_experts, 2, inter), down_scales.reshape(num_experts, 1, hidden)]
    elif decodes:  # the expert's whole [N/128, K/128] block scales, a few KB
        scales = [up_scales, down_scales]
    scale_specs = [pl.BlockSpec((pl.Squeezed(), *s.shape[1:]), expert_block(0, 0)) for s in scales]
    x_spec = pl.BlockSpec((tm, hidden), lambda v, seg, tile, *_: (tile[v], 0))
    out_spec = pl.BlockSpec((tm, hidden), lambda v, seg, tile, *_: (tile[v], 0))
    scalars, scratch, prefetch = [seg, tile, seg_starts, seg_ends, weight_group], [], None
    if pallas_gmm.prefetches_weights(True, generation):
        # Whole experts, a run of visits ahead (see pallas_gmm.WeightPrefetch).
        prefetch = pallas_gmm.WeightPrefetch(blocks, column_axis=None, visit_axis=0)
        scalars += list(pallas_gmm.weight_runs(weight_group, num_visits))
        weight_specs = [pl.BlockSpec(memory_space=pl.ANY)] * len(blocks)
        scratch = prefetch.scratch(gate_up.dtype)
    if decodes:
        scalars.append(pallas_qgmm.dequantizing_visits(seg, num_experts, 1))
        scratch += [pltpu.VMEM((two_inter, hidden), x.dtype), pltpu.VMEM((hidden, inter), x.dtype),
                    pltpu.VMEM(pallas_qgmm.fp8_expanded_scales_shape(two_inter, hidden), jnp.float32),
                    pltpu.VMEM(pallas_qgmm.fp8_expanded_scales_shape(hidden, inter), jnp.float32)]
    kernel = functools.partial(_kernel, tm=tm, inter=inter, num_segments=num_experts + 2,
                               activation=glu_activation(gate), prefetch=prefetch, masked_store=not interpret,
                               halves=tm >= pallas_gmm.MIN_HALVED_TILE
                               and tpu_generations.get_generation(generation).name in HALVED_TILE_GENERATIONS,
                               weight_format=weight_format)
    weights = (gate_up, down)
    if not decodes:
        halves = gate_up.reshape(num_experts, 2, inter, hidden) if prefetch else gate_up
        weights = (halves, halves, down)
    return pl.pallas_call(
        kernel,
        out_shape=pallas_helpers.out_struct((m, hidden), out_dtype, x, gate_up, down, group_sizes),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars), grid=(num_visits,),
            in_specs=[x_spec, *weight_specs, *scale_specs], out_specs=out_spec,
            scratch_shapes=scratch,
        ),
        compiler_params=pallas_helpers.compiler_params(generation, ("arbitrary",), large_vmem=True),
        interpret=interpret,
        name="fused_glu_experts" if weight_format is None else f"fused_glu_experts_{weight_format}",
    )(*scalars, x, *weights, *scales)
