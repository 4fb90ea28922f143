"""The CPU inference path of experts_forward: row chunks, grouped matmul
windows (both ways through them), and the chunked experts forward against
each module's own eager loop."""

import os

import numpy as np
import pytest
import torch

import reference
import ragged_dot_tpu
import tiny_experts
from moe_experts_tpu.experts import cpu_path, forward
from ragged_dot_tpu.gmm import cpu_native

SEED = int(os.environ.get("TEST_SEED", np.random.SeedSequence().entropy % (2**31)))


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Output buffers start as NaN: a row the code forgets to write shows up."""

    def nan_buffer(like, shape, dtype):
        return torch.full(shape, float("nan"), dtype=dtype)

    monkeypatch.setattr(cpu_native, "new_output", nan_buffer)


def test_poison_is_active(poisoned_outputs):
    assert torch.isnan(cpu_native.new_output(torch.zeros(1), (2, 3), torch.float32)).all()


@pytest.mark.parametrize("trial", range(200))
def test_row_chunks_cover_every_row_once(trial):
    rng = np.random.default_rng(SEED + trial)
    num_experts = int(rng.integers(1, 12))
    sizes = [int(s) for s in rng.integers(0, 9, size=num_experts) * (rng.random(num_experts) < 0.6)]
    max_rows = int(rng.integers(1, 12))
    chunks = cpu_path.plan_row_chunks(sizes, max_rows)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    covered = []
    for chunk in chunks:
        assert chunk.row_end - chunk.row_start == sum(chunk.sizes) <= max_rows
        assert chunk.sizes[0] > 0 and chunk.sizes[-1] > 0  # no empty experts at the edges
        row = chunk.row_start
        for i, size in enumerate(chunk.sizes):
            expert = chunk.first_expert + i
            # the chunk's rows of this expert lie inside the expert's rows
            assert starts[expert] <= row and row + size <= starts[expert + 1]
            if size < sizes[expert]:  # an expert is split only when it alone is too big
                assert sizes[expert] > max_rows and len(chunk.sizes) == 1
            row += size
        covered.extend(range(chunk.row_start, chunk.row_end))
    assert covered == list(range(sum(sizes))), (sizes, max_rows, chunks)


def test_row_chunks_reject_bad_size():
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        cpu_path.plan_row_chunks([1, 2], 0)


@pytest.mark.parametrize("sparse_ratio", [0, 10**6], ids=["grouped_mm", "loop"])
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
def test_grouped_matmul_both_ways_match_reference(poisoned_outputs, monkeypatch, sparse_ratio, layout,
                                                  dtype, out_dtype):
    monkeypatch.setattr(cpu_native, "SPARSE_WINDOW_RATIO", sparse_ratio)
    gen = torch.Generator().manual_seed(SEED)
    sizes = [5, 0, 9, 1, 0, 4]
    k, n = 24, 36
    x = torch.randn(sum(sizes), k, generator=gen).to(dtype)
    shape = (len(sizes), n, k) if layout == "nk" else (len(sizes), k, n)
    rhs = torch.randn(shape, generator=gen).to(dtype)
    out = cpu_native.grouped_matmul(x, rhs, sizes, layout, out_dtype)
    assert out.dtype == out_dtype and out.shape == (sum(sizes), n)
    want = reference.ragged_dot(x.double().numpy(), rhs.double().numpy(), sizes, layout)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    np.testing.assert_allclose(out.double().numpy(), want, rtol=tol, atol=tol * np.sqrt(k),
                               err_msg=f"seed={SEED}")


def test_ragged_dot_native_writes_every_row(poisoned_outputs):
    gen = torch.Generator().manual_seed(SEED)
    lhs, rhs = torch.randn(20, 8, generator=gen), torch.randn(3, 6, 8, generator=gen)
    sizes = torch.tensor([0, 4, 0, 7, 2, 0], dtype=torch.int32)
    out = ragged_dot_tpu.ragged_dot(lhs, rhs, sizes, group_offset=2)
    want = reference.ragged_dot(lhs.double().numpy(), rhs.double().numpy(), sizes.numpy(), "nk", group_offset=2)
    np.testing.assert_allclose(out.double().numpy(), want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------
# The chunked experts forward against the module's own eager loop
# ----------------------------------------------------------------------------

MODULES = tiny_experts.MODULES


def _experts(kind, dtype=torch.float32):
    return tiny_experts.build(kind, SEED, dtype)


def _routing(num_tokens, num_experts, top_k, gen, sentinels=False):
    index = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    if sentinels:  # expert parallelism: some picks belong to another rank
        remote = torch.rand(num_tokens, top_k, generator=gen) < 0.3
        index, weights = torch.where(remote, num_experts, index), torch.where(remote, 0.0, weights)
    return index, weights


def _eager(module, hidden, index, weights):
    """The module's own loop, with remote picks pointed at a real expert with weight 0."""
    local = index.clamp(max=module.num_experts - 1)
    return type(module).forward.__wrapped__(module, hidden, local, weights)


@pytest.mark.parametrize("chunk_rows", [1, 3, 8, None])
@pytest.mark.parametrize("kind", sorted(MODULES))
def test_chunked_forward_matches_module_eager(poisoned_outputs, kind, chunk_rows):
    module = _experts(kind)
    gen = torch.Generator().manual_seed(SEED + 1)
    hidden = torch.randn(11, 32, generator=gen)
    index, weights = _routing(11, module.num_experts, 3, gen, sentinels=True)
    with torch.no_grad():
        got = cpu_path.cpu_inference_forward(module, hidden, index, weights, chunk_rows=chunk_rows)
        want = _eager(module, hidden, index, weights)
    assert got.dtype == hidden.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"seed={SEED}")


def test_chunked_forward_bf16_and_split_experts(poisoned_outputs):
    """Many tokens on few experts: experts split across chunks, bf16 tolerance."""
    module = _experts("qwen3_moe", torch.bfloat16)
    gen = torch.Generator().manual_seed(SEED + 2)
    hidden = torch.randn(40, 32, generator=gen).bfloat16()
    index = torch.randint(0, 3, (40, 2), generator=gen)
    weights = torch.rand(40, 2, generator=gen).bfloat16()
    with torch.no_grad():
        got = cpu_path.cpu_inference_forward(module, hidden, index, weights, chunk_rows=16)
        want = _eager(module, hidden, index, weights)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_chunked_and_composed_paths_agree(kind):
    module = _experts(kind)
    gen = torch.Generator().manual_seed(SEED + 3)
    hidden = torch.randn(9, 32, generator=gen)
    index, weights = _routing(9, module.num_experts, 2, gen, sentinels=True)
    with torch.no_grad():
        chunked = cpu_path.cpu_inference_forward(module, hidden, index, weights, chunk_rows=4)
        composed = forward.composed_experts_forward(module, hidden, index, weights)
    torch.testing.assert_close(chunked, composed, rtol=1e-5, atol=1e-5)


def test_all_picks_remote_or_no_tokens_give_zeros():
    module = _experts("gpt_oss")  # biases: a remote row must not even get the bias
    with torch.no_grad():
        remote = cpu_path.cpu_inference_forward(module, torch.randn(3, 32), torch.full((3, 2), 7), torch.zeros(3, 2))
        empty = cpu_path.cpu_inference_forward(module, torch.randn(0, 32), torch.zeros(0, 2, dtype=torch.long),
                                              torch.zeros(0, 2))
    assert (remote == 0).all() and empty.shape == (0, 32)


def test_dispatch_inference_chunked_training_composed(monkeypatch):
    module = _experts("qwen3_moe")
    taken = []
    monkeypatch.setattr(cpu_path, "cpu_inference_forward", lambda *a, **k: taken.append("chunked"))
    monkeypatch.setattr(forward, "composed_experts_forward", lambda *a, **k: taken.append("composed"))
    hidden, index, weights = torch.randn(2, 32), torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2)
    with torch.no_grad():
        forward.experts_forward(module, hidden, index, weights)
    forward.experts_forward(module, hidden, index, weights)  # parameters require grad
    module.requires_grad_(False)
    forward.experts_forward(module, hidden.requires_grad_(), index, weights)
    assert taken == ["chunked", "composed", "composed"]


def test_tpu_falls_back_to_composed_with_a_warning_for_what_the_program_cannot_express():
    qwen, muse = _experts("qwen3_moe"), _experts("muse_spark")
    nemotron = tiny_experts.build("nemotron_h", SEED, mlp_hidden_act="tanh")  # an activation the program lacks
    path, program_args = forward.choose_path(qwen, "tpu", grad=False, compiling=False)
    assert path == "tpu_program" and program_args[4] == "glu_silu" and program_args[0] is qwen.gate_up_proj
    assert forward.choose_path(qwen, "tpu", grad=True, compiling=False) == ("composed", None)
    forward._WARNED_FALLBACK.clear()
    with pytest.warns(UserWarning, match="post-expert norm of MuseSparkExperts"):
        assert forward.choose_path(muse, "tpu", grad=False, compiling=False) == ("composed", None)
    with pytest.warns(UserWarning, match="activation Tanh"):
        assert forward.choose_path(nemotron, "tpu", grad=False, compiling=False) == ("composed", None)
    assert forward.choose_path(muse, "cpu", grad=False, compiling=False) == ("cpu_chunked", None)
    assert forward.choose_path(muse, "cpu", grad=False, compiling=True) == ("composed", None)


BAD_EXPERTS_INPUTS = [
    ("hidden_states must be \\[tokens, 32\\]", lambda h, i, w: (h[:, :16], i, w)),
    ("top_k_index must be \\[tokens=5, top_k\\]", lambda h, i, w: (h, i[:4], w)),
    ("top_k_weights must have the shape", lambda h, i, w: (h, i, w[:, :1])),
    ("top_k_index must be int32 or int64, got torch.float32", lambda h, i, w: (h, i.float(), w)),
    ("top_k_index must be int32 or int64, got torch.uint8", lambda h, i, w: (h, i.to(torch.uint8), w)),
    ("top_k_index must be int32 or int64, got torch.int8", lambda h, i, w: (h, i.to(torch.int8), w)),
    ("top_k_weights must be floating point", lambda h, i, w: (h, i, i)),
    ("expected ids in \\[0, 8\\], or 9", lambda h, i, w: (h, torch.where(i == i[0, 0], 10, i), w)),
    ("holds expert ids in \\[-1", lambda h, i, w: (h, torch.where(i == i[0, 0], -1, i), w)),
    ("one device", lambda h, i, w: (h, i, w.to("meta"))),
]


@pytest.mark.parametrize("message,make", BAD_EXPERTS_INPUTS, ids=[b[0][:30] for b in BAD_EXPERTS_INPUTS])
def test_bad_experts_input_raises_clear_error(message, make):
    module = _experts("qwen3_moe")  # 9 experts, hidden 32
    gen = torch.Generator().manual_seed(SEED + 4)
    index, weights = _routing(5, 9, 2, gen)
    args = make(torch.randn(5, 32, generator=gen), index, weights)
    with torch.no_grad(), pytest.raises(ValueError, match="experts_forward: .*" + message):
        forward.experts_forward(module, *args)


def test_module_without_experts_attributes_raises_type_error():
    class NotExperts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.down_proj = torch.nn.Parameter(torch.zeros(2, 32, 8))

    with pytest.raises(TypeError, match=r"NotExperts is not a Transformers experts module: it lacks "
                                        r"\['num_experts', 'gate_up_proj', '_apply_gate'\]"):
        forward.experts_forward(NotExperts(), torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.long),
                                torch.ones(1, 1))


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss", "muse_spark"])
def test_sentinel_picks_add_nothing_whatever_their_weight(kind):
    """A pick of a remote expert (id E) with a NaN or huge weight: no path lets it through."""
    module = _experts(kind)
    e = module.num_experts
    gen = torch.Generator().manual_seed(SEED + 5)
    hidden = torch.randn(6, 32, generator=gen)
    index, weights = _routing(6, e, 2, gen)
    remote = torch.zeros_like(index, dtype=torch.bool)
    remote[::2, 1] = True
    index = torch.where(remote, e, index)
    poisoned = torch.where(remote, torch.tensor([float("nan")]), weights)
    clean = torch.where(remote, 0.0, weights)
    with torch.no_grad():
        want = cpu_path.cpu_inference_forward(module, hidden, index, clean)
        chunked = cpu_path.cpu_inference_forward(module, hidden, index, poisoned)
    composed = forward.composed_experts_forward(module, hidden, index, poisoned)  # gradients enabled
    assert torch.isfinite(chunked).all() and torch.isfinite(composed).all()
    torch.testing.assert_close(chunked, want)
    torch.testing.assert_close(composed.detach(), want, rtol=1e-5, atol=1e-5)
