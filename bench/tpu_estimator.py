"""Estimate a Pallas kernel's time on a TPU generation without a TPU.

How (the method is in bench/results/tpu_calibration.md, with its error):
1. Compile the JAX function ahead of time for one chip of the generation
   with libtpu's LLO dump on, and read the kernel's final VLIW schedule
   (``tpu_schedule``): the grid loop's cycles per step, the ``pl.when``
   regions holding the MXU work, where each operand lives (HBM or VMEM).
2. Replay the grid on the host: the function's XLA ops before the kernel run
   on concrete routing inputs, which gives the scalar-prefetch arrays and the
   dynamic grid size; the kernel's index maps and ``pl.when`` predicates are
   then evaluated for every grid step (a small vectorised interpreter over
   the kernel's own jaxpr). A block is fetched when its block index changes;
   an output block is written back when its index changes.
3. Simulate the pipeline: one FIFO DMA queue at HBM bandwidth; the inputs of
   step i+1 are issued when step i starts, step i waits for its own inputs;
   a step computes for (loop cycles - regions it skips) / clock (a
   ``pl.when`` whose body holds other MXU ``pl.when`` bodies is skipped
   whole, its own scalar and vector work too, where it does not run); write-backs
   queue behind. Add the prologue/epilogue, the first fetch, the last
   write-back, the copies of operands XLA placed in VMEM, and the other XLA
   ops of the program (their static bundle counts, one pass each).

   Inner loops (``fori_loop``, ``emit_pipeline`` inside a kernel, a while
   with fori bounds) that the lowering keeps rolled are paired, in program
   order, with the schedule's loops inside a grid step and charged by their
   trip count on each step (loops lowered unrolled, e.g. splash's
   ``block_kv_compute`` loop with ``unroll=True``, are in the schedule
   already). The kernel's own DMAs (``make_async_copy``,
   ``make_async_remote_copy``) are replayed too: each start joins the DMA
   queue, each ``dma_wait`` sits where the schedule has it and stalls the
   core until the copy it waits for has landed. The XLA ops around the
   kernels are charged one pass of their schedule or their HBM traffic,
   whichever is longer (``tpu_schedule.other_ops``: the operands placed in
   HBM, a gather fusion only the rows it gathers; libtpu dumps one bundle
   file per distinct program, so a fusion identical to a dumped one, such as
   a combine's per-pick gathers, is found in the optimized module and
   charged its twin's schedule. Before that, v5e Qwen3-30B-A3B's program at
   4096 tokens counted 3 of its combine's 8 gathers, each at the whole
   134 MB source: its XLA ops 613.4 us, now 490.5).

Nothing is fitted: the clocks and bandwidths are the chips' published peaks.
Development tool: benchmarks only; never imported by a Hub kernel.

Not modelled, and which way each bends an estimate:
- Megacore (v5p, v4) is modelled (``estimate_kernel``): a "parallel" grid
  axis is split between the two TensorCores, each with half the chip's HBM
  bandwidth. Not modelled: the split Mosaic really picks where several axes
  are parallel (the first one of more than one step is taken) and a core
  getting more than half of the bandwidth while the other idles (reads high
  for an uneven split). A kernel without a grid axis to split (tokamax's
  ragged dot: ``emit_pipeline`` without ``core_axis``) runs on one core with
  the chip's full bandwidth.
- The second tpu7x TensorCore: a tpu7x chip is two JAX devices, not a
  megacore (``pltpu.get_tpu_info``: TPU7x does not support megacore; Mosaic
  does not split a grid across them); the estimate is for one device, with
  half the chip's HBM bandwidth and MXU peak. A kernel running alone on one
  core may get more than half of the HBM bandwidth (then an HBM-bound
  estimate reads high); two devices each running the kernel share it as
  modelled. The calibration finds the opposite on tpu7x ragged dot: its
  measured times fit half of that share (bench/results/tpu_calibration.md);
  unpublished, so not adopted: tpu7x estimates of HBM-heavy kernels read low.
- ICI: a remote copy's bytes are charged at HBM bandwidth on the local DMA
  queue, and a wait on a semaphore another chip signals is taken to have
  landed already (the peer is assumed in step). ICI links are slower than
  HBM: collective kernels read low.
- Values a kernel computes on the vector unit and keeps in SMEM (e.g. the
  routing tables of a kernel that routes its tokens itself, as tpu-inference's
  fused_ep_moe) cannot be replayed: the caller passes them (``estimate``'s
  ``kernel_refs``); without them the loops and copy sizes they decide are
  unknown (loops unmatched, copies at their full extent). A kernel on a mesh
  (``shard_map``) is estimated on a one-device mesh only, as device 0.
- DMA starts are placed at the kernel's preceding wait (or the step's
  start), not at their own bundle: a start issued after compute in the same
  step is taken as issued earlier, which hides up to that compute (reads
  low for kernels that start late).
- Fixed costs per DMA or per grid step (a DMA's issue-to-first-byte
  latency, semaphore round trips): the DMA queue charges bytes only. Kernels
  of many short steps read low (attention at 512-wide blocks on v6e and
  tpu7x, steps under 1 us: 0.44-0.76 in the calibration).
- The MXU and vector units run at the static schedule's rate: stalls the
  schedule cannot see (HBM bank conflicts, DMA descriptor limits, small
  strided DMAs below full bandwidth) make every estimate read low.
- tpu7x's clock is not published (cloud.google.com/tpu/docs/tpu7x gives
  2307 TF/s bf16 and 7.37 TB/s per chip, two TensorCores); 2.2 GHz is
  unverified and every tpu7x compute-bound estimate scales with it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import sys
import tempfile

import numpy as np

import tpu_schedule

# One folder per process: concurrent estimates must not clean up each other.
DUMP_ROOT = pathlib.Path(tempfile.gettempdir()) / f"tpu_estimator_dumps_{os.getpid()}"


@dataclasses.dataclass(frozen=True)
class Chip:
    """A JAX device of the chip: one TensorCore's published peaks, and how
    many TensorCores the device has. ``cores=2``: a megacore, whose two
    TensorCores share the chip's HBM and split a kernel's "parallel" grid
    axis. Megacore chips: v4 and v5p only (docs.jax.dev Pallas TPU guides:
    "Pipelining", section Megacore: "Megacore is only currently available on
    TPU v4 and TPU v5p"; "Core-specific programming": "For recent TPU chips
    (v4, v5p), every JAX device may contain 2 TensorCores (aka. a
    Megacore)"). v5e and v6e have one TensorCore per chip; a tpu7x chip's two
    TensorCores are two JAX devices (cloud.google.com/tpu/docs/tpu7x), so a
    device is one core. MXU: vmatmul rows x width per op."""

    name: str
    topology: str
    clock_hz: float
    hbm_bytes_per_s: float
    bf16_flops_per_s: float  # of one TensorCore
    note: str = ""
    cores: int = 1  # TensorCores behind one JAX device (a v5p megacore: 2)


CHIPS = {
    # 4 MXUs x (16 x 128 x 128) per 16 cycles at 1.5 GHz = 197 TF/s.
    "v5e": Chip("v5e", "v5e:1x1", 1.5e9, 819e9, 197e12),
    # v5p: 459 TF/s bf16 and 2765 GB/s per chip, whose one device is a
    # megacore of two TensorCores (cloud.google.com/tpu/docs/v5p). One core: 4
    # MXUs x (128 x 128) at 1.75 GHz = 229 TF/s; the device has two of them.
    "v5p": Chip("v5p", "v5p:1x1x1", 1.75e9, 2765e9, 459e12 / 2, cores=2),
    # 2 MXUs x (16 x 256 x 256) per 8 cycles at 1.75 GHz = 918 TF/s.
    "v6e": Chip("v6e", "v6e:1x1", 1.75e9, 1640e9, 918e12),
    # One of the chip's two TensorCores: half the chip's 7.37 TB/s and
    # 2307 TF/s bf16 (cloud.google.com/tpu/docs/tpu7x); the 2.2 GHz clock is
    # not published (unverified; see "Not modelled" above).
    "tpu7x": Chip("tpu7x", "tpu7x:1x1x1", 2.2e9, 7.37e12 / 2, 2307e12 / 2, note="clock unverified"),
}


# ----------------------------------------------------------------------------
# A vectorised interpreter for the scalar part of a kernel / index map jaxpr
# ----------------------------------------------------------------------------


class _Unknown:
    def __repr__(self):
        return "?"


UNKNOWN = _Unknown()


def _trunc_div(a, b):
    q = np.abs(a) // np.maximum(np.abs(b), 1)
    return np.where((a < 0) != (b < 0), -q, q)


_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum, "min": np.minimum,
    "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
    "ge": np.greater_equal, "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor,
    "div": _trunc_div, "rem": lambda a, b: a - _trunc_div(a, b) * b,
    "shift_left": np.left_shift, "shift_right_arithmetic": np.right_shift,
}
_UNARY = {"neg": np.negative, "not": lambda a: ~a if a.dtype != bool else np.logical_not(a), "abs": np.abs,
          "sign": np.sign}
_IDENTITY = {"squeeze", "reshape", "broadcast_in_dim", "copy", "multiple_of"}


@dataclasses.dataclass
class CondRecord:
    """One ``cond`` met while interpreting: per step, which branch runs
    (``-1`` where the enclosing region did not run), which branches hold
    MXU work with no MXU ``cond`` nested inside (innermost), and which hold
    MXU work at all (innermost or enclosing MXU conds)."""

    branch: np.ndarray
    dot_branches: tuple[int, ...]
    all_dot_branches: tuple[int, ...] = ()
    # A ``pl.when`` body that stores into a ref (vector work) with no MXU work (the other branch empty).
    store_branches: tuple[int, ...] = ()
    depth: int = 0  # conds enclosing this one


def _has_dot(jaxpr) -> bool:
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            return True
        if any(_has_dot(sub) for sub in _sub_jaxprs(e)):
            return True
    return False


def _sub_jaxprs(eqn):
    for p in eqn.params.values():
        for q in (p if isinstance(p, (tuple, list)) else (p,)):
            j = getattr(q, "jaxpr", None)
            if j is not None and hasattr(j, "eqns"):
                yield j
            elif hasattr(q, "eqns"):
                yield q


def _stores(jaxpr) -> bool:
    return any(e.primitive.name in ("swap", "masked_swap") for e in _walk(jaxpr))


def _innermost_dot_branches(eqn) -> tuple[int, ...]:
    out = []
    for b, br in enumerate(eqn.params["branches"]):
        if not _has_dot(br.jaxpr):
            continue
        nested = any(e.primitive.name == "cond" and any(_has_dot(x.jaxpr) for x in e.params["branches"])
                     for e in _walk(br.jaxpr))
        if not nested:
            out.append(b)
    return tuple(out)


def _walk(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for sub in _sub_jaxprs(e):
            yield from _walk(sub)


def _is_literal(v) -> bool:
    global _LITERAL
    if _LITERAL is None:  # imported once: the replay asks this millions of times for kernels that route themselves
        from jax._src import core

        _LITERAL = core.Literal
    return isinstance(v, _LITERAL)


_LITERAL = None


def grid_indices(grid) -> list[np.ndarray]:
    """Every grid step's indices, in Pallas' iteration order (last axis fastest)."""
    steps = int(np.prod(grid))
    return list(np.indices(grid).reshape(len(grid), steps)) if steps else [np.zeros(0, int)] * len(grid)


def stack_block_indices(index_map_outputs, steps: int) -> np.ndarray:
    """An index map's outputs (scalars or per-step arrays) as [steps, ndim]."""
    return np.stack([np.broadcast_to(np.asarray(o), (steps,)) for o in index_map_outputs], axis=1)


@dataclasses.dataclass
class LoopRecord:
    """One ``fori_loop`` / ``scan`` / ``while`` met in a kernel body: its trip
    count per step (0 where it does not run), whether the lowering unrolls it
    (then the schedule holds every trip and nothing is added), and the
    enclosing recorded loop. ``extra``: the trips beyond the one the schedule
    holds, summed over every run of the loop in a step (a loop nested in a
    loop whose trips are interpreted one by one may run a different count
    on each, e.g. one per expert sized by its rows)."""

    trips: np.ndarray
    unrolled: bool
    parent: int | None
    extra: np.ndarray | None = None


@dataclasses.dataclass
class DmaEvent:
    """A ``dma_start`` or ``dma_wait`` as executed, in program order: the steps
    where it runs, its bytes (starts), its semaphores (a start signals its
    destination semaphore and, for a remote copy, its source semaphore too;
    a wait names one), and which static wait of the kernel it is."""

    kind: str  # "start" / "wait"
    active: np.ndarray
    nbytes: int
    keys: tuple
    wait_index: int = -1


@dataclasses.dataclass
class KernelTrace:
    loops: list = dataclasses.field(default_factory=list)
    dmas: list = dataclasses.field(default_factory=list)
    wait_ids: dict = dataclasses.field(default_factory=dict)  # id(eqn) -> static index, program order
    loop: int | None = None  # the loop being interpreted
    first_trip: bool = True  # loops nested in a loop are recorded on its first trip only
    # Per step, how many runs one interpretation of the current body stands
    # for (the trips of enclosing loops interpreted once for all their trips).
    repeat: np.ndarray | None = None
    met: dict = dataclasses.field(default_factory=dict)  # (loop eqn, enclosing record) -> record
    # Starts of no bytes (a kernel that sizes its copies by routing, e.g. one
    # row or none per token and expert) are dropped: the queue charges bytes.
    skip_empty: bool = False


# Trips of one loop interpreted to collect its DMAs; longer loops are rare
# in kernels that start DMAs inside them (their DMAs past this are dropped).
MAX_INTERPRETED_TRIPS = 512


def _sem_key(ref, read):
    """A semaphore as (ref, its index values per step where known)."""
    if ref is None:
        return None
    var = getattr(ref, "ref", ref)
    index = []
    for t in getattr(ref, "transforms", ()):
        for i in getattr(t, "indices", ()):
            v = read(i) if hasattr(i, "aval") else np.asarray(i)
            index.append(v)
    return (id(var), tuple(index))


def _key_at(key, step):
    """The key at one grid step: an index is a constant or one value per step."""
    var, index = key

    def at(v):
        v = np.asarray(v)
        return int(v) if v.ndim == 0 else int(v.reshape(-1)[step])

    return (var, tuple(None if v is UNKNOWN else at(v) for v in index))


def _dma_bytes(ref, read=None, active=None) -> int:
    """Bytes of a DMA's ref. A dynamic slice size (``pl.ds(start, n)``, n
    traced) is read where known (its largest value over the steps that run
    it); unknown, the dimension's full extent (an upper bound)."""
    from jax._src.state.indexing import Slice

    aval = getattr(ref, "ref", ref).aval
    shape = aval.shape
    for t in getattr(ref, "transforms", ()):
        if hasattr(t, "get_indexer_shape"):
            shape = t.get_indexer_shape()
            # The extent of each dimension the indexer keeps (an integer index drops its dimension).
            extents = [n for i, n in zip(t.indices, t.shape) if isinstance(i, Slice) or np.ndim(i) > 0]
            dims = []
            for d in shape:
                if isinstance(d, (int, np.integer)):
                    dims.append(int(d))
                    continue
                v = read(d) if read is not None else UNKNOWN
                if v is UNKNOWN:
                    v = extents[len(dims)] if len(dims) < len(extents) else 0
                v = np.broadcast_to(np.asarray(v), active.shape)[active] if active is not None else np.asarray(v)
                dims.append(int(np.max(v, initial=0)))
            shape = dims
    dtype = getattr(aval, "dtype", None) or aval.inner_aval.dtype
    return int(np.prod(shape)) * np.dtype(dtype).itemsize


def static_waits(jaxpr, out=None) -> dict:
    """Every ``dma_wait`` of a kernel body in program order (into loop and
    cond bodies): id(eqn) -> index."""
    out = {} if out is None else out
    for e in jaxpr.eqns:
        if e.primitive.name == "dma_wait":
            out[id(e)] = len(out)
        for sub in _sub_jaxprs(e):
            static_waits(sub, out)
    return out


def _loop_trips(e, ins, steps):
    """(trip count per step or UNKNOWN, unrolled, carry layout) of a scan or fori-style while."""
    name = e.primitive.name
    if name == "scan":
        unroll = e.params["unroll"]
        length = e.params["length"]
        unrolled = unroll is True or (not isinstance(unroll, bool) and unroll >= length)
        return np.full(steps, length), unrolled
    from jax._src.pallas import utils as pallas_utils

    fori, _ = pallas_utils.pattern_match_while_to_fori_loop(
        e.params["cond_jaxpr"], e.params["cond_nconsts"], e.params["body_jaxpr"], e.params["body_nconsts"])
    carry = ins[e.params["cond_nconsts"] + e.params["body_nconsts"]:]
    if fori is None or carry[0] is UNKNOWN or carry[1] is UNKNOWN:
        return UNKNOWN, False
    return np.broadcast_to(np.maximum(np.asarray(carry[1]) - np.asarray(carry[0]), 0), (steps,)).copy(), False


def _interpret_loop(e, ins, trace, *, grid_index, grid, steps, active):
    """Record a loop and interpret its body trip by trip (for the DMAs it starts and waits)."""
    trips, unrolled = _loop_trips(e, ins, steps)
    if trips is UNKNOWN:
        return
    index = None
    run = np.where(active, trips, 0)
    more = np.maximum(run.astype(np.int64) - 1, 0) * (1 if trace.repeat is None else trace.repeat)
    if trace.first_trip:
        trace.loops.append(LoopRecord(run, unrolled, trace.loop, more))
        index = len(trace.loops) - 1
        trace.met.setdefault((id(e), trace.loop), index)
    elif (id(e), trace.loop) in trace.met:  # a later trip of an enclosing loop: add this run's trips
        index = trace.met[(id(e), trace.loop)]
        trace.loops[index].extra += more
    if e.primitive.name == "scan":
        n_consts, n_carry = e.params["num_consts"], e.params["num_carry"]
        body, consts, carry = e.params["jaxpr"].jaxpr, ins[:n_consts], ins[n_consts:n_consts + n_carry]
        xs = [UNKNOWN] * (len(body.invars) - n_consts - n_carry)
    else:
        n_cond, n_body = e.params["cond_nconsts"], e.params["body_nconsts"]
        body, consts, carry, xs = e.params["body_jaxpr"].jaxpr, ins[n_cond:n_cond + n_body], ins[n_cond + n_body:], []
    if not _has_dma(body):
        repeat = np.maximum(run, 1) * (1 if trace.repeat is None else trace.repeat)
        sub = dataclasses.replace(trace, loop=index if index is not None else trace.loop, dmas=[], wait_ids={},
                                  repeat=repeat)
        interpret(body, list(consts) + list(carry) + xs, grid_index=grid_index, grid=grid, steps=steps,
                  active=active & (trips > 0), trace=sub)  # nested loops only
        trace.loops[:] = sub.loops
        return
    outer = (trace.loop, trace.first_trip)
    trace.loop = index if index is not None else trace.loop
    for trip in range(min(int(np.max(trips, initial=0)), MAX_INTERPRETED_TRIPS)):
        trace.first_trip = outer[1] and trip == 0
        outs = interpret(body, list(consts) + list(carry) + xs, grid_index=grid_index, grid=grid, steps=steps,
                         active=active & (trip < trips), trace=trace)
        carry = outs[:len(carry)]
    trace.loop, trace.first_trip = outer


def _has_dma(jaxpr) -> bool:
    return any(e.primitive.name in ("dma_start", "dma_wait") for e in _walk(jaxpr))


def interpret(jaxpr, inputs, *, grid_index, grid, steps, conds=None, active=None, trace=None, depth=0):
    """Evaluate ``jaxpr`` on per-step values. ``inputs``: numpy arrays (refs
    and scalars are both arrays; a per-step scalar has shape [steps]) or
    UNKNOWN. ``program_id(a)`` is ``grid_index[a]``. Conds are recorded into
    ``conds`` in program order, nested ones with the steps where they run
    (not those inside loops). ``trace``: loops and DMAs are recorded there."""
    from jax._src.state.indexing import NDIndexer, Slice
    from jax import tree_util

    env = dict(zip(jaxpr.invars, inputs))
    active = np.ones(steps, bool) if active is None else active

    def read(v):
        return np.asarray(v.val) if _is_literal(v) else env.get(v, UNKNOWN)

    for e in jaxpr.eqns:
        name = e.primitive.name
        ins = [read(v) for v in e.invars]
        outs = [UNKNOWN] * len(e.outvars)
        known = all(x is not UNKNOWN for x in ins)
        if name == "program_id":
            outs = [grid_index[e.params["axis"]]]
        elif name == "axis_index":  # the estimate is for the mesh's first device
            outs = [np.asarray(0, np.int32)]
        elif name == "num_programs":
            outs = [np.asarray(grid[e.params["axis"]])]
        elif name == "cond":
            index = ins[0]
            branches = e.params["branches"]
            if (conds is not None or trace is not None) and index is not UNKNOWN:
                branch = np.where(active, np.broadcast_to(index, (steps,)), -1)
                if conds is not None:
                    conds.append(CondRecord(
                        branch, _innermost_dot_branches(e),
                        tuple(b for b, br in enumerate(branches) if _has_dot(br.jaxpr)),
                        tuple(b for b, br in enumerate(branches) if _stores(br.jaxpr) and not _has_dot(br.jaxpr)
                              and not any(o.jaxpr.eqns for o in branches if o is not br)),
                        depth))
                for b, br in enumerate(branches):  # nested conds: recorded where this branch runs
                    interpret(br.jaxpr, ins[1:], grid_index=grid_index, grid=grid, steps=steps,
                              conds=conds, active=active & (branch == b), trace=trace, depth=depth + 1)
        elif name in ("scan", "while") and trace is not None:
            _interpret_loop(e, ins, trace, grid_index=grid_index, grid=grid, steps=steps, active=active)
        elif name in ("dma_start", "dma_wait") and trace is not None:
            src, dst, dst_sem, src_sem, _ = e.params["tree"].unflatten(e.invars)
            if name == "dma_start":
                keys = tuple(k for k in (_sem_key(dst_sem, read), _sem_key(src_sem, read)) if k is not None)
                nbytes = _dma_bytes(src, read, active)
                if nbytes or not trace.skip_empty:
                    trace.dmas.append(DmaEvent("start", active.copy(), nbytes, keys))
            else:
                trace.dmas.append(DmaEvent("wait", active.copy(), _dma_bytes(dst, read, active),
                                           (_sem_key(dst_sem, read),), trace.wait_ids.get(id(e), -1)))
        elif (body := _call_body(e)) is not None:
            outs = interpret(getattr(body, "jaxpr", body), ins, grid_index=grid_index, grid=grid, steps=steps,
                             conds=conds, active=active, trace=trace, depth=depth)
        elif not known:
            pass
        elif name in _BINARY:
            outs = [_BINARY[name](*np.broadcast_arrays(*ins))]
        elif name in _UNARY:
            outs = [_UNARY[name](ins[0])]
        elif name in _IDENTITY and np.ndim(ins[0]) <= 1 and all(
                int(np.prod(v.aval.shape)) == 1 for v in e.outvars):
            outs = [np.asarray(ins[0])]
        elif name == "convert_element_type":
            outs = [np.asarray(ins[0]).astype(np.dtype(e.params["new_dtype"]))]
        elif name == "select_n":
            pred, *cases = ins
            outs = [np.choose(np.asarray(pred).astype(int), np.broadcast_arrays(*cases))]
        elif name == "clamp":
            lo, x, hi = ins
            outs = [np.clip(x, lo, hi)]
        elif name == "get":
            ref, *flat = ins
            transforms = tree_util.tree_unflatten(e.params["tree"], flat)
            index = None
            if len(transforms) == 1 and isinstance(transforms[0], NDIndexer):
                idx = transforms[0].indices
                if not any(isinstance(i, Slice) for i in idx):
                    index = tuple(np.asarray(i) for i in idx)
            if index is not None and np.ndim(ref) == len(index):
                # Clipped: a kernel may read past a table on steps whose result it
                # discards (SMEM reads are not bounds-checked on the chip either).
                array = np.asarray(ref)
                index = [np.clip(i, 0, n - 1) for i, n in zip(np.broadcast_arrays(*index), array.shape)]
                outs = [array[tuple(index)] if index else array]
        for var, val in zip(e.outvars, outs):
            env[var] = val
    return [read(v) for v in jaxpr.outvars]


# ----------------------------------------------------------------------------
# Finding the pallas_calls of a function and their concrete operands
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class KernelCall:
    name: str
    eqn: object
    operands: list  # concrete numpy values where known, else UNKNOWN


def kernel_calls(fn, args) -> list[KernelCall]:
    """The pallas_calls of ``fn(*args)`` in program order. ``args``: numpy
    arrays (concrete: routing inputs) or ``jax.ShapeDtypeStruct`` (abstract:
    activations and weights, never materialised). The ops before a kernel
    that depend only on concrete inputs are run on the host CPU."""
    import jax

    specs = [a if isinstance(a, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype)
             for a in args]
    closed = jax.make_jaxpr(fn)(*specs)
    values = [UNKNOWN if isinstance(a, jax.ShapeDtypeStruct) else np.asarray(a) for a in args]
    calls: list[KernelCall] = []
    _host_eval(closed.jaxpr, list(closed.consts), values, calls)
    return calls


# Primitives that only wrap a function of their operands (jit, custom
# derivatives, custom vmap): the estimate looks through them.
_CALL_PARAMS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
                "custom_jvp_call": "call_jaxpr", "custom_vmap_call": "call", "remat": "jaxpr", "checkpoint": "jaxpr"}


def _call_body(eqn):
    if eqn.primitive.name == "shard_map":
        # On a one-device mesh the body sees the whole arrays: a plain call
        # (a kernel written for a mesh, e.g. an expert-parallel one at ep=1).
        return eqn.params["jaxpr"] if eqn.params["mesh"].size == 1 else None
    param = _CALL_PARAMS.get(eqn.primitive.name)
    body = eqn.params.get(param) if param else None
    if body is None:
        return None
    inner = getattr(body, "jaxpr", body)
    return body if len(inner.invars) == len(eqn.invars) else None


def _host_eval(jaxpr, consts, inputs, calls, scope="kernel"):
    import jax

    env = dict(zip(jaxpr.constvars, [np.asarray(c) for c in consts]))
    env.update(zip(jaxpr.invars, inputs))

    def read(v):
        return v.val if _is_literal(v) else env.get(v, UNKNOWN)

    for e in jaxpr.eqns:
        ins = [read(v) for v in e.invars]
        outs = [UNKNOWN] * len(e.outvars)
        if e.primitive.name == "pallas_call":
            # An unnamed pallas_call is named by XLA after the jit around it.
            calls.append(KernelCall(e.params.get("name") or scope, e, ins))
        elif e.primitive.name == "with_memory_space_constraint":  # a placement hint: the value itself
            outs = ins
        elif (body := _call_body(e)) is not None:
            jaxpr_, consts = (body.jaxpr, list(body.consts)) if hasattr(body, "consts") else (body, [])
            outs = _host_eval(jaxpr_, consts, ins, calls, e.params.get("name") or scope)
        elif all(x is not UNKNOWN for x in ins):
            with jax.default_device(jax.devices("cpu")[0]):
                res = e.primitive.bind(*ins, **e.primitive.get_bind_params(e.params))
            outs = list(res) if e.primitive.multiple_results else [res]
            outs = [np.asarray(o) for o in outs]
        for var, val in zip(e.outvars, outs):
            env[var] = val
    return [read(v) for v in jaxpr.outvars]


# ----------------------------------------------------------------------------
# The grid replay: per step block indices and MXU regions taken
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class GridReplay:
    grid: tuple[int, ...]
    block_indices: list[np.ndarray]  # per block mapping (inputs, then outputs): [steps, ndim]
    block_bytes: list[int]
    is_output: list[bool]
    # Innermost MXU pl.when bodies in program order, [steps] bool each; None:
    # one MXU body runs every step (a pipeline whose body alternates buffers).
    mxu_taken: list[np.ndarray] | None
    buffers: list[int] | None = None  # per block mapping; default 2 (double buffering)
    whole_arrays: list[int] | None = None  # bytes of each mapping's full array
    loops: list[LoopRecord] = dataclasses.field(default_factory=list)  # inner loops, program order
    dmas: list[DmaEvent] = dataclasses.field(default_factory=list)  # manual DMAs, execution order
    manual: list[bool] | None = None  # per block mapping: memory_space=ANY, the kernel copies it itself
    # Every MXU pl.when body, enclosing ones too, in program order (an enclosing
    # body before those nested in it), [steps] bool each.
    mxu_taken_all: list[np.ndarray] | None = None
    # The kernel's top-level pl.when bodies with vector stores and no MXU work
    # (init / finish of an accumulator), program order, [steps] bool each.
    vector_taken: list[np.ndarray] | None = None

    @property
    def steps(self) -> int:
        return int(np.prod(self.grid))


def user_grid_axes(grid_mapping, rank: int) -> list[int]:
    """The grid axes a kernel body's ``program_id`` counts: all but those a
    ``jax.vmap`` of the pallas_call added in front of the user's."""
    vmapped = set(getattr(grid_mapping, "vmapped_dims", ()) or ())
    return [a for a in range(rank) if a not in vmapped]


def replay(call: KernelCall, known_refs: dict[int, np.ndarray] | None = None) -> GridReplay:
    """``known_refs``: contents of some of the kernel body's refs (by position
    in its arguments: inputs, outputs, scratch) that the replay cannot derive,
    e.g. the routing tables a kernel computes into SMEM itself."""
    from jax._src.pallas import core as pallas_core

    gm = call.eqn.params["grid_mapping"]
    ops = list(call.operands)
    grid = []
    for d in gm.grid:
        if isinstance(d, int):
            grid.append(d)
        else:
            bound = ops.pop(0)
            if bound is UNKNOWN:
                raise ValueError(f"{call.name}: the dynamic grid size depends on data the estimate was not given")
            grid.append(int(bound))
    prefetch = ops[:gm.num_index_operands]
    if any(p is UNKNOWN for p in prefetch):
        raise ValueError(f"{call.name}: scalar-prefetch operands depend on data the estimate was not given "
                         "(pass routing inputs as concrete arrays)")
    steps = int(np.prod(grid))
    grid_index = grid_indices(grid)
    block_indices, block_bytes, is_output, whole = [], [], [], []
    for j, bm in enumerate(gm.block_mappings):
        out = interpret(bm.index_map_jaxpr.jaxpr, grid_index + [np.asarray(p) for p in prefetch],
                        grid_index=grid_index, grid=grid, steps=steps)
        if any(o is UNKNOWN for o in out):
            raise ValueError(f"{call.name}: index map of operand {j} uses something the replay cannot evaluate")
        block_indices.append(stack_block_indices(out, steps))
        dims = [getattr(b, "block_size", b) for b in bm.block_shape
                if not isinstance(b, pallas_core.Squeezed) and b is not None]
        block_bytes.append(int(np.prod(dims)) * bm.array_aval.dtype.itemsize)
        is_output.append(j >= gm.num_inputs)
        whole.append(int(np.prod(bm.array_aval.shape)) * bm.array_aval.dtype.itemsize)
    kernel = call.eqn.params["jaxpr"]
    refs = [np.asarray(p) for p in prefetch] + [UNKNOWN] * (len(kernel.invars) - len(prefetch))
    for i, value in (known_refs or {}).items():
        refs[i] = np.asarray(value)
    conds: list[CondRecord] = []
    trace = KernelTrace(wait_ids=static_waits(kernel), skip_empty=bool(known_refs))
    # The body's program_id(a) / num_programs(a) count the user's grid axes
    # only: the axes a jax.vmap of the pallas_call added (vmapped_dims) are
    # skipped, as Mosaic lowers them (its user_grid_indices). The index maps
    # above take every axis.
    user = user_grid_axes(gm, len(grid))
    interpret(kernel, refs, grid_index=[grid_index[a] for a in user], grid=[grid[a] for a in user], steps=steps,
              conds=conds, trace=trace)
    taken = [np.isin(c.branch, b) for c in conds for b in c.dot_branches]
    taken_all = [np.isin(c.branch, b) for c in conds for b in c.all_dot_branches]
    vector_taken = [np.isin(c.branch, c.store_branches) for c in conds if c.depth == 0 and c.store_branches]
    buffers = [getattr(bm.pipeline_mode, "buffer_count", None) or 2 for bm in gm.block_mappings]
    # memory_space=ANY or HBM: the operand stays in HBM, the kernel copies what it needs itself
    manual = [str(getattr(bm.block_aval, "memory_space", "")) in ("any", "hbm") for bm in gm.block_mappings]
    return GridReplay(tuple(grid), block_indices, block_bytes, is_output, taken, buffers, whole,
                      trace.loops, trace.dmas, manual, taken_all, vector_taken)


# ----------------------------------------------------------------------------
# The pipeline simulation
# ----------------------------------------------------------------------------


def changed(indices: np.ndarray) -> np.ndarray:
    """Per step: does the block differ from the previous step's (step 0: yes)."""
    if len(indices) == 0:
        return np.zeros(0, bool)
    diff = np.any(indices[1:] != indices[:-1], axis=1)
    return np.concatenate([[True], diff])


def simulate(step_cycles, fetches, writeback_bytes, *, clock_hz, hbm_bytes_per_s,
             prologue_cycles=0, epilogue_cycles=0, before_bytes=0, after_bytes=0, manual=None) -> float:
    """Seconds for one kernel. ``fetches``: per input, ``(bytes per step,
    lookahead)``: with ``b`` buffers the block of step j is issued when step
    ``j - (b - 1)`` starts (the first ones in the prologue) and step j waits
    for it. ``writeback_bytes[i]`` is queued when step i ends. One FIFO DMA
    queue at HBM bandwidth; the core runs ``step_cycles[i]`` per step.
    ``manual[i]``: the kernel's own DMAs in step i, ``(cycles into the step,
    "start" or "wait", bytes, semaphore keys)`` in program order: a start
    joins the same queue when the core reaches it, a wait stalls the core
    until the oldest start on its semaphore has landed (a wait with no start
    in flight, e.g. one another chip signals, does not stall)."""
    bw = hbm_bytes_per_s
    n = len(step_cycles)
    issued_at: dict[int, list] = {}
    for nbytes, lookahead in fetches:
        for j in np.nonzero(nbytes)[0]:
            issued_at.setdefault(max(int(j) - lookahead, -1), []).append((int(j), float(nbytes[j])))
    for v in issued_at.values():
        v.sort()
    queue = before_bytes / bw  # XLA's copies of VMEM-placed operands, before the kernel
    core = queue + prologue_cycles / clock_hz
    ready = np.zeros(n)

    def issue(step, t):
        nonlocal queue
        for j, nbytes in issued_at.get(step, ()):
            queue = max(queue, t) + nbytes / bw
            ready[j] = max(ready[j], queue)

    issue(-1, core)
    in_flight: dict = {}
    for i in range(n):
        start = max(core, ready[i])
        issue(i, start)
        stall = 0.0
        for offset, kind, nbytes, keys in (manual[i] if manual is not None else ()):
            t = start + offset / clock_hz + stall
            if kind == "start":
                queue = max(queue, t) + nbytes / bw
                for key in keys:
                    in_flight.setdefault(key, []).append([queue, nbytes])
            else:  # until its bytes have landed: one start's, or several started on one semaphore
                pending, landed, need = in_flight.get(keys[0]) or [], None, max(nbytes, 1)
                while pending and need > 0:
                    take = min(pending[0][1], need) if pending[0][1] else need
                    landed, need = pending[0][0], need - take
                    pending[0][1] -= take
                    if pending[0][1] <= 0:
                        pending.pop(0)
                if landed is not None:
                    stall += max(landed - t, 0.0)
        core = start + step_cycles[i] / clock_hz + stall
        if writeback_bytes[i]:
            queue = max(queue, core) + writeback_bytes[i] / bw
    end = max(core + epilogue_cycles / clock_hz, queue)
    return end + after_bytes / bw


# ----------------------------------------------------------------------------
# The estimate
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class KernelEstimate:
    name: str
    steps: int
    loop_cycles: int
    step_cycles: np.ndarray
    regions_matched: bool
    inner_loops: int
    fetched_bytes: int
    written_bytes: int
    vmem_operand_bytes: int
    seconds: float
    inner_loops_matched: bool = True  # the schedule's inner loops paired with the kernel's
    manual_dmas_matched: bool = True  # the kernel's dma_waits placed on the schedule's
    manual_dma_bytes: int = 0  # moved by the kernel's own DMAs (make_async_copy ...)
    cores: int = 1  # TensorCores the grid ran on (2: split on a megacore)
    compute_s: float = 0.0  # the busiest core's step cycles at the clock
    dma_s: float = 0.0  # the busiest core's bytes at its share of the HBM bandwidth


@dataclasses.dataclass
class Estimate:
    generation: str
    kernels: list[KernelEstimate]
    other_ops_cycles: int
    seconds: float
    mxu_bound_s: float
    hbm_bound_s: float
    other_ops_s: float = 0.0
    what_if: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds with other constants

    @property
    def roofline_s(self) -> float:
        return max(self.mxu_bound_s, self.hbm_bound_s)


def _operand_memory(schedule, index: int) -> str:
    for o in schedule.operands:
        if o.index == index:
            return o.memory
    return "hbm"


def step_cycles(rp: GridReplay, schedule: tpu_schedule.Schedule) -> tuple[np.ndarray, bool, int]:
    """Cycles of every grid step: the loop minus the MXU regions the step
    skips. Returns (cycles, regions matched, cycles of the pipeline's fill
    iteration)."""
    loop = body_loop(rp, schedule)
    mxu_regions = schedule.innermost_mxu_regions(loop)
    cycles = np.full(rp.steps, loop.cycles, dtype=np.int64)
    if rp.mxu_taken is None:  # one of the alternative bodies runs per step
        matched = bool(mxu_regions)
        if matched:
            cycles -= sum(r.cycles for r in mxu_regions) - max(r.cycles for r in mxu_regions)
    elif not rp.mxu_taken:  # no matmul under a pl.when: every step runs all of the loop
        matched = True
    elif (nested_skips := _nested_skips(rp, schedule, loop)) is not None:
        matched = True
        cycles -= nested_skips
    else:
        taken_lists = rp.mxu_taken
        if len(mxu_regions) != len(taken_lists):
            # The compiler folds away a branch no step can take (a predicate
            # on a one-step grid axis, e.g. "not the last k tile" when k has
            # one tile): match the regions without those.
            taken_lists = [t for t in taken_lists if t.any()]
        matched = len(mxu_regions) == len(taken_lists)
        if matched:
            for region, taken in zip(mxu_regions, taken_lists):
                cycles -= np.where(taken, 0, region.cycles)
    # A pipelined grid loop runs one more iteration that only issues step 0's
    # DMAs: the loop minus its step body (the region enclosing the MXU work).
    wrappers = [r for r in schedule.regions_in(loop) if mxu_regions and all(r.contains(m) for m in mxu_regions)]
    if GATE_VECTOR_REGIONS and rp.vector_taken:
        cycles = cycles - _vector_skips(rp, schedule, loop, wrappers)
    fill = loop.cycles - max(w.cycles for w in wrappers) if wrappers and rp.mxu_taken is not None else 0
    return cycles, matched, fill


# Experimental, off (TPU_ESTIMATOR_GATE_VECTOR_REGIONS=1): charge the kernel's
# vector-only pl.when bodies (an accumulator's init and finish) only on the
# steps that run them, as the MXU bodies are; by default every step pays for
# them (a flash-attention step over one of several KV blocks: ~1250 cycles on
# v6e / tpu7x, ~2400 on v5e). Against the measured tables (tokamax's
# splash-based forward, causal entries over several KV blocks): v6e 14 entries,
# median estimate / measured 1.03 -> 0.97, D64 entries 1.06-1.18 -> 0.99-1.04,
# D128 / D256 ones 0.94-1.04 -> 0.89-0.97; tpu7x 10 entries, all lower (0.70-0.98
# -> 0.67-0.85, where the chip already reads low). Not adopted: the per-step
# charge stands in for costs the model lacks on some kernels, and adopting it
# means re-running the calibration and every table.
GATE_VECTOR_REGIONS = os.environ.get("TPU_ESTIMATOR_GATE_VECTOR_REGIONS") == "1"
VECTOR_REGION_MIN_CYCLES = 100


def _vector_skips(rp: GridReplay, schedule: tpu_schedule.Schedule, loop, wrappers) -> np.ndarray:
    """Per step, the cycles of the vector-only regions it skips: the schedule's
    top-level regions without MXU work (of at least ``VECTOR_REGION_MIN_CYCLES``;
    the pipeline's own DMA guards are shorter) paired in order with the kernel's
    top-level vector ``pl.when`` bodies (the largest regions where there are
    more); zeros where there are fewer."""
    mxu = [r for r in schedule.regions_in(loop) if r.mxu_ops and r not in wrappers]
    candidates = [r for r in schedule.regions_in(loop)
                  if not r.mxu_ops and r.cycles >= VECTOR_REGION_MIN_CYCLES and not any(m.contains(r) for m in mxu)]
    top = [r for r in candidates if not any(o.contains(r) for o in candidates)]
    skipped = np.zeros(rp.steps, dtype=np.int64)
    if len(top) < len(rp.vector_taken):
        return skipped
    if len(top) > len(rp.vector_taken):  # the largest ones, in order: the pipeline's guards are short
        top = sorted(sorted(top, key=lambda r: -r.cycles)[:len(rp.vector_taken)], key=lambda r: r.start)
    for region, taken in zip(top, rp.vector_taken):
        skipped += np.where(taken, 0, region.cycles)
    return skipped


def _nested_skips(rp: GridReplay, schedule: tpu_schedule.Schedule, loop) -> np.ndarray | None:
    """Per step, the cycles of the MXU regions it skips when some enclose
    others (a ``pl.when`` whose body holds more of them): a region not taken
    is skipped whole, its own scalar and vector work included, unless an
    enclosing one already is. None when there is no nesting or the regions do
    not pair with the ``pl.when`` bodies (then only innermost ones count)."""
    regions = sorted((r for r in schedule.regions_in(loop) if r.mxu_ops), key=lambda r: (r.start, -r.end))
    taken = rp.mxu_taken_all
    if taken and len(regions) == len(taken) + 1 and all(regions[0].contains(r) for r in regions[1:]):
        regions = regions[1:]  # the pipeline's own guard around the step body: no pl.when of the kernel's
    if taken is None or len(regions) != len(taken) or not any(a.contains(b) for a in regions for b in regions):
        return None
    skipped = np.zeros(rp.steps, dtype=np.int64)
    for i, region in enumerate(regions):
        parents = [j for j in range(i) if regions[j].contains(region)]
        parent_runs = taken[max(parents, key=lambda j: regions[j].start)] if parents else True
        skipped += np.where(~taken[i] & parent_runs, region.cycles, 0)
    return skipped


def body_loop(rp: GridReplay, schedule: tpu_schedule.Schedule) -> tpu_schedule.Loop:
    """The bundles of one grid step: the grid loop, or the whole kernel for a
    one-step grid (then every loop of the schedule is an inner loop)."""
    if rp.steps == 1:
        return tpu_schedule.Loop(0, schedule.total_cycles)
    return schedule.grid_loop()


def inner_loops(rp: GridReplay, schedule: tpu_schedule.Schedule):
    """The schedule's loops inside a grid step paired with the kernel's loops
    the lowering keeps rolled (both in program order, outer before inner):
    [(schedule loop, record, per-step multiplier: trips of enclosing loops)],
    and whether the two lists matched (else nothing is paired and every
    inner loop is charged one trip).

    Mosaic may add loops of its own (a few bundles each, e.g. around a
    packed 16-bit store after an in-kernel gate): where the schedule has more
    loops than the kernel, the kernel's are paired with the longest ones
    (``kernel_loops_among``), if that keeps every nested loop inside its
    parent's; the others are charged their one static trip."""
    body = body_loop(rp, schedule)
    sched = sorted((lp for lp in schedule.loops if lp != body and body.start <= lp.start and lp.end <= body.end),
                   key=lambda lp: (lp.start, -lp.end))
    rolled = [i for i, rec in enumerate(rp.loops) if not rec.unrolled]
    if len(sched) > len(rolled):
        sched = kernel_loops_among(sched, len(rolled))
    if len(sched) != len(rolled) or not _nesting_agrees(sched, rolled, rp.loops):
        return [], False
    pairs = []
    for lp, i in zip(sched, rolled):
        mult = np.ones(rp.steps, np.int64)
        parent = rp.loops[i].parent
        while parent is not None:
            mult *= np.maximum(rp.loops[parent].trips, 1)
            parent = rp.loops[parent].parent
        pairs.append((lp, rp.loops[i], mult))
    return pairs, True


def kernel_loops_among(sched: list, count: int) -> list:
    """The ``count`` longest of the schedule loops ``sched``, in program order."""
    longest = sorted(range(len(sched)), key=lambda i: -sched[i].cycles)[:count]
    return [sched[i] for i in sorted(longest)]


def _nesting_agrees(sched: list, rolled: list[int], records: list) -> bool:
    """Whether every paired kernel loop sits inside its parent's schedule loop."""
    loop_of = dict(zip(rolled, sched))
    for i, lp in loop_of.items():
        parent = records[i].parent
        while parent is not None and parent not in loop_of:  # an unrolled parent has no schedule loop
            parent = records[parent].parent
        if parent is not None and not (loop_of[parent].start <= lp.start and lp.end <= loop_of[parent].end):
            return False
    return True


def inner_loop_cycles(pairs, steps: int) -> np.ndarray:
    """Cycles a step spends in its inner loops beyond the one trip the
    static schedule holds: each loop's body (trips - 1) more times, once per
    trip of the loops around it. A loop that runs no trip is charged its one
    static trip (as if its region ran)."""
    extra = np.zeros(steps, np.int64)
    for lp, rec, mult in pairs:
        more = rec.extra if rec.extra is not None else mult * np.maximum(rec.trips.astype(np.int64) - 1, 0)
        extra += more * lp.cycles
    return extra


_MANUAL_WAIT = "dma.done.wait"


def manual_dma_events(rp: GridReplay, schedule: tpu_schedule.Schedule, pairs) -> tuple[list | None, bool]:
    """Per grid step, the kernel's own DMA starts and waits placed on the
    schedule: the k-th ``dma_wait`` of the kernel (program order) sits at the
    k-th ``dma.done.wait`` of the step's bundles that the pipeline did not
    emit (those carry ``pipeline-emitter-dma-wait``), moved by the extra
    trips of the inner loops before it and, for its n-th run in a step, by n
    trips of the innermost loop holding it. A start is placed where the event
    before it in program order is (the step's start for the first): the
    common patterns (start; wait) and (wait; start the next) issue right
    there. Returns (events per step or None, positions matched)."""
    if not rp.dmas:
        return None, True
    body = body_loop(rp, schedule)
    waits = [i for i in range(body.start, body.end) if _MANUAL_WAIT in schedule.bundles[i]
             and "pipeline-emitter" not in schedule.bundles[i]]
    static = max((e.wait_index for e in rp.dmas), default=-1) + 1
    # A one-step grid's body is the whole kernel: it opens with the waits of
    # the scalar-prefetch copies into SMEM (on a literal allocation, untagged).
    while rp.steps == 1 and len(waits) > static and "[#allocation" in schedule.bundles[waits[0]]:
        waits.pop(0)
    matched = len(waits) == static
    events = [[] for _ in range(rp.steps)]
    last = [0.0] * rp.steps
    runs = [dict() for _ in range(rp.steps)]
    for ev in rp.dmas:
        for i in np.nonzero(ev.active)[0]:
            keys = tuple(_key_at(k, int(i)) for k in ev.keys)
            if ev.kind == "start":
                events[i].append((last[i], "start", ev.nbytes, keys))
                continue
            if matched and ev.wait_index >= 0:
                pos = waits[ev.wait_index]
                offset = pos - body.start
                innermost = None
                for lp, rec, mult in pairs:
                    if lp.end <= pos:
                        offset += int(mult[i]) * max(int(rec.trips[i]) - 1, 0) * lp.cycles
                    elif lp.start <= pos < lp.end:
                        innermost = lp
                n = runs[i].get(ev.wait_index, 0)
                runs[i][ev.wait_index] = n + 1
                if innermost is not None:
                    offset += n * innermost.cycles
            else:  # unplaced: at the step's end
                offset = float("inf")
            last[i] = offset
            events[i].append((offset, "wait", ev.nbytes, keys))
    return events, matched


def megacore_split_axis(call: KernelCall, rp: GridReplay, chip: Chip) -> int | None:
    """The grid axis a megacore splits between its TensorCores, or None.

    Mosaic runs a kernel's grid on both TensorCores of a megacore device when
    the kernel marks grid axes "parallel" (the Pallas TPU pipelining guide,
    "Megacore": "Pallas will handle splitting up the grid automatically",
    available on v4 and v5p only). Taken here: the first "parallel" axis of
    more than one step (an axis a ``vmap`` of the pallas_call added is
    parallel too). A gridless kernel (``emit_pipeline`` inside, as
    tokamax's ragged dot, whose pipeline is not given a ``core_axis``) runs on
    one core."""
    if chip.cores < 2:
        return None
    semantics = grid_semantics(call)
    if len(semantics) != len(rp.grid):
        return None
    for axis, (kind, size) in enumerate(zip(semantics, rp.grid)):
        if kind == "parallel" and size > 1:
            return axis
    return None


def grid_semantics(call: KernelCall) -> tuple[str, ...]:
    """Per grid axis "parallel" or "arbitrary", as Mosaic lowers them: the
    kernel's ``dimension_semantics`` (default arbitrary) with the axes a
    ``vmap`` of the pallas_call added marked parallel."""
    gm = call.eqn.params["grid_mapping"]
    params = call.eqn.params.get("compiler_params")
    if isinstance(params, dict):
        params = params.get("mosaic_tpu") or params.get("mosaic")
    vmapped = set(getattr(gm, "vmapped_dims", ()) or ())
    user = [str(getattr(s, "value", s)).lower() for s in (getattr(params, "dimension_semantics", None) or ())]
    user = user or ["arbitrary"] * (len(gm.grid) - len(vmapped))
    it = iter(user)
    return tuple("parallel" if i in vmapped else next(it, "arbitrary") for i in range(len(gm.grid)))


def core_steps(grid, axis: int | None, cores: int) -> list[np.ndarray]:
    """The grid steps (in iteration order) each TensorCore runs: ``axis`` cut
    into ``cores`` contiguous parts, the first parts one longer when it does
    not divide; everything on one core when ``axis`` is None."""
    steps = int(np.prod(grid))
    if axis is None:
        return [np.arange(steps)]
    index = grid_indices(grid)[axis]
    per = -(-grid[axis] // cores)
    return [np.nonzero(index // per == c)[0] for c in range(cores)]


def estimate_kernel(call: KernelCall, schedule: tpu_schedule.Schedule, chip: Chip,
                    rp: GridReplay | None = None, own_grid: bool | None = None) -> KernelEstimate:
    """``rp``: the grid replay, by default from the pallas_call's own grid
    (``own_grid``: whether ``rp`` is that one; default: when ``rp`` is None).

    On a megacore (``chip.cores`` > 1) a kernel with a "parallel" grid axis
    runs each half of that axis on its own TensorCore: each core's pipeline
    is simulated on its own steps (its first step fetches its blocks afresh)
    with half the chip's HBM bandwidth, and the kernel takes as long as the
    slower core. Half, because the two cores run the same pipeline on halves
    of the grid, so they stream at the same time and the shared HBM serves
    both: exact for an HBM-bound kernel, irrelevant where the DMAs hide under
    compute; it reads high only while one core streams and the other is idle
    (an uneven split, the tail)."""
    gm = call.eqn.params["grid_mapping"]
    own_grid = rp is None if own_grid is None else own_grid
    rp = replay(call) if rp is None else rp
    loop = body_loop(rp, schedule)
    cycles, matched, fill = step_cycles(rp, schedule)
    pairs, loops_matched = inner_loops(rp, schedule)
    cycles = cycles + inner_loop_cycles(pairs, rp.steps)
    manual, dmas_matched = manual_dma_events(rp, schedule, pairs)
    if manual is not None:  # an unplaced wait: at the step's end
        manual = [[(min(o, c), *rest) for o, *rest in ev] for ev, c in zip(manual, cycles)]
    first_operand = sum(1 for d in gm.grid if not isinstance(d, int)) + gm.num_index_operands
    memories = [_operand_memory(schedule, first_operand + j) if own_grid else "hbm"
                for j in range(len(rp.block_indices))]
    parts = core_steps(rp.grid, megacore_split_axis(call, rp, chip), chip.cores)
    parts = [p for p in parts if len(p)] or [np.arange(rp.steps)]
    bandwidth = chip.hbm_bytes_per_s / len(parts)
    cores = [core_pipeline(rp, sel, cycles, memories, manual) for sel in parts]
    seconds = compute = dma = 0.0
    for c in cores:
        # XLA's copies of VMEM-placed operands run once, around the kernel, at
        # the chip's bandwidth: each core's share of them at its own.
        t = simulate(c.cycles, c.fetches, c.writeback, clock_hz=chip.clock_hz, hbm_bytes_per_s=bandwidth,
                     prologue_cycles=loop.start + fill, epilogue_cycles=schedule.total_cycles - loop.end,
                     before_bytes=c.before / len(parts), after_bytes=c.after / len(parts), manual=c.manual)
        seconds = max(seconds, t)
        compute = max(compute, float(c.cycles.sum()) / chip.clock_hz)
        dma = max(dma, c.moved_bytes / bandwidth)
    manual_bytes = sum(int(e.nbytes * e.active.sum()) for e in rp.dmas if e.kind == "start")
    return KernelEstimate(call.name, rp.steps, loop.cycles, cycles, matched, len(pairs),
                          sum(c.fetched for c in cores), sum(c.written for c in cores),
                          cores[0].before + cores[0].after, seconds, loops_matched, dmas_matched, manual_bytes,
                          cores=len(parts), compute_s=compute, dma_s=dma)


@dataclasses.dataclass
class CorePipeline:
    """What one TensorCore's pipeline does over its grid steps."""

    cycles: np.ndarray
    fetches: list  # (bytes per step, lookahead) per input block mapping
    writeback: np.ndarray
    before: int  # bytes XLA copies into VMEM before the kernel
    after: int
    manual: list | None

    @property
    def fetched(self) -> int:
        return int(sum(f.sum() for f, _ in self.fetches))

    @property
    def written(self) -> int:
        return int(self.writeback.sum())

    @property
    def moved_bytes(self) -> int:
        manual = sum(b for ev in self.manual or () for _, kind, b, _ in ev if kind == "start")
        return self.fetched + self.written + manual


def core_pipeline(rp: GridReplay, sel: np.ndarray, cycles: np.ndarray, memories: list[str],
                  manual: list | None) -> CorePipeline:
    """The fetches and write-backs of the steps ``sel`` run in order on one
    core: a block is fetched when it differs from the core's previous step's
    (the core's first step: always), written back when the next step moves
    to another block (and at the core's last step)."""
    fetches = []
    writeback = np.zeros(len(sel), np.int64)
    before = after = 0
    for j, (idx, nbytes, out) in enumerate(zip(rp.block_indices, rp.block_bytes, rp.is_output)):
        if rp.manual and rp.manual[j]:  # memory_space=ANY: only the kernel's own DMAs move it
            continue
        if memories[j] == "vmem":  # XLA copies the whole array in (or out) around the kernel
            if out:
                after += rp.whole_arrays[j]
            else:
                before += rp.whole_arrays[j]
            continue
        ch = changed(idx[sel])
        if out:
            last = np.concatenate([ch[1:], [True]]) if len(sel) else ch
            writeback += np.where(last, nbytes, 0)
        else:
            buffers = rp.buffers[j] if rp.buffers else 2
            fetches.append((np.where(ch, nbytes, 0), max(buffers - 1, 1)))
    return CorePipeline(cycles[sel], fetches, writeback, before, after,
                        [manual[i] for i in sel] if manual is not None else None)


def _libtpu_dump_dir() -> pathlib.Path:
    """libtpu reads its flags once, when it loads: the dump folder must be
    set before the first TPU compile of the process."""
    flag = f"--xla_jf_dump_to={DUMP_ROOT}"
    current = os.environ.get("LIBTPU_INIT_ARGS", "")
    if flag not in current:
        os.environ["LIBTPU_INIT_ARGS"] = (current + " " + flag).strip()
    DUMP_ROOT.mkdir(parents=True, exist_ok=True)
    return DUMP_ROOT


XLA_DUMP = "xla"


def _request_xla_dump():
    """The optimized HLO module as text, next to the bundles (XLA's own dump:
    jaxlib cannot print a module holding async collectives back from the
    compiled executable). XLA reads XLA_FLAGS once, when the process first
    uses it: set at this module's import, before jax initializes; not in a
    pytest process, whose other tests' CPU compiles would all dump (the
    tests estimate in subprocesses, which import this module afresh)."""
    if "pytest" in sys.modules:
        return
    xla_flags = f"--xla_dump_to={DUMP_ROOT / XLA_DUMP} --xla_dump_hlo_as_text"
    if xla_flags not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags).strip()


_request_xla_dump()


def _optimized_module(root: pathlib.Path, compiled) -> str | None:
    """The compile's optimized HLO module: XLA's dump of it (the largest, if
    a helper program was compiled too), else the executable's own text, else
    None (then fusions sharing a bundle file are charged once)."""
    dumps = sorted((root / XLA_DUMP).glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
    if dumps:
        return dumps[-1].read_text()
    try:
        return compiled.as_text()
    except Exception:  # noqa: BLE001  (jaxlib's printer refuses some async ops)
        return None


def chip_device(chip: Chip):
    """One abstract device of the chip (from libtpu's topology, no TPU needed);
    the same object on every call, so a mesh built on it (a kernel's
    ``shard_map``) matches the device the estimate compiles for."""
    from jax.experimental import topologies

    _libtpu_dump_dir()
    if chip.topology not in _DEVICES:
        _DEVICES[chip.topology] = topologies.get_topology_desc(platform="tpu", topology_name=chip.topology).devices[0]
    return _DEVICES[chip.topology]


_DEVICES: dict = {}


def row_major(ndim: int, sharding):
    """The default (row-major) layout of an array on the device. An AOT
    compile left free picks the program's parameter and result layouts
    itself (e.g. a column-major lhs) and then pays copies into the layouts
    its kernels need; a real call gets arrays in the default layout, so the
    estimate pins it (a copy the program still makes is then a real one)."""
    from jax.experimental.layout import Format, Layout

    return Format(Layout(major_to_minor=tuple(range(ndim))), sharding)


def aot_compile(fn, args, chip: Chip, donate_argnums: tuple[int, ...] = ()):
    """``fn`` compiled ahead of time for one device of the chip, its
    arguments and results in the default layout (``row_major``).
    ``donate_argnums``: arguments the caller gives up, as a serving loop
    donates a KV cache a kernel updates in place (``input_output_aliases``);
    without donation XLA copies the whole aliased input first."""
    import jax

    device = chip_device(chip)
    sharding = jax.sharding.SingleDeviceSharding(device)
    specs = [jax.ShapeDtypeStruct(np.shape(a), getattr(a, "dtype", None) or np.asarray(a).dtype,
                                  sharding=row_major(np.ndim(a), sharding)) for a in args]
    with jax.default_device(device):  # code that asks pltpu.get_tpu_info() sees the target chip
        outs = jax.eval_shape(fn, *specs)
        out_formats = jax.tree.map(lambda o: row_major(len(o.shape), sharding), outs)
        return jax.jit(fn, out_shardings=out_formats, donate_argnums=donate_argnums).lower(*specs).compile()


def compile_with_dump(fn, args, chip: Chip, donate_argnums: tuple[int, ...] = ()) -> pathlib.Path:
    """AOT-compile ``fn`` for one chip; returns a folder holding only this
    compile's dump files (the caller deletes it)."""
    import jax

    root = _libtpu_dump_dir()
    for p in root.iterdir():  # leftovers of an earlier compile
        p.unlink() if p.is_file() else shutil.rmtree(p)
    compiled = aot_compile(fn, args, chip, donate_argnums)
    own = pathlib.Path(tempfile.mkdtemp(prefix="tpu_dump_"))
    module = _optimized_module(root, compiled)  # names the ops of shared bundle files
    if module is not None:
        (own / tpu_schedule.HLO_MODULE).write_text(module)
    for p in root.iterdir():
        # Keep only what the estimate reads: the final schedules.
        if tpu_schedule.DUMP_NAME.match(p.name):
            shutil.move(str(p), own / p.name)
        else:
            p.unlink() if p.is_file() else shutil.rmtree(p)
    if not any(tpu_schedule.DUMP_NAME.match(p.name) for p in own.iterdir()):
        raise RuntimeError("libtpu wrote no schedule dump: it was loaded before the estimator set "
                           f"--xla_jf_dump_to (LIBTPU_INIT_ARGS); run the estimate before any other TPU "
                           "compile of the process")
    return own


def estimate(fn, args, generation: str, *, flops: float, min_bytes: float, replay_for=None,
             what_if: dict[str, Chip] | None = None, kernel_refs=None,
             donate_argnums: tuple[int, ...] = ()) -> Estimate:
    """Estimated seconds of ``fn(*args)`` on one JAX device of ``generation``
    (one TensorCore; a v5p megacore's two where a kernel's grid splits).

    ``args``: concrete numpy arrays for what decides the grid (group sizes,
    routing), ``jax.ShapeDtypeStruct`` for the rest. ``flops`` and
    ``min_bytes`` (what the op must move at least) give the two roofline
    minimums the estimate is compared with. ``replay_for(call)`` may give
    the grid replay of a kernel that runs its own pipeline (``emit_pipeline``:
    its pallas_call has no grid); None: replay the pallas_call's grid.
    ``kernel_refs(call)``: known contents of refs the kernel fills itself
    (``replay``'s ``known_refs``), e.g. routing tables it computes in SMEM.
    ``what_if``: other constants for the same chip (a clock, a bandwidth):
    the same schedules and replays re-simulated with each, seconds in
    ``Estimate.what_if`` (to test which constant a miss points at).
    ``donate_argnums``: arguments donated to the program (``aot_compile``),
    e.g. a KV cache the kernel updates in place."""
    import jax

    chip = CHIPS[generation]
    with jax.default_device(chip_device(chip)):
        calls = kernel_calls(fn, args)
    if not calls:
        raise ValueError("fn has no Pallas kernel")
    dump = compile_with_dump(fn, args, chip, donate_argnums)
    try:
        kernels, dumps, alternatives = [], {}, {name: 0.0 for name in what_if or {}}
        for call in calls:
            if call.name not in dumps:
                dumps[call.name] = tpu_schedule.kernel_dumps(dump, call.name)
            if not dumps[call.name]:
                raise ValueError(f"more calls of {call.name!r} than compiled kernels: XLA merged or removed one")
            schedule = tpu_schedule.read(dumps[call.name].pop(0))
            own_grid = replay_for is None
            rp = replay(call, kernel_refs(call) if kernel_refs else None) if own_grid else replay_for(call)
            kernels.append(estimate_kernel(call, schedule, chip, rp, own_grid=own_grid))
            for name, alt in (what_if or {}).items():
                alternatives[name] += estimate_kernel(call, schedule, alt, rp, own_grid=own_grid).seconds
        other_ops = tpu_schedule.other_ops(dump, {c.name for c in calls})
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    others = other_ops_seconds(other_ops, chip)
    seconds = sum(k.seconds for k in kernels) + others
    alternatives = {name: t + other_ops_seconds(other_ops, what_if[name]) for name, t in alternatives.items()}
    # The device's MXU peak: a megacore device has two TensorCores' worth.
    return Estimate(generation, kernels, sum(c for c, _ in other_ops.values()), seconds,
                    flops / (chip.bf16_flops_per_s * chip.cores),
                    min_bytes / chip.hbm_bytes_per_s, others, alternatives)


def other_ops_seconds(ops: dict[str, tuple[int, int]], chip: Chip) -> float:
    """The program's other XLA ops: each at least one pass of its static
    schedule and at least its HBM traffic at full bandwidth (a copy of a
    large output, e.g. when a function returns the kernel's result twice,
    loops over it: one pass of its bundles would undercount it)."""
    return sum(max(c / chip.clock_hz, b / chip.hbm_bytes_per_s) for c, b in ops.values())
