"""One test per class of defect found by trying to break the kernels (crashes,
silent wrong answers), so that no class comes back. Build integrity and
register() names are covered in test_build.py and test_experts.py."""

import os
import threading

import numpy as np
import pytest
import torch

import ragged_dot_tpu
import reference

SEED = int(os.environ.get("TEST_SEED", np.random.SeedSequence().entropy % (2**31)))
IMPLS = ["native", "interpret"]


def _np(t):
    return t.detach().to(torch.float64).numpy()


def _want(lhs, rhs, sizes, layout="nk"):
    return reference.ragged_dot(_np(lhs), _np(rhs), np.asarray(sizes), layout)


def _strided_cases(gen):
    """(lhs, rhs, layout) with every kind of stride autograd or a user can produce."""
    k, n = 24, 20
    base = torch.randn(3, n, 2 * k, generator=gen)
    return {
        "expanded_lhs": (torch.randn(1, k, generator=gen).expand(13, k), torch.randn(3, n, k, generator=gen), "nk"),
        "stepped_rhs": (torch.randn(13, k, generator=gen), base[:, :, ::2], "nk"),
        "permuted_rhs": (torch.randn(13, k, generator=gen), torch.randn(3, k, n, generator=gen).permute(0, 2, 1), "nk"),
        "expanded_rhs": (torch.randn(13, k, generator=gen), torch.randn(1, 1, 1, generator=gen).expand(3, n, k), "nk"),
        "expanded_rhs_kn": (torch.randn(13, k, generator=gen), torch.randn(1, k, n, generator=gen).expand(3, k, n), "kn"),
        "transposed_lhs": (torch.randn(k, 13, generator=gen).t(), torch.randn(3, n, k, generator=gen), "nk"),
    }


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ["expanded_lhs", "stepped_rhs", "permuted_rhs", "expanded_rhs",
                                  "expanded_rhs_kn", "transposed_lhs"])
def test_any_strides_forward(impl, case):
    """Issue 10 item 2: strided inputs reached torch._grouped_mm and crashed."""
    lhs, rhs, layout = _strided_cases(torch.Generator().manual_seed(SEED))[case]
    sizes = torch.tensor([4, 0, 9])
    out = ragged_dot_tpu.ragged_dot(lhs, rhs, sizes, rhs_layout=layout, impl=impl)
    np.testing.assert_allclose(_np(out), _want(lhs, rhs, sizes, layout), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("compiled", [False, True])
def test_sum_backward_with_stride_zero_gradient(layout, compiled):
    """Issue 10 item 1: `.sum().backward()` hands the op an expanded gradient;
    every group non-empty, so the dense torch._grouped_mm path runs."""
    gen = torch.Generator().manual_seed(SEED)
    lhs = torch.randn(6, 4, generator=gen, requires_grad=True)
    rhs = torch.randn((2, 3, 4) if layout == "nk" else (2, 4, 3), generator=gen, requires_grad=True)
    sizes = torch.tensor([2, 3])
    fn = lambda a, b: ragged_dot_tpu.ragged_dot(a, b, sizes, rhs_layout=layout)  # noqa: E731
    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    fn(lhs, rhs).sum().backward()
    lhs64, rhs64 = lhs.detach().double().requires_grad_(), rhs.detach().double().requires_grad_()
    w = rhs64.transpose(1, 2) if layout == "nk" else rhs64
    torch.cat([lhs64[:2] @ w[0], lhs64[2:5] @ w[1], torch.zeros(1, 3, dtype=torch.float64)]).sum().backward()
    torch.testing.assert_close(lhs.grad.double(), lhs64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rhs.grad.double(), rhs64.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("sizes", [[2**32 + 3, 0, 5], [-(2**32) + 3, 0, 5], [2**62, 2**62, 0]])
def test_int64_group_sizes_are_checked_before_narrowing(impl, sizes):
    """Issue 10 item 3: 2**32 + 3 was read as 3 after the int32 cast."""
    lhs, rhs = torch.randn(8, 16), torch.randn(3, 4, 16)
    with pytest.raises(ValueError, match="ragged_dot: (sum\\(group_sizes\\)=|group_sizes must be non-negative)"):
        ragged_dot_tpu.ragged_dot(lhs, rhs, torch.tensor(sizes, dtype=torch.int64), impl=impl)
    with pytest.raises(ValueError, match="ragged_dot: "):  # and through the op (autograd path)
        ragged_dot_tpu.ragged_dot(lhs.requires_grad_(), rhs, torch.tensor(sizes, dtype=torch.int64), impl=impl)


def test_interpret_mode_from_several_threads():
    """Issue 10 item 7: the Pallas interpreter has global state; calls are serialised."""
    gen = torch.Generator().manual_seed(SEED)
    lhs, rhs, sizes = torch.randn(12, 16, generator=gen), torch.randn(3, 8, 16, generator=gen), torch.tensor([5, 0, 6])
    want = _want(lhs, rhs, sizes)
    results, errors = [None] * 4, []

    def run(i):
        try:
            results[i] = ragged_dot_tpu.ragged_dot(lhs, rhs, sizes, impl="interpret")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for out in results:
        np.testing.assert_allclose(_np(out), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("k,n", [(0, 5), (6, 0), (0, 0)])
def test_empty_contraction_or_output_dims(impl, k, n):
    """Issue 10 item 8: K=0 or N=0 crashed interpret mode; both paths give zeros / empty."""
    lhs, rhs, sizes = torch.randn(7, k), torch.randn(2, n, k), torch.tensor([3, 2])
    out = ragged_dot_tpu.ragged_dot(lhs, rhs, sizes, impl=impl)
    assert out.shape == (7, n) and (out == 0).all()
    grads_lhs = lhs.requires_grad_()
    ragged_dot_tpu.ragged_dot(grads_lhs, rhs.requires_grad_(), sizes, impl=impl).sum().backward()
    assert lhs.grad.shape == (7, k) and rhs.grad.shape == (2, n, k)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("sizes", [[9, 11, 10, 10, 9, 11, 10, 10], [30, 0, 0, 0, 0, 0, 0, 0]])
def test_bf16_output_of_f32_inputs_is_rounded_once(impl, sizes):
    """Issue 10 item 9: f32 inputs were cast to bf16 before multiplying. The
    result must be the f64 product rounded to bf16 (at most half an ulp, bar
    f32 accumulation noise), on the dense and the sparse native paths."""
    gen = torch.Generator().manual_seed(SEED)
    lhs, rhs = torch.randn(80, 256, generator=gen), torch.randn(8, 32, 256, generator=gen)
    sizes = torch.tensor(sizes)
    out = ragged_dot_tpu.ragged_dot(lhs, rhs, sizes, out_dtype=torch.bfloat16, impl=impl)
    want = torch.from_numpy(_want(lhs, rhs, sizes))
    ideal = want.to(torch.bfloat16).double()
    err, ideal_err = (out.double() - want).abs(), (ideal - want).abs()
    assert out.dtype == torch.bfloat16
    assert (err <= ideal_err + 1e-3 * want.abs() + 1e-4).all(), float((err - ideal_err).max())


def test_double_backward_raises_a_clear_error():
    """Issue 10 item 13: no formula for the weight gradient's own gradient."""
    lhs = torch.randn(5, 4, dtype=torch.float32, requires_grad=True)
    rhs = torch.randn(2, 3, 4, requires_grad=True)
    out = ragged_dot_tpu.ragged_dot(lhs, rhs, torch.tensor([2, 3]))
    (g_rhs,) = torch.autograd.grad(out.square().sum(), rhs, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward .* is not supported"):
        g_rhs.sum().backward()
