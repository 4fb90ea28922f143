"""The torch op on CPU: numerics, torch.compile, autograd, argument errors,
and the torch_tpu (jax_op) registration on a host without a TPU."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import reference
import ragged_dot_tpu
from ragged_dot_tpu.common import torch_ops
from ragged_dot_tpu.gmm import ops

SEED = int(os.environ.get("TEST_SEED", np.random.SeedSequence().entropy % (2**31)))
IMPLS = ["native", "interpret"]
from conftest import DEV_TREE


def _case(layout, dtype=torch.float32, m=29, k=24, n=20, sizes=(6, 0, 11, 3, 0), seed=0):
    gen = torch.Generator().manual_seed(SEED + seed)
    lhs = torch.randn(m, k, generator=gen).to(dtype)
    shape = (len(sizes), n, k) if layout == "nk" else (len(sizes), k, n)
    rhs = torch.randn(shape, generator=gen).to(dtype)
    return lhs, rhs, torch.tensor(sizes, dtype=torch.int32)


def _np(t):
    return t.detach().to(torch.float64).numpy()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(impl, layout, dtype):
    lhs, rhs, sizes = _case(layout, dtype)
    out = ragged_dot_tpu.ragged_dot(lhs, rhs, sizes, rhs_layout=layout, impl=impl)
    assert out.dtype == dtype and out.shape == (29, 20)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    want = reference.ragged_dot(_np(lhs), _np(rhs), sizes.numpy(), layout)
    np.testing.assert_allclose(_np(out), want, rtol=tol, atol=tol * np.sqrt(24), err_msg=f"seed={SEED}")
    assert (out[20:] == 0).all()  # rows past sum(group_sizes)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_out_dtype_and_group_window(impl, out_dtype):
    lhs, rhs, sizes = _case("nk", torch.bfloat16)
    window = rhs[1:4]
    out = ragged_dot_tpu.ragged_dot(lhs, window, sizes, group_offset=1, out_dtype=out_dtype, impl=impl)
    assert out.dtype == out_dtype
    want = reference.ragged_dot(_np(lhs), _np(window), sizes.numpy(), "nk", group_offset=1)
    np.testing.assert_allclose(_np(out), want, rtol=1e-2, atol=5e-2)
    assert (out[:6] == 0).all()


def test_int64_group_sizes_and_empty_lhs():
    lhs, rhs, sizes = _case("kn")
    out = ragged_dot_tpu.ragged_dot(lhs, rhs, sizes.long(), rhs_layout="kn")
    np.testing.assert_allclose(_np(out), reference.ragged_dot(_np(lhs), _np(rhs), sizes.numpy(), "kn"),
                               rtol=1e-5, atol=1e-4)
    empty = ragged_dot_tpu.ragged_dot(lhs[:0], rhs, torch.zeros(5, dtype=torch.int32), rhs_layout="kn")
    assert empty.shape == (0, 20)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_autograd_matches_float64_loop(impl, layout):
    """Gradients of lhs and rhs against autograd through a float64 per-group loop."""
    lhs, rhs, sizes = _case(layout, seed=1)
    lhs.requires_grad_(True)
    rhs.requires_grad_(True)
    dout = torch.randn(29, 20, generator=torch.Generator().manual_seed(SEED + 2))
    ragged_dot_tpu.ragged_dot(lhs, rhs, sizes, rhs_layout=layout, impl=impl).backward(dout)

    lhs64 = lhs.detach().double().requires_grad_(True)
    rhs64 = rhs.detach().double().requires_grad_(True)
    rows, start = [], 0
    for g, size in enumerate(sizes.tolist()):
        w = rhs64[g].t() if layout == "nk" else rhs64[g]
        rows.append(lhs64[start:start + size] @ w)
        start += size
    rows.append(lhs64.new_zeros(29 - start, 20))
    torch.cat(rows).backward(dout.double())
    np.testing.assert_allclose(_np(lhs.grad), _np(lhs64.grad), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(_np(rhs.grad), _np(rhs64.grad), rtol=1e-5, atol=1e-4)
    assert (rhs.grad[1] == 0).all() and (rhs.grad[4] == 0).all()  # empty groups


def test_gradcheck_native():
    """Finite differences on a tiny f32 case (the op supports f32/bf16, not f64)."""
    lhs, rhs, sizes = _case("nk", m=7, k=5, n=4, sizes=(3, 0, 2))
    lhs.requires_grad_(True)
    rhs.requires_grad_(True)
    fn = lambda a, b: ragged_dot_tpu.ragged_dot(a, b, sizes)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (lhs, rhs), eps=1e-2, atol=1e-2, rtol=1e-2)


def test_torch_compile_fullgraph_forward_and_backward():
    lhs, rhs, sizes = _case("nk")
    lhs.requires_grad_(True)
    compiled = torch.compile(lambda a, b, s: ragged_dot_tpu.ragged_dot(a, b, s), fullgraph=True)
    out = compiled(lhs, rhs, sizes)
    eager = ragged_dot_tpu.ragged_dot(lhs, rhs, sizes)
    torch.testing.assert_close(out, eager)
    out.sum().backward()
    assert lhs.grad is not None and lhs.grad.shape == lhs.shape


def test_ops_live_in_the_build_namespace():
    assert ops.host_ragged_dot._qualname == f"{ragged_dot_tpu.NAMESPACE}::ragged_dot"
    assert hasattr(getattr(torch.ops, ragged_dot_tpu.NAMESPACE), "ragged_dot_weight_grad")


BAD_INPUTS = [
    ("lhs must be 2-D", lambda l, r, s: (l[None], r, s, {})),
    ("rhs must be 3-D", lambda l, r, s: (l, r[0], s, {})),
    ("contraction dims differ", lambda l, r, s: (l[:, :10], r, s, {})),
    ("group_sizes has 4 groups but rhs has 5", lambda l, r, s: (l, r, s[:4], {})),
    ("do not fit", lambda l, r, s: (l, r, s, {"group_offset": 1})),
    ("group_sizes must be int32 or int64", lambda l, r, s: (l, r, s.float(), {})),
    ("group_sizes must be 1-D", lambda l, r, s: (l, r, s[None], {})),
    ("must be non-negative", lambda l, r, s: (l, r, torch.tensor([6, -1, 11, 3, 0], dtype=torch.int32), {})),
    ("exceeds the 29 rows", lambda l, r, s: (l, r, s * 2, {})),
    ("same dtype", lambda l, r, s: (l.bfloat16(), r, s, {})),
    ("dtype must be one of", lambda l, r, s: (l.double(), r.double(), s, {})),
    ("out_dtype must be", lambda l, r, s: (l, r, s, {"out_dtype": torch.float16})),
    ("rhs_layout must be", lambda l, r, s: (l, r, s, {"rhs_layout": "kk"})),
    ("one device", lambda l, r, s: (l, r.to("meta"), s, {})),
    ("impl must be", lambda l, r, s: (l, r, s, {"impl": "cuda"})),
    ("tiling must be None or three ints", lambda l, r, s: (l, r, s, {"tiling": (8, 128)})),
    ("tiling must be None or three ints", lambda l, r, s: (l, r, s, {"tiling": (8.0, 128, 128)})),
    ("tm must be a positive multiple of 8", lambda l, r, s: (l, r, s, {"tiling": (-8, -8, -8)})),
    ("tk must be a positive multiple of 128", lambda l, r, s: (l, r, s, {"tiling": (8, 5, 7)})),
]


@pytest.mark.parametrize("message,make", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_clear_error(message, make):
    lhs, rhs, sizes = _case("nk")
    a, b, c, kwargs = make(lhs, rhs, sizes)
    with pytest.raises(ValueError, match=message):
        ragged_dot_tpu.ragged_dot(a, b, c, **kwargs)


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_tiling_raises_the_same_error_on_every_path(impl):
    lhs, rhs, sizes = _case("nk")
    with pytest.raises(ValueError, match="tk must be a positive multiple of 128"):
        ragged_dot_tpu.ragged_dot(lhs, rhs, sizes, tiling=(8, 100, 20), impl=impl)
    with pytest.raises(ValueError, match="tm must be a positive multiple of 8"):
        ragged_dot_tpu.ragged_dot(lhs, rhs, sizes, tiling=(3, 24, 20), impl=impl)


def _run(code: str) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter (torch_tpu may abort a CPU host)."""
    env = dict(os.environ, PYTHONPATH=str(DEV_TREE))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)


def test_missing_jax_gives_clear_import_error():
    result = _run("""
        import sys
        sys.modules["jax"] = None  # as if jax were not installed
        import torch, ragged_dot_tpu
        lhs, rhs, sizes = torch.ones(4, 8), torch.ones(2, 3, 8), torch.tensor([2, 2], dtype=torch.int32)
        print("native ok", ragged_dot_tpu.ragged_dot(lhs, rhs, sizes).shape)
        try:
            ragged_dot_tpu.ragged_dot(lhs, rhs, sizes, impl="interpret")
        except ImportError as e:
            print("ImportError:", e)
    """)
    assert "native ok torch.Size([4, 3])" in result.stdout, result.stderr[-2000:]
    assert "ImportError: ragged_dot: the Pallas kernels need the 'jax' package" in result.stdout


def test_tpu_ops_register_with_jax_op_and_infer_shapes():
    result = _run("""
        import torch, ragged_dot_tpu
        from torch._subclasses.fake_tensor import FakeTensorMode
        import moe_experts_tpu
        from moe_experts_tpu.experts import forward
        ops = ragged_dot_tpu.TPU_OPS.register_all()
        fwd, wgrad = ops["ragged_dot_tpu"], ops["ragged_dot_weight_grad_tpu"]
        experts_op = forward.TPU_OPS.get("experts_forward_tpu")
        with FakeTensorMode():
            lhs = torch.empty(512, 2048, dtype=torch.bfloat16)
            rhs = torch.empty(128, 1536, 2048, dtype=torch.bfloat16)
            sizes = torch.empty(128, dtype=torch.int32)
            out = fwd(lhs, rhs, sizes, "nk", 0, torch.float32, 0, 0, 0)
            dw = wgrad(lhs, torch.empty(512, 1536, dtype=torch.bfloat16), sizes, 128, "nk", 0,
                       torch.bfloat16, 0, 0, 0)
            hidden = torch.empty(4, 64, dtype=torch.bfloat16)
            experts_out = experts_op(
                hidden, torch.empty(4, 2, dtype=torch.int64), torch.empty(4, 2, dtype=torch.bfloat16),
                torch.empty(8, 64, 64, dtype=torch.bfloat16), torch.empty(8, 64, 32, dtype=torch.bfloat16),
                None, None, None, None, "glu_silu", 0.0, 0.0, "nk", "")
        print("experts", tuple(experts_out.shape), experts_out.dtype)
        print("fwd", tuple(out.shape), out.dtype)
        print("wgrad", tuple(dw.shape), dw.dtype)
        print("name", fwd._qualname, experts_op._qualname)
    """)
    if result.returncode != 0 and "TPU_LIBRARY_PATH" in result.stderr:
        pytest.skip("torch_tpu aborted on this CPU host (docs/ARCHITECTURE.md)")
    assert "fwd (512, 1536) torch.float32" in result.stdout, result.stderr[-3000:]
    assert "wgrad (128, 1536, 2048) torch.bfloat16" in result.stdout
    assert "experts (4, 64) torch.bfloat16" in result.stdout
    assert f"{ragged_dot_tpu.NAMESPACE}::ragged_dot_tpu" in result.stdout
    assert "_moe_experts_tpu_" in result.stdout.split("name")[-1]


@pytest.mark.skipif(not torch_ops.tpu_available(), reason="needs a TPU device: execution of the Mosaic kernel "
                    "is checked by AOT compilation and interpret mode on this host")
def test_runs_on_tpu():  # pragma: no cover - only on a TPU VM
    lhs, rhs, sizes = _case("nk", torch.bfloat16)
    out = ragged_dot_tpu.ragged_dot(lhs.to("tpu"), rhs.to("tpu"), sizes.to("tpu"))
    want = reference.ragged_dot(_np(lhs), _np(rhs), sizes.numpy(), "nk")
    np.testing.assert_allclose(_np(out.cpu()), want, rtol=2e-2, atol=5e-2)
