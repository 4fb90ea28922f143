#!/usr/bin/env python
"""attention-tpu on TPU generations, without a TPU: estimated kernel times from
libtpu's own schedule (``tpu_estimator``), ours against the peers at their
best config, and the block plan behind ours.

Per case and generation (bf16, batch 1 unless named):

* ours: ``flash_forward.flash_attention`` with the block rule of ``blocks.py``;
  forward + backward: the forward kernel then the two backward kernels from
  its lse.
* splash: ``jax.experimental.pallas.ops.tpu.splash_attention``, GQA as its MQA
  kernel vmapped over KV heads (how MaxText calls it), causal / local masks
  with the decode offset, sinks where the case has them. Swept: the forward
  over ``SPLASH_FORWARD`` (block_q, block_kv, block_kv_compute), the legal
  ones (blocks dividing the lengths); the estimator charges the
  ``block_kv_compute`` sub-blocks (splash unrolls that loop, so they are in
  the schedule). Forward + backward: the best forward blocks with each of
  ``SPLASH_BACKWARD`` (the dq and dk/dv kernels, or the fused one), through
  ``jax.grad`` of splash's custom VJP. A config the compiler refuses (VMEM)
  is reported with its reason and skipped. Splash needs blocks that divide
  the lengths: no decode (1-8 query rows).
* tokamax 0.0.12 ``PallasMosaicTpuFlashAttention`` (tokamax's fork of splash:
  layouts, experimental scheduler, base-2 exp), forward and through its VJP
  op: at the fastest config of its wheel's measured table for the chip
  (``tokamax/data/autotuning/<chip>/pallas_mosaic_tpu_flash_attention*.json``;
  the wheel has tables for tpu7x only) where the table holds the exact shape,
  else at its heuristic default (128-wide blocks), which is what a tokamax
  user gets with autotuning off; the table says which. No sliding window
  (only dense boolean masks), no sinks, no decode (128-row blocks).
* JAX flash: ``jax.experimental.pallas.ops.tpu.flash_attention``, 512 x 512
  blocks, K/V repeated to every query head beforehand (it has no GQA; the
  repeat is not charged to it). Causal only top-left aligned, no window, no
  sinks: prefill without window only, forward only (its backward kernels are
  unnamed pallas_calls that XLA renames under ``jax.grad``, so the estimator
  cannot match them to their schedules).
* RPA v3: tpu-inference 0.32.0's ragged paged attention v3 (vLLM's TPU
  attention kernel, ``kernels/ragged_paged_attention/v3``), called as vLLM
  calls it on one device (``tpu_inference_peers``: its default block sizes,
  VMEM limit and ``update_kv_cache``), the KV cache paged at vLLM's default
  page size for the case's cache length, each sequence holding only the pages
  its keys fill; the metadata (block table, kv_lens, cu_q_lens,
  distribution) concrete, so the estimator replays its page copies and
  loops; the cache donated, as vLLM donates it. Decode of one token: its
  decode-only kernel; of several (speculative decoding) and prefill: its
  mixed kernel (vLLM sends it every sequence of more than one new token);
  head_dim 64 (gpt-oss, sinks): its hd64 variant at its tuned blocks.
  Forward only.

Decode cases: up to ``MAX_DECODE_TOKENS`` new tokens per sequence (one, or
a few draft tokens verified at once), forward only, ours against RPA.

Ratios: ours / best peer (< 1: ours is faster) and ours / roofline. The
roofline is ``max(MXU-bound, HBM-bound)`` of the visible (query, key) pairs and
of reading q, the visible K/V and writing the output once (forward + backward:
3.5x the forward's MXU work, 3x its bytes). Next to each chip: the estimator's
attention calibration on that chip (median estimate / measured and the share
within 25%, from ``bench/results/tpu_calibration.md``).

Every estimate prints one progress line (stderr); ``--from-logs`` rebuilds
the tables from such lines (runs cut short, parts run separately).

Usage:
    python bench/bench_attention_tpu.py [--generations v6e tpu7x v5e] [--cases llama3-8b-8k ...]
        [--quick] [--skip-train] [--peers splash tokamax jaxflash rpa]
        [--from-logs bench/results/attention_tpu_v6e.log ...]
Writes bench/results/attention_tpu.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import time
from typing import NamedTuple

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import markdown  # noqa: E402

import tpu_estimator  # noqa: E402  (sets libtpu's dump folder before jax loads libtpu)

RESULTS = ROOT / "bench" / "results"


# New tokens per sequence up to which a case is a decode (speculative decoding
# verifies a few draft tokens at once): forward only, no splash / tokamax.
MAX_DECODE_TOKENS = 8


class Case(NamedTuple):
    key: str  # short id, used by --cases and in the logs
    label: str
    batch: int
    hq: int
    hkv: int
    sq: int
    skv: int
    filled: int  # keys written in the cache (decode against a static cache)
    head_dim: int
    window: int  # 0: causal without window
    sinks: bool = False

    @property
    def prefill(self) -> bool:
        return self.sq > MAX_DECODE_TOKENS


CASES = [
    Case("llama3-8b-8k", "llama3-8b causal prefill 8k", 1, 32, 8, 8192, 8192, 8192, 128, 0),
    Case("llama3-8b-32k", "llama3-8b causal prefill 32k", 1, 32, 8, 32768, 32768, 32768, 128, 0),
    Case("qwen3-8k", "qwen3 (32 q / 4 kv) causal prefill 8k", 1, 32, 4, 8192, 8192, 8192, 128, 0),
    Case("gpt-oss-8k", "gpt-oss sliding-128 prefill 8k (D 64, sinks)", 1, 64, 8, 8192, 8192, 8192, 64, 128, True),
    Case("gemma4-sliding-8k", "gemma4 sliding-512 prefill 8k (D 256)", 1, 8, 4, 8192, 8192, 8192, 256, 512),
    Case("gemma4-global-4k", "gemma4 global causal prefill 4k (D 512)", 1, 8, 2, 4096, 4096, 4096, 512, 0),
    Case("llama3-decode-32k-full", "llama3-8b decode, batch 8, 32k cache full", 8, 32, 8, 1, 32768, 32768, 128, 0),
    Case("llama3-decode-32k-2k", "llama3-8b decode, batch 8, 32k cache, 2k filled", 8, 32, 8, 1, 32768, 2048, 128,
         0),
    Case("llama3-decode-8k-3k", "llama3-8b decode, batch 8, 8k cache, 3k filled", 8, 32, 8, 1, 8192, 3000, 128, 0),
    Case("gemma4-decode-32k", "gemma4 global decode, 32k cache full (D 512)", 1, 8, 2, 1, 32768, 32768, 512, 0),
    Case("llama3-spec4-32k-full", "llama3-8b decode of 4 tokens, batch 8, 32k cache full", 8, 32, 8, 4, 32768,
         32768, 128, 0),
    Case("llama3-spec8-32k-full", "llama3-8b decode of 8 tokens, batch 8, 32k cache full", 8, 32, 8, 8, 32768,
         32768, 128, 0),
    Case("llama3-spec4-8k-3k", "llama3-8b decode of 4 tokens, batch 8, 8k cache, 3k filled", 8, 32, 8, 4, 8192,
         3000, 128, 0),
    # The decode goal's ends: batch 64 (a short cache), a 128k cache (one sequence, partly filled).
    Case("llama3-decode-b64-4k", "llama3-8b decode, batch 64, 4k cache full", 64, 32, 8, 1, 4096, 4096, 128, 0),
    Case("llama3-decode-128k-100k", "llama3-8b decode, batch 1, 128k cache, 100k filled", 1, 32, 8, 1, 131072,
         100000, 128, 0),
]
CASE_BY_KEY = {c.key: c for c in CASES}

# Splash forward sweep: (block_q, block_kv, block_kv_compute).
SPLASH_FORWARD = [(512, 512, 512), (1024, 1024, 512), (1024, 1024, 1024), (2048, 1024, 512), (1024, 2048, 512),
                  (2048, 2048, 512), (2048, 2048, 1024)]
SPLASH_FORWARD_QUICK = [(512, 512, 512), (1024, 1024, 512), (2048, 2048, 512)]
# Splash backward sweep: "fused" (one dk/dv/dq kernel) or "dq" (separate dq
# kernel, its blocks = the dk/dv kernel's), with (block_q_dkv, block_kv_dkv,
# block_kv_dkv_compute).
SPLASH_BACKWARD = [("dq", (512, 512, 512)), ("fused", (512, 512, 512)), ("fused", (1024, 1024, 512)),
                   ("fused", (2048, 2048, 512))]
SPLASH_BACKWARD_QUICK = [("dq", (512, 512, 512)), ("fused", (2048, 2048, 512))]
JAX_FLASH_BLOCK = 512
TOKAMAX_CHIP_FOLDER = {"v5e": "tpu_v5_lite", "v6e": "tpu_v6_lite", "tpu7x": "tpu7x"}


# ---------------------------------------------------------------------------
# Roofline
# ---------------------------------------------------------------------------


def visible_pairs(sq: int, filled: int, window: int) -> int:
    """(query, key) pairs a causal (windowed) attention computes per head."""
    pos = filled - sq + np.arange(sq)
    lo = np.maximum(0, pos - window + 1) if window else np.zeros_like(pos)
    return int(np.maximum(pos + 1 - lo, 0).sum())


def roofline_inputs(case: Case, train: bool) -> tuple[float, float]:
    """(flops, minimum bytes) of the case; forward + backward: 3.5x the
    forward's MXU work, 3x its bytes."""
    pairs = visible_pairs(case.sq, case.filled, case.window)
    flops = 4 * case.batch * case.hq * pairs * case.head_dim
    keys = min(case.filled, case.sq - 1 + case.window) if case.window else case.filled
    min_bytes = 2 * (2 * case.batch * case.hkv * keys * case.head_dim + 2 * case.batch * case.hq * case.sq * case.head_dim)
    return (3.5 * flops, 3.0 * min_bytes) if train else (float(flops), float(min_bytes))


def roofline_seconds(case: Case, generation: str, train: bool) -> tuple[float, str]:
    chip = tpu_estimator.CHIPS[generation]
    flops, min_bytes = roofline_inputs(case, train)
    mxu, hbm = flops / (chip.bf16_flops_per_s * chip.cores), min_bytes / chip.hbm_bytes_per_s
    return max(mxu, hbm), ("HBM" if hbm >= mxu else "MXU")


# ---------------------------------------------------------------------------
# Contenders: each returns (fn, args), or raises Unsupported
# ---------------------------------------------------------------------------


class Unsupported(Exception):
    """The contender cannot run the case (the message says why)."""


def _qkv(case: Case, kv_heads: int | None = None, layout: str = "bhsd"):
    import jax
    import jax.numpy as jnp

    hkv = case.hkv if kv_heads is None else kv_heads
    bf16 = jnp.bfloat16
    if layout == "bshd":  # tokamax: [B, T, H, D]
        return (jax.ShapeDtypeStruct((case.batch, case.sq, case.hq, case.head_dim), bf16),
                jax.ShapeDtypeStruct((case.batch, case.skv, hkv, case.head_dim), bf16),
                jax.ShapeDtypeStruct((case.batch, case.skv, hkv, case.head_dim), bf16))
    return (jax.ShapeDtypeStruct((case.batch, case.hq, case.sq, case.head_dim), bf16),
            jax.ShapeDtypeStruct((case.batch, hkv, case.skv, case.head_dim), bf16),
            jax.ShapeDtypeStruct((case.batch, hkv, case.skv, case.head_dim), bf16))


def _sinks_spec(case: Case):
    import jax
    import jax.numpy as jnp

    return jax.ShapeDtypeStruct((case.hq,), jnp.float32)


def _loss_grad(fn):
    """``jax.grad`` of sum(fn(...)) over q, k, v (the output cotangent is all ones)."""
    import jax
    import jax.numpy as jnp

    return jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))


def ours(generation: str, case: Case, train: bool):
    import jax.numpy as jnp

    from attention_tpu.attention import flash_backward, flash_forward, key_ranges

    b, sq, skv, window = case.batch, case.sq, case.skv, case.window

    def fwd(q, k, v, start, end, sinks=None):
        bounds = key_ranges.rule_key_bounds(start, end, sq=sq, skv=skv, causal=True, window=window)
        return flash_forward.flash_attention(q, k, v, bounds, sinks, causal=True, window=window,
                                             generation=generation)

    def step(q, k, v, start, end, sinks=None):
        bounds = key_ranges.rule_key_bounds(start, end, sq=sq, skv=skv, causal=True, window=window)
        out, lse = flash_forward.flash_attention_with_lse(q, k, v, bounds, sinks, causal=True, window=window,
                                                          generation=generation)
        return flash_backward.flash_attention_backward(q, k, v, out, lse, jnp.ones_like(out), bounds, sinks,
                                                       causal=True, window=window, generation=generation)

    args = _qkv(case) + (np.zeros(b, np.int32), np.full(b, case.filled, np.int32))
    if case.sinks:
        args += (_sinks_spec(case),)
    return (step if train else fwd), args


def splash_block_sizes(fwd_blocks, bwd=None):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    bq, bkv, bkvc = fwd_blocks
    if bwd is None:
        return sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkvc)
    kind, (bq_d, bkv_d, bkvc_d) = bwd
    if kind == "fused":
        return sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkvc, block_q_dkv=bq_d, block_kv_dkv=bkv_d,
                             block_kv_dkv_compute=bkvc_d, use_fused_bwd_kernel=True)
    return sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkvc, block_q_dkv=bq_d, block_kv_dkv=bkv_d,
                         block_kv_dkv_compute=bkvc_d, block_q_dq=bq_d, block_kv_dq=bkv_d)


def splash_legal(case: Case, blocks) -> str | None:
    """Why splash cannot run these blocks on the case, or None."""
    if not case.prefill:
        return f"no decode: blocks must divide the query length ({case.sq} rows)"
    if case.filled != case.skv:
        return "no partly filled cache"
    bq, bkv, bkvc = blocks
    if case.sq % bq or case.skv % bkv or bkv % bkvc:
        return "blocks do not divide the lengths"
    return None


def splash(generation: str, case: Case, train: bool, fwd_blocks, bwd=None):
    import jax
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    for blocks in (fwd_blocks, bwd[1] if bwd else fwd_blocks):
        if (why := splash_legal(case, blocks)) is not None:
            raise Unsupported(why)
    b, hq, hkv, sq, skv, d = case.batch, case.hq, case.hkv, case.sq, case.skv, case.head_dim
    group = hq // hkv
    shape = (sq, skv)
    head_mask = (sm.LocalMask(shape, (case.window - 1, 0), offset=skv - sq) if case.window
                 else sm.CausalMask(shape, offset=skv - sq))
    kernel = sk.make_splash_mqa_single_device(sm.MultiHeadMask([head_mask] * group),
                                              block_sizes=splash_block_sizes(fwd_blocks, bwd if train else None))

    def fn(q, k, v, sinks=None):
        grouped = (q * d ** -0.5).reshape(b, hkv, group, sq, d)  # splash takes pre-scaled queries
        if sinks is None:
            out = jax.vmap(jax.vmap(kernel))(grouped, k, v)
        else:
            per_head = jax.vmap(lambda q_, k_, v_, s_: kernel(q_, k_, v_, sinks=s_))
            out = jax.vmap(per_head, in_axes=(0, 0, 0, None))(grouped, k, v, sinks.reshape(hkv, group))
        return out.reshape(b, hq, sq, d)

    args = _qkv(case) + ((_sinks_spec(case),) if case.sinks else ())
    return (_loss_grad(fn) if train else fn), args


def tokamax_tuned_config(generation: str, case: Case, vjp: bool) -> dict | None:
    """The fastest config of tokamax's wheel table for this exact shape, or None."""
    import tokamax

    folder = TOKAMAX_CHIP_FOLDER.get(generation)
    name = "pallas_mosaic_tpu_flash_attention" + ("_vjp" if vjp else "") + ".json"
    path = pathlib.Path(tokamax.__file__).parent / "data" / "autotuning" / str(folder) / name
    if folder is None or not path.exists():
        return None
    q = f"bf16[{case.batch},{case.sq},{case.hq},{case.head_dim}]"
    kv = f"bf16[{case.batch},{case.skv},{case.hkv},{case.head_dim}]"
    best = None
    for key_text, configs in json.loads(path.read_text()).items():
        key = json.loads(key_text)
        mask = key["mask"]
        if (key["q"], key["k"], key["v"]) != (q, kv, kv) or not mask["is_causal"] or key["bias"] is not None:
            continue
        if mask["bool_mask"] is not None or key["logits_soft_cap"] is not None or key.get("return_residuals"):
            continue
        for config_text, entry in configs.items():
            times = entry.get("evaluation_times_ms") or []
            if times and (best is None or min(times) < best[0]):
                best = (min(times), json.loads(config_text))
    return None if best is None else best[1]


def tokamax_configs(generation: str, case: Case):
    """(forward config, VJP config, where from: "tuned" or "default")."""
    from tokamax._src.ops.attention import pallas_mosaic_tpu as tk
    from tokamax._src.ops.attention import pallas_mosaic_tpu_vjp as tkv

    fwd, bwd = tokamax_tuned_config(generation, case, False), tokamax_tuned_config(generation, case, True)
    source = "tuned" if fwd is not None else "default"
    if fwd is None:
        fwd_cfg = tk.Config(block_q=128, block_kv=128, block_kv_compute=128,
                            q_layout=tk.splash.QKVLayout.HEAD_DIM_MINOR, k_layout=tk.splash.QKVLayout.HEAD_DIM_MINOR,
                            v_layout=tk.splash.QKVLayout.HEAD_DIM_MINOR, use_experimental_scheduler=True)
    else:
        fwd = dict(fwd)
        for name in ("q_layout", "k_layout", "v_layout"):
            fwd[name] = tk.splash.QKVLayout(fwd[name])
        fwd_cfg = tk.Config(**fwd)
    bwd_cfg = tkv.Config(**bwd) if bwd is not None else tkv.Config(block_q_dkv=128, block_kv_dkv=128,
                                                                     block_kv_dkv_compute=128)
    return fwd_cfg, bwd_cfg, source + ("" if (bwd is None) == (fwd is None) else "/bwd " + ("tuned" if bwd else
                                                                                           "default"))


def tokamax_label(generation: str, case: Case, train: bool) -> str:
    fwd, bwd, source = tokamax_configs(generation, case)
    text = f"tokamax-{source.replace(' ', '_')}@{fwd.block_q},{fwd.block_kv},{fwd.block_kv_compute}"
    if train:
        text += f"/dkv:{bwd.block_q_dkv},{bwd.block_kv_dkv},{bwd.block_kv_dkv_compute}"
    return text


def tokamax(generation: str, case: Case, train: bool):
    if not case.prefill:
        raise Unsupported("no decode: 128-row blocks")
    if case.window:
        raise Unsupported("no sliding window (dense boolean masks only)")
    if case.sinks:
        raise Unsupported("no sinks")
    if case.filled != case.skv:
        raise Unsupported("no partly filled cache")
    from tokamax._src.ops.attention import pallas_mosaic_tpu as tk
    from tokamax._src.ops.attention import pallas_mosaic_tpu_vjp as tkv

    fwd_cfg, bwd_cfg, _ = tokamax_configs(generation, case)
    op = tk.PallasMosaicTpuFlashAttention(config=fwd_cfg, vjp=tkv.PallasMosaicTpuFlashAttentionVjp(config=bwd_cfg))
    scale = case.head_dim ** -0.5

    def fn(q, k, v):
        return op(q, k, v, is_causal=True, logits_scale=scale)

    args = _qkv(case, layout="bshd")
    return (_loss_grad(fn) if train else fn), args


def rpa_batch(case: Case):
    """The case as ragged paged attention's batch: ``case.batch`` sequences
    of ``case.sq`` new tokens and ``case.filled`` keys each (new ones
    included), pages of vLLM's default size for a ``case.skv`` model length,
    each sequence holding only the pages its keys fill."""
    from tpu_inference_peers import paged_batch, rpa_page_size

    return paged_batch([case.filled] * case.batch, [case.sq] * case.batch, rpa_page_size(case.skv), case.skv)


def rpa_label(generation: str, case: Case, mixed_blocks=None) -> str:
    import tpu_inference_peers as tip

    if case.head_dim == 64:
        return tip.rpa_hd64_label(generation, rpa_batch(case), (case.hq, case.hkv), case.window or None)
    return tip.rpa_label(generation, rpa_batch(case), (case.hq, case.hkv), case.head_dim, case.batch * case.sq,
                         mixed_blocks)


def rpa_halved_blocks(generation: str, case: Case) -> tuple[int, int, int, int]:
    """Its mixed kernel's default blocks with the query blocks (fetched and
    computed) halved: what a user sets (RPA_V3_MIXED_BLOCK_SIZES) when the
    defaults exceed the VMEM limit."""
    from tpu_inference_peers import rpa_block_sizes

    s = rpa_block_sizes(generation, rpa_batch(case), (case.hq, case.hkv), case.head_dim,
                        case.batch * case.sq)["mixed"]
    return max(1, s["bq_sz"] // 2), s["bkv_sz"], max(1, s["bq_csz"] // 2), s["bkv_csz"]


def rpa(generation: str, case: Case, train: bool, mixed_blocks=None):
    """tpu-inference 0.32.0's ragged paged attention v3 (vLLM's TPU kernel)
    on the case's batch, returning (fn, args, estimate options)."""
    if train:
        raise Unsupported("inference only (no backward)")
    import tpu_inference_peers as tip

    heads, window, batch = (case.hq, case.hkv), case.window or None, rpa_batch(case)
    if case.head_dim == 64:  # vLLM's choice: the hd64 variant, the only one taking sinks
        fn = tip.rpa_hd64_fn(generation, sm_scale=case.head_dim ** -0.5, sliding_window=window)
        args = tip.rpa_hd64_args(generation, batch, heads, case.sinks)
    elif case.sinks:
        raise Unsupported("sinks only on its head_dim-64 kernel")
    else:
        fn = tip.rpa_fn(generation, sm_scale=case.head_dim ** -0.5, sliding_window=window, mixed_blocks=mixed_blocks)
        args = tip.rpa_args(generation, batch, heads, case.head_dim)
    return fn, args, {"donate_argnums": (tip.RPA_CACHE_ARG,)}


def jax_flash(generation: str, case: Case, train: bool):
    if train:
        raise Unsupported("backward not estimated (unnamed kernels under jax.grad)")
    if case.window or case.sinks or case.sq != case.skv or case.filled != case.skv or case.sq % JAX_FLASH_BLOCK:
        raise Unsupported("causal top-left only, no window / sinks / decode")
    from jax.experimental.pallas.ops.tpu import flash_attention as jf

    b_ = JAX_FLASH_BLOCK
    blocks = jf.BlockSizes(block_q=b_, block_k_major=b_, block_k=b_, block_b=1, block_q_major_dkv=b_,
                           block_k_major_dkv=b_, block_k_dkv=b_, block_q_dkv=b_, block_k_major_dq=b_, block_k_dq=b_,
                           block_q_dq=b_)

    def fn(q, k, v):
        return jf.flash_attention(q, k, v, causal=True, sm_scale=case.head_dim ** -0.5, block_sizes=blocks)

    return fn, _qkv(case, kv_heads=case.hq)


# ---------------------------------------------------------------------------
# Running, logging, parsing logs
# ---------------------------------------------------------------------------


def splash_label(fwd_blocks, bwd=None) -> str:
    text = "splash@" + ",".join(map(str, fwd_blocks))
    if bwd is not None:
        text += f"/{bwd[0]}:" + ",".join(map(str, bwd[1]))
    return text


_LINE = re.compile(r"^\[(\S+)\] (\S+) (fwd|train) (\S+): (.*)$")
_TIME = re.compile(r"^([\d.]+) us")


def log_line(generation, case, mode, contender, text):
    print(f"[{generation}] {case.key} {mode} {contender}: {text}", file=sys.stderr, flush=True)


def parse_logs(paths) -> dict:
    """{(generation, case key, mode): {contender: seconds or reason}} from the
    progress lines of earlier runs (later lines win)."""
    out: dict = {}
    for path in paths:
        for line in pathlib.Path(path).read_text().splitlines():
            m = _LINE.match(line.strip())
            if m:
                gen, key, mode, name, rest = m.groups()
                t = _TIME.match(rest)
                reason = re.sub(r" \(\d+ s\)$", "", rest)  # the elapsed time the line ends with
                reason = re.sub(r"^refused: JaxRuntimeError: .*CompileTimeHbmOom.*$",
                                "refused: compiler: the program exceeds the chip's HBM", reason)
                out.setdefault((gen, key, mode), {})[name] = float(t.group(1)) * 1e-6 if t else reason
    return out


def short_reason(error: BaseException | str) -> str:
    text = str(error)
    if "CompileTimeHbmOom" in text:
        return "compiler: the program exceeds the chip's HBM"
    for needle, reason in (("vmem", "VMEM refused"), ("VMEM", "VMEM refused"),
                           ("RESOURCE_EXHAUSTED", "compiler: resources exhausted")):
        if needle in text:
            line = next((ln for ln in text.splitlines() if needle in ln), "")
            return f"{reason} ({line.strip()[:100]})"
    return (text.splitlines() or [""])[0][:120]


def run_one(results, generation, case, mode, contender, make):
    """Estimate one contender (``make()`` -> (fn, args) or (fn, args,
    ``estimate`` keywords)); log and record it."""
    cell = results.setdefault((generation, case.key, mode), {})
    t0 = time.time()
    try:
        fn, args, *options = make()  # options: estimate keywords (e.g. a donated cache)
        flops, min_bytes = roofline_inputs(case, mode == "train")
        est = tpu_estimator.estimate(fn, list(args), generation, flops=flops, min_bytes=min_bytes,
                                     **(options[0] if options else {}))
    except Unsupported as exc:
        cell[contender] = f"cannot: {exc}"
    except Exception as exc:  # noqa: BLE001 -- a config the compiler refuses is reported and skipped
        cell[contender] = f"refused: {type(exc).__name__}: {short_reason(exc)}"
    else:
        cell[contender] = est.seconds
        unmatched = "" if all(k.regions_matched for k in est.kernels) else " MXU regions unmatched"
        log_line(generation, case, mode, contender,
                 f"{est.seconds * 1e6:.1f} us (roofline {est.roofline_s * 1e6:.1f} us, {time.time() - t0:.0f} s)"
                 f"{unmatched}")
        return est.seconds
    log_line(generation, case, mode, contender, f"{cell[contender]} ({time.time() - t0:.0f} s)")
    return None


def best_of(cell: dict, prefix: str):
    """(name, seconds) of the fastest contender whose name starts with prefix."""
    timed = {n: t for n, t in cell.items() if n.startswith(prefix) and isinstance(t, float)}
    if not timed:
        return None, None
    name = min(timed, key=timed.get)
    return name, timed[name]


def run(generations, cases, quick: bool, skip_train: bool, results: dict,
        peers=("splash", "tokamax", "jaxflash", "rpa"),
        skip=()):
    fwd_sweep = SPLASH_FORWARD_QUICK if quick else SPLASH_FORWARD
    bwd_sweep = SPLASH_BACKWARD_QUICK if quick else SPLASH_BACKWARD
    for generation in generations:
        for case in cases:
            run_one(results, generation, case, "fwd", "ours", lambda: ours(generation, case, False))
            if "rpa" in peers:
                label = rpa_label(generation, case)
                run_one(results, generation, case, "fwd", label, lambda: rpa(generation, case, False))
                if case.prefill and "VMEM" in str(results[(generation, case.key, "fwd")][label]):
                    blocks = rpa_halved_blocks(generation, case)  # its defaults exceed the VMEM limit
                    run_one(results, generation, case, "fwd", rpa_label(generation, case, blocks),
                            lambda: rpa(generation, case, False, blocks))
            if not case.prefill:
                continue
            for blocks in fwd_sweep if "splash" in peers else ():
                if splash_legal(case, blocks) is None:
                    run_one(results, generation, case, "fwd", splash_label(blocks),
                            lambda blocks=blocks: splash(generation, case, False, blocks))
            if "tokamax" in peers:
                run_one(results, generation, case, "fwd", tokamax_label(generation, case, False),
                        lambda: tokamax(generation, case, False))
            if "jaxflash" in peers:
                run_one(results, generation, case, "fwd", f"jaxflash@{JAX_FLASH_BLOCK}",
                        lambda: jax_flash(generation, case, False))
            if skip_train:
                continue
            run_one(results, generation, case, "train", "ours", lambda: ours(generation, case, True))
            best, _ = best_of(results[(generation, case.key, "fwd")], "splash@")
            if best is not None and "splash" in peers:
                fwd_blocks = tuple(int(v) for v in best.split("@")[1].split(","))
                for bwd in bwd_sweep:
                    if splash_legal(case, bwd[1]) is None:
                        run_one(results, generation, case, "train", splash_label(fwd_blocks, bwd),
                                lambda bwd=bwd: splash(generation, case, True, fwd_blocks, bwd))
            if "tokamax" in peers and "tokamax-train" not in skip:
                run_one(results, generation, case, "train", tokamax_label(generation, case, True),
                        lambda: tokamax(generation, case, True))


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def calibration(path=RESULTS / "tpu_calibration.md") -> dict:
    """{(chip, kind): (median, within 25%)} from the calibration summary table."""
    out = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 7 and cells[0] in tpu_estimator.CHIPS and cells[2].isdigit():
            out[(cells[0], cells[1])] = (cells[3], cells[5])
    return out


def calibration_note(calib: dict, generation: str, train: bool) -> str:
    parts = []
    for kind in (("attention fwd", "attention bwd") if train else ("attention fwd",)):
        if (generation, kind) in calib:
            median, within = calib[(generation, kind)]
            parts.append(f"{kind.split()[1]} {median}, {within} within 25%")
    if not parts:
        other = calib.get((generation, "ragged dot"))
        return "no attention entries" + (f" (ragged dot {other[0]})" if other else "")
    return "; ".join(parts)


def _fmt_us(seconds) -> str:
    return f"{seconds * 1e6:.1f}" if isinstance(seconds, float) else "-"


def _config_of(name: str) -> str:
    return name.split("@", 1)[1] if "@" in name else ""


def _reason(cell: dict, prefix: str, case: Case | None = None) -> str:
    if case is not None and not case.prefill and prefix in ("splash@", "tokamax-"):
        return "no decode: " + (f"blocks must divide the {case.sq}-row query" if prefix == "splash@"
                                else "128-row blocks")
    reasons = {v.split(": ", 1)[1] if ": " in v else v for n, v in cell.items()
               if n.startswith(prefix) and isinstance(v, str)}
    return "; ".join(sorted(reasons)) if reasons else "not estimated"


def table_rows(results, generations, cases, mode, calib):
    rows, missing = [], []
    train = mode == "train"
    for case in cases:
        if train and not case.prefill:
            continue
        for generation in generations:
            cell = results.get((generation, case.key, mode))
            if not cell or not isinstance(cell.get("ours"), float):
                missing.append(f"{case.key} on {generation}")
                continue
            ours_s = cell["ours"]
            roofline, bound = roofline_seconds(case, generation, train)
            splash_name, splash_s = best_of(cell, "splash@")
            tk_name, tk_s = best_of(cell, "tokamax-")
            jf_name, jf_s = best_of(cell, "jaxflash@")
            rpa_name, rpa_s = best_of(cell, "rpa@")
            peers = {n: s for n, s in ((splash_name, splash_s), (tk_name, tk_s), (jf_name, jf_s), (rpa_name, rpa_s))
                     if s}
            best = min(peers, key=peers.get) if peers else None
            swept = sum(1 for n, v in cell.items() if n.startswith("splash@"))
            refused = sum(1 for n, v in cell.items() if n.startswith("splash@") and not isinstance(v, float))
            row = {"case": case.label, "chip (attention calibration: est/meas median)":
                   f"{generation} ({calibration_note(calib, generation, train)})",
                   "ours us": _fmt_us(ours_s), "roofline us": f"{roofline * 1e6:.1f} ({bound})",
                   "ours / roofline": f"{ours_s / roofline:.2f}"}
            row["best splash us (blocks)"] = (f"{_fmt_us(splash_s)} ({_config_of(splash_name)}; best of {swept - refused}"
                                              f"{f', {refused} refused' if refused else ''})" if splash_s
                                              else f"- ({_reason(cell, 'splash@', case)})")
            tk_any = next((n for n in cell if n.startswith("tokamax-")), None)
            if tk_s:
                source = tk_name.split("@")[0].removeprefix("tokamax-").replace("_", " ")
                row["tokamax us (config)"] = f"{_fmt_us(tk_s)} ({source}: {_config_of(tk_name)})"
            else:
                row["tokamax us (config)"] = (f"- ({_reason(cell, 'tokamax-', case)})" if tk_any or not case.prefill
                                          else "- (not estimated)")
            if not train:
                row["jax flash us (512)"] = _fmt_us(jf_s) if jf_s else "-"
                rpa_any = any(n.startswith("rpa@") for n in cell)
                row["rpa v3 us (config)"] = (f"{_fmt_us(rpa_s)} ({_config_of(rpa_name)})" if rpa_s else
                                             f"- ({_reason(cell, 'rpa@')})" if rpa_any else "- (not estimated)")
            row["best peer"] = best.split("@")[0].replace("-default", "").replace("-tuned", "") if best else "-"
            row["ours / best peer"] = f"{ours_s / peers[best]:.2f}" if best else "-"
            rows.append(row)
    return rows, missing


def sweep_rows(results, generations, cases, mode):
    rows = []
    for case in cases:
        for generation in generations:
            cell = results.get((generation, case.key, mode)) or {}
            for name, value in cell.items():
                if name.startswith("splash@"):
                    rows.append({"case": case.key, "chip": generation, "splash blocks": _config_of(name),
                                 "us": _fmt_us(value) if isinstance(value, float) else value})
    return rows


def block_plan_row(case: Case, generation: str):
    from attention_visit_plan import kv_block_plan
    from attention_tpu.attention import blocks

    rows = case.hq // case.hkv * case.sq
    chunk = blocks.choose_decode_chunk(rows, case.skv, kv_heads=case.hkv, head_dim=case.head_dim, generation=generation)
    if chunk:  # the decode kernel: its double-buffered chunks of every KV head
        label, working_set = f"decode kernel, {chunk}-key chunks", 2 * case.hkv * chunk * 2 * case.head_dim * 2
    else:
        block_q, block_k = blocks.choose_blocks(rows, case.skv, head_dim=case.head_dim, window=case.window,
                                                generation=generation)
        label = (block_q, block_k)
        working_set = blocks.working_set_bytes(block_q, block_k, case.head_dim, case.head_dim, 2)
    plan = kv_block_plan([0], [case.filled], rows=rows, sq=case.sq, skv=case.skv, causal=True, window=case.window,
                         head_dim=case.head_dim, generation=generation)
    return {"case": case.label, "generation": generation, "blocks (q, k)": label,
            "VMEM working set (MiB)": working_set / 2**20,
            "grid steps / dense": plan.grid_steps / plan.dense, "steps computed / dense": plan.live / plan.dense,
            "K/V fetches / dense": plan.fetched / plan.dense}


def write(results, generations, cases, out_dir, command):
    calib = calibration()
    fwd_rows, fwd_missing = table_rows(results, generations, cases, "fwd", calib)
    train_rows, train_missing = table_rows(results, generations, cases, "train", calib)
    plans = [block_plan_row(c, g) for c in cases for g in generations]
    missing_note = ""
    if fwd_missing or train_missing:
        missing_note = ("\n\nNot estimated (run cut short or not run): forward: " + (", ".join(fwd_missing) or "none")
                        + "; forward + backward: " + (", ".join(train_missing) or "none") + ".")
    intro = (
        "No TPU here: every number is an estimate of `bench/tpu_estimator.py` (static bundle counts of the compiled "
        "kernels plus the DMA the grid implies and the kernels' inner loops by trip count), not a measurement. "
        "bf16, f32 accumulation. Next to each chip: the estimator's error on measured attention timings of that "
        "chip (`tpu_calibration.md`: median estimate / measured of tokamax's splash-based flash attention, and the "
        "share within 25%; below 1: the estimator reads low). v5e has no measured attention table: its figure is "
        "unchecked for attention. Those calibration figures predate the estimator fix these tables were made "
        "with (a kernel body's `program_id` under `jax.vmap` now skips the vmapped grid axes, as Mosaic lowers "
        "it): in tokamax's causal entries only the split between masked and unmasked blocks changes (it runs a "
        "compacted grid), so those entries will read somewhat lower once `tpu_calibration.md` is regenerated. "
        "For JAX's splash (vmapped over KV heads here) the fix decided which blocks compute: splash estimates "
        "made before it (issue 20's table, 2355 us for Llama-3 8k at 1024 blocks on v6e) are void.\n\n"
        "**ours / best peer: < 1 means ours is faster** (0.80: ours takes 80% of the best peer's time). "
        "ours / roofline: how far ours is from max(MXU-bound, HBM-bound) of the visible work (forward + backward: "
        "3.5x the forward's MXU work, 3x its bytes). Peers at their best: splash swept over (block_q, block_kv, "
        "block_kv_compute) in " + ", ".join(map(str, SPLASH_FORWARD)) + " (legal ones: blocks dividing the "
        "lengths; compiler refusals listed in the sweep tables); forward + backward: splash's best forward blocks "
        "with each backward of " + ", ".join(f"{k} {b}" for k, b in SPLASH_BACKWARD) + " ('dq': separate dq "
        "kernel at the dk/dv blocks; 'fused': one backward kernel). tokamax 0.0.12: the fastest config of its "
        "wheel's measured table for the exact shape and chip ('tuned'; the wheel has tpu7x tables only, and they "
        "hold none of these shapes: Llama-3 heads only at batch 32 x 4096) else its heuristic default "
        "(128-wide blocks, 'default'): what a tokamax user gets without autotuning. JAX flash: 512 blocks, "
        "forward only. A splash cell reading 'best of 3' comes from the `--quick` sweep (forward "
        + ", ".join(map(str, SPLASH_FORWARD_QUICK)) + "; backward " + ", ".join(f"{k} {b}" for k, b in
                                                                               SPLASH_BACKWARD_QUICK)
        + "), run where time was short. Where the tokamax column reads 'not estimated', that chip's run "
        "left tokamax out (`--peers splash jaxflash`, for time): on v6e its default ran 5-22x slower than ours. "
        "RPA v3: tpu-inference 0.32.0's ragged paged attention v3 (vLLM's TPU attention kernel), run as "
        "vLLM runs it on one device: its own defaults, named in the column as page size, bq (query tokens "
        "fetched / computed per block), bkv (keys fetched / computed per block; / page size = KV pages per "
        "block) and VMEM limit. Its v3 kernel takes no tuned table (its `tuned_block_sizes.py` holds the older "
        "(pages, queries) entries, which the v3 path never reads): the blocks are its `get_default_block_sizes` "
        "(decode: 1 token and 4096 keys per block, computed in one 4096-key chunk however few keys a sequence "
        "has; a decode of 4 or 8 tokens (speculative decoding) runs its mixed kernel, as vLLM sends it every "
        "sequence of more than one new token; prefill on its mixed kernel: v5e/v6e 256 / 128 tokens, 1024 / 512 keys, tpu7x 512 / 256 tokens, "
        "2048 / 512 keys, Qwen3's 8 heads per KV head half the tokens), the VMEM limit the chip's whole VMEM. Where "
        "the compiler refuses its defaults (tpu7x, Llama-3 8k and 32k prefill: 72 MiB of VMEM used over the 64 MiB "
        "limit, with our libtpu 0.0.52; tpu-inference pins 0.0.48) it is listed at its query blocks halved, "
        "',set' in the column (what a user sets through vLLM's RPA_V3_MIXED_BLOCK_SIZES). "
        "Its head_dim-64 variant (gpt-oss; the only one taking sinks) reads its tuned table "
        "(kvpages: KV pages per block, q: query tokens per block) at a 100 MiB VMEM limit. Page size: "
        "vLLM's default (16 tokens above an 8192 model length, else the length / 16 within [16, 256]); "
        "each sequence holds only the pages its keys fill, as in serving, and RPA copies only those (ours "
        "reads the filled keys of a static cache in 1024-key chunks, the last one up to the last filled key "
        "in whole 16-key tiles). Its time includes what its call "
        "does beyond ours: writing the step's new K/V into the cache (decode: one token per sequence; "
        "prefill: the prompt's K/V, 32 MiB for Llama-3 8k), the relayouts of q, K / V and the output around "
        "the kernel (XLA ops; Llama-3 8k prefill on v6e: 205 of its 2609 us, its kernel alone 2405), and the "
        "pass of its decode / mixed kernel over an empty range (2-5 us). It keeps the running max, sum and "
        "output accumulator in bf16 for bf16 inputs (its default `out_dtype`; ours: f32). Its hd64 kernel "
        "visits every KV block of the sequence for every query block (in a prefill from an empty cache no "
        "causal or window skip; masks drop the rest): in gpt-oss's 8k prefill at 16-token query blocks "
        "(v6e, tpu7x; 8 on v5e) it reads the whole K/V 512 times (v5e: 1024). Not modelled, which favours RPA: the "
        "estimator charges a copy its bytes only, and RPA issues one DMA per page (256 per 4096-key block at "
        "16-token pages). Estimated with our jax 0.10.2 (tpu-inference pins 0.11.2; its modules compile "
        "unchanged, except that the hd64 kernel's `pltpu.reciprocal` is jax 0.10's `pl.reciprocal`) and the "
        "TPU version its code reads from the device set to the target chip's. The v5e prefill rows: ours and RPA "
        "(`attention_tpu_rpa.log`), splash's `--quick` sweep where `attention_tpu_v5e_peers.log` has it (its "
        "2048 blocks exceed v5e's scoped VMEM); no tokamax there, JAX flash only at Gemma-4 global "
        "(`attention_tpu_backward_large_vmem.log`, the run that re-estimated that case after the backward "
        "took the large VMEM budget)."
        f"\n\nCommand: `{command}`; tables rebuilt from the logs with `--from-logs`." + missing_note)
    sections = [("Estimated times, forward", fwd_rows),
                ("Estimated times, forward + backward (prefill)", train_rows),
                ("Splash forward sweep (every config estimated)", sweep_rows(results, generations, cases, "fwd")),
                ("Splash forward + backward sweep (best forward blocks / backward kernel: blocks)",
                 sweep_rows(results, generations, cases, "train")),
                ("Block plan of ours (forward)", plans)]
    parts = ["# attention-tpu on TPU generations: ours against the peers at their best (estimated)\n", intro]
    for heading, rows in sections:
        parts.append(f"## {heading}")
        parts.append(markdown(rows) if rows else "(none)")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_tpu.md").write_text("\n\n".join(parts) + "\n")
    print(f"wrote {out / 'attention_tpu.md'}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--generations", nargs="+", default=["v6e", "tpu7x", "v5e"])
    parser.add_argument("--cases", nargs="+", default=[c.key for c in CASES], choices=[c.key for c in CASES])
    parser.add_argument("--quick", action="store_true", help="a smaller splash sweep (3 forward, 2 backward configs: "
                        "the ones that won on v6e)")
    parser.add_argument("--skip-train", action="store_true", help="forward only")
    parser.add_argument("--peers", nargs="+", default=["splash", "tokamax", "jaxflash", "rpa"],
                        choices=["splash", "tokamax", "jaxflash", "rpa"])
    parser.add_argument("--skip-tokamax-train", action="store_true",
                        help="tokamax forward only (its 128-block default's backward compiles for minutes)")
    parser.add_argument("--from-logs", nargs="+", default=None,
                        help="build the tables from the progress lines of earlier runs instead of estimating")
    args = parser.parse_args(argv)
    cases = [CASE_BY_KEY[k] for k in args.cases]
    from common import use_shipped_packages

    use_shipped_packages()  # the block plan imports ours either way
    if args.from_logs:
        results = parse_logs(args.from_logs)
        command = "python bench/bench_attention_tpu.py --from-logs " + " ".join(
            str(pathlib.Path(p).resolve().relative_to(ROOT)) if pathlib.Path(p).resolve().is_relative_to(ROOT)
            else p for p in args.from_logs)
    else:
        from absl import flags

        flags.FLAGS(sys.argv[:1], known_only=True)  # tokamax reads absl flags
        tpu_estimator.chip_device(tpu_estimator.CHIPS[args.generations[0]])  # dump flag before libtpu loads
        results = {}
        run(args.generations, cases, args.quick, args.skip_train, results, args.peers,
            ("tokamax-train",) if args.skip_tokamax_train else ())
        command = "python bench/bench_attention_tpu.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write(results, args.generations, cases, args.out, command)


if __name__ == "__main__":
    main()
