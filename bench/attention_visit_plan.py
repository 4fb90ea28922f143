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
    batch = len(kv_start)  # the plan's (its walk's) as the kernel makes it for this batch
    shape = jax.ShapeDtypeStruct((batch, rows // sq, sq, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, 1, skv, head_dim), jnp.bfloat16)
    plan = flash_forward.forward_plan(shape, kv, kv, block_sizes, kv_splits, generation, causal, window)
    key_bounds = kr.rule_key_bounds(kv_start, kv_end, sq=sq, skv=skv, causal=causal, window=window)
    table = np.asarray(kr.visit_table(kr.row_bounds(key_bounds, rows // sq), num_q_blocks=plan.num_q_blocks,
                                      block_q=plan.block_q, block_k=plan.block_k, rows=rows)).reshape(
        batch, plan.num_q_blocks, kr.TABLE_COLUMNS)
    per_split, walk_q, walk_step, (splits, q_axis, kv_axis) = (
        np.asarray(x) for x in flash_forward.grid_walk(jnp.asarray(table.reshape(-1)), plan))
    per_split, kv_axis = int(per_split), int(kv_axis)
    pairs = plan.num_q_blocks * plan.num_kv_blocks
    live = fetched = 0
    for b in range(batch):
        previous = None
        for split in range(int(splits)):
            for q_step in range(int(q_axis)):
                for kv_step in range(kv_axis):  # the kernel's walk: its grid, or the compacted pairs
                    if plan.compact:
                        qb, step = int(walk_q[b * pairs + kv_step]), int(walk_step[b * pairs + kv_step])
                    else:
                        qb, step = q_step, kv_step
                    entry = lambda column, qb=qb: int(table[b, qb, column])  # noqa: E731
                    lo = min(max(entry(kr.FIRST), 0), plan.num_kv_blocks - 1)
                    hi = min(max(entry(kr.LAST), lo), plan.num_kv_blocks - 1)
                    kb = kr.kv_block_of_step(entry, split, step, per_split)
                    live += bool(entry(kr.FIRST) <= kb <= entry(kr.LAST))
                    index = min(max(kb, lo), hi)
                    fetched += index != previous
                    previous = index
    return VisitPlan(live, fetched, batch * int(splits) * int(q_axis) * kv_axis,
                     batch * plan.num_q_blocks * plan.num_kv_blocks)
