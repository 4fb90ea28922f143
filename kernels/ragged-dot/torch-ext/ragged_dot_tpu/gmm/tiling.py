"""Tile sizes of the grouped matmul kernels, chosen per TPU generation.

The rule (used by the forward and both backward kernels; the forward kernel's
row and output tiles differ, see "Forward tiles"):

* ``tm`` (rows per tile) follows the average group size:
  ``tm = next_pow2(ceil(M / G))`` clamped to ``[tm_min, tm_max]`` (and never
  below the sublane tile: 8 rows for 32-bit, 16 for 16-bit operands). The
  floor comes from the TPU estimator (bench/tpu_estimator.py: the compiler's
  schedule + a DMA simulation): a grid step costs the weight tile's push into
  the MXU whatever its row count, so tiny row tiles lose even when most of a
  large tile's rows are masked. Estimated on v5e and v6e at Qwen3-30B-A3B,
  gpt-oss-20b and Mixtral shapes (1 to 4096 tokens), 128-row tiles beat the
  group-sized 16-64-row ones by 3-19% (gpt-oss-20b 512 tokens on v6e: 876 us
  vs 1013 us for the up projection), and tied or won everywhere else; above
  128 rows per group the group-sized tile stays best (Mixtral 4096 tokens:
  512). v4 and v5p keep the sublane floor: the estimator has no calibrated
  figures for those chips. TPU7x takes v6e's caps (two 256-wide MXUs per
  core) except for its forward tiles (below).
* Forward tiles (``row_chunks=True``: ``gmm`` and the fused experts kernel,
  on v5e and v6e, ``FORWARD_TILE_CAPS``): ``tm = 512`` whatever the group
  sizes, and output tiles up to 2048 (v5e) / 4096 (v6e) columns (the VMEM
  budget narrows them first; v5e's were 1024 until re-estimated on the
  current kernels, the two matmuls, 1024 -> 2048: Qwen3-30B-A3B 4096 tokens
  2764.9 -> 2462.6 us, Gemma-4-26B-A4B 4096 tokens 3778.6 -> 3250.9,
  gpt-oss-20b 512 / 4096 tokens 2105.6 / 6133.7 -> 2064.4 / 5612.5,
  Mixtral-8x7B 512 / 4096 tokens 3825.8 / 16287.3 -> 3682.6 / 15981.7;
  decode unchanged, Qwen3 1 / 64 tokens 95.4 / 1452.9 us; 3072 loses on
  Mixtral's 4096 tokens, 17486.8, where its tiles halve to fit). A tile
  shared by several groups costs each group only the row chunks holding its
  rows, so a large tile adds little MXU work; it removes grid steps and the
  lhs / out traffic between them.
  Estimated, the layer's two matmuls (``bench/peer_sweep.py --peers ours``
  walk on v6e, then the old and new rule at every shape of
  ``bench_tpu_estimates``): v6e gpt-oss-20b 512 tokens 1314 -> 1169 us, 4096
  tokens 2243 -> 2144; Mixtral-8x7B 512 tokens 2411 -> 2092, 4096 tokens
  5618 -> 5483; DeepSeek-V3 512 tokens 14568 -> 14159, 4096 tokens 20287 ->
  16985; v5e gpt-oss-20b 512 tokens 2820 -> 2541, 4096 tokens 7267 -> 6598,
  Mixtral-8x7B 512 tokens 5464 -> 4523, 4096 tokens 19307 -> 18892; decode
  (64 tokens) within 1% on both. 1024-row tiles lose (v6e gpt-oss-20b 4096
  tokens 2215 us, Mixtral-8x7B 4096 tokens 7122: the down projection's
  whole-K tile no longer fits and K splits). The fused experts kernel takes
  the same row tile within its own VMEM rule (v6e Qwen3-30B-A3B 512 tokens
  830 -> 806 us, 4096 tokens 1280 -> 1260). The weight gradient (``tgmm``,
  whole row tiles, no chunks) keeps the group-size row tile (see "Weight
  gradient").
* Forward tiles on tpu7x (``FORWARD_TILE_CAPS["tpu7x"]``, ``wide_from_rows``):
  v6e's caps lose there (gpt-oss-20b 512 tokens 663 -> 685 us, Mixtral-8x7B
  512 tokens 1287 -> 1370: 512-row tiles split K within its VMEM). Its rule:
  from 64 rows per group on, ``tm = 256`` (one row chunk) and output tiles up
  to 2048; below, the group-size rule (128 to 256 rows) and 1024-wide output
  tiles, unless the whole output dim fits 2048. Its forward tiles may fill
  15/16 of the 48 MiB large limit (``FORWARD_VMEM_FRACTION``: 45 MiB, not
  36): a whole K at 256 rows needs 44 MiB counted for Mixtral's down
  projection, (256, 14336, 512), which compiles; the split K the 36 MiB
  budget gives, (256, 7168, 512), re-reads the weights (4096 tokens 1905 us
  against 1173). From the walk of our kernel (``bench/peer_sweep.py --chips
  tpu7x --peers ours``, f32 out; every config in ``peer_sweep.jsonl``), old
  rule -> new, us: gpt-oss-20b 512 tokens up (128, 2880, 1024) 440 ->
  (256, 2880, 2048) 407, down (128, 2880, 1024) 223 -> (256, 2880, 1536) 209;
  4096 tokens up (512, 2880, 1024) 1046 -> 991, down (512, 2880, 1024) 526 ->
  504; Mixtral-8x7B 512 tokens up (128, 4096, 1024) 865 -> (256, 4096, 2048)
  737, down (128, 14336, 512) 422 -> (256, 14336, 512) 367; 4096 tokens up
  (512, 4096, 1024) 2565 -> 2463, down (512, 7168, 512) 1508 -> 1173. Why
  not more: 512 rows tie or lose (gpt-oss-20b 4096 tokens up (512, 2880,
  2048) 996; Mixtral-8x7B 4096 tokens up (1024, 4096, 1024) 2655) and do not
  leave a whole K in VMEM; at 32 rows per group 256 rows lose (Qwen3-30B-A3B
  512 tokens up (128, 2048, 1536) 274 -> (256, ...) 281, down (128, 768,
  2048) 156 -> 181); at decode split 2048-wide tiles lose 1-2% (gpt-oss-20b
  1 token up 41.5 -> 42.5 us, Mixtral-8x7B 130.9 -> 132.1), a whole output
  dim wins (Qwen3-30B-A3B 64 tokens down (128, 768, 1024) 152 -> (128, 768,
  2048) 120). Wider still where it fits (``wide_tn_fit``, 3072): a wide tile
  takes up to 3072 columns when the tile holds K whole within the budget and
  the MXU computes no more padded columns than the 2048 cap's tiles
  (``mxu_columns``): gpt-oss-20b's down projection (N = 2880) in one tile
  instead of two of 1536, its gated up projection (2I = 5760) in two of 3072
  instead of three of 2048, Gemma-4-26B-A4B's down projection (N = 2816)
  in one. TPU estimator, the two matmuls on the program's rows (aligned at
  4096 tokens): gpt-oss-20b 4096 tokens 1252.5 -> 1173.4 us (up 834.6 ->
  791.7, down 416.4 -> 380.2), 512 tokens 486.9 -> 466.8; Gemma-4-26B-A4B
  4096 tokens 889.9 -> 790.5 (down 446.8 -> 347.4); training, gpt-oss-20b
  4096 tokens, the down projection's input gradient 424.1 -> 368.0. Not
  taken: a 3072 cap everywhere halves Mixtral-8x7B's up projection to 1536
  where 2048 fits (4096 tokens 2124.6 -> 2230.2 us); DeepSeek-V3's down
  projection (N = 7168) in three tiles of 2560 instead of four of 1792
  computes 512 padded columns (4096 tokens 2746.3 -> 2816.4). Decode rows
  (below 64 rows per group, N past 2048) keep their tiles. The layer
  (``bench_tpu_estimates``) in "Figures" below.
* ``tk`` covers the whole contraction dim when it fits (``K <= tk_max``): the
  kernel then streams each expert's weights exactly once per output column
  tile, consecutive tiles of one group reuse the weight block already in VMEM,
  and no tail masking along K is needed.
* ``tn`` covers the whole output dim up to ``tn_max`` (a multiple of the MXU
  width of the generation).
* If the double-buffered working set exceeds the budget, first narrow ``tn``
  (halving, lane-aligned) down to ``TN_KEEP_K`` (512), then halve the larger
  of tk / tn until it fits. On v5e, v6e and tpu7x the budget is the large one
  (``tpu_generations.large_vmem_budget``: 72 MiB on v5e / v6e, 36 MiB on
  tpu7x) and a kernel whose tiles pass the default budget asks Mosaic for the
  matching limit (``needs_large_vmem``); v4 and v5p keep the default budget. Why (TPU estimator, v6e, Mixtral-8x7B 4096 tokens, the
  bench's two-matmul layer): with the default 24 MiB budget the rule split K
  (up (512, 2048, 1024), down (512, 2048, 1024)), and a split K changes the
  weight block on every step, so a group's weights were re-read once per row
  tile: 8103 + 4052 MB fetched, 5517 + 2556 us. Whole-K tiles (up (512, 4096,
  1024), down (512, 14336, 512)) fetch 3758 + 2819 MB: 3788 + 1809 us, the
  layer 8791 -> 6315 us (6332 us with the row chunks below). Every row
  measured, on v5e, v6e and tpu7x, is in ``bench/results/experts_prefill_tiles.md``.
* Split K: where K cannot stay whole even at ``TN_KEEP_K`` columns (K past
  ``tk_max``, or a whole-K tile over the budget), narrowing the output tile
  buys nothing: every step of a split K fetches new lhs and weight tiles, and
  a group's lhs is re-read once per output tile. The output tile then stays
  wide and K is halved until the tiles fit. TPU estimator, v6e, Mixtral-8x7B
  4096 tokens, the up projection's input gradient (``dout [8192, 28672] @
  W``, K = 28672): (512, 14336, 512) before 6640 us (DMA-bound: 6629 us of
  DMA), (512, 2048, 4096) now 3790; (512, 2048, 2048) 4167, (512, 1024,
  4096) 4182, (1024, 1024, 4096) 4285, tokamax's (512, 1024, 2048) in our
  kernel 4528; tpu7x (256, 7168, 512) 3751 -> (256, 4096, 2048) 2821 ((256,
  2048, 4096), past its 2048 cap, 2666); v5e (512, 14336, 512) 14115 ->
  (512, 7168, 1024) 13196.
* Direct stores: a forward step over the whole K stores each live row
  chunk's product straight into its rows of the output block (a masked
  store; ``pallas_gmm``): no f32 accumulator, whose zeroing, adding and
  reloading were three vector passes over the tile per step. Its working set
  (``forward_working_set_bytes``) counts the product of one chunk and no
  accumulator, and the forward budget of v5e and v6e is 15/16 of the 96 MiB
  large limit, as on tpu7x (``FORWARD_VMEM_FRACTION``). TPU estimator, v6e:
  gpt-oss-20b's up projection at 4096 tokens, (512, 2880, 2048), f32 out,
  1509 -> 1421 us (a full step 15798 -> 14249 cycles); the layer (gated up +
  down) at 512 / 4096 tokens: gpt-oss-20b 1189 / 2268 -> 1147 / 1991 us,
  Qwen3-30B-A3B 836 / 1376 -> 811 / 1275, Mixtral-8x7B 1952 / 5282 -> 1923 /
  5129. The freed VMEM then widens Mixtral-8x7B's tiles: down (512, 14336,
  512) -> (512, 14336, 1024), 1811 -> 1669 us at 4096 tokens (the lhs is
  re-read once per output tile: 1879 MB fetched -> 1228 us of DMA), gated up
  (512, 4096, 1024) -> (512, 4096, 2048) per half, 3320 -> 3249 us (the gated
  rule now counts the output in its own dtype, not f32); the layer 1923 /
  5129 -> 1910 / 4916 us on v6e, 4449 / 18941 -> 4237 / 18240 on v5e.
* Balanced tiles: a split K or N takes the narrowest MXU-aligned tile giving
  the same tile count (``balanced_tile``): Qwen3-30B-A3B's up projection (N =
  1536) on v6e runs two 768-wide column tiles instead of 1024 + 1024 with
  512 masked columns computed for nothing.
* Row chunks (``ROW_CHUNK``: the MXU width, 128 rows on v5e, 256 on v6e and
  tpu7x, when ``tm`` is a larger multiple): the forward kernel computes a row tile in chunks and skips the
  chunks without a row of the visit's group, so a tile shared by two groups
  (about ``M / tm + G`` visits for ``M / tm`` tiles) costs each group about
  its own rows. A chunk re-pushes the weight tile into the MXU, so chunks
  narrower than the MXU lose: v6e gpt-oss-20b 4096 tokens (tm 512, 62 visits
  for 32 tiles), the two kernels 2649 us without chunks, 2524 us with 128-row
  chunks, 2238 us with 256-row chunks. On v5e's 128-wide MXUs 128-row
  chunks cost 5% more cycles when every chunk runs and save more: gpt-oss-20b
  4096 tokens 13396 -> 10782 us for the layer, Mixtral-8x7B 4096 tokens
  23455 -> 20738 us. v4 and v5p keep whole tiles (not estimated).
* Half chunks (``pallas_gmm.visit_row_chunks``): a chunk whose one half
  holds no row of the visit's group computes only the other half (one of
  three static bodies per chunk: whole, first half, second half), so a group
  boundary inside a chunk costs half a chunk, not a whole one; a 256-row tile
  without chunks (tpu7x) runs as halves too (``MIN_HALVED_TILE``), as does
  the fused experts kernel's on tpu7x (not on v6e, where it lost:
  ``pallas_fused_experts.HALVED_TILE_GENERATIONS``). A half re-pushes the weight tile as a chunk
  does, so it costs more than half a chunk, but less than the whole: v6e
  gpt-oss-20b 4096 tokens, up projection 1164 -> 1076 us, down 578 -> 530;
  v5e up 4068 -> 3872, Mixtral-8x7B up 11475 -> 11056; tpu7x gpt-oss-20b up
  935 -> 857. Chunks started at the group's first row instead (a dynamic,
  16-row aligned offset, no halves) lost: 1388 us for that v6e up
  projection, the dynamic slices of the lhs and output blocks costing more
  than the rows they saved. The layer (``bench_tpu_estimates``, logs
  ``tpu_estimates_{v6e,tpu7x}_ours_half_chunks.log``): v6e gpt-oss-20b 4096
  tokens 1769 -> 1616 us, Mixtral-8x7B 4096 4188 -> 4058; tpu7x gpt-oss-20b
  512 / 4096 616 / 1481 -> 487 / 1349, Mixtral-8x7B 512 / 4096 967 / 3419
  -> 880 / 3263, DeepSeek-V3 4096 8697 -> 7376; HBM-bound shapes unchanged.
* Weight gradient (``tgmm``, ``weight_gradient_tiling``): the group-size row
  tile up to the MXU width (one MXU-deep contraction: the weight gradient
  computes whole row tiles, so a tile shared by two groups costs both the
  whole tile), and a gradient tile ``(tk, tn)`` as large as the VMEM budget allows,
  from the whole ``[K, N]`` down, halving the larger side
  (``weight_gradient_working_set_bytes``: the double-buffered tiles plus two
  f32 gradient-sized buffers, the accumulator and one step's product). Every
  gradient tile re-reads its rows of lhs and dout, so fewer, larger gradient
  tiles fetch less; the kernel runs one ``pl.when`` per case of a visit
  (a group's first, middle, last or only visit), each holding the matmul, so
  no step pays a zeroing or a store pass over the accumulator (the estimator
  counts a non-MXU region on every step that holds it). TPU estimator, bf16,
  4096 tokens, the gradient alone, old (forward-rule tiles, zero / add /
  store passes) -> new: v6e Qwen3-30B-A3B up 1209 -> 895 us (HBM-bound 634;
  (256, 2048, 1536)), down 678 -> 512 (358); gpt-oss-20b up 2121 -> 1691,
  down 1064 -> 830; Mixtral-8x7B up 4867 -> 3882 ((512, 2048, 2048)), down
  2652 -> 1977; tpu7x Qwen3-30B-A3B up 801 -> 555 ((256, 1024, 1536)), down
  469 -> 284. Then the row tile capped at the MXU width, 512 -> 256 rows
  (v5e and v5p 128): v6e gpt-oss-20b up 1691 -> 1609 us, down 830 -> 787,
  Mixtral-8x7B up 3882 -> 3765, down 1977 -> 1927; tpu7x gpt-oss-20b up
  1188 -> 1106; v5e gpt-oss-20b up 5979 -> 4727 (256 rows: 4785),
  Mixtral-8x7B up 14388 -> 12864; v5p gpt-oss-20b up 2774 -> 2115. Its
  budget is the forward kernels' (``FORWARD_VMEM_FRACTION``: the working set
  counts every buffer): tpu7x Qwen3-30B-A3B up (256, 1024, 1536) -> (256,
  2048, 1536), 555 -> 493 us (39 MiB counted of the 48 MiB limit); v6e
  Mixtral-8x7B down (256, 1792, 2048) -> (256, 3584, 2048), 1927 -> 1792.
  Per kernel: ``python bench/bench_training_estimates.py --breakdown
  --chips tpu7x --tokens 4096``. What is left above the bounds: a group's gradient (6 MB at
  Qwen3's up projection) is written back while the next group's first tiles
  are fetched, and the pipeline holds two buffers only (Mosaic refuses
  ``pl.Buffered(3)``).

Figures: ``python bench/bench_tpu_estimates.py --chips v6e v5e --models
mixtral-8x7b gpt-oss-20b qwen3-30b-a3b --tokens 512 4096 --contenders ours
"ours fused"`` before and after (table in ``bench/results/tpu_estimates.md``).
tpu7x: ``--chips tpu7x --models qwen3-30b-a3b gpt-oss-20b mixtral-8x7b
--tokens 1 8 64 512 4096`` (``bench/results/tpu_estimates_tpu7x_ours_before_forward_tiles.log``
-> ``..._ours_forward_tiles.log``), the layer in us: gpt-oss-20b 512 tokens
673.6 -> 630.3, 4096 tokens 1698.2 -> 1621.3; Mixtral-8x7B 512 tokens 1324.6
-> 1142.3, 4096 tokens 4390.2 -> 3953.3; Qwen3-30B-A3B two matmuls 8 / 64 /
512 / 4096 tokens 142.2 / 375.4 / 480.4 / 989.7 -> 133.2 / 339.0 / 434.2 /
923.1 (whole output dims), fused 512 tokens 394.7 -> 378.0
(then a 256-row floor of the fused kernel, dropped with its weight prefetch:
``pallas_fused_experts``); gpt-oss-20b and Mixtral-8x7B at 1
to 64 tokens unchanged (same tiles).

Quantized weights (``pallas_qgmm``) have their own rule, ``choose_quantized_tiling``
(the section at the end of this module; docs/quantized_kernels.md).

A caller overrides the rule with all three sizes at once (``tiling=(tm, tk,
tn)``), checked by ``validate_tiling``; there is no partial override.
"""

from __future__ import annotations

import dataclasses

from ..common import tpu_generations
from ..common.tile_math import halve_lane_aligned, next_pow2, sublane


@dataclasses.dataclass(frozen=True)
class TileCaps:
    """Largest tiles the rule picks on a generation (multiples of its MXU width)."""

    tm_max: int
    tn_max: int
    tk_max: int
    tm_min: int = 0  # 0: the sublane tile
    # From this average group size (rows) on, the row tile is tm_max whatever
    # the group size and output tiles reach wide_tn_max; below it, only a
    # whole output dim up to wide_tn_max takes one tile (0: neither; see
    # "Forward tiles", tpu7x).
    wide_from_rows: int = 0
    wide_tn_max: int = 0
    # Where a tile takes wide_tn_max, it may instead reach this width when the
    # tile still fits the budget with K whole (0: never; see "Forward tiles",
    # tpu7x): fewer column tiles, without the halving a wider cap would cost
    # where it does not fit.
    wide_tn_fit: int = 0

    def wide(self, rows_per_group: int, n: int) -> bool:
        return bool(self.wide_tn_max) and (rows_per_group >= self.wide_from_rows or n <= self.wide_tn_max)

    def tn_cap(self, rows_per_group: int, n: int) -> int:
        return self.wide_tn_max if self.wide(rows_per_group, n) else self.tn_max


TILE_CAPS = {
    "v4": TileCaps(512, 512, 2048),  # 16 MiB of VMEM: a smaller whole-K tile
    "v5e": TileCaps(512, 512, 16384, tm_min=128),
    "v5p": TileCaps(512, 512, 4096),
    "v6e": TileCaps(512, 1024, 16384, tm_min=128),  # 256-wide MXU: output tiles of 256 multiples
    "tpu7x": TileCaps(512, 1024, 16384, tm_min=128),  # v6e's: the same MXU shape
}
assert set(TILE_CAPS) == set(tpu_generations.GENERATIONS)
# Row chunk of the forward kernel (0: the whole tile), see the module docstring.
ROW_CHUNK = {"v4": 0, "v5e": 128, "v5p": 0, "v6e": 256, "tpu7x": 256}
# The forward kernels' caps where they differ (see "Forward tiles"): whole
# 512-row tiles, wider output tiles (the VMEM budget usually decides first);
# on tpu7x one 256-row chunk and output tiles up to 2048 from 64 rows per
# group on, else the group-size rule's rows (128 to 256) and 1024-wide
# output tiles unless the whole output dim fits 2048.
FORWARD_TILE_CAPS = {
    "v5e": TileCaps(512, 2048, 16384, tm_min=512),
    "v6e": TileCaps(512, 4096, 16384, tm_min=512),
    "tpu7x": TileCaps(256, 1024, 16384, tm_min=128, wide_from_rows=64, wide_tn_max=2048, wide_tn_fit=3072),
}
# The VMEM budget of the forward kernels and the weight gradient, whose
# working sets count every buffer: 15/16 of the large limit (tpu7x 45 MiB,
# not 36; v5e and v6e 90 MiB, not 72), see "Forward tiles", "Direct stores"
# and "Weight gradient".
FORWARD_VMEM_FRACTION = {"v5e": (15, 16), "v6e": (15, 16), "tpu7x": (15, 16)}


@dataclasses.dataclass(frozen=True)
class Tiling:
    tm: int
    tk: int
    tn: int

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.tm, self.tk, self.tn)


def working_set_bytes(t: Tiling, lhs_bytes: int, rhs_bytes: int, out_bytes: int, *,
                      direct_store_rows: int = 0) -> int:
    """Double-buffered lhs, rhs and out tiles, the f32 accumulator and the f32
    product of one step (Mosaic holds it in VMEM before the add: without it,
    Qwen3-30B-A3B's input gradient at 4096 tokens on v6e, tiles (512, 1536,
    2048), was counted at 24.1 MB, under the 32 MiB limit's budget, and
    overflowed that limit). ``direct_store_rows``: a forward step over the
    whole K stores each row chunk of that many rows directly (``pallas_gmm``):
    no accumulator, and the product of one chunk."""
    io = t.tm * t.tk * lhs_bytes + t.tk * t.tn * rhs_bytes + t.tm * t.tn * out_bytes
    if direct_store_rows:
        return 2 * io + direct_store_rows * t.tn * 4
    return 2 * io + 2 * t.tm * t.tn * 4


def forward_working_set_bytes(t: Tiling, k: int, lhs_bytes: int, rhs_bytes: int, out_bytes: int,
                              generation: str | None) -> int:
    """``working_set_bytes`` of the forward kernel's tiles ``t`` for a contraction dim ``k``."""
    whole_k = t.tk == k
    return working_set_bytes(t, lhs_bytes, rhs_bytes, out_bytes,
                             direct_store_rows=row_chunk(t.tm, generation) if whole_k else 0)


def tile_caps(generation: str | None, row_chunks: bool) -> TileCaps:
    """The caps of the forward kernels (``row_chunks``) or of the weight gradient."""
    gen = tpu_generations.get_generation(generation).name
    return FORWARD_TILE_CAPS.get(gen, TILE_CAPS[gen]) if row_chunks else TILE_CAPS[gen]


def rows_per_group(m: int, num_groups: int) -> int:
    """The average group size, rounded up."""
    return -(-max(m, 1) // max(num_groups, 1))


def row_tile(m: int, num_groups: int, itemsize: int, generation: str | None, *, row_chunks: bool = False) -> int:
    """``tm`` of the rule: the average group size within the generation's
    bounds (the forward kernels' bounds with ``row_chunks``), as a legal row
    block."""
    caps = tile_caps(generation, row_chunks)
    sub = sublane(itemsize)
    rows = rows_per_group(m, num_groups)
    tm = min(max(next_pow2(rows), sub, caps.tm_min), caps.tm_max)
    if caps.wide_from_rows and rows >= caps.wide_from_rows:
        tm = caps.tm_max
    # Never larger than M rounded up to the sublane tile; below one native
    # tile, the whole (tiny) M is the block, which is always legal.
    return m if m < 8 else min(tm, -(-m // sub) * sub)


# Generations whose grouped matmuls get the large scoped VMEM limit
# (``tpu_generations.large_vmem_limit``) and keep K whole down to this output
# tile width; see the module docstring.
TN_KEEP_K = {"v5e": 512, "v6e": 512, "tpu7x": 512}


def vmem_budget(generation: str | None, exact_count: bool = False) -> int:
    """Bytes the rule's tiles may take on ``generation``. ``exact_count``: a
    working set that counts every buffer Mosaic allocates, f32 products
    included (the forward kernels', the weight gradient's), may take
    ``FORWARD_VMEM_FRACTION`` of the large limit."""
    gen = tpu_generations.get_generation(generation)
    if exact_count and gen.name in FORWARD_VMEM_FRACTION:
        num, den = FORWARD_VMEM_FRACTION[gen.name]
        return gen.large_vmem_limit * num // den
    return gen.large_vmem_budget if gen.name in TN_KEEP_K else gen.vmem_budget


def needs_large_vmem(working_set: int, generation: str | None) -> bool:
    """Whether a kernel whose tiles take ``working_set`` bytes of VMEM asks
    for the large limit: only where the rule allows it and the tiles pass the
    default budget (smaller tiles keep the default limit and the schedule they
    always had)."""
    gen = tpu_generations.get_generation(generation)
    return gen.name in TN_KEEP_K and working_set > gen.vmem_budget


def row_chunk(tm: int, generation: str | None) -> int:
    """Rows the forward kernel computes at once within a row tile: the
    generation's ``row_chunk`` when it divides ``tm``, else the whole tile."""
    chunk = ROW_CHUNK.get(tpu_generations.get_generation(generation).name, 0)
    return chunk if chunk and tm > chunk and tm % chunk == 0 else tm


def choose_tiling(m: int, k: int, n: int, num_groups: int, *, lhs_itemsize: int, rhs_itemsize: int,
                  out_itemsize: int, generation: str | None = None) -> Tiling:
    """Applies the rule of the module docstring to the forward kernels
    (``gmm``, its input gradient and the fused experts kernel); the weight
    gradient has its own, ``weight_gradient_tiling``."""
    gen = tpu_generations.get_generation(generation)
    caps = tile_caps(gen.name, row_chunks=True)
    t = Tiling(row_tile(m, num_groups, min(lhs_itemsize, out_itemsize), gen.name, row_chunks=True),
               min(k, caps.tk_max), min(n, caps.tn_cap(rows_per_group(m, num_groups), n)))
    budget = vmem_budget(gen.name, exact_count=True)

    def working_set(c: Tiling) -> int:
        return forward_working_set_bytes(c, k, lhs_itemsize, rhs_itemsize, out_itemsize, gen.name)

    if caps.wide_tn_fit and t.tk == k and caps.wide(rows_per_group(m, num_groups), n):
        # Fewer, wider column tiles, where they fit with K whole and the MXU
        # computes no more (padded) columns than the narrower tiles would.
        fitted = Tiling(t.tm, t.tk, balanced_tile(n, min(n, caps.wide_tn_fit), gen.mxu))
        if (fitted.tn > t.tn and working_set(fitted) <= budget
                and mxu_columns(n, fitted.tn, gen.mxu) <= mxu_columns(n, balanced_tile(n, t.tn, gen.mxu), gen.mxu)):
            t = fitted
    # A whole-K tile first: narrow the output tile down to TN_KEEP_K before
    # splitting K (a split K re-reads a group's weights on every row tile).
    # Only where that keeps K whole: a K that splits anyway keeps its wide
    # output tile ("Split K" in the module docstring).
    keep_k = TN_KEEP_K.get(gen.name, 0)
    narrowed = t
    while keep_k and narrowed.tn > keep_k and working_set(narrowed) > budget:
        narrowed = Tiling(narrowed.tm, narrowed.tk, max(keep_k, halve_lane_aligned(narrowed.tn)))
    if narrowed.tk == k and working_set(narrowed) <= budget:
        t = narrowed
    while working_set(t) > budget:
        if t.tk > 128 and (t.tk >= t.tn or t.tn <= gen.mxu):
            t = Tiling(t.tm, halve_lane_aligned(t.tk), t.tn)
        elif t.tn > gen.mxu:
            t = Tiling(t.tm, t.tk, halve_lane_aligned(t.tn))
        else:
            break  # unreachable for K, N >= 128 at the budgets above; Mosaic would report it
    return Tiling(t.tm, balanced_tile(k, t.tk, 128), balanced_tile(n, t.tn, gen.mxu))


def weight_gradient_working_set_bytes(t: Tiling, lhs_bytes: int, dout_bytes: int, out_bytes: int) -> int:
    """``tgmm``'s VMEM: double-buffered lhs ``[tm, tk]``, dout ``[tm, tn]`` and
    gradient ``[tk, tn]`` tiles, the f32 accumulator and the f32 product of one
    step, both gradient-sized (the contraction runs over the rows)."""
    io = t.tm * t.tk * lhs_bytes + t.tm * t.tn * dout_bytes + t.tk * t.tn * out_bytes
    return 2 * io + 2 * t.tk * t.tn * 4


def weight_gradient_tiling(m: int, k: int, n: int, num_groups: int, *, lhs_itemsize: int, dout_itemsize: int,
                           out_itemsize: int, generation: str | None = None) -> Tiling:
    """The weight gradient's tiles (see "Weight gradient"): the group-size
    row tile up to one MXU-deep contraction (a tile shared by two groups is
    computed once per group), and the largest gradient tile ``(tk, tn)`` that
    fits the VMEM budget, from the whole ``[K, N]`` down (halving the larger
    side): every gradient tile re-reads the rows of the other operand."""
    gen = tpu_generations.get_generation(generation)
    caps = tile_caps(gen.name, row_chunks=False)
    tm = min(row_tile(m, num_groups, min(lhs_itemsize, dout_itemsize), gen.name), gen.mxu)
    t = Tiling(tm, min(k, caps.tk_max), min(n, caps.tk_max))
    budget = vmem_budget(gen.name, exact_count=True)
    while weight_gradient_working_set_bytes(t, lhs_itemsize, dout_itemsize, out_itemsize) > budget:
        if t.tk >= t.tn and t.tk > 128:
            t = Tiling(t.tm, halve_lane_aligned(t.tk), t.tn)
        elif t.tn > 128:
            t = Tiling(t.tm, t.tk, halve_lane_aligned(t.tn))
        else:
            break  # unreachable at the budgets above
    return Tiling(t.tm, balanced_tile(k, t.tk, 128), balanced_tile(n, t.tn, 128))


def mxu_columns(dim: int, tile: int, mxu: int) -> int:
    """Columns the MXU computes for ``dim`` in ``tile``-wide tiles (each padded to its width)."""
    return -(-dim // tile) * (-(-min(tile, dim) // mxu) * mxu)


def balanced_tile(dim: int, tile: int, align: int) -> int:
    """The smallest ``align`` multiple giving as many tiles as ``tile`` does:
    N = 1536 in 1024-wide tiles is two 768-wide ones, not 1024 + a half-masked
    1024 (the MXU computes the masked half all the same)."""
    if tile >= dim:
        return tile
    return min(tile, -(-dim // (-(-dim // tile) * align)) * align)


def validate_tiling(t: Tiling, m: int, k: int, n: int) -> None:
    """Block-shape legality on TPU: (8, 128)-aligned or the full dim."""
    if t.tm <= 0 or (t.tm % 8 and t.tm != m):
        raise ValueError(f"tiling: tm must be a positive multiple of 8 or M={m}, got {t.tm}")
    for name, size, dim in (("tk", t.tk, k), ("tn", t.tn, n)):
        if size <= 0 or (size % 128 and size != dim):
            raise ValueError(f"tiling: {name} must be a positive multiple of 128 or the full "
                             f"dimension {dim}, got {size}")



# ----------------------------------------------------------------------------
# Quantized weights (int8, fp8, mxfp4: common.quant_formats), forward only
# ----------------------------------------------------------------------------

# A split K must keep each format's blocks whole and its blocks lane-legal:
# fp8's 128-wide scale blocks; mxfp4's [tn, tk / 32] scale block needs tk / 32
# to be a multiple of 128 lanes (so tk a multiple of 4096) unless K is whole.
QUANT_TK_ALIGN = {"int8": 128, "fp8": 128, "mxfp4": 4096}
# Widest output tile of the quantized rule. At decode a step reads a quarter
# to a half of the bf16 bytes, so the per-step cost weighs more: whole-N
# tiles (TPU estimator, v6e, Qwen3-30B-A3B 8 tokens, int8, tm 16: up / down
# tiles 768 / 1024 wide 163 us, 1536 / 2048 wide 153 us, roofline 145 us).
QUANT_TN_MAX = {"v5e": 4096, "v6e": 4096, "tpu7x": 4096}
# fp8 runs per 128-wide K slice with the block scale on the f32 partial
# products (pallas_qgmm, "sliced": the e4m3 tile straight into the MXU, no
# dequantized copy) while its groups average at most
# FP8_SLICED_ROWS_PER_GROUP[generation] rows (m / groups), else it
# dequantizes: streamed (STREAMED_MIN_TM) or once per group into a
# tile. The slices cost per visit and per live row (a 128-deep push: half
# the depth of a 256-deep MXU), the dequantization a fixed VPU decode per
# weight. TPU estimator, the layer (bench_quantized_estimates), tile ->
# sliced, rows a group in brackets: v6e gpt-oss-20b 512 tokens (64) 1739 ->
# 965 us, Mixtral-8x7B 512 (128) 3150 -> 1897, Qwen3-30B-A3B 4096 (256)
# 1902 -> 1821, gpt-oss-20b 4096 (512) 3106 -> 3460, Mixtral-8x7B 4096
# (1024) 7030 -> 9224; tpu7x 64: 862 -> 808, 128: 2077 -> 1611, 256: 1064
# -> 1393, 512: 2103 -> 2940; v5e (128-deep MXU: a slice fills it) sliced
# at every size: 64: 4078 -> 2587, 128: 5896 -> 3957, 256: 3996 -> 3100,
# 512: 9881 -> 8382, 1024: 20735 -> 18763. Against the streamed path (up
# projection alone, sliced -> streamed): v6e Mixtral-8x7B 512 tokens (128
# rows) 1250 -> 1573 us, Qwen3-30B-A3B 4096 (256) 1069 -> 983, so v6e
# slices up to 128 rows; tpu7x Qwen3-30B-A3B 64 tokens (4 rows) 147 -> 196,
# but Mixtral-8x7B 64 (16 rows) 613 -> 428, Qwen3 512 (32) 295 -> 242,
# gpt-oss-20b 512 (64) 487 -> 350, Mixtral 512 (128) 1031 -> 746, so tpu7x
# slices up to 8 (FP8_SLICED_ROWS_PER_GROUP_BEFORE_STREAM) where the stream
# applies; where it does not (a split K: tpu7x Mixtral-8x7B's down
# projection at 512 tokens, tk 7168, sliced 531 us, the tile 1016) the
# limits above hold. Generations not listed (v4: an astype per slice; v5p):
# not estimated at prefill, the decode threshold. With groups averaging at
# most FP8_DECODE_TM_ROWS_PER_GROUP rows the row tile is at most
# FP8_DECODE_TM. TPU estimator, v6e: up projection at 64 tokens,
# Qwen3-30B-A3B (4 rows a group) tm 128 / 32 / 16: 308 / 264 / 279 us;
# gpt-oss-20b (8 rows) tm 128 / 32: 449 / 402 us; layer, tm 128 -> 32:
# Qwen3 64 tokens 503 -> 399 us, DeepSeek-V3 64 tokens (2 rows) 6971 ->
# 6176, but Mixtral 64 tokens (16 rows) 1065 -> 1112 and Qwen3 512 tokens
# (32 rows) 641 -> 690: no cap there.
FP8_SLICED_ROWS_PER_GROUP = {"v5e": None, "v6e": 256, "tpu7x": 128}  # None: always sliced
FP8_SLICED_ROWS_PER_GROUP_BEFORE_STREAM = {"v6e": 128, "tpu7x": 8}
FP8_SLICED_ROWS_PER_GROUP_OTHERS = 32
FP8_DECODE_TM_ROWS_PER_GROUP = 8
FP8_DECODE_TM = 32


def fp8_sliced(m: int, num_groups: int, generation: str | None, streams: bool = False) -> bool:
    """Whether the fp8 kernel takes its K-sliced path (pallas_qgmm) on
    ``generation``; ``streams``: whether the streamed path would apply
    otherwise (``stream_applies``), which moves the limit down."""
    name = tpu_generations.get_generation(generation).name
    limit = FP8_SLICED_ROWS_PER_GROUP.get(name, FP8_SLICED_ROWS_PER_GROUP_OTHERS)
    if streams:
        limit = FP8_SLICED_ROWS_PER_GROUP_BEFORE_STREAM.get(name, limit)
    return limit is None or rows_per_group(m, num_groups) <= limit


# fp8 past the sliced path and mxfp4 past the stacked one (bf16 lhs),
# streamed (pallas_qgmm): a step dequantizes its tile STREAMED_PIECE weight
# rows at a time in registers and pushes each piece straight into the MXU,
# never storing it, so the VPU's decode runs under the MXU's work on the
# visit's rows; the dequantized tile instead is stored once per group and
# read back, its decode and the dot one after the other (the vector load /
# store slots they share). Generations where it pays, with the least row
# tile it needs (v6e: its fp8 decode about as fast as the MXU on 1024 rows;
# tpu7x decodes fp8 four times faster, any tile). TPU estimator, whole-K up
# projections, tile -> streamed: v6e Mixtral-8x7B 4096 tokens fp8 4110 ->
# 3624 us (tm 1024; at the rule's 512 streamed is 4349), Qwen3-30B-A3B 4096
# fp8 (sliced 1069 ->) 980 (tm 1024; 1033 at 512, 1252 at 256), mxfp4 1631
# -> 1452 (tm 1024; 1798 at 256); tpu7x Qwen3-30B-A3B 4096 tokens fp8 616 ->
# 496, mxfp4 896 -> 720 (tm 256). Where the streamed tile does not fit (v6e
# Mixtral-8x7B's fp8 down projection, K = 14336, at 1024 rows) the
# dequantized tile stays (at 512 rows streamed 2145 against 2110 us).
# Synthetic fp8 step (v6e, [256 | 512 | 1024, 2048] x [1536, 2048]): the
# bf16 dot 2.00 / 3.76 / 7.27 us, streamed 4.41 / 4.97 / 7.36, decode alone
# 3.97, decode stored then the dot 5.86 (at 256 rows); tpu7x streamed = the
# dot.
STREAMED_MIN_TM = {"v6e": 1024, "tpu7x": 0}
STREAMED_PIECE = 256  # weight rows dequantized and pushed at once (128: v6e 512-row fp8 step 7.27 us, not 4.97)


def stream_applies(weight_format: str, generation: str | None, t: "Tiling", k: int, lhs_itemsize: int,
                   out_itemsize: int) -> bool:
    """Whether the quantized kernel could stream its dequantized weights at
    tiles ``t`` (``STREAMED_MIN_TM``; K whole; mxfp4: bf16 lhs and whole
    32-row byte tiles; its working set, whose f32 pieces outgrow a narrow
    tile's dequantized copy at a long K, within the budget), whatever the rows."""
    name = tpu_generations.get_generation(generation).name
    if name not in STREAMED_MIN_TM or t.tk != k or t.tm < STREAMED_MIN_TM[name]:  # a tk past K: no tail masking
        return False
    if weight_format == "mxfp4" and (lhs_itemsize != 2 or t.tn % 32):
        return False
    return (weight_format in ("fp8", "mxfp4")
            and quantized_working_set_bytes(weight_format, t, lhs_itemsize, out_itemsize, True) <= vmem_budget(name))


def streamed_dequantization(weight_format: str, m: int, num_groups: int, generation: str | None, t: "Tiling",
                            k: int, lhs_itemsize: int, out_itemsize: int) -> bool:
    """Whether the quantized kernel streams its dequantized weights at tiles
    ``t``: where ``stream_applies``, fp8 past the sliced path, mxfp4 past the
    stacked one."""
    if not stream_applies(weight_format, generation, t, k, lhs_itemsize, out_itemsize):
        return False
    if weight_format == "fp8":
        return not fp8_sliced(m, num_groups, generation, streams=True)
    # past the stacked path's rows (its decode tile, not ``t``'s: a raised tile must not take decode off it)
    return rows_per_group(m, num_groups) > MXFP4_STACKED_ROWS_PER_GROUP and not mxfp4_stacked(m, num_groups, t.tm, t.tn)


# mxfp4 at decode (groups averaging at most MXFP4_STACKED_ROWS_PER_GROUP rows)
# pushes e4m3 tiles into the MXU with each e8m0 scale on a partial product
# (pallas_qgmm, "stacked"), at a cost growing with the rows of a visit (8
# rows at a time), in row tiles of MXFP4_DECODE_TM rows; the output tile's
# rows must fill whole uint32 words (tn % 32: the bitcast of its bytes). The
# dequantized tile costs once per group whatever its rows. TPU estimator,
# v6e, the layer (bench_quantized_estimates), dequantized tile -> stacked
# (the final kernel, log tpu_estimates_quantized_mxfp4_e4m3_v6e.log):
# Qwen3-30B-A3B 8 tokens 609 -> 126 us, 64 tokens (4 rows a group) 1559 ->
# 426, 512 tokens (32 rows) 1734 -> 1520; Mixtral-8x7B 64 tokens (16 rows)
# 3411 -> 1576; but gpt-oss-20b 512 tokens (64 rows, the first stacked
# kernel) 2471 -> 3342: no stacked path there. Row tiles of 8 instead of 16
# rows (first kernel): Qwen3 8 tokens 147 -> 146 us (the kernel skips a
# tile's row chunks without rows of the visit's group).
MXFP4_STACKED_ROWS_PER_GROUP = 32
MXFP4_DECODE_TM = 16
# Generations whose matmul takes an e4m3 operand (libtpu AOT compiles; v4
# refuses it: "Unsupported matmul RHS type").
E4M3_MXU_GENERATIONS = ("v5e", "v5p", "v6e", "tpu7x")


def mxfp4_stacked(m: int, num_groups: int, tm: int, tn: int) -> bool:
    """Whether the mxfp4 kernel takes its stacked decode path (pallas_qgmm)."""
    return tm <= MXFP4_DECODE_TM and tn % 32 == 0 and rows_per_group(m, num_groups) <= MXFP4_STACKED_ROWS_PER_GROUP


# Columns the quantized kernel dequantizes at a time, per 32-row block (its
# f32 temporaries).
QUANT_CHUNK = 1024


def quantized_k_width(weight_format: str, tk: int) -> int:
    """Columns of the kernel's lhs block and dequantized tile: ``tk``, or for
    mxfp4 two halves (even k, odd k) each padded to whole lanes."""
    if weight_format != "mxfp4":
        return tk
    return 2 * -(-(tk // 2) // 128) * 128


def quantized_working_set_bytes(weight_format: str, t: Tiling, lhs_bytes: int, out_bytes: int,
                                streamed: bool = False) -> int:
    """Double-buffered lhs, values, scales and out tiles, the f32 accumulator,
    the dequantized tile (kept across the visits of one group) and the f32
    temporaries of one dequantized chunk; ``streamed``: no tile, the f32
    temporaries of one streamed piece."""
    tkw = quantized_k_width(weight_format, t.tk)
    values = t.tn * t.tk // (2 if weight_format == "mxfp4" else 1)
    scales = {"int8": 4 * t.tn, "fp8": 4 * (t.tn // 128 + 1) * (t.tk // 128 + 1), "mxfp4": t.tn * t.tk // 32}
    io = t.tm * tkw * lhs_bytes + values + scales[weight_format] + t.tm * t.tn * out_bytes
    dequantized = 0 if weight_format == "int8" else t.tn * tkw * lhs_bytes  # int8 feeds the dot directly
    temporaries = 6 * 128 * QUANT_CHUNK * 4
    if streamed:
        dequantized, temporaries = 0, 2 * STREAMED_PIECE * tkw * 4
    if weight_format == "fp8":  # its block scales expanded along K, per 128-row group
        dequantized += 4 * (t.tn // 1024 + 1) * 8 * t.tk
    return 2 * io + t.tm * t.tn * 4 + dequantized + temporaries


def choose_quantized_tiling(weight_format: str, m: int, k: int, n: int, num_groups: int, *,
                            lhs_itemsize: int, out_itemsize: int, generation: str | None = None) -> Tiling:
    """The bf16 rule's row tile and whole-K, wide-N tiles, narrowed to the
    VMEM budget (tn first, down to TN_KEEP_K, then tk in the format's
    alignment, then tn, then tm); decode tiles for fp8's K slices and
    mxfp4's stacked path; the row tile raised to ``STREAMED_MIN_TM`` where
    the stream then applies and fits."""
    gen = tpu_generations.get_generation(generation)
    caps = TILE_CAPS[gen.name]
    align = QUANT_TK_ALIGN[weight_format]
    t = Tiling(row_tile(m, num_groups, min(lhs_itemsize, out_itemsize), gen.name),
               k if k <= caps.tk_max else max(align, caps.tk_max // align * align),
               min(n, QUANT_TN_MAX.get(gen.name, caps.tn_max)))
    budget = vmem_budget(gen.name)

    def fits(t):
        return quantized_working_set_bytes(weight_format, t, lhs_itemsize, out_itemsize) <= budget

    keep_k = TN_KEEP_K.get(gen.name, gen.mxu)
    while t.tn > keep_k and not fits(t):
        t = Tiling(t.tm, t.tk, max(keep_k, halve_lane_aligned(t.tn)))
    while not fits(t) and t.tk > align:
        t = Tiling(t.tm, max(align, (t.tk // 2) // align * align), t.tn)
    while not fits(t) and t.tn > 128:
        t = Tiling(t.tm, t.tk, halve_lane_aligned(t.tn))
    while not fits(t) and t.tm > 16:  # v4's 12 MiB with mxfp4's 4096-wide K tiles
        t = Tiling(t.tm // 2, t.tk, t.tn)
    tk = k if t.tk >= k else balanced_tile(k, t.tk, align)
    tm = t.tm
    if (weight_format == "fp8" and fp8_sliced(m, num_groups, gen.name)
            and rows_per_group(m, num_groups) <= FP8_DECODE_TM_ROWS_PER_GROUP):
        tm = min(tm, FP8_DECODE_TM)
    if (weight_format == "mxfp4" and lhs_itemsize == 2 and gen.name in E4M3_MXU_GENERATIONS
            and rows_per_group(m, num_groups) <= MXFP4_STACKED_ROWS_PER_GROUP):  # the stacked path's tiles
        tm = min(tm, MXFP4_DECODE_TM)
    tn = balanced_tile(n, t.tn, gen.mxu if t.tn >= gen.mxu else 128)
    if tk >= k and m >= STREAMED_MIN_TM.get(gen.name, 0) > tm:
        # the streamed path's row tile, where it fits (its working set holds no dequantized tile)
        streamed = Tiling(STREAMED_MIN_TM[gen.name], tk, tn)
        if streamed_dequantization(weight_format, m, num_groups, gen.name, streamed, k, lhs_itemsize, out_itemsize):
            return streamed
    return Tiling(tm, tk, tn)


def validate_quantized_tiling(weight_format: str, t: Tiling, m: int, k: int, n: int) -> None:
    """``validate_tiling`` plus the format's K alignment (``QUANT_TK_ALIGN``)."""
    validate_tiling(t, m, k, n)
    align = QUANT_TK_ALIGN[weight_format]
    if t.tk != k and t.tk % align:
        raise ValueError(f"tiling: {weight_format} weights need tk a multiple of {align} or the "
                         f"whole K={k}, got {t.tk}")
