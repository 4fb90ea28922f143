"""Block sizes and KV splits of the flash attention kernels, by a documented rule
(pure Python).

Rows are the query rows of one KV head's group, flattened (``G * Sq``: see
``flash_forward``). Forward rule:

* decode, rows <= ``DECODE_MAX_ROWS`` (one token of G heads is a G-row block,
  never a padded 128-row one): ``block_q`` = all rows, ``block_k`` =
  ``DECODE_BLOCK_K``;
* prefill, with or without a sliding window: ``PREFILL_BLOCK`` x
  ``PREFILL_BLOCK`` (a window's tiles skip what the window hides in static
  sub-tiles: "Windows" below);
* ``block_q`` is at most the rows and ``block_k`` all keys when they fit in
  one block; a prefill's ``block_q`` is halved down to
  ``PREFILL_MIN_BLOCK_Q``, then ``block_k`` (not below ``MIN_BLOCK_K``), then a
  prefill's ``block_q`` (not below 128), until the working set fits the
  generation's VMEM budget (the second step only for 4-byte tiles, f32 and
  float16 decoded to f32, at head_dim 512 on v4's 16 MiB).

Why (``bench/bench_attention_tpu.py``; the TPU estimator, from libtpu's own
schedule of the kernel, bf16): a grid step costs a fixed ~500-1000 cycles of
pipeline bookkeeping whatever it computes, so blocks are as long as VMEM and
the mask allow.

==========================================  ==========  ===========  ===========
case (estimated us)                         blocks      v5e          v6e
==========================================  ==========  ===========  ===========
Llama-3-8B decode, batch 8, 32k keys        4 x 512     2898         2875
                                            4 x 4096    1313 (1.00)  656 (1.00)
Llama-3-8B causal prefill 8k                512 x 512   --           5488
                                            512 x 2048  5994         3532
                                            1024 x 1024 6024         3193
                                            1024 x 2048 --           3118
  re-estimated after the key ranges         1024 x 1024 5961         3083
                                            2048 x 1024 --           3205
                                            1024 x 2048 5540         3042
                                            2048 x 2048 5484         2940
gpt-oss sliding-128 prefill 8k (D 64)       512 x 512   --           2402 (2148*)
                                            512 x 1024  --           2536
                                            1024 x 512  --           3008
                                            256 x 256   --           2668*
                                            512 x 256   --           2659*
                                            256 x 128   --           3736*
                                            512 x 128   --           3892*
==========================================  ==========  ===========  ===========

On tpu7x (2.25x v6e's HBM bandwidth per core) 8192-key decode blocks would
reach the HBM-bound time on a full 32k cache (batch 8: 296 us, 1.02x, against
406 us at 4096) but read 44% more on a partly filled one (2k of 32k: 75 vs
52 us; 3k of 8k: 75 vs 52 us): 4096 is kept on every chip, since a static
cache is partly filled for most of a generation.

Prefill blocks of 2048 x 2048 (bf16, head_dim 128: a 23 MiB working set, inside
the 24 MiB budget of v5e, v6e, v5p and tpu7x) halve the grid steps of 1024 x
1024: a causal prefill's grid was rectangular then (query blocks x the most KV
blocks any of them sees), so nearly half its steps did no work, and each still cost
~850 cycles (v6e: 896 such steps, 436 us of 3077 at 1024 x 1024; the grid now
walks only the live pairs, below); the larger
tiles also amortise the per-step softmax bookkeeping (an unmasked 1024 x 2048
tile costs 6818 cycles, two 1024 x 1024 ones 7580). tpu7x: 2609 us at 1024 x
1024, 2492 at 1024 x 2048, 2340 at 2048 x 2048. Tall tiles lose (2048 x
1024: 3205 us): where 2048 x 2048 misses VMEM (f32, head_dim >= 256) the rule
gives up query rows first (1024 x 2048). Tried together and dropped (v6e,
1024 x 1024: 4164 us against 3083): computing a masked tile whose rows follow
the rule as 256 x 256 sub-tiles, skipping those no row sees and unmasking
those every row sees (a diagonal tile: 8824 cycles as 10 sub-tiles against
4645 whole), and scaling q once per query block into a VMEM scratch (empty
steps rose from 852 to 1312 cycles, unmasked tiles from 3790 to 4246).

Compute sub-blocks (``compute_block_k``): a prefill tile is computed in key
sub-blocks (512 then; 256 now, below), each folded into the running softmax
in turn, so its f32 temporaries are [block_q, 512] rather than [block_q,
2048] (the DMA blocks, and so the grid steps, stay 2048 x 2048). v6e,
Llama-3-8B causal 8k forward: 2940 us whole, 2845 with the unmasked tiles
in sub-blocks only, 2649 with every tile (2663 at 1024-key sub-blocks); Qwen3
8k 2930 -> 2639; Gemma-4 global D512 4k 386 -> 369. Decode tiles stay whole.

Masked tiles are also cut by rows (``forward_compute_blocks``: sub-tiles of
``FORWARD_COMPUTE_ROWS`` x ``FORWARD_COMPUTE_KEYS`` = 512 x 512), each skipped, unmasked or
masked on its own from the sub-tiles' visit table: a causal diagonal 2048 x
2048 tile computes 10 of its 16 sub-tiles, 4 of them masked, instead of 4
masked 2048 x 512 pieces. Llama-3-8B causal 8k forward: v6e 2649 -> 2458 us
(1024-row sub-tiles 2500, 256-row 2938: the per-sub-tile set-up and the
reloaded q outweigh the skipped work), tpu7x 2130 -> 1983 (1024 rows: 2011),
v5e 5484 -> 4254; Gemma-4 global D512 4k v6e 369 -> 308. Interior tiles keep
all rows at once (their table check is one per tile).

Static sub-tiles and 256-key folds (``static_sub_tile``, ``compute_block_k``).
The sub-tiles of a masked 2048 x 2048 tile each ran in a region of their own
(a ``pl.when`` on the visit table), so each waited on its own matmuls: an
unmasked 512 x 512 sub-tile cost 960 cycles on v6e where the same work inside an
interior tile costs ~570 (the compiler overlaps one fold's matmuls with the
previous fold's softmax only within a region). But a tile whose first query
sits on a key at a whole query block's offset (a causal prefill's diagonal, a
window's tiles), with its batch row's keys starting before it and ending within
Skv, has sub-tiles whose kinds do not depend on the data
(``key_ranges.static_sub_tiles``): such tiles run all their live sub-tiles in
one region (one per possible offset), and the visit table decides only for the
others (padding, packed sequences, unaligned offsets), still at 512 x 512. Then
interior tiles fold 256 keys at a time (``COMPUTE_BLOCK_K``; [2048, 256] f32
scores: fewer spilled vregs), and the static sub-tiles are 256 x 256
(``DIAGONAL_SUB_TILE``; a diagonal computes 36 of 64). Llama-3-8B causal 8k
forward, estimated us (steps of a diagonal tile in cycles):

=======================================  =====================  ======  ======  ======
forward                                  v6e diagonal step      v6e     tpu7x   v5e
=======================================  =====================  ======  ======  ======
512 x 512 sub-tiles, a region each       12458                  2268    1983    4254
static kinds, 512 x 512, one region      9543                   2062    1833    4053
+ interior folds of 256 keys             9543                   2036    1767    --
+ static sub-tiles of 256 x 256          7554                   1891    1701    4013
=======================================  =====================  ======  ======  ======

Interior folds of 128 keys lose (tpu7x 2485 us), as do row-major interior
folds (1024 rows at a time: tpu7x 1882), 256 x 256 sub-tiles for the masked
tiles the table decides (tpu7x diagonal step 21619 cycles: 64 regions) and
masking a diagonal key block's rows in one fold (v6e 2132). Rectangular tiles
(Gemma-4 global D512, 1024 x 2048) have a region per offset, and sub-tiles at
least as wide as V (v6e: 256 x 256 sub-tiles 325 us, 512 x 512 282, against 308
before); their interior tiles fold as many keys as V is wide (tpu7x: 227 us
at 256 keys, 215 at 512). Windows: a whole
512 x 512 tile of a window up to ``WINDOW_SUB_TILE`` = 256 keys is computed as
256 x 256 static sub-tiles (gpt-oss, window 128: the previous block's tile
computes one of four): v6e 2237 -> 2112 us, tpu7x 1922 -> 1831, v5e 3142 ->
2900; 128 x 128 sub-tiles lose (v6e 3060), and a longer window leaves too little
to skip (Gemma-4 sliding-512, D256: 327 -> 353, not taken).

Compacted walk (``flash_forward.compacts_walk``, ``key_ranges.compact_walk``):
a causal prefill without a window walks only its live (query block, KV block)
pairs on one flat grid axis, instead of query blocks x the most KV blocks any
of them sees (Llama-3-8B 8k at 2048 x 2048: 320 steps instead of 512, the
192 empty ones each estimated at 1525 cycles on v6e, 2630 on v5e: the
pipeline's step and the softmax's init / store regions). Estimated us,
forward, rectangular -> compacted: Llama-3-8B 8k v6e 1891 -> 1739, tpu7x 1699
-> 1565, v5e 4013 -> 3697; 32k v6e 29123 -> 25639, tpu7x 25426 -> 22510;
Qwen3 8k v6e 1881 -> 1730; Gemma-4 global D512 4k v6e 283 -> 274, tpu7x 214
-> 206. A step reads its pair from SMEM (an interior step +81 cycles), which
loses where the rectangle has few empty steps: a window's grid already spans
only its blocks (v6e gpt-oss sliding-128 2112 -> 2185, Gemma-4 sliding-512
327 -> 336), so windows keep the rectangular grid, as do KV splits and more
than ``COMPACT_WALK_MAX_PAIRS`` pairs (SMEM).

Windows at prefill blocks. A causal window's grid spans only the window's KV
blocks, so its tiles were kept short (512 x 512: the rows' window and the
block's diagonal and little else). With static sub-tiles a window's tile
computes only the 256 x 256 sub-tiles the window reaches, whatever the
block's size: 2048 x 2048 tiles then cost the same MXU and softmax work as
512 x 512 ones with a sixteenth of the grid steps (each a fixed ~600-1300
cycles of pipeline and init / store) and the K / V read once per 2048 rows,
not per 512. Forward, estimated us, 512 -> 2048 blocks (ours / splash at its
best blocks after): gpt-oss sliding-128 8k (D 64) v6e 2112 -> 1406 (0.64),
tpu7x 1829 -> 1123 (0.63), v5e 2900 -> 2111 (0.68); Gemma-4 sliding-512 8k
(D 256) v6e 326 -> 271 (0.86), tpu7x 290 -> 201 (0.64), v5e 615 -> 511
(0.73); 1024 blocks in between (v6e gpt-oss 1616, Gemma-4 273), which
float32 and float16 take (``WINDOW_WIDE_TILE_BLOCK``: at 2048 a window's static
region of f32 temporaries passed the scoped VMEM). The backward's windows:
"Backward windows at large blocks" (below).

Row sums on the MXU (``ROW_SUMS_ON_MXU``: v6e): a tile's softmax denominators
come from the P V product with a block of 128 ones appended to V (each row's
sum lands lane-replicated, as the statistics are kept) instead of a
cross-lane reduction per row. v6e's 256-wide MXU multiplies a 128-wide V at
the cost of a 256-wide one, so the sums cost no MXU time and free the
cross-lane unit: Llama-3-8B causal 8k forward 2458 -> 2268 us, 32k 34539 ->
30933, Qwen3 8k 2449 -> 2259. Only there (``ROW_SUMS_V_DIM`` = 128 on v6e):
other widths lose (Gemma-4 global D512 4k 308 -> 338 us, sliding D256 327 ->
359, gpt-oss D64 2237 -> 2349), as do the other chips (Llama-3-8B 8k: tpu7x
1983 -> 2178 us; v5e, whose 128-wide MXU does twice the P V work, 4254 ->
5661).

(1.00: at the HBM-bound time; --: not measured; *: after the per-query key
ranges, whose rule blocks skip some integer work: smaller window tiles lose
to the fixed per-step cost even though they compute fewer masked pairs.) Decode blocks longer than
4096 gain nothing and waste reads in a partly filled cache (the grid walks
only the filled part, but its last block is read whole: 2k of 32k keys runs
at 2.0x the HBM-bound time).

The backward (``choose_backward_blocks``) takes ``BACKWARD_BLOCK`` square
blocks where VMEM allows, each computed as ``BACKWARD_COMPUTE_BLOCK`` square
sub-tiles (``backward_compute_blocks``; a static loop in the kernel body, each
sub-tile skipped, unmasked or masked on its own from a visit table of the
sub-tiles), else ``BACKWARD_COMPUTE_BLOCK`` square blocks computed whole, then
smaller (its kernels hold f32 dk / dv or dq accumulators and three f32
temporaries the size of a sub-tile besides the blocks). Llama-3-8B causal 8k,
the backward's two kernels alone (bf16, estimated us):

==============================================  ==========  ==========  =====
v6e                                             blocks      sub-tiles   us
==============================================  ==========  ==========  =====
first kernels (13.4 ms at 512 x 512, 11.6 ms    1024 x 1024 whole       7177
with the visit table, 8.4 ms at 1024 x 512)
grid steps quartered                            2048 x 2048 1024 x 1024 6330
                                                2048 x 2048 1024 x 512  6848
dk/dv tiles transposed                          2048 x 2048 1024 x 1024 6258
masked tiles select once                        2048 x 2048 1024 x 1024 5956
==============================================  ==========  ==========  =====

Why: a grid step costs ~700-1000 cycles of bookkeeping whatever it computes
(1024 x 1024 blocks: 2048 steps per kernel, 896 of them with nothing to do),
and a causal grid's diagonal blocks are half invisible; 2048 x 2048 blocks cut
the steps to 512 while 1024 x 1024 sub-tiles skip the invisible quarter of a
diagonal block and keep the f32 temporaries inside VMEM (whole 2048 tiles
would need 48 MiB of them). Smaller sub-tiles lose (1024 x 512: 6848 us): each
re-reads its accumulator rows and pays the mask set-up. The dk/dv kernel
computes its tiles transposed (keys x queries), so that dv and dk are plain
products: the queries-first tile transposed p and ds on the cross-lane unit
(a whole 1024 x 1024 tile: 4628 cycles, transposed 4365). A masked tile then
selects once (``exp(-inf) = 0``) instead of guarding the lse and selecting
twice (a diagonal dk/dv tile: 6175 cycles, then 4764).

The blocks' budget is the generation's large one (``large_vmem_budget``: 72
MiB on v5e / v6e, 36 on tpu7x / v5p; v4 keeps 12), which the kernels ask for
only where their blocks pass the default 24 MiB (``backward_needs_large_vmem``):
bf16 at head_dim 128 fits 2048 blocks in the default budget everywhere but
v4; wider heads and float32 took 1024 or 512 blocks there. Gemma-4 global
(head_dim 512) 4k, forward + backward, bf16, estimated: v6e 1378 -> 1041 us
at 2048 blocks with dq fused (1024 blocks fused 1218-1238, unfused 1290),
tpu7x 1071 -> 973 at 1024 blocks. Where 2048 blocks fit but only 1024 ones
fit with dq fused (tpu7x at head_dim 256), the fused 1024 ones win (batch 2,
8 / 4 heads, causal 4k, tpu7x: 1104 us against 1161). Blocks that 1024 does
not divide (1500 rows: sub-tiles of all rows) keep the 1024 rule.

dq in the dk/dv kernel (``fuses_dq``): the dk/dv kernel holds each tile's
``ds``; one more product, ``ds^T K`` (``ds`` transposed on the cross-lane unit),
gives the tile's part of dq, written per (key block, query block) into an f32
``[B, Hkv, key blocks, rows, D]`` buffer and summed in XLA over the key blocks
each query block sees (``flash_backward._sum_dq_parts``). That replaces the dq
kernel, which recomputed every tile's ``p`` and ``dO V^T``, by a fifth
product per tile and the parts' HBM round trip, 4 D bytes per row per key
block: cheap against the tile's work when key blocks are long
(``FUSED_DQ_MIN_BLOCK_K`` = 1024), and the buffer is bounded
(``FUSED_DQ_MAX_BYTES`` = 1 GiB, transient): where all key blocks' parts
exceed it, the kernel runs in several calls, each over as many key blocks as
the cap holds, and their sums are added (Llama-3-8B at 32k keys: 8 GiB of
parts, eight calls of two 2048-key blocks). The fused kernel's working set (a double-buffered
f32 dq block and a fourth sub-tile temporary) asks for the large VMEM limit.
Forward + backward, bf16, estimated us (two kernels -> fused):

==============================  ===============  ===============  ===============
case                            v5e              v6e              tpu7x
==============================  ===============  ===============  ===============
Llama-3-8B causal 8k            16659 -> 14308   8247 -> 7008     6690 -> 5561
Qwen3 causal 8k                 16674 -> 14361   8150 -> 7005     6631 -> 5542
Llama-3-8B causal 32k (8 calls) 243831 -> 203709 116056 -> 96778 95940 -> 78431
Gemma-4 global D512 4k (512)    --               1378 -> 1393     1071 -> 1043
Gemma-4 sliding-512 8k (512)    --               1015 -> 1443     799 -> 953
==============================  ===============  ===============  ===============

The last two rows, with 512-key blocks, were fused by hand to set the
threshold: a window's parts are mostly never visited yet still summed, and a
short key block makes the parts large against the tile's work; the rule keeps
them on two kernels. (Windows of at most 512 keys now take 2048-key blocks,
which fuse: "Backward windows at large blocks".)

Backward walks of the live pairs. Under a causal mask without a window the
dk/dv kernel walked every query block for every KV block (its query blocks
span the G heads of a group, so the ones that see a KV block are not one
run: Llama-3-8B 8k, 24 of each (batch, KV head)'s 64 steps empty, 18 of them
still fetching their query block), and the dq kernel the forward's
rectangle. Both now walk only the live pairs on one grid axis
(``key_ranges.compact_key_walk``, KV block by KV block; ``compact_walk`` for
dq), as the forward does. The fused kernel's parts of dq were summed by an
XLA reduction that read every part (live or not) and wrote an f32 sum a
second pass scaled and cast (v6e Llama-3-8B 8k: 532 us of XLA ops); a small
kernel (``_sum_dq_parts``) reads only the live parts (skipped steps keep the
resident block) and writes dq in q's dtype (306 us). Forward + backward,
estimated us, before -> walks -> sum kernel: Llama-3-8B 8k v6e 6378 -> 6162
-> 5936; tpu7x 5063 -> 4861, v5e 13701 -> 12810, Qwen3 8k v6e 6375 -> 5917,
tpu7x 5054 -> 4853, v5e 13754 -> 12813, Gemma-4 global D512 4k v6e 1008 ->
948, tpu7x 941 -> 882, v5e 3528 -> 3433 (the last two columns together).

Backward windows at large blocks. Under a causal window the backward kept
512 x 512 blocks computed whole (``WINDOW_BLOCK``): a window's band is
narrow, and 2048 tiles computed whole or in 1024 sub-tiles cover it many
times over. A window of at most ``BACKWARD_WINDOW_SUB_TILE`` = 512 keys now
takes ``BACKWARD_BLOCK`` blocks in 512 x 512 sub-tiles, whose kinds are
static in a prefill's tiles: a diagonal tile computes its 4 diagonal and 3
sub-diagonal sub-tiles, the next query block's tile its corner one. A
quarter of the grid steps remain, K / V and q / dO are read once per 2048
rows, and the 2048-key blocks fuse dq (``fuses_dq``). The parts' sum walks,
per query block, only as many key blocks as any query block sees in the
call, from its first (``key_ranges.call_kv_steps``: 2 of 4 at 8k; a step
costs ~600-1000 cycles even when it reads nothing). Forward + backward, bf16,
estimated us, v6e:

================================  =========  ==========================  =====
case                              blocks     sub-tiles                   us
================================  =========  ==========================  =====
gpt-oss sliding-128 8k (D 64)     512        whole, dq kernel            5797
                                  2048       256 (sum over every block)  4651
                                  2048       512                         4151
                                  2048       1024                        5373
Gemma-4 sliding-512 8k (D 256)    512        whole, dq kernel            957
                                  2048       256                         847
                                  2048       512                         745
================================  =========  ==========================  =====

256 sub-tiles compute less of the band but each costs its set-up, and a step
off the diagonal still checks all 64 of them (gpt-oss's off-diagonal dk/dv
steps: 6566 cycles at 256, 4137 at 512). tpu7x and v5e: gpt-oss 4809 ->
3273, 8881 -> 6977; Gemma-4 sliding 711 -> 513, 2080 -> 1765. Wider windows keep
``WINDOW_BLOCK`` (not measured at large blocks), as do float32 and float16
(4-byte tiles: not estimated at large blocks, and gpt-oss's float16 backward
at 2048 blocks took ~5 minutes to compile here, against ~15 s at 512).

``choose_kv_splits``: on a megacore chip (v4, v5p) a decode call whose only
parallel work is a single (batch, head) pair would leave one TensorCore idle;
the keys are split in one part per TensorCore and the partial softmaxes
merged. On single-core chips a split only adds the merge: one part.

Decode kernel (``choose_decode_chunk``, ``flash_decode``): on v5e, v6e and
tpu7x a decode (rows <= ``DECODE_MAX_ROWS``, keys a multiple of 128) copies K
and V itself in chunks of every KV head at once (1024 keys), only the chunks
some row sees, instead of the grid kernel's 4096-key blocks (whose last block
is read whole in a partly filled static cache). Estimated (us; ours /
HBM-bound time), the decode kernel computing each chunk's scores of up to 8
KV heads before their softmax steps (``flash_decode``, "Heads"); the 1024 rows
with its chunk spans (``key_ranges.decode_chunk_spans``), the 2048 rows
before them (0.4-0.6 us more of XLA ops):

==========================================  =============  ============  ============  ============
case                                        kernel         v5e           v6e           tpu7x
==========================================  =============  ============  ============  ============
Llama-3-8B decode, batch 8, 32k cache full  grid 4 x 4096  1314 (1.00)   657 (1.00)    393 (1.35)
                                            decode 1024    1312 (1.00)   655 (1.00)    292 (1.00)
                                            decode 2048    1312 (1.00)   656 (1.00)    292 (1.00)
  same, 2k of 32k filled                    grid 4 x 4096  166 (2.03)    84.1 (2.05)   50.7 (2.78)
                                            decode 1024    82.7 (1.01)   41.4 (1.01)   18.6 (1.02)
                                            decode 2048    83.1 (1.01)   42.0 (1.02)   19.1 (1.05)
  batch 8, 3k of an 8k cache                grid 4 x 4096  166 (1.38)    84.1 (1.40)   50.7 (1.90)
                                            decode 1024    124 (1.03)    61.9 (1.03)   27.7 (1.04)
                                            decode 2048    165 (1.37)    82.9 (1.38)   37.3 (1.40)
Gemma-4 global decode, 32k full (D 512)     grid 4 x 4096  168 (1.03)    84.8 (1.04)   39.0 (1.07)
                                            decode 1024    164 (1.00)    82.3 (1.01)   36.8 (1.01)
                                            decode 2048    166 (1.01)    82.8 (1.01)   37.2 (1.02)
==========================================  =============  ============  ============  ============

Since the table, a chunk's copy stops at the last key some row sees (whole
16-key tiles in bf16, ``flash_decode``, "Chunks"): 3k of an 8k cache at 1024
keys reads 3008 keys, not 3072: v5e 124 -> 121.3 us (1.01), v6e 61.9 -> 60.7
(1.01), tpu7x 27.7 -> 27.2 (1.02); ragged paged attention v3 122.1 / 61.8 /
31.7. Where the chunk is the tradeoff: every chip is HBM-bound at 1024 keys,
and longer chunks only read more of a partly filled cache (3k of 8k, before
the partial copies: 3072 keys read at 1024, 4096 at 2048). On tpu7x (2.25x
v6e's HBM bandwidth per core) the copies leave the least slack: at 1024 keys the chunk loop computes for
213 of the full cache's 292 us; at 512, for 276 (292 us, 3k of 8k 28.2 as at
1024), too close to the copies to be worth the few keys it saves. Before the
heads' scores came first, tpu7x computed slower than 1024-key copies arrive
(547 us on the full cache at 1024, 363 at 2048, which it then took: 3k of 8k
46.7 us, 2k of 32k 24.1). Chunks of 512 lost to the loop's per-iteration
cost on v6e then (1.66x on the full cache). Computing the scores as K q^T (K
streamed through the MXU, the few query rows as its weights) and transposing
them cost more than it saved (tpu7x 822 us at 1024, heads whole). v4 and v5p
(not estimated) keep the grid kernel.

Callers may pass their own sizes (``block_sizes=``, a pair or a ``BlockSizes``,
checked where the kernels are entered) and splits (``kv_splits=``).
"""

from __future__ import annotations

import dataclasses

from ..common import tpu_generations

PREFILL_BLOCK = 2048
PREFILL_MIN_BLOCK_Q = 1024
WINDOW_BLOCK = 512  # the backward's blocks under a causal window wider than BACKWARD_WINDOW_SUB_TILE
WINDOW_WIDE_TILE_BLOCK = 1024  # the forward's under a window, f32 / float16 tiles
DECODE_MAX_ROWS = 128
DECODE_BLOCK_K = 4096
# Keys per copy of the decode kernel, by generation; a generation missing here
# decodes with the grid kernel (see the module docstring's decode table: tpu7x
# took 2048 until the decode kernel computed its heads' scores first).
DECODE_CHUNKS = {"v5e": 1024, "v6e": 1024, "tpu7x": 1024}
MIN_BLOCK_K = 512
COMPUTE_BLOCK_K = 256
FORWARD_COMPUTE_ROWS = 512
FORWARD_COMPUTE_KEYS = 512
DIAGONAL_SUB_TILE = 256
WINDOW_SUB_TILE = 256
# Generations whose forward takes a tile's row sums from the MXU (module docstring).
ROW_SUMS_ON_MXU = frozenset({"v6e"})
ROW_SUMS_V_DIM = 128
BACKWARD_BLOCK = 2048
BACKWARD_COMPUTE_BLOCK = 1024
BACKWARD_WINDOW_SUB_TILE = 512  # the backward's sub-tiles under a window of at most as many keys
FUSED_DQ_MAX_BYTES = 1 << 30
FUSED_DQ_MIN_BLOCK_K = 1024


def choose_blocks(rows: int, kv_len: int, *, head_dim: int = 128, v_dim: int | None = None, itemsize: int = 2,
                  window: int = 0, generation: str | None = None) -> tuple[int, int]:
    """Forward ``(block_q, block_k)`` for ``rows`` flattened query rows and
    ``kv_len`` keys. ``window``: a causal sliding window (0: none); it takes the
    prefill blocks too, except 4-byte tiles at ``WINDOW_WIDE_TILE_BLOCK``
    (module docstring, "Windows at prefill blocks")."""
    if rows <= DECODE_MAX_ROWS:
        block_q, block_k = rows, DECODE_BLOCK_K
    else:
        # 4-byte tiles under a window: a static region's f32 temporaries pass the scoped VMEM at 2048
        # (gpt-oss float16 on v6e: 34.9 MiB of 32), which the working set below does not count.
        block_q = block_k = WINDOW_WIDE_TILE_BLOCK if window and itemsize > 2 else PREFILL_BLOCK
        block_q = min(block_q, rows)
    budget = tpu_generations.get_generation(generation).vmem_budget
    v_dim = head_dim if v_dim is None else v_dim
    def fits():
        return working_set_bytes(block_q, block_k, head_dim, v_dim, itemsize) <= budget

    # A prefill gives up query rows first, down to PREFILL_MIN_BLOCK_Q (1024 x 2048
    # beats 2048 x 1024); from 1024 x 1024 on, the order is the one below.
    while not fits() and rows > DECODE_MAX_ROWS and block_q > PREFILL_MIN_BLOCK_Q:
        block_q //= 2
    while not fits() and block_k > MIN_BLOCK_K:
        block_k //= 2
    while not fits() and rows > DECODE_MAX_ROWS and block_q > 128 and block_q % 16 == 0:
        block_q //= 2
    return block_q, (kv_len if kv_len <= block_k else block_k)


def _splits_keys(block_q: int, block_k: int) -> bool:
    """Is this a prefill tile computed in pieces: more keys than a window tile
    (``FORWARD_COMPUTE_KEYS``; window and decode tiles stay whole: their
    per-piece set-up would outweigh what the pieces skip)."""
    return block_q > DECODE_MAX_ROWS and block_k > FORWARD_COMPUTE_KEYS and block_k % FORWARD_COMPUTE_KEYS == 0


def compute_block_k(block_q: int, block_k: int, v_dim: int = 128) -> int:
    """Keys per fold of a forward tile every row sees whole: ``COMPUTE_BLOCK_K``
    for a prefill tile split in pieces, or ``v_dim`` where wider (each fold
    rescales the ``[rows, v_dim]`` f32 accumulator), else the whole tile."""
    fold = max(COMPUTE_BLOCK_K, v_dim)
    if _splits_keys(block_q, block_k) and block_k % fold == 0:
        return fold
    return block_k


def forward_compute_blocks(block_q: int, block_k: int) -> tuple[int, int]:
    """The forward's masked-tile sub-tiles ``(sub_q, sub_k)`` of a ``(block_q,
    block_k)`` tile: ``FORWARD_COMPUTE_KEYS`` keys, and ``FORWARD_COMPUTE_ROWS``
    rows where they divide a prefill tile split in pieces (else all rows; a
    tile not split is its one sub-tile). Each sub-tile is skipped, unmasked or
    masked on its own from the sub-tiles' visit table."""
    if not _splits_keys(block_q, block_k):
        return block_q, block_k
    split_rows = block_q > FORWARD_COMPUTE_ROWS and block_q % FORWARD_COMPUTE_ROWS == 0
    return (FORWARD_COMPUTE_ROWS if split_rows else block_q), FORWARD_COMPUTE_KEYS


def static_sub_tile(block_q: int, block_k: int, window: int = 0, v_dim: int = 128) -> int:
    """The square sub-tiles a tile whose sub-tiles' kinds are static
    (``key_ranges.aligned_tile``: a causal diagonal, a window's tiles) is
    computed in, all in one region: ``DIAGONAL_SUB_TILE`` in a prefill tile
    split in pieces, or ``v_dim`` where wider (each sub-tile rescales its rows'
    ``[rows, v_dim]`` f32 accumulator: narrower sub-tiles would spend more on
    it than on their scores); ``WINDOW_SUB_TILE`` in a whole tile of a window
    no longer than that (a longer window leaves too few sub-tiles to skip); 0:
    none (the size does not divide the tile, or the tile would be its one
    sub-tile)."""
    if _splits_keys(block_q, block_k):
        size = max(DIAGONAL_SUB_TILE, v_dim)
    elif 0 < window <= WINDOW_SUB_TILE and block_q > DECODE_MAX_ROWS:
        size = WINDOW_SUB_TILE
    else:
        return 0
    split = block_q % size == 0 and block_k % size == 0 and block_q * block_k > size * size
    return size if split else 0


def row_sums_on_mxu(generation: str | None, v_dim: int) -> bool:
    """Does the forward take its tiles' row sums from the P V product
    (``softmax_tiles.online_softmax_step(sum_on_mxu=True)``): on a generation
    of ``ROW_SUMS_ON_MXU`` with 128-wide V rows (module docstring)."""
    return tpu_generations.get_generation(generation).name in ROW_SUMS_ON_MXU and v_dim == ROW_SUMS_V_DIM


def sub_tiles(block_q: int, block_k: int, sub_q: int, sub_k: int):
    """The static ``(i, j, rows, keys)`` of a block's compute sub-tiles: the
    ``i``-th ``sub_q`` rows and ``j``-th ``sub_k`` keys, as slices of the block."""
    for i in range(block_q // sub_q):
        for j in range(block_k // sub_k):
            yield i, j, slice(i * sub_q, (i + 1) * sub_q), slice(j * sub_k, (j + 1) * sub_k)


def choose_decode_chunk(rows: int, kv_len: int, *, kv_heads: int = 1, head_dim: int = 128, v_dim: int | None = None,
                        itemsize: int = 2, generation: str | None = None) -> int | None:
    """Keys per copy of the decode kernel (``flash_decode``), or None where the
    grid kernel runs: a generation without a ``DECODE_CHUNKS`` entry, more
    than ``DECODE_MAX_ROWS`` rows (not a decode), keys not a multiple of 128
    (its copies start on whole tiles) or fewer than one chunk. The chunk is
    halved (not below 128) until two chunks of K and V of every KV head (the
    kernel's double buffer) fit 3/4 of the generation's VMEM budget (None if
    128 keys do not; the rest holds q, the statistics and a head's f32 tiles)."""
    gen = tpu_generations.get_generation(generation)
    chunk = DECODE_CHUNKS.get(gen.name)
    if chunk is None or rows > DECODE_MAX_ROWS or kv_len % 128:
        return None
    v_dim = head_dim if v_dim is None else v_dim
    budget = gen.vmem_budget
    def fits():
        return 2 * kv_heads * chunk * (head_dim + v_dim) * itemsize <= budget * 3 // 4

    while chunk > 128 and not fits():
        chunk //= 2
    return chunk if fits() and kv_len >= chunk else None


def choose_backward_blocks(rows: int, kv_len: int, *, head_dim: int = 128, v_dim: int | None = None,
                           itemsize: int = 2, window: int = 0, generation: str | None = None) -> tuple[int, int]:
    """Backward ``(block_q, block_k)``: ``BACKWARD_BLOCK`` square blocks (computed in
    ``backward_compute_blocks`` sub-tiles) where ``backward_working_set_bytes``
    fits the large budget and the sub-tiles are at most ``BACKWARD_COMPUTE_BLOCK``,
    else ``BACKWARD_COMPUTE_BLOCK`` square ones (``WINDOW_BLOCK`` under a causal
    window wider than ``BACKWARD_WINDOW_SUB_TILE`` or over 4-byte tiles; a
    narrower one over 2-byte tiles takes the large blocks in sub-tiles of that
    size), at most the rows / keys; ``block_k`` then ``block_q`` halved (not
    below 512 / 128) until the working set fits; ``BACKWARD_COMPUTE_BLOCK``
    ones again where only they fit with dq fused (module docstring)."""
    budget = tpu_generations.get_generation(generation).large_vmem_budget
    v_dim = head_dim if v_dim is None else v_dim

    def fits():
        return backward_working_set_bytes(block_q, block_k, head_dim, v_dim, itemsize, window=window) <= budget

    def fits_fused(bq, bk):
        return backward_working_set_bytes(bq, bk, head_dim, v_dim, itemsize, fused_dq=True, window=window) <= budget

    block_q, block_k = min(rows, BACKWARD_BLOCK), min(kv_len, BACKWARD_BLOCK)
    # Sub-tiles larger than BACKWARD_COMPUTE_BLOCK (a block it does not divide) keep the smaller blocks; so do
    # windows wider than BACKWARD_WINDOW_SUB_TILE and 4-byte tiles under a window (module docstring).
    small_window_blocks = window > BACKWARD_WINDOW_SUB_TILE or (window and itemsize > 2)
    if (small_window_blocks or not fits()
            or max(backward_compute_blocks(block_q, block_k, window)) > BACKWARD_COMPUTE_BLOCK):
        size = WINDOW_BLOCK if window else BACKWARD_COMPUTE_BLOCK
        block_q, block_k = min(rows, size), min(kv_len, size)
    while not fits() and block_k > MIN_BLOCK_K:
        block_k //= 2
    while not fits() and block_q > 128:
        block_q //= 2
    # dq fuses only where the fused kernel's blocks fit too (``fuses_dq``):
    # square BACKWARD_COMPUTE_BLOCK blocks with dq fused beat larger ones without.
    smaller = min(rows, BACKWARD_COMPUTE_BLOCK), min(kv_len, BACKWARD_COMPUTE_BLOCK)
    if (block_k > BACKWARD_COMPUTE_BLOCK and not fits_fused(block_q, block_k)
            and fits_fused(*smaller)):
        block_q, block_k = smaller
    return block_q, block_k


def backward_needs_large_vmem(working_set: int, generation: str | None) -> bool:
    """Whether a backward kernel whose blocks take ``working_set`` bytes
    (``backward_working_set_bytes``) asks Mosaic for the large VMEM limit:
    only where they pass the default budget (smaller blocks keep the default
    limit)."""
    return working_set > tpu_generations.get_generation(generation).vmem_budget


def fuses_dq(part_bytes: int, working_set: int, *, block_k: int, num_kv_blocks: int,
             generation: str | None) -> bool:
    """Whether the backward computes dq in its dk/dv kernel (module docstring):
    key blocks of at least ``FUSED_DQ_MIN_BLOCK_K`` keys (or a single one), one
    key block's f32 part of dq (``part_bytes``) within ``FUSED_DQ_MAX_BYTES``,
    and the fused kernel's ``working_set`` (``backward_working_set_bytes(
    fused_dq=True)``) within the generation's large VMEM budget, which that
    kernel then asks for."""
    return ((block_k >= FUSED_DQ_MIN_BLOCK_K or num_kv_blocks == 1) and part_bytes <= FUSED_DQ_MAX_BYTES
            and working_set <= tpu_generations.get_generation(generation).large_vmem_budget)


def fused_dq_blocks_per_call(part_bytes: int, num_kv_blocks: int) -> int:
    """Key blocks per call of the fused dk/dv kernel: its parts of dq (kept
    until summed) stay within ``FUSED_DQ_MAX_BYTES``; more key blocks take
    several calls, each over its own key blocks."""
    return max(1, min(num_kv_blocks, FUSED_DQ_MAX_BYTES // part_bytes))


def backward_compute_blocks(block_q: int, block_k: int, window: int = 0) -> tuple[int, int]:
    """The backward's compute sub-tiles ``(sub_q, sub_k)`` of ``(block_q, block_k)``
    blocks: ``BACKWARD_COMPUTE_BLOCK`` (``BACKWARD_WINDOW_SUB_TILE`` under a
    window of at most that many keys) on a side it divides, else the whole side."""
    size = BACKWARD_WINDOW_SUB_TILE if 0 < window <= BACKWARD_WINDOW_SUB_TILE else BACKWARD_COMPUTE_BLOCK

    def side(block):
        return size if block > size and block % size == 0 else block
    return side(block_q), side(block_k)


def check_compute_blocks(compute_blocks, block_q: int, block_k: int) -> tuple[int, int]:
    """``(sub_q, sub_k)`` if they divide the blocks and are TPU-legal slices of
    them (rows a multiple of 8, keys of 128, or the whole side)."""
    sub_q, sub_k = BlockSizes.of(compute_blocks)
    if block_q % sub_q or (sub_q % 8 and sub_q != block_q):
        raise ValueError(f"attention: compute block_q must divide block_q={block_q} and be a multiple of 8, "
                         f"got {sub_q}")
    if block_k % sub_k or (sub_k % 128 and sub_k != block_k):
        raise ValueError(f"attention: compute block_k must divide block_k={block_k} and be a multiple of 128, "
                         f"got {sub_k}")
    return sub_q, sub_k


def backward_working_set_bytes(block_q: int, block_k: int, head_dim: int, v_dim: int, itemsize: int, *,
                               fused_dq: bool = False, window: int = 0) -> int:
    """The larger of the two kernels: double-buffered q, dO, k, v blocks and the
    dq kernel's lane-padded lse / delta columns (the dk/dv kernel takes them as
    lane rows), double-buffered dk / dv blocks and their f32 accumulators (as
    much as the dq kernel's dq block, accumulator and ranges at square blocks),
    and three f32 temporaries (p, dp, ds) the size of one compute sub-tile
    (``backward_compute_blocks``). ``fused_dq``: the dk/dv kernel that also
    computes dq, with its double-buffered f32 dq part block and a fourth
    temporary (ds transposed). ``window``: the sub-tiles' (``backward_compute_blocks``)."""
    d = head_dim + v_dim
    sub_q, sub_k = backward_compute_blocks(block_q, block_k, window)
    inputs = 2 * ((block_q + block_k) * d * itemsize + 2 * block_q * 128 * 4)
    outputs = 2 * block_k * d * itemsize + 4 * block_k * d
    if fused_dq:
        return inputs + outputs + 2 * 4 * block_q * head_dim + 4 * 4 * sub_q * sub_k
    return inputs + outputs + 3 * 4 * sub_q * sub_k


def choose_kv_splits(parallel_units: int, num_q_blocks: int, num_kv_blocks: int, generation: str | None) -> int:
    """Parts the keys are split into (see the module docstring): ``parallel_units``
    is the number of (batch, KV head) pairs."""
    cores = tpu_generations.get_generation(generation).tensorcores
    if cores == 1 or num_q_blocks > 1 or parallel_units * num_q_blocks >= cores:
        return 1
    return min(cores, num_kv_blocks)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """``(block_q, block_k)`` of one kernel call: positive ints, checked on
    creation; ``check_fits`` checks TPU legality against the call's rows and
    keys, where every path enters the kernels (and in the op, on the host).
    Unpacks as a pair."""
    block_q: int
    block_k: int

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"attention: {name} must be a positive int, got {value!r}")

    @classmethod
    def of(cls, sizes) -> "BlockSizes":
        """``sizes`` as ``BlockSizes``: one already, or a ``(block_q, block_k)`` pair."""
        if isinstance(sizes, cls):
            return sizes
        if not isinstance(sizes, (tuple, list)) or len(sizes) != 2:
            raise ValueError(f"attention: block_sizes must be a (block_q, block_k) pair, got {sizes!r}")
        return cls(*sizes)

    def check_fits(self, rows: int, kv_len: int) -> "BlockSizes":
        """``self`` if legal for ``rows`` query rows and ``kv_len`` keys: rows a
        multiple of 8 or all of them; keys a multiple of 128 or all."""
        if self.block_q % 8 and self.block_q != rows:
            raise ValueError(f"attention: block_q must be a multiple of 8 or all {rows} rows, got {self.block_q}")
        if self.block_k % 128 and self.block_k != kv_len:
            raise ValueError(f"attention: block_k must be a multiple of 128 or all {kv_len} keys, got {self.block_k}")
        return self

    def __iter__(self):
        return iter((self.block_q, self.block_k))


def check_kv_splits(kv_splits: int) -> None:
    if not isinstance(kv_splits, int) or isinstance(kv_splits, bool) or kv_splits <= 0:
        raise ValueError(f"attention: kv_splits must be a positive int or None, got {kv_splits!r}")


def working_set_bytes(block_q: int, block_k: int, head_dim: int, v_dim: int, itemsize: int) -> int:
    """Double-buffered q, k, v and out blocks, the f32 scores, accumulator and row stats."""
    io = (block_q * head_dim + block_k * head_dim + block_k * v_dim + block_q * v_dim) * itemsize
    return 2 * io + 4 * (block_q * block_k + block_q * v_dim + 2 * block_q * 128)
