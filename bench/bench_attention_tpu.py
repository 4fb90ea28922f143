#!/usr/bin/env python
"""attention-tpu on TPU generations, without a TPU: estimated kernel times from
libtpu's own schedule (``tpu_estimator``), ours against splash attention and
JAX's flash attention on the same shapes, and the block plan behind ours.

Per case and generation (bf16, batch 1 unless named):

* ours: ``flash_forward.flash_attention`` with the block rule of ``blocks.py``;
* splash: ``jax.experimental.pallas.ops.tpu.splash_attention``, GQA as its MQA
  kernel vmapped over KV heads (how MaxText calls it), causal / local masks
  with the decode offset, 512 x 512 blocks, backward ones too (``block_kv_compute = block_kv``: the
  estimator counts one trip of a kernel's inner loop, so splash's split
  compute blocks would read short). Splash needs blocks that divide the
  lengths: no decode (one query row);
* JAX flash: ``jax.experimental.pallas.ops.tpu.flash_attention``, 512 x 512
  blocks (backward too), K/V repeated to every query head beforehand (it has no GQA; the
  repeat is not charged to it). Causal only top-left aligned and no window:
  no decode, no sliding window.

Forward + backward (prefill cases): ours is the forward kernel then the two
backward kernels from its lse; the peers ``jax.grad`` through their own
custom VJPs (splash: its forward with residuals, then its dq and dk/dv
kernels); JAX flash is not estimated there (see ``TRAINING``).

Ratios are peer estimate / our estimate (> 1: ours is faster). The roofline is
``max(MXU-bound, HBM-bound)`` of the visible (query, key) pairs and of reading
q, the visible K/V and writing the output once.

Usage: python bench/bench_attention_tpu.py [--out bench/results] [--generations v5e v6e]
Writes bench/results/attention_tpu.md.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import use_shipped_packages, write_report  # noqa: E402

use_shipped_packages()
import tpu_estimator  # noqa: E402

# (label, batch, q heads, kv heads, Sq, Skv, filled keys, head_dim, window)
CASES = [
    ("llama3-8b causal prefill 8k", 1, 32, 8, 8192, 8192, 8192, 128, 0),
    ("llama3-8b causal prefill 32k", 1, 32, 8, 32768, 32768, 32768, 128, 0),
    ("gpt-oss sliding-128 prefill 8k", 1, 64, 8, 8192, 8192, 8192, 64, 128),
    ("gemma4 sliding-512 prefill 8k (D 256)", 1, 8, 4, 8192, 8192, 8192, 256, 512),
    ("llama3-8b decode, batch 8, 32k cache full", 8, 32, 8, 1, 32768, 32768, 128, 0),
    ("llama3-8b decode, batch 8, 32k cache, 2k filled", 8, 32, 8, 1, 32768, 2048, 128, 0),
    ("llama3-8b decode, batch 8, 8k cache, 3k filled", 8, 32, 8, 1, 8192, 3000, 128, 0),
    ("gemma4 global decode, 32k cache full (D 512)", 1, 8, 2, 1, 32768, 32768, 512, 0),
]
PEER_BLOCK = 512


def visible_pairs(sq: int, filled: int, window: int) -> int:
    """(query, key) pairs a causal (windowed) attention computes per head."""
    pos = filled - sq + np.arange(sq)
    lo = np.maximum(0, pos - window + 1) if window else np.zeros_like(pos)
    return int(np.maximum(pos + 1 - lo, 0).sum())


def roofline_inputs(b, hq, hkv, sq, filled, d, window):
    pairs = visible_pairs(sq, filled, window)
    flops = 4 * b * hq * pairs * d
    keys = min(filled, sq - 1 + window) if window else filled
    min_bytes = 2 * (2 * b * hkv * keys * d + 2 * b * hq * sq * d)
    return flops, min_bytes


def ours(generation, b, hq, hkv, sq, skv, filled, d, window):
    from attention_tpu.attention import flash_forward, key_ranges

    def fn(q, k, v, start, end):
        bounds = key_ranges.rule_key_bounds(start, end, sq=sq, skv=skv, causal=True, window=window)
        return flash_forward.flash_attention(q, k, v, bounds, causal=True, window=window, generation=generation)

    return fn, _qkv(b, hq, hkv, sq, skv, d) + (np.zeros(b, np.int32), np.full(b, filled, np.int32))


def splash(generation, b, hq, hkv, sq, skv, filled, d, window):
    if sq < PEER_BLOCK or sq % PEER_BLOCK or skv % PEER_BLOCK or filled != skv:
        return None
    import jax
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    group = hq // hkv
    shape = (sq, skv)
    head_mask = (sm.LocalMask(shape, (window - 1, 0), offset=skv - sq) if window
                 else sm.CausalMask(shape, offset=skv - sq))
    b_ = PEER_BLOCK
    blocks = sk.BlockSizes(block_q=b_, block_kv=b_, block_kv_compute=b_, block_q_dkv=b_, block_kv_dkv=b_,
                           block_kv_dkv_compute=b_, block_q_dq=b_, block_kv_dq=b_)
    kernel = sk.make_splash_mqa_single_device(sm.MultiHeadMask([head_mask] * group), block_sizes=blocks)

    def fn(q, k, v):
        grouped = (q * d ** -0.5).reshape(b, hkv, group, sq, d)  # splash takes pre-scaled queries
        return jax.vmap(jax.vmap(kernel))(grouped, k, v).reshape(b, hq, sq, d)

    return fn, _qkv(b, hq, hkv, sq, skv, d)


def jax_flash(generation, b, hq, hkv, sq, skv, filled, d, window):
    if window or sq != skv or filled != skv or sq % PEER_BLOCK:
        return None
    from jax.experimental.pallas.ops.tpu import flash_attention as jf

    b_ = PEER_BLOCK
    blocks = jf.BlockSizes(block_q=b_, block_k_major=b_, block_k=b_, block_b=1, block_q_major_dkv=b_,
                           block_k_major_dkv=b_, block_k_dkv=b_, block_q_dkv=b_, block_k_major_dq=b_, block_k_dq=b_,
                           block_q_dq=b_)

    def fn(q, k, v):
        return jf.flash_attention(q, k, v, causal=True, sm_scale=d ** -0.5, block_sizes=blocks)

    return fn, _qkv(b, hq, hq, sq, skv, d)


def _qkv(b, hq, hkv, sq, skv, d):
    import jax
    import jax.numpy as jnp

    return (jax.ShapeDtypeStruct((b, hq, sq, d), jnp.bfloat16), jax.ShapeDtypeStruct((b, hkv, skv, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, hkv, skv, d), jnp.bfloat16))


CONTENDERS = {"ours": ours, "splash": splash, "jax flash": jax_flash}


def training(make):
    """Forward and backward of a contender (``None`` where it cannot run the case):
    ours through its own backward kernels from the forward's lse, the peers
    through ``jax.grad`` of their custom VJPs; the output cotangent is all ones."""
    def make_training(generation, b, hq, hkv, sq, skv, filled, d, window):
        made = make(generation, b, hq, hkv, sq, skv, filled, d, window)
        if made is None:
            return None
        import jax
        import jax.numpy as jnp

        fn, args = made
        if make is ours:
            from attention_tpu.attention import flash_backward, flash_forward, key_ranges

            def step(q, k, v, start, end):
                bounds = key_ranges.rule_key_bounds(start, end, sq=sq, skv=skv, causal=True, window=window)
                out, lse = flash_forward.flash_attention_with_lse(q, k, v, bounds, causal=True, window=window,
                                                                  generation=generation)
                return flash_backward.flash_attention_backward(q, k, v, out, lse, jnp.ones_like(out), bounds,
                                                               causal=True, window=window,
                                                               generation=generation)[:3]
            return step, args
        return jax.grad(lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)), args

    return make_training


# JAX flash is left out: its backward kernels are unnamed pallas_calls that XLA
# renames under jax.grad, so the estimator cannot match them to their schedules.
TRAINING = {name: training(CONTENDERS[name]) for name in ("ours", "splash")}


def block_plan_row(label, b, hq, hkv, sq, skv, filled, d, window, generation):
    from attention_visit_plan import kv_block_plan
    from attention_tpu.attention import blocks

    rows = hq // hkv * sq
    block_q, block_k = blocks.choose_blocks(rows, skv, head_dim=d, window=window, generation=generation)
    plan = kv_block_plan([0], [filled], rows=rows, sq=sq, skv=skv, causal=True, window=window, head_dim=d,
                         generation=generation)
    return {"case": label, "generation": generation, "blocks (q, k)": (block_q, block_k),
            "VMEM working set (MiB)": blocks.working_set_bytes(block_q, block_k, d, d, 2) / 2**20,
            "grid steps / dense": plan.grid_steps / plan.dense, "steps computed / dense": plan.live / plan.dense,
            "K/V fetches / dense": plan.fetched / plan.dense}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--generations", nargs="+", default=["v5e", "v6e"])
    args = parser.parse_args()
    tpu_estimator.chip_device(tpu_estimator.CHIPS[args.generations[0]])  # dump flag before libtpu loads
    times, plans, training_rows = [], [], []
    for label, *shape in CASES:
        flops, min_bytes = roofline_inputs(shape[0], shape[1], shape[2], shape[3], shape[5], shape[6], shape[7])
        for generation in args.generations:
            row = {"case": label, "generation": generation}
            estimates = {}
            for name, make in CONTENDERS.items():
                made = make(generation, *shape)
                if made is not None:
                    estimates[name] = tpu_estimator.estimate(*made, generation, flops=flops, min_bytes=min_bytes)
            ours_s = estimates["ours"].seconds
            row["ours (us)"] = ours_s * 1e6
            row["ours / roofline"] = ours_s / estimates["ours"].roofline_s
            for peer in ("splash", "jax flash"):
                row[f"{peer} / ours"] = estimates[peer].seconds / ours_s if peer in estimates else "-"
            times.append(row)
            plans.append(block_plan_row(label, *shape, generation))
            print(row, flush=True)
            if shape[3] > 1:  # prefill: forward + backward (training)
                train = {name: tpu_estimator.estimate(*made, generation, flops=3.5 * flops, min_bytes=3 * min_bytes)
                         for name, make in TRAINING.items() if (made := make(generation, *shape)) is not None}
                ours_s = train["ours"].seconds
                row = {"case": label, "generation": generation, "ours (us)": ours_s * 1e6,
                       "ours / roofline": ours_s / train["ours"].roofline_s}
                row["splash / ours"] = train["splash"].seconds / ours_s if "splash" in train else "-"
                training_rows.append(row)
                print(row, flush=True)
    write_report(
        args.out, "attention_tpu.md", "attention-tpu on TPU generations (estimated from libtpu's schedule)",
        "No TPU here: every number is an estimate of `bench/tpu_estimator.py` (static bundle counts of the "
        "compiled kernels plus the DMA the grid implies; calibrated against measured TPU ragged-dot timings, "
        "see `tpu_calibration.md`). bf16, causal. Ratios: peer estimate / ours (> 1: ours is faster); '-': the "
        "peer cannot run the case (see the script's docstring). Roofline: max of the MXU-bound and HBM-bound "
        f"times of the visible work. `python bench/bench_attention_tpu.py --generations {' '.join(args.generations)}`."
        "\n\nBlock plan: the blocks of the rule, the VMEM working set, and per KV head the grid's KV steps, the "
        "steps that compute and the K/V block fetches, as fractions of the dense grid (every query block "
        "against every KV block).",
        [("Estimated times, forward", times),
         ("Estimated times, forward + backward (prefill; roofline: 3.5x the forward's MXU work)", training_rows),
         ("Block plan (forward)", plans)],
    )


if __name__ == "__main__":
    main()
