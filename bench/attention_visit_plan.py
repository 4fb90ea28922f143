"""The attention forward kernel's visit plan, replayed on the host: how many of
its grid steps compute, how many K/V blocks it fetches. For tests and
benchmarks only (not shipped): it walks the kernel's own visit table and index
maps (``key_ranges``) in Python.
"""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp
import numpy as np

from attention_tpu.attention import flash_forward
from attention_tpu.attention import key_ranges as kr


class VisitPlan(typing.NamedTuple):
    live: int
    fetched: int
    grid_steps: int
    dense: int


def kv_block_plan(kv_start, kv_end, *, rows: int, sq: int, skv: int, causal: bool, window: int,
                  block_sizes=None, kv_splits=None, head_dim: int = 128, generation=None) -> VisitPlan:
    """Per KV head, for the rule's ranges on ``kv_start`` / ``kv_end``: the KV
    block steps that compute, the K/V block fetches (a fetch happens when the
    clamped block index changes between consecutive steps), the grid's steps,
    and the dense count (every query block against every KV block)."""
    shape = jax.ShapeDtypeStruct((1, rows // sq, sq, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1, skv, head_dim), jnp.bfloat16)
    plan = flash_forward.forward_plan(shape, kv, kv, block_sizes, kv_splits, generation, causal, window)
    key_bounds = kr.rule_key_bounds(kv_start, kv_end, sq=sq, skv=skv, causal=causal, window=window)
    batch = len(key_bounds)
    table = np.asarray(kr.visit_table(kr.row_bounds(key_bounds, rows // sq), num_q_blocks=plan.num_q_blocks,
                                      block_q=plan.block_q, block_k=plan.block_k, rows=rows)).reshape(
        batch, plan.num_q_blocks, kr.TABLE_COLUMNS)
    per_split = int(kr.kv_steps(jnp.asarray(table), num_kv_blocks=plan.num_kv_blocks, splits=plan.splits))
    live = fetched = 0
    for b in range(batch):
        previous = None
        for split in range(plan.splits):
            for qb in range(plan.num_q_blocks):
                entry = lambda column: int(table[b, qb, column])  # noqa: E731
                lo = min(max(entry(kr.FIRST), 0), plan.num_kv_blocks - 1)
                hi = min(max(entry(kr.LAST), lo), plan.num_kv_blocks - 1)
                for step in range(per_split):
                    kb = kr.kv_block_of_step(entry, split, step, per_split)
                    live += bool(entry(kr.FIRST) <= kb <= entry(kr.LAST))
                    index = min(max(kb, lo), hi)
                    fetched += index != previous
                    previous = index
    return VisitPlan(live, fetched, batch * plan.num_q_blocks * plan.splits * per_split,
                     batch * plan.num_q_blocks * plan.num_kv_blocks)
