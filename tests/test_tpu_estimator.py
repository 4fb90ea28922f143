"""The TPU estimator (bench/tpu_estimator.py, bench/tpu_schedule.py): the
bundle parser on a stored dump, the loop and region finder, the DMA pipeline
simulation on hand-checked cases, the grid replay against the kernel's own
visit plan, and one real compile whose estimate must sit at or above both
roofline minimums."""

from __future__ import annotations

import gzip
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import tpu_estimator  # noqa: E402
import tpu_schedule  # noqa: E402

DATA = pathlib.Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def gmm_schedule():
    # libtpu 0.0.52's schedule of pallas_gmm.gmm for v5e: lhs [512, 2048], rhs
    # [8, 1536, 2048] ("nk"), tiles (64, 2048, 512).
    return tpu_schedule.parse(gzip.decompress((DATA / "gmm_nk_v5e_packed_bundles_post_ra.txt.gz").read_bytes()).decode())


def test_stored_dump_grid_loop_regions_dmas(gmm_schedule):
    s = gmm_schedule
    assert s.total_cycles == 1442
    loop = s.grid_loop()
    # LB at 0x20; backward branch at 0x599, 4 delay slots: 0x599 + 5 - 0x20.
    assert (loop.start, loop.end, loop.cycles) == (0x20, 0x599 + 5, 1406)
    assert s.inner_loops() == ()
    [mxu] = s.innermost_mxu_regions(loop)
    # the pl.when(is_local) body: branch at 0x79 to 0x55e
    assert (mxu.branch, mxu.start, mxu.end) == (0x79, 0x79 + 5, 0x55E)
    # (64/16) * (2048/128) * (512/128) vmatmuls + their weight pushes, 4 MXUs
    assert mxu.mxu_ops == s.mxu_ops_in(mxu.start, mxu.end) > 0
    # one rhs block in (1 x 512 x 2048 bf16), one out block back (64 x 512 bf16)
    assert sorted((d.direction, d.bytes) for d in s.dmas) == [
        ("hbm_to_vmem", 512 * 2048 * 2), ("vmem_to_hbm", 64 * 512 * 2)]
    memory = {o.index: o.memory for o in s.operands}
    assert memory[6] == "vmem" and memory[7] == "hbm" and memory[8] == "hbm"  # lhs, rhs, out


def test_parser_nested_markers_continuations_and_regions():
    text = textwrap.dedent("""\
        = control target key start
        LB: loop body
        = control target key end

             0   :  { %s1 = smov.u32 0 }
           0x1 LB: > { %s2 = sadd.s32 1, %s1 }
           0x2   : > { %3 = sbr.rel (%p1) target bundleno = 12 (0xc), region = 5 }
           0x3   : > { %4 = dma.hbm_to_vmem [thread:$0]  /*hbm=*/%s5, /*size_in_granules=*/64, /*vmem=*/%s6 /*
        base_bounds: (8, 192, 16)
        */ }
           0x4   : > {}
           0x5   : > {}
           0x6   : > {}
           0x7 LB: >> { %v1 = vmatmul.bf16.gmra.mxu0 %v2 }
           0x8   : >> { %9 = sbr.rel (%p2) target bundleno = 7 (0x7), region = 9 }
           0x9   : >> {}
           0xa   : >> {}
           0xb   : >> {}
           0xc   : > {}
           0xd   : > { %10 = sbr.rel (!%p3) target bundleno = 1 (0x1), region = 2 }
           0xe   : > {}
           0xf   : > {}
          0x10   : > {}
          0x11   : > {}
          0x12   :  {}
        """)
    s = tpu_schedule.parse(text)
    assert s.total_cycles == 19
    assert s.grid_loop() == tpu_schedule.Loop(1, 0xD + 5)
    assert s.inner_loops() == (tpu_schedule.Loop(7, 8 + 5),)
    [region] = s.regions
    assert (region.start, region.end, region.cycles, region.mxu_ops) == (7, 12, 5, 1)
    assert s.dmas == (tpu_schedule.Dma(3, "hbm_to_vmem", 64 * 32),)


def test_parser_refuses_text_that_is_not_a_bundle_dump():
    with pytest.raises(ValueError, match="no bundles"):
        tpu_schedule.parse("HloModule foo\nENTRY main { }\n")
    with pytest.raises(ValueError, match="follows bundle"):
        tpu_schedule.parse("   0   :  {}\n   0x5   :  {}\n")


def test_simulation_dma_bound_hand_checked():
    # 1 GHz, 1 GB/s: a step computes 1 us, its input block takes 2 us to land.
    # Fetch 0 in the prologue [0, 2]; step 0 [2, 3] issues fetch 1 [2, 4];
    # step 1 [4, 5] issues fetch 2 [4, 6]; step 2 [6, 7].
    t = tpu_estimator.simulate([1000] * 3, [(np.array([2000] * 3), 1)], np.zeros(3),
                               clock_hz=1e9, hbm_bytes_per_s=1e9)
    assert t == pytest.approx(7e-6)


def test_simulation_compute_bound_and_writebacks_hand_checked():
    # Step 3 us, block 1 us: fetch 0 [0, 1]; steps [1, 4], [4, 7], [7, 10].
    # The write-back queued at 10 (0.5 us) ends at 10.5.
    t = tpu_estimator.simulate([3000] * 3, [(np.array([1000] * 3), 1)], np.array([0, 0, 500]),
                               clock_hz=1e9, hbm_bytes_per_s=1e9)
    assert t == pytest.approx(10.5e-6)


def test_simulation_deeper_buffering_issues_earlier():
    # Steps of 1 us; blocks of (1, 0, 0, 3) us. Two buffers: fetch 3 is issued
    # when step 2 starts: f0 [0,1], s0 [1,2], s1 [2,3], s2 [3,4] issues f3
    # [3,6], s3 [6,7]. Three buffers: f3 is issued when step 1 starts: [2,5],
    # s2 [3,4], s3 [5,6].
    fetch = np.array([1000, 0, 0, 3000])
    run = lambda lookahead: tpu_estimator.simulate([1000] * 4, [(fetch, lookahead)], np.zeros(4),
                                                   clock_hz=1e9, hbm_bytes_per_s=1e9)
    assert run(1) == pytest.approx(7e-6)
    assert run(2) == pytest.approx(6e-6)


def test_changed_blocks():
    idx = np.array([[0, 1], [0, 1], [1, 1], [1, 1], [0, 1]])
    assert tpu_estimator.changed(idx).tolist() == [True, False, True, False, True]


def test_replay_of_gmm_matches_its_visit_plan():
    import jax
    import jax.numpy as jnp

    from ragged_dot_tpu.gmm import pallas_gmm, tiling

    m, k, n, g = 96, 256, 384, 5
    sizes = np.array([10, 0, 37, 0, 30], np.int32)  # 19 rows past the sum
    t = tiling.Tiling(32, 128, 128)
    fn = lambda lhs, rhs, gs: pallas_gmm.gmm(lhs, rhs, gs, tiling=t)
    [call] = tpu_estimator.kernel_calls(fn, [jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                                              jax.ShapeDtypeStruct((g, n, k), jnp.bfloat16), sizes])
    rp = tpu_estimator.replay(call)
    seg, tile, num_visits, *_ = pallas_gmm.forward_visits(jnp.asarray(sizes), 0, g, m=m, tm=t.tm)
    num_visits = int(num_visits)
    assert rp.grid == (n // t.tn, num_visits, k // t.tk)
    lhs_idx, rhs_idx, out_idx = rp.block_indices
    steps = np.indices(rp.grid).reshape(3, -1)
    assert np.array_equal(lhs_idx[:, 0], np.asarray(tile)[steps[1]])
    assert np.array_equal(lhs_idx[:, 1], steps[2])
    # rhs: the expert of each visit; the experts with rows are 0, 2, 4
    assert set(np.unique(rhs_idx[:, 0])) <= {0, 2, 4}
    # the matmul runs exactly on the visits of local segments
    [taken] = rp.mxu_taken
    is_local = (np.asarray(seg) > 0) & (np.asarray(seg) < g + 1)
    assert np.array_equal(taken, is_local[steps[1]])
    assert rp.block_bytes == [t.tm * t.tk * 2, t.tn * t.tk * 2, t.tm * t.tn * 2]


def test_replay_under_vmap_reads_program_id_on_the_users_axes():
    """A jax.vmap of a pallas_call adds a grid axis in front; the body's
    program_id(0) still means the user's first axis (Mosaic skips the
    vmapped ones), so the matmul runs where that axis is 1, per batch."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.zeros_like(o_ref)

        @pl.when(pl.program_id(0) == 1)
        def _():
            o_ref[...] = jnp.dot(x_ref[...], x_ref[...], preferred_element_type=jnp.float32)

    def one(x):  # grid of 4 row blocks
        return pl.pallas_call(kernel, grid=(4,), in_specs=[pl.BlockSpec((128, 128), lambda i: (i, 0))],
                              out_specs=pl.BlockSpec((128, 128), lambda i: (i, 0)),
                              out_shape=jax.ShapeDtypeStruct((512, 128), jnp.float32))(x)

    [call] = tpu_estimator.kernel_calls(jax.vmap(one), [jax.ShapeDtypeStruct((3, 512, 128), jnp.float32)])
    rp = tpu_estimator.replay(call)
    assert rp.grid == (3, 4)
    [taken] = rp.mxu_taken
    batch, block = np.indices(rp.grid).reshape(2, -1)
    assert np.array_equal(taken, block == 1)  # 3 steps; reading the batch axis would give 4
    assert np.array_equal(rp.block_indices[0][:, 0], batch)  # the index maps still see every axis


_COMPILE_ONE = """
import json, sys
sys.path.insert(0, {bench!r}); sys.path.insert(0, {dev!r})
import tpu_estimator
import numpy as np, jax, jax.numpy as jnp
from ragged_dot_tpu.gmm import pallas_gmm
m, k, n, g = 256, 1024, 768, 4
sizes = np.array([100, 0, 120, 36], np.int32)
fn = lambda lhs, rhs, gs: pallas_gmm.gmm(lhs, rhs, gs, generation="v5e")
est = tpu_estimator.estimate(fn, [jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                                  jax.ShapeDtypeStruct((g, n, k), jnp.bfloat16), sizes], "v5e",
                             flops=2 * m * k * n, min_bytes=2 * (m * k + 3 * n * k + m * n))
[kern] = est.kernels
print(json.dumps(dict(seconds=est.seconds, mxu=est.mxu_bound_s, hbm=est.hbm_bound_s, matched=kern.regions_matched,
                      fetched=kern.fetched_bytes + kern.manual_dma_bytes, steps=kern.steps)))
"""


def test_one_real_compile_estimate_at_or_above_both_rooflines():
    import json

    # Own process: libtpu must load with the dump flag, which the test
    # process (other AOT tests) may have loaded without.
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env.pop("LIBTPU_INIT_ARGS", None)
    code = _COMPILE_ONE.format(bench=str(ROOT / "bench"), dev=str(ROOT / ".dev"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["matched"]
    assert r["seconds"] >= r["mxu"] and r["seconds"] >= r["hbm"]
    # it reads at least the weights of the three experts with rows (the kernel's own DMAs: WeightPrefetch)
    assert r["fetched"] >= 3 * 768 * 1024 * 2
    assert r["seconds"] < 20 * max(r["mxu"], r["hbm"])  # and is not absurd


def test_no_hub_kernel_imports_a_benchmark_peer():
    import re

    # Import statements only: a docstring may cite the estimator a rule came from.
    peer_import = re.compile(r"^\s*(?:from|import)\s+(?:tokamax|tpu_estimator|tpu_schedule|jax\.experimental\.pallas\.ops\.tpu\.megablox)\b"
                             r"|^\s*from\s+jax\.experimental\.pallas\.ops\.tpu\s+import\s+megablox", re.M)
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "kernels").rglob("*.py") if peer_import.search(p.read_text())]
    assert offenders == []
    assert peer_import.search("x = 1\nfrom tokamax._src import ops\n")  # the pattern does catch an import


def test_simulation_manual_dma_start_then_wait_hand_checked():
    # 1 GHz, 1 GB/s, one step of 3 us. A 2 us copy starts at 0 and is waited
    # for at 1 us: the core stalls 1 us, the step ends at 4 us. A wait on a
    # semaphore nothing started (another chip signals it) does not stall.
    manual = [[(0, "start", 2000, ("s",)), (1000, "wait", 2000, ("s",)), (2000, "wait", 0, ("remote",))]]
    t = tpu_estimator.simulate([3000], [], np.zeros(1), clock_hz=1e9, hbm_bytes_per_s=1e9, manual=manual)
    assert t == pytest.approx(4e-6)
    # A prefetch started in step 0 and waited for in step 1 overlaps step 0.
    manual = [[(0, "start", 2000, ("s",))], [(0, "wait", 2000, ("s",))]]
    t = tpu_estimator.simulate([1000, 1000], [], np.zeros(2), clock_hz=1e9, hbm_bytes_per_s=1e9, manual=manual)
    assert t == pytest.approx(3e-6)  # step 1 waits until 2 us, then computes 1 us


_INNER_AND_MANUAL = """
import json, sys
sys.path.insert(0, {bench!r})
import tpu_estimator
import jax, jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
R, C = 64, 512

def looped(trips):
    def kernel(x_ref, o_ref):
        o_ref[...] = jax.lax.fori_loop(0, trips, lambda i, acc: jnp.tanh(acc) + x_ref[...], x_ref[...])
    return lambda x: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((R, C), jnp.float32), name="looped")(x)

def copies(n):
    def kernel(x_hbm, o_ref, buf, sem):
        def body(i, acc):
            cp = pltpu.make_async_copy(x_hbm.at[i], buf, sem)
            cp.start()
            cp.wait()
            return acc + buf[...]
        o_ref[...] = jax.lax.fori_loop(0, n, body, jnp.zeros((R, C), jnp.float32))
    return lambda x: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((R, C), jnp.float32), name="copies",
                                    in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                                    scratch_shapes=[pltpu.VMEM((R, C), jnp.float32), pltpu.SemaphoreType.DMA(())])(x)

def prefetched_copies(n):
    # The same copies in a one-step grid with a scalar-prefetched table: its
    # copy into SMEM opens the kernel with a wait that is not the kernel's own.
    def kernel(table_ref, x_hbm, o_ref, buf, sem):
        def body(i, acc):
            cp = pltpu.make_async_copy(x_hbm.at[table_ref[i]], buf, sem)
            cp.start()
            cp.wait()
            return acc + buf[...]
        o_ref[...] = jax.lax.fori_loop(0, n, body, jnp.zeros((R, C), jnp.float32))
    spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(1,), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                                        out_specs=pl.BlockSpec((R, C), lambda i, t: (0, 0)),
                                        scratch_shapes=[pltpu.VMEM((R, C), jnp.float32), pltpu.SemaphoreType.DMA(())])
    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((R, C), jnp.float32), grid_spec=spec,
                          name="prefetched_copies")
    return lambda table, x: call(table, x)

out = {{}}
for trips in (2, 3, 8):
    est = tpu_estimator.estimate(looped(trips), [jax.ShapeDtypeStruct((R, C), jnp.float32)], "v5e", flops=0, min_bytes=0)
    [k] = est.kernels
    out[f"loop{{trips}}"] = dict(cycles=int(k.step_cycles[0]), inner=k.inner_loops, matched=k.inner_loops_matched)
n = 8
est = tpu_estimator.estimate(copies(n), [jax.ShapeDtypeStruct((n, R, C), jnp.float32)], "v5e", flops=0, min_bytes=0)
[k] = est.kernels
out["copies"] = dict(seconds=k.seconds, cycles=int(k.step_cycles[0]), bytes=k.manual_dma_bytes, written=k.written_bytes,
                     fetched=k.fetched_bytes, matched=k.manual_dmas_matched, inner=k.inner_loops)
est = tpu_estimator.estimate(prefetched_copies(n), [np.arange(n, dtype=np.int32)[::-1].copy(),
                             jax.ShapeDtypeStruct((n, R, C), jnp.float32)], "v5e", flops=0, min_bytes=0)
[k] = est.kernels
out["prefetched"] = dict(bytes=k.manual_dma_bytes, matched=k.manual_dmas_matched)
print(json.dumps(out))
"""


def _estimate_in_subprocess(template: str) -> dict:
    """Run an estimator script in a fresh process (libtpu reads its dump flag once per process); its last
    stdout line is JSON."""
    import json

    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env.pop("LIBTPU_INIT_ARGS", None)
    code = template.format(bench=str(ROOT / "bench"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def inner_and_manual():
    return _estimate_in_subprocess(_INNER_AND_MANUAL)


def test_inner_loop_charged_by_its_trip_count(inner_and_manual):
    r = inner_and_manual
    assert all(r[f"loop{t}"]["inner"] == 1 and r[f"loop{t}"]["matched"] for t in (2, 3, 8))
    # the schedule holds one trip of the loop body; each further trip adds it again
    body = r["loop3"]["cycles"] - r["loop2"]["cycles"]
    assert body > 0
    assert r["loop8"]["cycles"] - r["loop2"]["cycles"] == 6 * body


def test_kernel_loops_paired_with_the_longest_schedule_loops():
    """Mosaic's own short loops (a packed store's, after an in-kernel gate)
    beside a kernel's fori_loop: the kernel's loop pairs with the longest
    schedule loop, so its trips are charged; when the longest loops would put
    a nested kernel loop outside its parent's, nothing is paired."""
    from types import SimpleNamespace

    L, Rec = tpu_schedule.Loop, tpu_estimator.LoopRecord
    grid = L(0, 2000)
    schedule = SimpleNamespace(loops=[grid, L(100, 900), L(950, 983), L(990, 1000)], grid_loop=lambda: grid)
    rp = SimpleNamespace(steps=3, loops=[Rec(np.array([24, 24, 0]), False, None)])
    pairs, matched = tpu_estimator.inner_loops(rp, schedule)
    assert matched and [lp for lp, _, _ in pairs] == [L(100, 900)]
    assert list(tpu_estimator.inner_loop_cycles(pairs, 3)) == [23 * 800, 23 * 800, 0]
    nested = SimpleNamespace(steps=3, loops=[Rec(np.array([2] * 3), False, None), Rec(np.array([4] * 3), False, 0)])
    assert tpu_estimator.inner_loops(nested, schedule) == ([], False)
    schedule.loops.append(L(200, 400))  # now the inner loop's schedule loop sits in the outer's
    pairs, matched = tpu_estimator.inner_loops(nested, schedule)
    assert matched and [lp for lp, _, _ in pairs] == [L(100, 900), L(200, 400)]


def test_manual_dmas_bytes_and_waits_on_the_schedule(inner_and_manual):
    c = inner_and_manual["copies"]
    v5e = tpu_estimator.CHIPS["v5e"]
    chunk = 64 * 512 * 4
    assert c["matched"] and c["inner"] == 1
    assert c["bytes"] == 8 * chunk  # every trip's copy counted
    assert c["fetched"] == 0  # the memory_space=ANY operand is not fetched by the pipeline
    # Each trip waits for its own copy before adding it: the copies cannot
    # overlap each other, so the kernel takes at least all of them plus the
    # output's write-back, and at most that plus all of its compute.
    dma = (c["bytes"] + c["written"]) / v5e.hbm_bytes_per_s
    assert dma <= c["seconds"] <= dma + c["cycles"] / v5e.clock_hz + 1e-9


def test_manual_dma_waits_matched_past_a_one_step_grids_scalar_prefetch(inner_and_manual):
    p = inner_and_manual["prefetched"]
    assert p["bytes"] == 8 * 64 * 512 * 4
    assert p["matched"]  # the SMEM table's wait is not taken for one of the kernel's own


_NESTED_WHEN = """
import json, sys
sys.path.insert(0, {bench!r})
import tpu_estimator
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl

def kernel(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...]

    @pl.when(pl.program_id(0) >= 2)
    def _outer():  # vector work of its own, then a matmul under a nested pl.when
        y = x_ref[...]
        for _ in range(6):
            y = jnp.tanh(y) * 1.5
        o_ref[...] = y

        @pl.when(pl.program_id(0) == 3)
        def _inner():
            o_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

call = pl.pallas_call(kernel, grid=(4,), in_specs=[pl.BlockSpec((256, 256), lambda i: (i, 0)),
                                                   pl.BlockSpec((256, 256), lambda i: (0, 0))],
                      out_specs=pl.BlockSpec((256, 256), lambda i: (i, 0)),
                      out_shape=jax.ShapeDtypeStruct((1024, 256), jnp.float32), name="nested_when")
est = tpu_estimator.estimate(call, [jax.ShapeDtypeStruct((1024, 256), jnp.float32),
                                    jax.ShapeDtypeStruct((256, 256), jnp.float32)], "v6e", flops=0, min_bytes=0)
[k] = est.kernels
print(json.dumps(dict(cycles=[int(c) for c in k.step_cycles], matched=k.regions_matched)))
"""


def test_a_pl_when_enclosing_matmul_regions_is_skipped_whole():
    """Steps 0-1 skip the outer pl.when (its own vector work and the matmul
    nested in it), step 2 runs the outer work only, step 3 both: each step is
    charged what it runs (charging only the innermost matmul regions made steps
    0-2 cost the same)."""
    r = _estimate_in_subprocess(_NESTED_WHEN)
    c = r["cycles"]
    assert r["matched"]
    assert c[0] == c[1] < c[2] < c[3], c


def test_megacore_core_steps_split_the_axis_in_contiguous_halves():
    # grid (3, 2), split on axis 0: core 0 takes rows 0-1 (steps 0-3), core 1 row 2.
    core0, core1 = tpu_estimator.core_steps((3, 2), 0, 2)
    assert core0.tolist() == [0, 1, 2, 3] and core1.tolist() == [4, 5]
    # split on the inner axis: each core takes one column of every row
    core0, core1 = tpu_estimator.core_steps((3, 2), 1, 2)
    assert core0.tolist() == [0, 2, 4] and core1.tolist() == [1, 3, 5]
    [every] = tpu_estimator.core_steps((3, 2), None, 2)
    assert every.tolist() == list(range(6))


def test_megacore_chips_are_v5p_only():
    assert {name for name, chip in tpu_estimator.CHIPS.items() if chip.cores > 1} == {"v5p"}


_MEGACORE = """
import dataclasses, json, sys
sys.path.insert(0, {bench!r})
import tpu_estimator
import jax, jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
STEPS = 8

def kernel_fn(rows, semantics, trips):
    def kernel(x_ref, o_ref):
        o_ref[...] = jax.lax.fori_loop(0, trips, lambda i, acc: jnp.tanh(acc), x_ref[...]) if trips else x_ref[...] + 1
    spec = pl.BlockSpec((rows, 512), lambda i: (i, 0))
    return lambda x: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((STEPS * rows, 512), jnp.float32),
                                    grid=(STEPS,), in_specs=[spec], out_specs=spec, name="k",
                                    compiler_params=pltpu.CompilerParams(dimension_semantics=(semantics,)))(x)

out = {{}}
for name, rows, trips in (("compute", 64, 64), ("copy", 1024, 0)):
    for chip, semantics in (("v5p", "parallel"), ("v5p", "arbitrary"), ("v5e", "parallel")):
        base = tpu_estimator.CHIPS[chip]
        what_if = {{"half bandwidth": dataclasses.replace(base, hbm_bytes_per_s=base.hbm_bytes_per_s / 2)}}
        est = tpu_estimator.estimate(kernel_fn(rows, semantics, trips),
                                     [jax.ShapeDtypeStruct((STEPS * rows, 512), jnp.float32)], chip, flops=0, min_bytes=0,
                                     what_if=what_if)
        [k] = est.kernels
        out[f"{{name}} {{chip}} {{semantics}}"] = dict(
            seconds=k.seconds, cores=k.cores, compute=k.compute_s, dma=k.dma_s, steps=k.steps,
            cycles=[int(c) for c in k.step_cycles], fetched=k.fetched_bytes, written=k.written_bytes,
            total=est.seconds, half_bandwidth=est.what_if["half bandwidth"])
out["device cores"] = tpu_estimator.chip_device(tpu_estimator.CHIPS["v5p"]).num_cores
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def megacore():
    return _estimate_in_subprocess(_MEGACORE)


def test_megacore_splits_a_parallel_grid_between_two_cores(megacore):
    r = megacore
    v5p = tpu_estimator.CHIPS["v5p"]
    assert r["device cores"] == 2  # libtpu's v5p device is a megacore too
    par, arb, v5e = r["compute v5p parallel"], r["compute v5p arbitrary"], r["compute v5e parallel"]
    assert (par["cores"], arb["cores"], v5e["cores"]) == (2, 1, 1)
    # Compute-bound (64 tanh passes per 128 KiB block): each core runs 4 of
    # the 8 steps, so the busiest core computes half of the steps...
    assert par["compute"] == pytest.approx(sum(par["cycles"][:4]) / v5p.clock_hz)
    assert arb["compute"] == pytest.approx(sum(arb["cycles"]) / v5p.clock_hz)
    # ... and the kernel takes about half as long as on one core.
    assert 0.45 <= par["seconds"] / arb["seconds"] <= 0.6


def test_megacore_shares_the_hbm_so_a_copy_is_not_faster(megacore):
    r = megacore
    v5p = tpu_estimator.CHIPS["v5p"]
    par, arb = r["copy v5p parallel"], r["copy v5p arbitrary"]
    assert par["cores"] == 2
    moved = 2 * 8 * 1024 * 512 * 4  # every 2 MiB block read once and written once
    assert par["fetched"] + par["written"] == arb["fetched"] + arb["written"] == moved
    # Each core moves half the bytes at half the bandwidth: the same DMA time,
    # and the HBM-bound kernel takes about as long split as on one core.
    assert par["dma"] == pytest.approx(arb["dma"]) == pytest.approx(moved / v5p.hbm_bytes_per_s)
    assert par["seconds"] >= moved / v5p.hbm_bytes_per_s
    assert 0.9 <= par["seconds"] / arb["seconds"] <= 1.1


def test_what_if_resimulates_the_same_schedule(megacore):
    # The HBM-bound copy takes about twice as long at half the bandwidth; the
    # compute-bound kernel hardly changes.
    copy, compute = megacore["copy v5p arbitrary"], megacore["compute v5p arbitrary"]
    assert 1.8 <= copy["half_bandwidth"] / copy["total"] <= 2.05
    assert 1.0 <= compute["half_bandwidth"] / compute["total"] <= 1.1


def test_programs_are_compiled_with_arguments_and_results_in_the_default_layout():
    # Left free, an AOT compile lays this lhs out column-major and would charge
    # the program a copy no real call (arrays in the default layout) makes.
    import jax
    import jax.numpy as jnp

    compiled = tpu_estimator.aot_compile(
        lambda x, w: (x @ w).astype(jnp.float32),
        [jax.ShapeDtypeStruct((4096, 2880), jnp.bfloat16), jax.ShapeDtypeStruct((2880, 5760), jnp.bfloat16)],
        tpu_estimator.CHIPS["v6e"])
    head = compiled.as_text().split("entry_computation_layout=", 1)[1][:400]
    for array in ("bf16[4096,2880]", "bf16[2880,5760]", "f32[4096,5760]"):  # row-major: minor-to-major {1,0}
        assert array + "{1,0:" in head, head


def test_simulation_wait_covers_several_starts_on_one_semaphore():
    # 1 GHz, 1 GB/s. Three copies of 1000 bytes start at 0 on one semaphore
    # (queued: they land at 1, 2 and 3 us); one wait for 3000 bytes at 0.5 us
    # stalls until the last has landed, then the step computes 1 us: 4 us.
    manual = [[(0, "start", 1000, ("s",)), (0, "start", 1000, ("s",)), (0, "start", 1000, ("s",)),
               (500, "wait", 3000, ("s",))]]
    t = tpu_estimator.simulate([1500], [], np.zeros(1), clock_hz=1e9, hbm_bytes_per_s=1e9, manual=manual)
    assert t == pytest.approx(4e-6)
    # A wait for one copy's bytes waits for the first only.
    manual[0][-1] = (500, "wait", 1000, ("s",))
    t = tpu_estimator.simulate([1500], [], np.zeros(1), clock_hz=1e9, hbm_bytes_per_s=1e9, manual=manual)
    assert t == pytest.approx(3e-6)  # the queue still drains the other two copies


def test_replay_of_a_kernel_that_routes_itself_with_known_smem():
    # A kernel on a one-device mesh copies, for each of 4 experts, as many
    # rows as its SMEM table says (a table such a kernel computes itself, so
    # the replay is given it), starting at its device's row: the replay reads
    # the dynamic sizes, drops the empty copies and sees the one-device
    # shard_map as a plain call.
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import Mesh, PartitionSpec as P

    rows, cols = 16, 128

    def kernel(x_hbm, o_ref, sizes, buf, sem):
        me = jax.lax.axis_index("x")
        for e in range(4):
            n = sizes[e]
            cp = pltpu.make_async_copy(x_hbm.at[pl.ds(me, n)], buf.at[pl.ds(0, n)], sem)
            cp.start()
            cp.wait()
        o_ref[...] = buf[...]

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((rows, cols), jnp.float32),
                          in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                          scratch_shapes=[pltpu.SMEM((4,), jnp.int32), pltpu.VMEM((rows, cols), jnp.float32),
                                          pltpu.SemaphoreType.DMA(())], name="routed")
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("x",))
    fn = jax.shard_map(call, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    [kc] = tpu_estimator.kernel_calls(fn, [jax.ShapeDtypeStruct((rows, cols), jnp.float32)])
    rp = tpu_estimator.replay(kc, known_refs={2: np.array([3, 0, 5, 1], np.int32)})
    starts = [ev.nbytes for ev in rp.dmas if ev.kind == "start"]
    assert starts == [3 * cols * 4, 5 * cols * 4, cols * 4]  # the empty copy is dropped
    assert [ev.nbytes for ev in rp.dmas if ev.kind == "wait"] == [3 * cols * 4, 0, 5 * cols * 4, cols * 4]
    assert rp.manual[0]  # the ANY operand moves by the kernel's own copies only


def test_replay_reads_a_dynamic_copy_length_per_step():
    # Each step copies x[b, :, :n] for a scalar-prefetched n through
    # pl.multiple_of (the attention decode kernel's last chunk): the replay
    # reads n per step. A length it cannot read (an SMEM scratch) stands for
    # the sliced dimension's whole extent, not the one the integer index b
    # dropped.
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    batch, heads, rows, cols = 2, 4, 64, 128

    def kernel(lens, x_hbm, o_ref, unknown, buf, sem):
        b = pl.program_id(0)
        for n in (pl.multiple_of(lens[b], 8), unknown[0]):
            copy = pltpu.make_async_copy(x_hbm.at[b, :, pl.ds(0, n)], buf.at[:, pl.ds(0, n)], sem)
            copy.start()
            copy.wait()
        o_ref[...] = buf[0]

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((batch, rows, cols), jnp.float32),
                          grid_spec=pltpu.PrefetchScalarGridSpec(
                              num_scalar_prefetch=1, grid=(batch,),
                              in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                              out_specs=pl.BlockSpec((None, rows, cols), lambda b, lens: (b, 0, 0)),
                              scratch_shapes=[pltpu.SMEM((1,), jnp.int32),
                                              pltpu.VMEM((heads, rows, cols), jnp.float32),
                                              pltpu.SemaphoreType.DMA(())]),
                          name="dynamic_lengths")
    [kc] = tpu_estimator.kernel_calls(call, [np.array([24, 40], np.int32),
                                             jax.ShapeDtypeStruct((batch, heads, rows, cols), jnp.float32)])
    rp = tpu_estimator.replay(kc)
    starts = [(list(ev.active), ev.nbytes) for ev in rp.dmas if ev.kind == "start"]
    row_bytes = heads * cols * 4
    # A start runs on both steps and is charged its largest length (step 1's 40 rows).
    assert starts == [([True, True], 40 * row_bytes), ([True, True], rows * row_bytes)]


def test_replay_sums_a_nested_loop_over_its_parents_trips():
    # An outer loop that copies (so its trips are interpreted one by one)
    # runs an inner loop of table[i] trips: 1, 4, 2. Beyond the one trip per
    # run the schedule holds: 0 + 3 + 1 = 4 (the first run's count times
    # three would say 0).
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def kernel(table, x_hbm, o_ref, buf, sem):
        def outer(i, acc):
            cp = pltpu.make_async_copy(x_hbm, buf, sem)
            cp.start()
            cp.wait()
            return jax.lax.fori_loop(0, table[i], lambda j, a: jnp.tanh(a) + buf[...], acc)
        o_ref[...] = jax.lax.fori_loop(0, 3, outer, jnp.zeros((8, 128), jnp.float32))

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                          grid_spec=pltpu.PrefetchScalarGridSpec(
                              num_scalar_prefetch=1, in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                              scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())]),
                          name="nested")
    [kc] = tpu_estimator.kernel_calls(call, [np.array([1, 4, 2], np.int32),
                                             jax.ShapeDtypeStruct((8, 128), jnp.float32)])
    rp = tpu_estimator.replay(kc)
    outer, inner = rp.loops
    assert outer.trips.tolist() == [3] and inner.parent == 0
    assert inner.extra.tolist() == [4]
    assert tpu_estimator.inner_loop_cycles([(tpu_schedule.Loop(0, 10), inner, np.ones(1, np.int64))], 1).tolist() == [40]


def test_a_donated_argument_is_aliased_to_the_result_it_updates():
    # A KV cache a kernel updates in place is donated by a serving loop;
    # compiled without donation, XLA would copy the whole cache first.
    import jax
    import jax.numpy as jnp

    def update(cache, row):
        return cache.at[0].set(row)

    args = [jax.ShapeDtypeStruct((1024, 128), jnp.bfloat16), jax.ShapeDtypeStruct((128,), jnp.bfloat16)]
    donated = tpu_estimator.aot_compile(update, args, tpu_estimator.CHIPS["v6e"], donate_argnums=(0,)).as_text()
    kept = tpu_estimator.aot_compile(update, args, tpu_estimator.CHIPS["v6e"]).as_text()
    assert "input_output_alias" in donated
    assert "input_output_alias" not in kept


# An optimized module's ENTRY as libtpu prints it (shapes abridged): a combine
# of two per-pick gathers from one [64, 256] array, the second identical to
# the first but for its result's memory space (S(1): VMEM), then their sum.
COMBINE_MODULE = textwrap.dedent("""\
    HloModule jit_fn

    %fused_computation.1 (param_0: bf16[64,256], param_1: s32[32]) -> bf16[32,256] {
      ROOT %gather.1 = bf16[32,256]{1,0} gather(%param_0, %param_1)
    }

    ENTRY %main.9 (out.1: bf16[64,256], idx.1: s32[32], idx.2: s32[32]) -> bf16[32,256] {
      %out.1 = bf16[64,256]{1,0:T(8,128)(2,1)} parameter(0)
      %idx.1 = s32[32]{0:T(128)S(1)} parameter(1)
      %idx.2 = s32[32]{0:T(128)S(1)} parameter(2)
      %gather_fusion.1 = bf16[32,256]{1,0:T(8,128)(2,1)} fusion(%out.1, %idx.1), kind=kCustom, calls=%fused_computation.1
      %gather_fusion.2 = bf16[32,256]{1,0:T(8,128)(2,1)S(1)} fusion(%out.1, %idx.2), kind=kCustom, calls=%fused_computation.2
      %pair = (bf16[32,256]{1,0:T(8,128)(2,1)}, s32[32]{0:T(128)}) tuple(%gather_fusion.1, %idx.1)
      ROOT %add_fusion = bf16[32,256]{1,0:T(8,128)(2,1)} fusion(%gather_fusion.1, %gather_fusion.2), kind=kLoop, calls=%fused_computation.3
    }
    """)


def test_fusions_sharing_a_bundle_file_are_each_charged():
    """libtpu dumps one bundle file per distinct program: the second gather
    (no file) takes its twin's cycles and its own bytes; a gather is charged
    the rows it reads (its output's bytes), not its whole source array."""
    instructions = tpu_schedule.entry_instructions(COMBINE_MODULE)
    assert instructions["gather_fusion.2"].operands == ("out.1", "idx.2")
    assert instructions["pair"].opcode == "tuple"
    rows = 32 * 256 * 2
    # As other_ops reads the dumped twin: its HBM source (capped at the rows
    # it writes), its HBM result; the indices are in VMEM.
    first = tpu_schedule.hbm_bytes("gather_fusion.1", [("input", True, 64 * 256 * 2), ("input", False, 128),
                                                       ("output", True, rows)])
    assert first == 2 * rows
    dumped = {"gather_fusion.1": (700, first), "add_fusion": (50, 3 * rows)}
    ops = tpu_schedule.with_twins(dumped, instructions)
    assert ops["gather_fusion.2"] == (700, rows)  # reads its rows from HBM, writes them to VMEM
    assert set(ops) == {"gather_fusion.1", "gather_fusion.2", "add_fusion"}
    # A fusion of another signature is not a twin.
    other = COMBINE_MODULE.replace("%gather_fusion.2 = bf16[32,256]", "%gather_fusion.2 = bf16[16,256]")
    assert "gather_fusion.2" not in tpu_schedule.with_twins(dumped, tpu_schedule.entry_instructions(other))
