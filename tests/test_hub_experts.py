"""The moe-experts-tpu Hub kernel: its build from shared ragged-dot sources, and
the user flow end to end with no network: build, install into a Hugging Face
cache, then in a fresh offline process get_kernel, register, from_pretrained
with experts_implementation=..., logits and greedy generation against eager;
with ragged-dot-tpu loaded into the same process under its own op namespace."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_build import git_dirty, git_head, hub, run_hub, tree_bytes

ROOT = Path(__file__).resolve().parent.parent
ORG = "hub-test-org"  # not the manifests' org: the repo ids follow --org
MOE, RAGGED = "moe-experts-tpu", "ragged-dot-tpu"
MOE_PKG = ROOT / "kernels" / "moe-experts" / "torch-ext" / "moe_experts_tpu"
SHARED_PKG = ROOT / "kernels" / "ragged-dot" / "torch-ext" / "ragged_dot_tpu"
BACKENDS = ("tpu", "cpu")
NS_RE = re.compile(r'^NAMESPACE = "([^"]+)"', re.MULTILINE)


def _sources(pkg: Path) -> dict[str, bytes]:
    return {p.relative_to(pkg).as_posix(): p.read_bytes() for p in sorted(pkg.rglob("*.py"))
            if "__pycache__" not in p.parts}


def _namespace(ops_file: Path) -> str:
    return NS_RE.search(ops_file.read_text()).group(1)


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hub-experts-build")
    r = run_hub("build", "--out", str(out), "--org", ORG)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def cache(out, tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("hf-cache-experts")
    for name in (MOE, RAGGED):
        r = run_hub("install-cache", "--tree", str(out / name), "--cache", str(cache))
        assert r.returncode == 0, r.stderr
    return cache


# ---------------------------------------------------------------------------
# The build


def test_shared_sources_live_once_in_the_tree():
    """Each component lives in one folder; no file is written twice."""
    folders = [MOE_PKG, SHARED_PKG, ROOT / "kernels" / "common"]
    seen: dict[bytes, str] = {}
    for folder in folders:
        for rel, content in _sources(folder).items():
            assert content not in seen, f"{folder / rel} repeats {seen[content]}"
            seen[content] = str(folder / rel)
    assert sorted(_sources(MOE_PKG)) == sorted(["__init__.py", *(
        f"experts/{rel}" for rel in _sources(MOE_PKG / "experts"))])


@pytest.mark.parametrize("backend", BACKENDS)
def test_built_variant_copies_shared_sources(out, backend):
    from test_build import COMMON, expected_package

    variant = out / MOE / "build" / f"torch-{backend}"
    files = tree_bytes(variant)
    want = expected_package(MOE_PKG, {"common": COMMON, "gmm": SHARED_PKG / "gmm"})
    assert sorted(files) == sorted({*want, "_ops.py", "metadata.json", "symbols.json"})
    for rel, content in want.items():
        assert files[rel] == content, rel
    # One _ops.py, this build's namespace, which is not ragged-dot-tpu's.
    ns = _namespace(variant / "_ops.py")
    assert re.fullmatch(r"_moe_experts_tpu_[0-9a-f]{10}", ns)
    assert [rel for rel in files if rel.rsplit("/", 1)[-1] == "_ops.py"] == ["_ops.py"]
    assert _namespace(out / RAGGED / "build" / f"torch-{backend}" / "_ops.py") != ns


@pytest.mark.parametrize("backend", BACKENDS)
def test_metadata_and_digest(out, backend):
    from kernels._rust import Backend, Digest, Metadata

    variant = out / MOE / "build" / f"torch-{backend}"
    md = Metadata.read_from_file(variant / "metadata.json")
    assert str(md.name) == MOE and md.version == 1 and md.python_depends == []
    assert md.id == f"_moe_experts_tpu_{backend}_{_namespace(variant / '_ops.py').rsplit('_', 1)[1]}"
    assert md.backend.backend_type == Backend.from_str(backend)
    md.digest.validate(Digest.hash_variant(md.digest.algorithm, variant))
    # The shared sources count towards `dirty`: their folder is part of this kernel's sources.
    if git_head():
        assert md.provenance.kernel.dirty == git_dirty(
            "kernels/moe-experts", "kernels/ragged-dot/torch-ext/ragged_dot_tpu/gmm", "kernels/common",
            "hub_manifests/moe-experts-tpu.toml")


def test_card_and_build_toml(out):
    import tomllib

    from kernels._rust import Build

    tree = out / MOE
    cfg = tomllib.loads((tree / "build.toml").read_text())
    assert cfg["general"]["name"] == MOE and cfg["general"]["hub"]["repo-id"] == f"{ORG}/{MOE}"
    Build.open(tree)
    text = (tree / "README.md").read_text()
    assert text.startswith("---\nlibrary_name: kernels\n")
    assert f'get_kernel("{ORG}/{MOE}", version=1' in text and "k.register()" in text
    assert "{{" not in text


def test_source_tree_package_explains_itself():
    # Not runnable unbuilt: the shared sources come in at build time.
    code = "import sys; sys.path.insert(0, sys.argv[1]); import moe_experts_tpu"
    r = subprocess.run([sys.executable, "-c", code, str(MOE_PKG.parent)], capture_output=True, text=True)
    assert r.returncode != 0
    assert "ImportError: moe_experts_tpu: the shared sources (subpackages `gmm`, `common`) are missing" in r.stderr
    assert "build/hub.py" in r.stderr


# ---------------------------------------------------------------------------
# The user flow, offline, in a fresh process


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE saved with save_pretrained (as a user's checkpoint)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger than the default init (norms kept at one): decisive logits
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    model.save_pretrained(path)
    return path


USER_SCRIPT = r'''
import json, sys
from pathlib import Path

import torch
from huggingface_hub import constants
from kernels import get_kernel

org, tiny, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
assert constants.HF_HUB_OFFLINE, "must run offline"
info = {}

k = get_kernel(f"{org}/moe-experts-tpu", version=1)
info["transformers_imported_by_load"] = "transformers" in sys.modules

# register() without Transformers: a clear ImportError (then the real import).
if not info["transformers_imported_by_load"]:
    sys.modules["transformers"] = None
    try:
        k.register("moe_experts_tpu")
    except ImportError as e:
        info["no_transformers_error"] = str(e)
    del sys.modules["transformers"]
try:
    k.register("eager")
except ValueError as e:
    info["eager_error"] = str(e)

from transformers import AutoModelForCausalLM
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

info["registered_name"] = k.register("moe_experts_tpu")
info["registered_is_experts_forward"] = ALL_EXPERTS_FUNCTIONS["moe_experts_tpu"] is k.experts_forward

r = get_kernel(f"{org}/ragged-dot-tpu", version=1)
ALL_EXPERTS_FUNCTIONS.register("ragged_dot_tpu", r.experts_forward)

# Both kernels in this one process: each registers its ops under its own namespace.
def ops_namespaces(module):
    md = json.loads((Path(module.__file__).parent / "metadata.json").read_text())
    return {name: mod.NAMESPACE for name, mod in sorted(sys.modules.items())
            if name.startswith(md["id"] + ".") and name.endswith("._ops")}

all_ops = torch._C._dispatch_get_all_op_names()
info["kernels"] = {}
for label, m in (("moe", k), ("ragged", r)):
    info["kernels"][label] = {
        "id": m.__name__, "variant_dir": str(Path(m.__file__).parent), "namespace": m.NAMESPACE,
        "ops_modules": ops_namespaces(m),
        "ops": sorted(op for op in all_ops if op.startswith(m.NAMESPACE + "::")),
    }
g = torch.Generator().manual_seed(0)
lhs, rhs = torch.randn(10, 16, generator=g), torch.randn(3, 24, 16, generator=g)
gs = torch.tensor([4, 0, 5], dtype=torch.int32)
a, b = k.ragged_dot(lhs, rhs, gs), r.ragged_dot(lhs, rhs, gs)
ref = torch.cat([lhs[:4] @ rhs[0].T, lhs[4:9] @ rhs[2].T, torch.zeros(1, 24)])
info["ragged_dot_equal"] = bool(torch.equal(a, b))
info["ragged_dot_err"] = float((a - ref).abs().max())

# The user flow.
from torch.utils._python_dispatch import TorchDispatchMode

class OpCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))

ids = torch.randint(0, 128, (2, 9), generator=g)
results, info["op_calls"], info["config_impl"] = {}, {}, {}
for impl in ("eager", "moe_experts_tpu", "ragged_dot_tpu"):
    model = AutoModelForCausalLM.from_pretrained(tiny, experts_implementation=impl).eval()
    info["config_impl"][impl] = model.config._experts_implementation
    with torch.no_grad():
        logits = model(ids).logits
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    # Which kernel's torch ops ran: with gradients on, the experts path goes
    # through the registered (autograd) ops; eager CPU inference calls the
    # native kernel directly, skipping the op dispatch.
    with OpCalls() as calls:
        model(ids).logits.sum()
    # Gap between the best and the second-best token at every greedy step.
    top2 = torch.stack(gen.scores).topk(2, dim=-1).values
    info.setdefault("greedy_margin", {})[impl] = float((top2[..., 0] - top2[..., 1]).min())
    generated = gen.sequences
    info["op_calls"][impl] = {ns: sum(n.startswith(ns + "::") for n in calls.names)
                              for ns in (k.NAMESPACE, r.NAMESPACE)}
    results[impl] = {"logits": logits, "generated": generated}
torch.save(results, out / "results.pt")
(out / "info.json").write_text(json.dumps(info))
'''


@pytest.fixture(scope="module")
def user_flow(out, cache, tiny_model_dir, tmp_path_factory) -> tuple[dict, dict]:
    work = tmp_path_factory.mktemp("user-flow")
    script = work / "user.py"
    script.write_text(USER_SCRIPT)
    env = hub.smoke_env(cache)
    r = subprocess.run([sys.executable, str(script), ORG, str(tiny_model_dir), str(work)],
                       env=env, capture_output=True, text=True, cwd=work, timeout=600)
    assert r.returncode == 0, r.stderr[-6000:]
    import torch

    return json.loads((work / "info.json").read_text()), torch.load(work / "results.pt")


def test_loaded_from_the_cache(user_flow, cache):
    info, _ = user_flow
    for label, prefix in (("moe", "_moe_experts_tpu_cpu_"), ("ragged", "_ragged_dot_tpu_cpu_")):
        k = info["kernels"][label]
        assert k["id"].startswith(prefix)
        variant = Path(k["variant_dir"]).resolve()
        assert variant.name == "torch-cpu" and variant.is_relative_to(cache.resolve())


def test_register(user_flow):
    info, _ = user_flow
    assert not info["transformers_imported_by_load"]
    assert "needs Transformers" in info["no_transformers_error"]
    assert "'eager'" in info["eager_error"]
    assert info["registered_name"] == "moe_experts_tpu"
    assert info["registered_is_experts_forward"]


def test_both_kernels_in_one_process_have_distinct_namespaces(user_flow):
    info, _ = user_flow
    moe, ragged = info["kernels"]["moe"], info["kernels"]["ragged"]
    assert re.fullmatch(r"_moe_experts_tpu_[0-9a-f]{10}", moe["namespace"])
    assert re.fullmatch(r"_ragged_dot_tpu_[0-9a-f]{10}", ragged["namespace"])
    # One _ops module per kernel (shared code reaches it as `.._ops`), naming that kernel's namespace.
    assert set(moe["ops_modules"]) == {f"{moe['id']}._ops"}
    assert set(moe["ops_modules"].values()) == {moe["namespace"]}
    assert set(ragged["ops_modules"].values()) == {ragged["namespace"]}
    # The same shared ops, registered twice, once per namespace.
    strip = lambda ops: sorted(op.split("::", 1)[1] for op in ops)  # noqa: E731
    assert "ragged_dot" in strip(moe["ops"]) and strip(moe["ops"]) == strip(ragged["ops"])
    assert info["ragged_dot_equal"] and info["ragged_dot_err"] < 1e-5


def test_from_pretrained_logits_match_eager(user_flow):
    import torch

    info, results = user_flow
    moe_ns, ragged_ns = info["kernels"]["moe"]["namespace"], info["kernels"]["ragged"]["namespace"]
    assert info["config_impl"] == {impl: impl for impl in ("eager", "moe_experts_tpu", "ragged_dot_tpu")}
    # Each implementation ran its own kernel's ops, and eager ran none.
    calls = info["op_calls"]
    assert calls["eager"] == {moe_ns: 0, ragged_ns: 0}
    assert calls["moe_experts_tpu"][moe_ns] > 0 and calls["moe_experts_tpu"][ragged_ns] == 0
    assert calls["ragged_dot_tpu"][ragged_ns] > 0 and calls["ragged_dot_tpu"][moe_ns] == 0

    want = results["eager"]["logits"]
    assert want.shape == (2, 9, 128) and want.std() > 0.3
    for impl in ("moe_experts_tpu", "ragged_dot_tpu"):
        torch.testing.assert_close(results[impl]["logits"], want, rtol=1e-5, atol=1e-6)


def test_greedy_generate_matches_eager(user_flow):
    import torch

    info, results = user_flow
    want = results["eager"]["generated"]
    assert want.shape == (2, 17)
    # No near ties: equal tokens are a check, not luck.
    assert info["greedy_margin"]["eager"] > 1e-3
    for impl in ("moe_experts_tpu", "ragged_dot_tpu"):
        assert torch.equal(results[impl]["generated"], want), impl
