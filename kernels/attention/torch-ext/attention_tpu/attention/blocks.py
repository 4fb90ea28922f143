"""Block sizes of the flash attention kernel, by a documented rule (pure Python).

Rows are the query rows of one KV head's group, flattened (``G * Sq``: see
``pallas_flash``). The rule:

* ``block_q``: all rows when they fit in ``MAX_BLOCK_Q`` (decode: ``G`` rows
  for one token, so a single token never pads a 128-row block), else
  ``MAX_BLOCK_Q``, a multiple of every sublane tile and of the MXU width;
* ``block_k``: all keys when they fit in ``MAX_BLOCK_K``, else ``MAX_BLOCK_K``
  (a multiple of 128 lanes, and of v6e's 256-wide MXU).

512 x 512 score tiles keep the working set (double-buffered q, k, v, out
blocks, the f32 scores and accumulator) under 8 MiB at head dim 512 in bf16,
within every generation's VMEM budget (``common.tpu_generations``: 12 MiB on
v4, 24 MiB elsewhere). Callers may pass their own sizes (``block_sizes=``),
checked by ``check_blocks``.
"""

from __future__ import annotations

MAX_BLOCK_Q = 512
MAX_BLOCK_K = 512


def choose_blocks(rows: int, kv_len: int) -> tuple[int, int]:
    """``(block_q, block_k)`` for ``rows`` flattened query rows and ``kv_len`` keys."""
    return (rows if rows <= MAX_BLOCK_Q else MAX_BLOCK_Q), (kv_len if kv_len <= MAX_BLOCK_K else MAX_BLOCK_K)


def check_blocks(block_q: int, block_k: int, rows: int, kv_len: int) -> None:
    """TPU block legality: rows a multiple of 8 or all of them; keys a multiple of 128 or all."""
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"attention: {name} must be a positive int, got {value!r}")
    if block_q % 8 and block_q != rows:
        raise ValueError(f"attention: block_q must be a multiple of 8 or all {rows} rows, got {block_q}")
    if block_k % 128 and block_k != kv_len:
        raise ValueError(f"attention: block_k must be a multiple of 128 or all {kv_len} keys, got {block_k}")


def working_set_bytes(block_q: int, block_k: int, head_dim: int, v_dim: int, itemsize: int) -> int:
    """Double-buffered q, k, v and out blocks, the f32 scores, accumulator and row stats."""
    io = (block_q * head_dim + block_k * head_dim + block_k * v_dim + block_q * v_dim) * itemsize
    return 2 * io + 4 * (block_q * block_k + block_q * v_dim + 2 * block_q * 128)
