"""tpu-inference 0.32.0 (vLLM's TPU backend) as a peer of the MoE experts
benchmark and of the attention benchmark (its ragged paged attention v3:
``bench_attention_tpu.py --peers rpa``, the RPA section below).

Benchmark-only: the wheel is installed without its serving stack
(bench/requirements-nodeps.lock), so its package ``__init__`` (which imports
vllm and sets serving environment variables) must not run. ``load`` imports
only the kernel modules: the two top-level packages on the import path are
registered as bare namespace modules (their ``__init__`` not executed), and
``tpu_inference.logger`` (it wraps vllm's logger) is replaced by a stand-in
with the two methods the kernels call.

Contenders (names for ``bench_tpu_estimates.py --contenders``):

- ``tpu-inference-gmm``: ``tpu_inference.kernels.megablox.gmm`` twice (up,
  gate, down) on the rows sorted by expert, weights ``[E, in, out]`` as the
  other peers; tiling: what the kernel picks itself when not given one (its
  tuned table, else its heuristic ``get_default_gmm_block_sizes``). This is
  the grouped matmul the wheel vendors (a megablox derivative; its MoE layers
  run it with ``USE_UNFUSED_MEGABLOCKS``). Its default MoE path (GMM_TP /
  GMM_EP) calls tokamax's ``gmm_v2`` instead, from tokamax 0.0.17.dev20261015,
  a dependency it does not vendor; our benchmarks pin tokamax 0.0.12 (the
  estimator's calibration source), which has no ``gmm_v2``: not estimated.
- ``fused-ep-moe``: ``tpu_inference.kernels.fused_moe.v1.fused_ep_moe`` on one
  device (ep=1): it takes the layer's hidden states ``[T, H]`` and the router
  logits ``[T, E]`` and does the routing (softmax, top-k), the gather of each
  expert's tokens, both matmuls and the gate, and the weighted scatter-add
  back to ``[T, H]`` (bf16 out). Weights ``w1 [E, 2, H, F]`` (gate and up
  stacked) and ``w2 [E, F, H]``: the same bytes as the others'. Block sizes:
  its tuned table, else its defaults (``get_tuned_block_sizes``). Hidden and
  intermediate sizes padded to multiples of 256, as its layer pads the
  weights when loading them (gpt-oss-20b: 2880 -> 3072).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import pathlib
import sys
import types

import numpy as np

CONTENDERS = ("tpu-inference-gmm", "fused-ep-moe")
# Errors of these kernels on a shape -> the table's few words.
SHORT_REASONS = (
    ("to be aligned to t_packing", "odd token count (bf16 packs 2 tokens)"),
    ("CompileTimeScopedVmemOom", "its tiles exceed the scoped VMEM limit"),
    ("to be aligned to bd1=", "its default blocks do not divide the hidden size"),
)
_PACKAGE = "tpu_inference"


def _bare_package(name: str, path: pathlib.Path) -> types.ModuleType:
    """A package module whose ``__init__`` is not run: its submodules import
    from ``path`` as usual."""
    module = types.ModuleType(name)
    module.__path__ = [str(path)]
    module.__spec__ = importlib.util.spec_from_loader(name, loader=None, is_package=True)
    module.__spec__.submodule_search_locations = [str(path)]
    return module


class _OnceLogger(logging.LoggerAdapter):
    """What the kernels call on tpu-inference's (vllm's) logger."""

    def __init__(self, name):
        super().__init__(logging.getLogger(name), {})
        self._seen = set()

    def _once(self, level, msg, *args):
        if msg not in self._seen:
            self._seen.add(msg)
            self.log(level, msg, *args)

    def warning_once(self, msg, *args, **_):
        self._once(logging.WARNING, msg, *args)

    def info_once(self, msg, *args, **_):
        self._once(logging.INFO, msg, *args)


def load(module: str) -> types.ModuleType:
    """Import ``tpu_inference.<module>`` without the package's ``__init__``."""
    if _PACKAGE not in sys.modules:
        spec = importlib.util.find_spec(_PACKAGE)  # finds, does not execute
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("tpu-inference is not installed: bash scripts/bootstrap.sh bench")
        root = pathlib.Path(list(spec.submodule_search_locations)[0])
        sys.modules[_PACKAGE] = _bare_package(_PACKAGE, root)
        sys.modules[f"{_PACKAGE}.kernels"] = _bare_package(f"{_PACKAGE}.kernels", root / "kernels")
        logger = types.ModuleType(f"{_PACKAGE}.logger")
        logger.init_logger = _OnceLogger
        sys.modules[logger.__name__] = logger
    return importlib.import_module(f"{_PACKAGE}.{module}")


# ----------------------------------------------------------------------------
# tpu-inference gmm
# ----------------------------------------------------------------------------


def gmm_tiling(m: int, k: int, n: int, experts: int, dtype: str = "bfloat16",
               rhs_dtype: str | None = None) -> tuple[int, int, int]:
    """The (tm, tk, tn) tpu-inference's gmm runs ``[m, k] @ [E, k, n]`` with
    when called without a tiling (as its ``gmm`` does: bf16 weights, one
    shard holding every expert). ``rhs_dtype``: the weights' dtype where it
    differs from the rows' (quantized weights: part of its table's key; its
    ``gmm`` always looks up with the whole K as the quantization block)."""
    tuned = load("kernels.megablox.tuned_block_sizes")
    return tuple(tuned.get_tuned_block_sizes(m=m, k=k, n=n, num_total_groups=experts, num_current_groups=experts,
                                             lhs_dtype=dtype, rhs_dtype=rhs_dtype or dtype, quant_block_size=k))


def gmm_fn(act):
    """``down(act(up(x)))`` by tpu-inference's gmm at its own tiling;
    ``act``: the gate (f32 in, bf16 out)."""
    import jax.numpy as jnp

    gmm = load("kernels.megablox.gmm").gmm

    def fn(x, up, down, gs):
        h = gmm(x, up, gs, preferred_element_type=jnp.float32)
        return gmm(act(h), down, gs, preferred_element_type=jnp.float32)

    return fn


def gmm_config(rows: int, hidden: int, inter: int, experts: int) -> str:
    """The two tilings (up, down) as the table names them: ``up 128,2048,1536 / down 128,768,2048``."""
    up = gmm_tiling(rows, hidden, 2 * inter, experts)
    down = gmm_tiling(rows, inter, hidden, experts)
    return f"up {','.join(map(str, up))} / down {','.join(map(str, down))}"


# ----------------------------------------------------------------------------
# tpu-inference gmm on quantized weights (rhs_scale)
# ----------------------------------------------------------------------------

# Our formats (``common.quant_formats``) as its gmm takes them: the weights'
# dtype, and the quantization block along K (None: the whole K, one scale per
# output channel). Its ``rhs_scale [E, K / block, 1, N]`` has one scale per
# (K block, output column), so fp8's 128 x 128 block scale is repeated over the
# block's 128 columns (the same products), and mxfp4's e8m0 exponents become
# f32 scales (the dtype its ``quantize_tensor`` gives every scale; e2m1 values
# with f32 scales per 32 K values is what its own mxfp4 path computes, there
# requantized to blocks of 512 and run by tokamax's gmm_v2 instead).
QUANTIZED_GMM = {"int8": ("int8", None), "fp8": ("float8_e4m3fn", 128), "mxfp4": ("float4_e2m1fn", 32)}
QUANTIZED_PREFIX = "tpu-inference-gmm "  # + a format: "tpu-inference-gmm fp8"


def quantized_dims(fmt: str, hidden: int, inter: int) -> tuple[int, int]:
    """(hidden, intermediate) the weights have in its layout: its
    ``quantize_moe_weights`` pads both to a multiple of the block before
    quantizing (gpt-oss-20b in fp8: 2880 -> 2944; per channel: unpadded)."""
    block = QUANTIZED_GMM[fmt][1]
    return (hidden, inter) if block is None else (_align(hidden, block), _align(inter, block))


def quantized_gmm_tiling(fmt: str, m: int, k: int, n: int, experts: int) -> tuple[int, int, int]:
    """The (tm, tk, tn) its gmm runs on ``[m, k] @ [E, k, n]`` in ``fmt``: its
    pick without a tiling (``gmm_tiling`` with the weights' dtype), then its
    own fix-up: tk becomes the quantization block when neither divides the
    other."""
    rhs_dtype, block = QUANTIZED_GMM[fmt]
    tm, tk, tn = gmm_tiling(m, k, n, experts, rhs_dtype=rhs_dtype)
    block = block or k
    if tk % block and block % tk:
        tk = block
    return tm, tk, tn


def quantized_gmm_fn(act):
    """``down(act(up(x)))`` by its gmm with ``rhs_scale`` (and no bias), at
    the tiling it picks itself; f32 out as ``gmm_fn``."""
    import jax.numpy as jnp

    gmm = load("kernels.megablox.gmm").gmm

    def fn(x, up, up_s, down, down_s, gs):
        h = gmm(x, up, gs, preferred_element_type=jnp.float32, rhs_scale=up_s)
        return gmm(act(h), down, gs, preferred_element_type=jnp.float32, rhs_scale=down_s)

    return fn


def quantized_gmm_args(fmt: str, rows: int, hidden: int, inter: int, experts: int, gs) -> list:
    """``quantized_gmm_fn``'s arguments: rows ``[rows, H]`` bf16, weights
    ``[E, in, out]`` in the format's dtype, scales ``[E, in / block, 1, out]``
    f32, on the padded sizes of ``quantized_dims``."""
    import jax
    import jax.numpy as jnp

    rhs_dtype, block = QUANTIZED_GMM[fmt]
    hidden, inter = quantized_dims(fmt, hidden, inter)
    args = [jax.ShapeDtypeStruct((rows, hidden), jnp.bfloat16)]
    for k, n in ((hidden, 2 * inter), (inter, hidden)):
        args += [jax.ShapeDtypeStruct((experts, k, n), jnp.dtype(rhs_dtype)),
                 jax.ShapeDtypeStruct((experts, k // (block or k), 1, n), jnp.float32)]
    return args + [gs]


def quantized_gmm_config(fmt: str, rows: int, hidden: int, inter: int, experts: int) -> str:
    """``up 128,2048,1536 / down 128,768,2048`` (+ the padded sizes where the
    format pads them)."""
    h, f = quantized_dims(fmt, hidden, inter)
    up = quantized_gmm_tiling(fmt, rows, h, 2 * f, experts)
    down = quantized_gmm_tiling(fmt, rows, f, h, experts)
    padded = f" (H, F padded to {h}, {f})" if (h, f) != (hidden, inter) else ""
    return f"up {','.join(map(str, up))} / down {','.join(map(str, down))}{padded}"


def quantized_table_note(formats) -> str:
    """What the quantized tpu-inference-gmm contenders of a table run."""
    if not formats:
        return ""
    return (
        "tpu-inference-gmm (quantized): tpu-inference 0.32.0's `kernels/megablox/gmm.py` twice (up, gate, "
        "down; f32 out) with `rhs_scale`, at the tiles it picks itself when given none (its tuned table, "
        "whose only quantized entries are fp8 shapes of a 160-expert model, so here its heuristic "
        "`get_default_gmm_block_sizes` as for bf16, looked up with the weights' dtype; then tk = the "
        "quantization block where neither divides the other); tiles in the notes. Its gmm takes bf16 "
        "rows and int8, fp8 (e4m3 / e5m2), int4 / uint4 or e2m1 weights with f32 scales "
        "`[E, K / block, 1, N]`: one scale per (K block, output column); per K block it runs a separate dot "
        "of the block's K columns and scales the f32 partial product. int8: scales `[E, 1, 1, N]` (per "
        "output channel, as ours). fp8: `[E, K / 128, 1, N]`, our 128 x 128 block scale repeated over "
        "the block's 128 columns (same products, 128x our scale bytes); hidden and intermediate padded to "
        "multiples of 128 as its `quantize_moe_weights` pads them (gpt-oss-20b: 2880 -> 2944; "
        "gemma-4-26b-a4b: intermediate 704 -> 768). mxfp4: e2m1 "
        "weights with f32 scales `[E, K / 32, 1, N]` (our e8m0 exponents as f32, 4x our scale bytes): "
        "the same format, but not a path tpu-inference serves (its mxfp4 layer requantizes to e2m1 "
        "blocks of 512 and runs tokamax's gmm_v2, not estimated: see the bf16 table). On v5e and v6e it "
        "does not compile: Mosaic has no bf16 x e2m1 matmul there (its gmm hands the e2m1 tile to the dot as "
        "it is), and where tk does not divide K (gpt-oss-20b) its K-remainder mask casts the weights through "
        "f32 back to e2m1, a cast Mosaic supports only from TPU7x on; it compiles on tpu7x. Its MoE layer "
        "that calls this gmm with scales (`layers/jax/moe`, USE_UNFUSED_MEGABLOCKS; qwix-quantized "
        "weights) passes its own tiles instead (tm = rows rounded up to 128 at most 512, rows padded to "
        "tm; tk, tn as here) and runs gate and up as two calls; not what is estimated here. "
        "`ours / tpu-inference`: our time over its time (< 1: ours is faster). Both against our "
        "format's roofline bytes.\n\n")


# ----------------------------------------------------------------------------
# tpu-inference fused_ep_moe at ep=1
# ----------------------------------------------------------------------------


def fused_block_sizes(tokens: int, hidden: int, inter: int, experts: int, top_k: int) -> dict[str, int]:
    """The block sizes fused_ep_moe runs with at ep=1, bf16, on weights padded
    to multiples of 256 as its serving layer pads them (its tuned table, else
    its defaults, then its own clamps to the token count)."""
    tuned = load("kernels.fused_moe.v1.tuned_block_sizes")
    hidden, inter = _align(hidden, 256), _align(inter, 256)
    names = ("bt", "bf", "bd1", "bd2", "btc", "bfc", "bd1c", "bd2c")
    sizes = dict(zip(names, tuned.get_tuned_block_sizes(hidden, inter, experts, top_k, 2, 2, tokens, 1)))
    if tokens <= 2 * 8:  # its override: t_packing (2 for bf16) * 8 tokens or fewer run as one block
        sizes["bt"] = sizes["btc"] = tokens
    sizes["bt"] = min(tokens, sizes["bt"])
    sizes["btc"] = min(sizes["bt"], sizes["btc"])
    return sizes


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def fused_fn(generation: str, top_k: int):
    """``fused_ep_moe(tokens [T, H], w1 [E, 2, H, F], w2 [E, F, H], logits [T, E])``
    on a one-device mesh of the chip."""
    import jax
    from jax.sharding import Mesh

    import tpu_estimator

    kernel = load("kernels.fused_moe.v1.kernel")
    device = tpu_estimator.chip_device(tpu_estimator.CHIPS[generation])
    mesh = Mesh(np.array([device]).reshape(1, 1), ("data", "model"))

    def fn(tokens, w1, w2, logits):
        return kernel.fused_ep_moe(mesh, tokens, w1, w2, logits, top_k, act_fn="silu", ep_axis_name="model")

    return jax.jit(fn)


def router_logits(tokens: int, experts: int, rng_seed: int) -> np.ndarray:
    """Router logits (bf16: the kernel takes them in the tokens' dtype) whose
    top-k is bench_tpu_estimates' ``routing_group_sizes`` routing for the same
    seed (it takes the k smallest of the same draw), but for ties bf16 makes."""
    import ml_dtypes

    return (-np.random.default_rng(rng_seed).random((tokens, experts))).astype(ml_dtypes.bfloat16)


def fused_config(tokens: int, hidden: int, inter: int, experts: int, top_k: int) -> str:
    sizes = fused_block_sizes(tokens, hidden, inter, experts, top_k)
    return " ".join(f"{k}={v}" for k, v in sizes.items())


def config_notes(model_dims, tokens: int, ran) -> list[str]:
    """The config each tpu-inference contender in ``ran`` (the row's results)
    ran or failed with, for the table's notes."""
    hidden, inter, experts, top_k, _ = model_dims
    notes = []
    if "tpu-inference-gmm" in ran:
        notes.append(f"tpu-inference-gmm tiles {gmm_config(tokens * top_k, hidden, inter, experts)}")
    if "fused-ep-moe" in ran and tokens % 2 == 0:
        notes.append(f"fused-ep-moe {fused_config(tokens, hidden, inter, experts, top_k)}")
    return notes


def estimate_fused(chip: str, tokens: int, hidden: int, inter: int, experts: int, top_k: int, rng_seed: int,
                   *, flops: float, min_bytes: float):
    """The estimate of fused_ep_moe (ep=1) for one experts layer of ``tokens``
    tokens, routed as bench_tpu_estimates routes them (same seed)."""
    import jax
    import jax.numpy as jnp

    import tpu_estimator

    # Its serving layer pads the weights' hidden and intermediate sizes to
    # multiples of 256 when it loads them (and the hidden states per call).
    hidden, inter = _align(hidden, 256), _align(inter, 256)
    bf16 = jnp.bfloat16
    args = [jax.ShapeDtypeStruct((tokens, hidden), bf16),
            jax.ShapeDtypeStruct((experts, 2, hidden, inter), bf16),
            jax.ShapeDtypeStruct((experts, inter, hidden), bf16),
            router_logits(tokens, experts, rng_seed)]
    routing = np.argsort(-args[3].astype(np.float32), axis=1, kind="stable")[:, :top_k]
    bt = fused_block_sizes(tokens, hidden, inter, experts, top_k)["bt"]
    return tpu_estimator.estimate(fused_fn(chip, top_k), args, chip, flops=flops, min_bytes=min_bytes,
                                  kernel_refs=lambda call: fused_routing_refs(call, routing, experts, bt))


def fused_routing_refs(call, routing: np.ndarray, experts: int, bt: int) -> dict[int, np.ndarray]:
    """What fused_ep_moe computes into SMEM from the router logits (its top-k
    on the vector unit, then a DMA), which the estimator's replay cannot
    follow: per token block (two slots, block b in slot b % 2) the token ->
    expert table, each expert's row count (also the one device's row of the
    device -> expert counts) and zero starts / offsets (ep=1). Blocks past the
    second are taken to route as the first two (same distribution: the
    routing is uniform at random); exact up to 2 * bt tokens."""
    kernel = call.eqn.params["jaxpr"]
    smem = [i for i, v in enumerate(kernel.invars) if "smem" in str(getattr(v.aval, "memory_space", "")).lower()]
    t2e, d2e, offsets, starts, sizes = smem[:5]
    shape = lambda i: kernel.invars[i].aval.shape  # noqa: E731
    values = {i: np.zeros(shape(i), np.int32) for i in (t2e, d2e, offsets, starts, sizes)}
    for slot in range(2):
        block = routing[slot * bt:(slot + 1) * bt]
        if not len(block):
            continue
        values[t2e][slot, :len(block), :block.shape[1]] = block
        counts = np.bincount(block.reshape(-1), minlength=experts)
        values[sizes][slot, 0, :experts] = counts
        values[d2e][slot, 0, 0, :experts] = counts
    return values


def table_note(contenders) -> str:
    """What the tpu-inference contenders of a table run and include."""
    notes = []
    if "tpu-inference-gmm" in contenders:
        notes.append(
            "tpu-inference-gmm: tpu-inference 0.32.0's `kernels/megablox/gmm.py` (a megablox derivative) twice, "
            "f32 out like the other peers, at the tiles it picks itself when given none (its tuned table, "
            "which holds no bf16 shape of these models, else its heuristic `get_default_gmm_block_sizes`: "
            "tm = the largest divisor of the rows not above 2 x rows / experts rounded up to 128 (at most 512), "
            "tk, tn = the dimension rounded up to 128, at most 2048); the tiles are in the notes. It takes "
            "fewer than 128 rows (tm divides the rows). Not tpu-inference's default MoE path, which calls tokamax's "
            "gmm_v2 from tokamax 0.0.17.dev (not vendored; our pinned tokamax 0.0.12 has no gmm_v2).")
    if "fused-ep-moe" in contenders:
        notes.append(
            "fused-ep-moe: tpu-inference 0.32.0's `fused_ep_moe` (fused_moe v1) on one device (ep=1) at its "
            "block sizes (its tuned table has no entry for these models and ep=1: its defaults, then its "
            "clamps to the token count; in the notes). It does more than ours: it takes the hidden states "
            "[T, H] and the router logits and does the routing itself (softmax, top-k on the vector unit), "
            "copies each expert's token rows into VMEM one row per DMA, runs up, gate and down, copies the "
            "rows back through an HBM buffer and sums them weighted by the router (bf16 out; ours: rows "
            "already sorted by expert, f32 out, no routing, no gather or scatter). It also streams every "
            "expert's weights once per token block (bt tokens, at most 128), whether tokens are routed to "
            "the expert or not: at decode that alone is the weights of all experts (ours: of the experts "
            "with rows), and from 256 tokens on it is several passes over all of them; the part comparable "
            "to ours cannot be split off its one kernel, so its whole time is listed. Not estimable: an odd "
            "token count (bf16 tokens are packed in pairs). Estimated with the routing computed on the host "
            "(the estimator cannot follow the kernel's own top-k): exact up to two token blocks, beyond that "
            "every block is taken to route as the first two. gpt-oss-20b: hidden and intermediate 2880 padded to 3072 "
            "as tpu-inference pads them when loading the weights (the kernel takes multiples of 128 only).")
    return "".join(n + "\n\n" for n in notes)


# ----------------------------------------------------------------------------
# tpu-inference ragged paged attention v3 (vLLM's TPU attention kernel)
# ----------------------------------------------------------------------------

# The TPU version its kernels read from ``jax.devices()[0].device_kind``; the
# estimator compiles for a chip it does not run on (the process's devices are
# CPUs), so the version of the target chip is set by hand (``_rpa_kernel``).
RPA_TPU_VERSION = {"v5e": 5, "v6e": 6, "tpu7x": 7}


def rpa_page_size(max_model_len: int) -> int:
    """The KV page size vLLM's TPU backend picks when the user sets none
    (tpu-inference 0.32.0, ``PallasAttentionBackend.get_page_size``): 16 above
    8192 tokens (larger pages spill its VMEM there), else the model length's
    power of two / 16, within [16, 256]."""
    if max_model_len > 8192:
        return 16
    pow2 = 1 << max(max_model_len - 1, 0).bit_length()
    return min(256, max(16, pow2 // 16))


@dataclasses.dataclass(frozen=True)
class PagedBatch:
    """The metadata arrays ragged paged attention takes for a batch, as a
    serving loop builds them: each sequence owns the pages its keys fill
    (``ceil(kv_len / page_size)``, numbered in order after the previous
    sequence's), its row of the block table is ``pages_per_seq`` wide (the
    model length's pages; unused entries 0)."""

    kv_lens: np.ndarray  # i32[seqs]: keys of each sequence, its new tokens included
    page_indices: np.ndarray  # i32[seqs * pages_per_seq]: the block table, row-major
    cu_q_lens: np.ndarray  # i32[seqs + 1]: where each sequence's queries start in the token axis
    distribution: np.ndarray  # i32[3]: (decode-only end, chunked-prefill end, mixed end)
    total_pages: int  # pages of the cache: the ones the batch holds
    page_size: int


def paged_batch(kv_lens, q_lens, page_size: int, max_model_len: int) -> PagedBatch:
    """``kv_lens`` / ``q_lens``: per sequence. Sequences of one query token
    are decode-only (first in the batch, as the scheduler orders them), the
    others mixed (vLLM runs no separate chunked-prefill group unless
    ``chunk_prefill_size`` is set)."""
    kv_lens = np.asarray(kv_lens, np.int32)
    q_lens = np.asarray(q_lens, np.int32)
    if kv_lens.shape != q_lens.shape or kv_lens.ndim != 1 or not len(kv_lens):
        raise ValueError(f"kv_lens {kv_lens.shape} and q_lens {q_lens.shape} must be one length per sequence")
    if (q_lens < 1).any() or (kv_lens < q_lens).any():
        raise ValueError("each sequence needs q_lens >= 1 and kv_lens >= q_lens (its new tokens are keys too)")
    if kv_lens.max() > max_model_len:
        raise ValueError(f"kv_lens up to {kv_lens.max()} exceed max_model_len {max_model_len}")
    decode = q_lens == 1
    if (np.diff(decode.astype(np.int8)) > 0).any():  # a decode sequence after a longer one
        raise ValueError("decode-only sequences (q_lens 1) must come first")
    pages_per_seq = -(-max_model_len // page_size)
    owned = -(-kv_lens // page_size)
    first = np.concatenate([[0], np.cumsum(owned)[:-1]])
    table = np.zeros((len(kv_lens), pages_per_seq), np.int32)
    columns = np.arange(pages_per_seq)
    table[:] = np.where(columns < owned[:, None], first[:, None] + columns, 0)
    seqs, decodes = len(kv_lens), int(decode.sum())
    return PagedBatch(kv_lens, table.reshape(-1), np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                      np.array([decodes, decodes, seqs], np.int32), int(max(owned.sum(), 1)), page_size)


def _rpa_kernel(generation: str):
    kernel = load("kernels.ragged_paged_attention.v3.kernel")
    version = RPA_TPU_VERSION[generation]
    kernel.get_tpu_version = lambda: version
    return kernel


def rpa_block_sizes(generation: str, batch: PagedBatch, heads: tuple[int, int], head_dim: int,
                    tokens: int) -> dict[str, dict[str, int]]:
    """The (bq_sz, bkv_sz, bq_csz, bkv_csz) its decode and mixed kernels run
    with when the caller passes none: ``get_default_block_sizes`` (v3 has no
    tuned table for its default head dims; its ``tuned_block_sizes.py`` is the
    older (pages, queries) table, read by nothing in the v3 path; vLLM passes
    block sizes only from the RPA_V3_*_BLOCK_SIZES environment variables)."""
    import jax.numpy as jnp

    kernel = _rpa_kernel(generation)
    hq, hkv = heads
    pages_per_seq = len(batch.page_indices) // len(batch.kv_lens)
    return {case.name.lower(): kernel.get_default_block_sizes(
        jnp.bfloat16, jnp.bfloat16, hq, hkv, head_dim, batch.page_size, tokens, len(batch.kv_lens), pages_per_seq,
        case=case) for case in (kernel.RpaCase.DECODE, kernel.RpaCase.MIXED)}


def rpa_vmem_limit(generation: str) -> int:
    """Its VMEM limit when given none: the chip's whole VMEM."""
    import jax
    from jax.experimental.pallas import tpu as pltpu

    import tpu_estimator

    with jax.default_device(tpu_estimator.chip_device(tpu_estimator.CHIPS[generation])):
        return int(pltpu.get_tpu_info().vmem_capacity_bytes)


def rpa_label(generation: str, batch: PagedBatch, heads, head_dim: int, tokens: int,
              mixed_blocks: tuple[int, int, int, int] | None = None) -> str:
    """The contender's name in the logs: page size and the block sizes of the
    kernel that does the work (decode-only batch: the decode kernel, else the
    mixed one), ``rpa@p16,bq1/1,bkv4096/4096,vmem128M`` (fetch / compute);
    ``,set`` ends it where ``mixed_blocks`` replaces its defaults."""
    if mixed_blocks is not None:
        bq, bkv, bq_c, bkv_c = mixed_blocks
        blocks = f"bq{bq}/{bq_c},bkv{bkv}/{bkv_c}"
    else:
        sizes = rpa_block_sizes(generation, batch, heads, head_dim, tokens)
        s = sizes["decode" if batch.distribution[0] == len(batch.kv_lens) else "mixed"]
        blocks = f"bq{s['bq_sz']}/{s['bq_csz']},bkv{s['bkv_sz']}/{s['bkv_csz']}"
    return (f"rpa@p{batch.page_size},{blocks},vmem{rpa_vmem_limit(generation) >> 20}M"
            + (",set" if mixed_blocks is not None else ""))


def rpa_fn(generation: str, *, sm_scale: float, sliding_window: int | None = None,
           mixed_blocks: tuple[int, int, int, int] | None = None):
    """``ragged_paged_attention(q [T, Hq, D], k, v [T, Hkv, D], kv_cache,
    kv_lens, page_indices, cu_q_lens, distribution)`` -> (out, updated
    cache), as vLLM calls it on one device: its defaults (block sizes, VMEM
    limit, ``update_kv_cache=True``: the step's new K/V are written into the
    cache by the kernel). The un-jitted function: its own ``jax.jit`` would
    keep the trace of the first chip (the TPU version it reads is not part of
    the jit's cache key). ``mixed_blocks``: (bq_sz, bkv_sz, bq_csz, bkv_csz)
    of its mixed kernel instead of its defaults (what vLLM's
    RPA_V3_MIXED_BLOCK_SIZES sets)."""
    kernel = _rpa_kernel(generation)
    attention = kernel.ragged_paged_attention.__wrapped__

    def fn(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution):
        return attention(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, sm_scale=sm_scale,
                         sliding_window=sliding_window, m_block_sizes=mixed_blocks)

    return fn


def rpa_args(generation: str, batch: PagedBatch, heads: tuple[int, int], head_dim: int) -> list:
    """The arguments of ``rpa_fn``: q, k, v abstract (bf16), the cache
    abstract in its layout (``get_kv_cache_shape``: K and V heads interleaved,
    bf16 pairs packed), the metadata concrete (the estimator replays the
    kernel's loops and page copies from them)."""
    import jax
    import jax.numpy as jnp

    kernel = _rpa_kernel(generation)
    hq, hkv = heads
    tokens = int(batch.cu_q_lens[-1])
    bf16 = jnp.bfloat16
    cache = kernel.get_kv_cache_shape(batch.total_pages, batch.page_size, hkv, head_dim, bf16)
    return [jax.ShapeDtypeStruct((tokens, hq, head_dim), bf16), jax.ShapeDtypeStruct((tokens, hkv, head_dim), bf16),
            jax.ShapeDtypeStruct((tokens, hkv, head_dim), bf16), jax.ShapeDtypeStruct(cache, bf16),
            batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.distribution]


RPA_CACHE_ARG = 3  # donated: the kernel updates the cache in place (input_output_aliases), as vLLM donates it


# Its head_dim-64 variant (gpt-oss: the only one with attention sinks)
# picks its blocks from a tuned table keyed by the device name, which its
# module imports from ``tpu_inference.utils`` (that module imports vllm): a
# stand-in module is registered for the import, and the name is set per chip.
RPA_DEVICE_NAME = {"v5e": "TPU v5e", "v6e": "TPU v6e", "tpu7x": "TPU v7"}


def _rpa_hd64_kernel(generation: str):
    load("kernels")  # registers the bare package
    name = f"{_PACKAGE}.utils"
    if name not in sys.modules:
        stand_in = types.ModuleType(name)
        stand_in.get_device_name = lambda num_devices=None: None  # replaced per chip below
        sys.modules[name] = stand_in
    tuned = load("kernels.ragged_paged_attention.v3.tuned_block_sizes_hd64")
    version, device = RPA_TPU_VERSION[generation], RPA_DEVICE_NAME[generation]
    tuned.get_tpu_version = lambda: version
    tuned.get_device_name = lambda num_devices=None: device
    kernel = load("kernels.ragged_paged_attention.v3.kernel_hd64")
    kernel.pltpu = _pltpu_with_reciprocal()
    return kernel, tuned


def _pltpu_with_reciprocal():
    """``jax.experimental.pallas.tpu`` as the hd64 kernel (written for jax
    0.11.2, which tpu-inference pins) calls it: its ``pltpu.reciprocal`` is
    ``pl.reciprocal`` in our jax 0.10.2 (same Mosaic op, ``tpu.reciprocal``).
    A view of the module for the kernel's globals only; jax itself is left
    as it is."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    if hasattr(pltpu, "reciprocal"):
        return pltpu
    view = types.ModuleType(pltpu.__name__)
    view.__dict__.update(pltpu.__dict__)
    view.reciprocal = pl.reciprocal
    return view


def rpa_hd64_blocks(generation: str, batch: PagedBatch, heads: tuple[int, int], window: int | None) -> tuple:
    """(num_kv_pages_per_block, num_queries_per_block, VMEM limit) the hd64
    kernel runs with when given none: its tuned table for the chip, else its
    per-version default; 100 MiB."""
    import jax.numpy as jnp

    kernel, tuned = _rpa_hd64_kernel(generation)
    hq, hkv = heads
    pages_per_seq = len(batch.page_indices) // len(batch.kv_lens)
    pages, queries = tuned.get_tuned_block_sizes(jnp.bfloat16, jnp.bfloat16, hq, hkv, 64, batch.page_size,
                                                 int(batch.cu_q_lens[-1]), pages_per_seq, window)
    return pages, queries, kernel.DEFAULT_VMEM_LIMIT_BYTES


def rpa_hd64_label(generation: str, batch: PagedBatch, heads, window: int | None) -> str:
    """``rpa@hd64,p256,kvpages1,q16,vmem100M``."""
    pages, queries, vmem = rpa_hd64_blocks(generation, batch, heads, window)
    return f"rpa@hd64,p{batch.page_size},kvpages{pages},q{queries},vmem{vmem >> 20}M"


def rpa_hd64_fn(generation: str, *, sm_scale: float, sliding_window: int | None = None):
    """``ragged_paged_attention_hd64(q, k, v, kv_cache, kv_lens, page_indices,
    cu_q_lens, distribution, sinks)`` -> (out, updated cache): the variant
    vLLM runs for head_dim 64 (and the only one taking sinks), at its defaults."""
    kernel, _ = _rpa_hd64_kernel(generation)
    attention = kernel.ragged_paged_attention_hd64.__wrapped__

    def fn(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, sinks=None):
        return attention(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, sinks,
                         sm_scale=sm_scale, sliding_window=sliding_window)

    return fn


def rpa_hd64_args(generation: str, batch: PagedBatch, heads: tuple[int, int], sinks: bool) -> list:
    """As ``rpa_args`` with the hd64 cache layout (K and V of a head side by
    side in one 128-lane row), and the sinks (f32 per query head)."""
    import jax
    import jax.numpy as jnp

    kernel, _ = _rpa_hd64_kernel(generation)
    hq, hkv = heads
    tokens = int(batch.cu_q_lens[-1])
    bf16 = jnp.bfloat16
    cache = kernel.get_kv_cache_shape(batch.total_pages, batch.page_size, hkv, 64, bf16)
    args = [jax.ShapeDtypeStruct((tokens, hq, 64), bf16), jax.ShapeDtypeStruct((tokens, hkv, 64), bf16),
            jax.ShapeDtypeStruct((tokens, hkv, 64), bf16), jax.ShapeDtypeStruct(cache, bf16),
            batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.distribution]
    return args + [jax.ShapeDtypeStruct((hq,), jnp.float32)] if sinks else args
