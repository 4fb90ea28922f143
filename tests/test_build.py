"""The Hub build (build/hub.py): reproducible trees, metadata the `kernels`
library accepts and verifies, per-build op namespaces, the upload plan, the
cache install, and loading the built repo through the real `kernels` library
three ways (each in its own process: offline, isolated cache)."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HUB_PY = ROOT / "build" / "hub.py"
NAME = "ragged-dot-tpu"
PACKAGE = "ragged_dot_tpu"
DEFAULT_REPO_ID = "tpu-kernel-hub/ragged-dot-tpu"
BACKENDS = ("tpu", "cpu")
SOURCE_PKG = ROOT / "kernels" / "ragged-dot" / "torch-ext" / PACKAGE


hub = sys.modules["_hub_build_script"]  # build/hub.py, loaded by conftest.py


def run_hub(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    if env is None:  # the default org unless a test asks otherwise
        env = {k: v for k, v in os.environ.items() if k != hub.ORG_ENV}
    return subprocess.run(
        [sys.executable, str(HUB_PY), *args], capture_output=True, text=True, env=env, cwd=ROOT, check=False
    )


def git_head() -> str | None:
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def git_dirty(*paths: str) -> bool:
    """Whether git sees changed or untracked files under paths (what provenance.dirty records)."""
    return bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=all", "--",
                                *paths], capture_output=True, text=True, check=True).stdout.strip())


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="session")
def builds(tmp_path_factory) -> tuple[Path, Path]:
    """Two independent builds of every manifest (the default org)."""
    outs = []
    for i in range(2):
        out = tmp_path_factory.mktemp(f"hub-build-{i}")
        r = run_hub("build", "--out", str(out))
        assert r.returncode == 0, r.stderr
        outs.append(out)
    return outs[0], outs[1]


@pytest.fixture(scope="session")
def tree(builds) -> Path:
    return builds[0] / NAME


@pytest.fixture(scope="session")
def cache(tree, tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("hf-cache")
    r = run_hub("install-cache", "--tree", str(tree), "--cache", str(cache),
                "--repo-id", DEFAULT_REPO_ID, "--version", "1")
    assert r.returncode == 0, r.stderr
    return cache


# ---------------------------------------------------------------------------
# The tree


def test_two_builds_are_byte_identical(builds):
    a, b = (tree_bytes(out) for out in builds)
    assert sorted(a) == sorted(b)
    assert a == b


def _py_sources(folder: Path, exclude=()) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*.py"))
            if "__pycache__" not in p.parts and p.relative_to(folder).as_posix() not in exclude}


def expected_package(own: Path, shared: dict[str, Path], dev_only=("aot.py",)) -> dict[str, bytes]:
    """What a variant must hold, read from the source folders: the kernel's own
    package, each shared folder under its subpackage (without the dev-only
    files), the generated _ops.py aside."""
    files = _py_sources(own)
    for sub, folder in shared.items():
        files.update({f"{sub}/{rel}": content for rel, content in _py_sources(folder, dev_only).items()})
    return files


COMMON = ROOT / "kernels" / "common"
EXPERTS_SRC = ROOT / "kernels" / "moe-experts" / "torch-ext" / "moe_experts_tpu" / "experts"


def test_tree_layout(tree):
    files = tree_bytes(tree)
    assert "README.md" in files and "build.toml" in files
    want = expected_package(SOURCE_PKG, {"common": COMMON, "experts": EXPERTS_SRC})
    assert "common/aot.py" not in want and "gmm/pallas_gmm.py" in want and "experts/program.py" in want
    for backend in BACKENDS:
        variant = f"build/torch-{backend}/"
        in_variant = sorted(rel[len(variant):] for rel in files if rel.startswith(variant))
        assert in_variant == sorted({*want, "_ops.py", "metadata.json", "symbols.json"})
        for rel, content in want.items():
            assert files[variant + rel] == content, rel
    assert not [rel for rel in files if "__pycache__" in rel or rel.endswith(".pyc")]
    assert sorted({rel.split("/")[1] for rel in files if rel.startswith("build/")}) == ["torch-cpu", "torch-tpu"]


def test_dev_tree_is_the_shipped_package_plus_dev_only_files(tree):
    """What the tests import (.dev, written by conftest) is byte for byte what ships."""
    from conftest import DEV_TREE

    dev = tree_bytes(DEV_TREE / PACKAGE)
    dev = {rel: c for rel, c in dev.items() if "__pycache__" not in rel}
    generated = {"metadata.json", "symbols.json"}  # written per variant by the build
    shipped = {rel[len("build/torch-cpu/"):]: c for rel, c in tree_bytes(tree).items()
               if rel.startswith("build/torch-cpu/") and rel[len("build/torch-cpu/"):] not in generated}
    assert set(dev) - set(shipped) == {"common/aot.py"}
    assert {rel: dev[rel] for rel in shipped} == shipped


def test_readme_front_matter_and_usage(tree):
    import yaml

    text = (tree / "README.md").read_text()
    assert text.startswith("---\n")
    front, body = text[4:].split("\n---\n", 1)
    meta = yaml.safe_load(front)
    assert meta["library_name"] == "kernels"
    assert meta["license"] == "apache-2.0"
    assert "kernels" in meta["tags"] and "tpu" in meta["tags"]
    assert f'get_kernel("{DEFAULT_REPO_ID}", version=1' in body
    assert f'ALL_EXPERTS_FUNCTIONS.register("{PACKAGE}", k.experts_forward)' in body
    assert "{{" not in body


def test_build_toml_is_kernel_builder_edition_5(tree):
    from kernels._rust import Backend, Build

    cfg = tomllib.loads((tree / "build.toml").read_text())
    assert cfg["general"]["name"] == NAME
    assert cfg["general"]["version"] == 1
    assert cfg["general"]["edition"] == 5
    assert cfg["general"]["hub"]["repo-id"] == DEFAULT_REPO_ID
    assert "torch-noarch" in cfg
    # The kernels library's own build.toml parser accepts it.
    parsed = Build.open(tree)
    assert sorted(map(str, parsed.general.backends)) == sorted(map(str, [Backend.TPU, Backend.CPU]))


def test_org_override(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != hub.ORG_ENV}
    r = run_hub("build", "--out", str(tmp_path / "env"), env={**env, hub.ORG_ENV: "env-org"})
    assert r.returncode == 0, r.stderr
    r = run_hub("build", "--out", str(tmp_path / "cli"), "--org", "cli-org",
                env={**env, hub.ORG_ENV: "env-org"})
    assert r.returncode == 0, r.stderr
    for sub, org in (("env", "env-org"), ("cli", "cli-org")):
        built = tmp_path / sub / NAME
        assert tomllib.loads((built / "build.toml").read_text())["general"]["hub"]["repo-id"] == f"{org}/{NAME}"
        assert f'get_kernel("{org}/{NAME}"' in (built / "README.md").read_text()


# ---------------------------------------------------------------------------
# metadata.json and the digest


@pytest.mark.parametrize("backend", BACKENDS)
def test_metadata(tree, backend):
    from kernels._rust import Backend, Metadata

    path = tree / "build" / f"torch-{backend}" / "metadata.json"
    raw = json.loads(path.read_text())
    assert path.read_text() == json.dumps(raw, indent=2, sort_keys=True) + "\n"
    assert not hub.FORBIDDEN_DEPENDS & set(raw["python-depends"])
    md = Metadata.read_from_file(path)
    assert str(md.name) == NAME
    assert re.fullmatch(rf"_{PACKAGE}_{backend}_[0-9a-f]{{10}}", md.id)
    assert md.version == 1
    assert md.license == "apache-2.0"
    assert md.python_depends == []
    assert md.backend.backend_type == Backend.from_str(backend)
    # The oldest kernels the builds are tested with (tests/test_compat.py loads them with it).
    assert str(md.kernels_minver) == hub.KERNELS_MINVER == compat_pin("kernels")

    head = git_head()
    if head:
        assert md.provenance is not None and md.provenance.kernel is not None
        assert str(md.provenance.kernel.commit) == head  # an Oid since kernels 0.19
        assert md.provenance.kernel.dirty == git_dirty(
            "kernels/ragged-dot", "kernels/common", "kernels/moe-experts/torch-ext/moe_experts_tpu/experts",
            "hub_manifests/ragged-dot-tpu.toml")


def compat_pin(name: str) -> str:
    """The version requirements-compat.lock pins for `name`."""
    pins = dict(line.split("#")[0].strip().split("==") for line in (ROOT / "requirements-compat.lock").read_text()
                .splitlines() if "==" in line.split("#")[0])
    return pins[name]


@pytest.mark.parametrize("backend", BACKENDS)
def test_digest_verifies_with_kernels(tree, cache, tmp_path, backend):
    from kernels._internals.digest import DigestVerificationResult, verify_digest
    from kernels._rust import Digest, DigestValidationError, Metadata

    variant = tree / "build" / f"torch-{backend}"
    md = Metadata.from_bytes((variant / "metadata.json").read_bytes())
    assert md.digest is not None
    # What kernels (0.18+) runs at every load (validate.DigestValidator), without its receipt cache.
    result = verify_digest(variant, metadata=md, location=None, cache=False)
    assert isinstance(result, DigestVerificationResult.Success), str(result)
    # Format: base64 (standard alphabet, padded) of each file's sha256; symbols.json is covered.
    files = json.loads((variant / "metadata.json").read_text())["digest"]["files"]
    assert "symbols.json" in files and "metadata.json" not in files
    for rel, value in files.items():
        assert value == base64.b64encode(hashlib.sha256((variant / rel).read_bytes()).digest()).decode()

    # Also in the cache, where every file is a symlink to a blob.
    snapshot = next((cache / f"kernels--{DEFAULT_REPO_ID.replace('/', '--')}" / "snapshots").iterdir())
    md.digest.validate(Digest.hash_variant(md.digest.algorithm, snapshot / "build" / f"torch-{backend}"))

    # A changed or an extra file is caught.
    copy = tmp_path / "variant"
    shutil.copytree(variant, copy)
    (copy / "gmm/ops.py").write_text((copy / "gmm/ops.py").read_text() + "\n# tampered\n")
    with pytest.raises(DigestValidationError):
        md.digest.validate(Digest.hash_variant(md.digest.algorithm, copy))
    (copy / "gmm/ops.py").write_bytes((variant / "gmm/ops.py").read_bytes())
    (copy / "extra.py").write_text("x = 1\n")
    with pytest.raises(DigestValidationError):
        md.digest.validate(Digest.hash_variant(md.digest.algorithm, copy))
    # So is a changed symbols.json (what describe-api reports), through kernels' load-time check.
    (copy / "extra.py").unlink()
    assert isinstance(verify_digest(copy, metadata=md, location=None, cache=False), DigestVerificationResult.Success)
    (copy / "symbols.json").write_text(json.dumps({"schema_version": 1, "functions": [{"name": "evil"}], "layers": []}))
    result = verify_digest(copy, metadata=md, location=None, cache=False)
    assert isinstance(result, DigestVerificationResult.DigestVerificationFailure)
    assert "symbols.json" in str(result)


# ---------------------------------------------------------------------------
# symbols.json and `kernels describe-api`

PACKAGES = {"ragged-dot-tpu": "ragged_dot_tpu", "moe-experts-tpu": "moe_experts_tpu", "attention-tpu": "attention_tpu"}


def public_functions_of(package: str) -> list[str]:
    """The callables (not classes) of a package's __all__, imported from .dev (what ships)."""
    import importlib
    import inspect

    module = importlib.import_module(package)
    return sorted(n for n in module.__all__ if callable(getattr(module, n)) and not inspect.isclass(getattr(module, n)))


def test_describe_api_lists_the_public_functions(builds, capsys):
    from kernels._internals.cli.describe_api import print_kernel_api

    assert sorted(PACKAGES) == sorted(m.name for m in hub.load_manifests())
    for name, package in PACKAGES.items():
        want = public_functions_of(package)
        # Not vacuous: each package's entry points are among them, its constants and classes are not.
        assert {"ragged-dot-tpu": "ragged_dot", "moe-experts-tpu": "register", "attention-tpu": "attention"}[name] in want
        assert "NAMESPACE" not in want and "Tiling" not in want
        for backend in BACKENDS:
            variant = builds[0] / name / "build" / f"torch-{backend}"
            print_kernel_api(str(variant), json_output=True)  # what `kernels describe-api --json DIR` prints
            info = json.loads(capsys.readouterr().out)
            assert [f["name"] for f in info["functions"]] == want, (name, backend)
            assert info["layers"] == [] and info["variant"] == f"torch-{backend}"


def test_describe_api_command_on_a_built_repo(tree):
    """The `kernels describe-api` command itself, on a whole repo (it picks this host's variant)."""
    r = subprocess.run([str(Path(sys.executable).parent / "kernels"), "describe-api", str(tree)],
                       capture_output=True, text=True, env=hub.script_env(), check=False)
    assert r.returncode == 0, r.stderr
    functions = r.stdout.split("Functions:\n", 1)[1].split("\n\n", 1)[0].split()
    assert functions == public_functions_of(PACKAGE)
    assert "Variant: torch-cpu" in r.stdout


def test_a_tampered_symbols_json_fails_verification(tree, tmp_path):
    copy = tmp_path / NAME
    shutil.copytree(tree, copy)
    path = copy / "build" / "torch-tpu" / "symbols.json"
    symbols = json.loads(path.read_text())
    symbols["functions"].append({"name": "exfiltrate"})
    path.write_text(json.dumps(symbols))
    r = run_hub("verify", "--tree", str(copy))
    assert r.returncode == 2 and "build/torch-tpu/symbols.json does not match its digest" in r.stderr, r.stderr


@pytest.fixture
def tampered(tree, tmp_path) -> Path:
    """A copy of the built tree with one shipped file changed after the build."""
    copy = tmp_path / NAME
    shutil.copytree(tree, copy)
    target = copy / "build" / "torch-cpu" / "gmm" / "cpu_native.py"
    target.write_text(target.read_text().replace("return out\n", "return out * 2\n", 1))
    return copy


def test_verify_accepts_the_build_and_names_a_tampered_file(tree, tampered, tmp_path):
    r = run_hub("verify", "--tree", str(tree))
    assert r.returncode == 0 and "digests match (torch-cpu, torch-tpu)" in r.stdout, r.stderr
    r = run_hub("verify", "--tree", str(tampered))
    assert r.returncode == 2
    assert "build/torch-cpu/gmm/cpu_native.py does not match its digest" in r.stderr
    extra = tmp_path / "extra"
    shutil.copytree(tree, extra)
    (extra / "build" / "torch-tpu" / "evil.py").write_text("x = 1\n")
    r = run_hub("verify", "--tree", str(extra))
    assert r.returncode == 2 and "build/torch-tpu/evil.py is not in the digest" in r.stderr
    # One variant folder, as get_kernel loads it (Path(k.__file__).parent).
    r = run_hub("verify", "--tree", str(tree / "build" / "torch-cpu"))
    assert r.returncode == 0 and "digests match (torch-cpu)" in r.stdout, r.stderr
    r = run_hub("verify", "--tree", str(tampered / "build" / "torch-cpu"))
    assert r.returncode == 2 and "gmm/cpu_native.py does not match its digest" in r.stderr


def test_install_cache_and_push_refuse_a_tampered_tree(tampered, tmp_path):
    for args in (("install-cache", "--tree", str(tampered), "--cache", str(tmp_path / "c")),
                 ("push", "--tree", str(tampered), "--dry-run")):
        r = run_hub(*args)
        assert r.returncode == 2, (args, r.stdout)
        assert "gmm/cpu_native.py does not match its digest" in r.stderr
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").rglob("refs/v1"))


@pytest.mark.parametrize("cmd", ["install-cache", "push", "verify"])
def test_a_folder_that_is_not_a_build_gives_a_clear_error(cmd, tmp_path):
    r = run_hub(cmd, "--tree", str(tmp_path), *(["--dry-run"] if cmd == "push" else []))
    assert r.returncode == 2
    assert "is not a built kernel repo (no build.toml and build/)" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------------------
# _ops.py


def test_ops_namespace_generated(tree):
    assert not (SOURCE_PKG / "_ops.py").exists()  # generated by the build, never written by hand
    source = hub.DEFAULT_OPS
    namespaces = set()
    for backend in BACKENDS:
        variant = tree / "build" / f"torch-{backend}"
        built = (variant / "_ops.py").read_text()
        scope: dict = {}
        exec(compile(built, str(variant / "_ops.py"), "exec"), scope)
        ns = scope["NAMESPACE"]
        assert re.fullmatch(rf"_{PACKAGE}_[0-9a-f]{{10}}", ns)
        assert scope["op_name"]("ragged_dot") == f"{ns}::ragged_dot"
        # Only the NAMESPACE line differs from the source (op_name kept as is).
        diff = [(a, b) for a, b in zip(source.splitlines(), built.splitlines()) if a != b]
        assert len(source.splitlines()) == len(built.splitlines()) and len(diff) == 1
        assert diff[0][0].startswith("NAMESPACE =") and diff[0][1].startswith(f'NAMESPACE = "{ns}"')
        md = json.loads((variant / "metadata.json").read_text())
        assert md["id"] == f"_{PACKAGE}_{backend}_{ns.rsplit('_', 1)[1]}"
        namespaces.add(ns)
    assert len(namespaces) == 1  # one namespace per build, shared by its variants


# ---------------------------------------------------------------------------
# push --dry-run and install-cache


def test_push_dry_run_lists_uploads(tree):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_invalid_not_used"}
    r = run_hub("push", "--tree", str(tree), "--repo-id", DEFAULT_REPO_ID, "--dry-run", env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"repo {DEFAULT_REPO_ID} (repo_type=kernel)")
    plan = {}
    for line in lines[1:]:
        branch, path = line.split("\t")
        plan.setdefault(branch, set()).add(path)
    assert plan["main"] == {"README.md", "build.toml"}
    expected_build = {rel for rel in tree_bytes(tree) if rel.startswith("build/")}
    assert plan["v1"] == expected_build
    assert set(plan) == {"main", "v1"}


def test_install_cache_layout(tree, cache, tmp_path):
    storage = cache / f"kernels--{DEFAULT_REPO_ID.replace('/', '--')}"
    commit = (storage / "refs" / "v1").read_text()
    assert re.fullmatch(r"[0-9a-f]{40}", commit)
    snapshot = storage / "snapshots" / commit
    files = tree_bytes(tree)
    for rel, content in files.items():
        link = snapshot / rel
        assert link.is_symlink()
        target = link.resolve()
        assert target.parent == (storage / "blobs").resolve()
        assert target.read_bytes() == content
        assert target.name == hub.git_blob_id(content)
    listing = json.loads((storage / "trees" / f"{commit}.json").read_text())
    assert sorted(listing["files"]) == sorted(files)

    # Deterministic: another install of the same tree gives the same commit,
    # which is the git tree id of the content.
    r = run_hub("install-cache", "--tree", str(tree), "--cache", str(tmp_path / "c2"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "c2" / storage.name / "refs" / "v1").read_text() == commit
    if shutil.which("git"):
        work = tmp_path / "git"
        shutil.copytree(tree, work)
        git = ["git", "-C", str(work), "-c", "core.autocrlf=false"]
        subprocess.run([*git, "init", "-q"], check=True)
        subprocess.run([*git, "add", "-A"], check=True)
        assert subprocess.run([*git, "write-tree"], capture_output=True, text=True,
                              check=True).stdout.strip() == commit

    # huggingface_hub itself finds the snapshot offline.
    from huggingface_hub import snapshot_download

    found = snapshot_download(DEFAULT_REPO_ID, repo_type="kernel", revision=commit,
                              cache_dir=str(cache), local_files_only=True)
    assert Path(found) == snapshot.resolve() or Path(found) == snapshot


def test_install_cache_refuses_wrong_version(tree, tmp_path):
    r = run_hub("install-cache", "--tree", str(tree), "--cache", str(tmp_path), "--version", "2")
    assert r.returncode != 0 and "version 1" in r.stderr


# ---------------------------------------------------------------------------
# Manifest features, without subprocesses


def _fake_repo(tmp_path: Path, init_body: str, manifest_extra: str = "") -> Path:
    """A repo root with a second kernel that pulls shared sources from ragged-dot."""
    root = tmp_path / "repo"
    shutil.copytree(SOURCE_PKG, root / "kernels" / "ragged-dot" / "torch-ext" / PACKAGE,
                    ignore=shutil.ignore_patterns("__pycache__"))
    pkg = root / "kernels" / "moe-experts" / "torch-ext" / "moe_experts_tpu"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(init_body)
    (pkg.parent.parent / "CARD.md").write_text("# {{name}}\n\n{{description}}\n")
    (pkg.parent.parent / "build.toml").write_text(textwrap.dedent("""\
        [general]
        name = "moe-experts-tpu"
        edition = 5
        version = 1
        license = "apache-2.0"
        backends = ["tpu", "cpu"]

        [torch-noarch]

        [kernel]
        """))
    (root / "hub_manifests").mkdir()
    manifest = root / "hub_manifests" / "moe-experts-tpu.toml"
    manifest.write_text(textwrap.dedent(f"""\
        [repo]
        org = "tpu-kernel-hub"
        name = "moe-experts-tpu"

        [kernel]
        folder = "kernels/moe-experts"
        package = "moe_experts_tpu"
        version = 1
        backends = ["tpu", "cpu"]
        license = "apache-2.0"
        {manifest_extra}

        [[kernel.extra-sources]]
        from = "kernels/ragged-dot/torch-ext/{PACKAGE}/gmm"
        files = ["tiling.py", "pallas_*.py"]
        to = "_gmm"
        dev-only = ["pallas_gmm.py", "pallas_qgmm.py"]  # the Pallas kernels: the second imports the first

        [card]
        description = "MoE experts."
        """))
    return manifest


def test_extra_sources_are_copied(tmp_path, monkeypatch):
    manifest = _fake_repo(tmp_path, "from ._gmm import tiling\n")
    monkeypatch.setattr(hub, "REPO_ROOT", manifest.parent.parent)
    m = hub.load_manifest(manifest)
    assert m.repo_id == "tpu-kernel-hub/moe-experts-tpu"
    # functions given: this half-copied package is not importable, which listing them would need.
    files, namespace, ids = hub.plan_repo(m, functions=[])
    for backend in BACKENDS:
        v = f"build/torch-{backend}/"
        assert files[v + "_gmm/tiling.py"] == (SOURCE_PKG / "gmm" / "tiling.py").read_bytes()
        assert v + "_gmm/pallas_gmm.py" not in files  # dev-only: not shipped
        assert v + "_gmm/__init__.py" in files
        assert namespace.startswith("_moe_experts_tpu_")
        md = json.loads(files[v + "metadata.json"])
        assert set(md["digest"]["files"]) == {rel[len(v):] for rel in files if rel.startswith(v)} - {"metadata.json"}
        assert "kernel" not in md["provenance"]  # not a git checkout


def test_shipped_module_importing_a_dev_only_one_is_refused(tmp_path, monkeypatch):
    manifest = _fake_repo(tmp_path, "def f():\n    from ._gmm import pallas_gmm\n")
    monkeypatch.setattr(hub, "REPO_ROOT", manifest.parent.parent)
    with pytest.raises(hub.BuildError, match="imports _gmm/pallas_gmm.py, which the manifest marks dev-only"):
        hub.plan_repo(hub.load_manifest(manifest))


def test_absolute_self_import_is_refused(tmp_path, monkeypatch):
    manifest = _fake_repo(tmp_path, "from moe_experts_tpu._gmm import tiling\n")
    monkeypatch.setattr(hub, "REPO_ROOT", manifest.parent.parent)
    with pytest.raises(hub.BuildError, match="relative imports only"):
        hub.plan_repo(hub.load_manifest(manifest))


def test_forbidden_python_depends_refused(tmp_path, monkeypatch):
    manifest = _fake_repo(tmp_path, "", manifest_extra='python-depends = ["jax"]')
    monkeypatch.setattr(hub, "REPO_ROOT", manifest.parent.parent)
    with pytest.raises(hub.BuildError, match="allowlist"):
        hub.load_manifest(manifest)


# ---------------------------------------------------------------------------
# Loading through the real `kernels` library


CHECK_SCRIPT = r'''
import inspect, json, os, sys
from pathlib import Path
import numpy as np
import torch
import kernels
from huggingface_hub import constants

method, path, repo_id, version = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
assert constants.HF_HUB_OFFLINE, "must run offline"
if method == "get_local_kernel":
    k = kernels.get_local_kernel(path)
else:
    k = kernels.get_kernel(repo_id, version=version)

variant = Path(k.__file__).parent
md = json.loads((variant / "metadata.json").read_text())
ops_ns = sys.modules[md["id"] + "._ops"].NAMESPACE
registered = sorted({n for n in torch._C._dispatch_get_all_op_names() if n.startswith(ops_ns + "::")})

def reference(lhs, rhs_nk, gs, m):
    out = np.zeros((m, rhs_nk.shape[1]))
    start = 0
    for g, size in enumerate(gs):
        out[start:start + size] = lhs[start:start + size].astype(np.float64) @ rhs_nk[g].astype(np.float64).T
        start += size
    return out

rng = np.random.default_rng(1)
impls = ["default"] + (["interpret"] if "impl" in inspect.signature(k.ragged_dot).parameters else [])
cases = []
for gs, m, interpret in (([3, 0, 5, 2], 12, True), ([0, 0, 6], 6, False), ([0, 0], 4, True), ([7], 7, False)):
    gs = np.array(gs, dtype=np.int32)
    lhs = rng.standard_normal((m, 16)).astype(np.float32)
    rhs_nk = rng.standard_normal((len(gs), 24, 16)).astype(np.float32)
    ref = reference(lhs, rhs_nk, gs, m)
    for impl in impls:
        if impl == "interpret" and not interpret:
            continue
        for layout in ("nk", "kn"):
            rhs = rhs_nk if layout == "nk" else np.ascontiguousarray(rhs_nk.transpose(0, 2, 1))
            kw = {} if impl == "default" else {"impl": impl}
            out = k.ragged_dot(torch.from_numpy(lhs), torch.from_numpy(rhs), torch.from_numpy(gs),
                               rhs_layout=layout, **kw)
            got = out.to(torch.float64).numpy()
            cases.append({
                "group_sizes": gs.tolist(), "m": m, "impl": impl, "layout": layout,
                "shape": list(out.shape), "dtype": str(out.dtype),
                "tail_zero": bool(np.all(got[int(gs.sum()):] == 0)),
                "max_err": float(np.max(np.abs(got - ref))) if got.shape == ref.shape else None,
            })
print("RESULT " + json.dumps({
    "variant_dir": str(variant), "module": k.__name__, "id": md["id"],
    "registered": md["id"] in sys.modules and sys.modules[md["id"]] is k,
    "namespace": ops_ns, "ops": registered, "cases": cases,
}))
'''

METHODS = ("get_local_kernel", "LOCAL_KERNELS", "hub-cache")


@pytest.fixture(scope="session")
def loads(tree, cache, tmp_path_factory) -> dict[str, dict]:
    """Load the built repo the three ways, concurrently, each in a fresh process."""
    script = tmp_path_factory.mktemp("check") / "check.py"
    script.write_text(CHECK_SCRIPT)
    procs = {}
    for method in METHODS:
        env = hub.script_env({
            "HF_HUB_OFFLINE": "1",
            "HF_HUB_CACHE": str(cache),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
            "KERNELS_CACHE": None,
            "LOCAL_KERNELS": f"{DEFAULT_REPO_ID}={tree}" if method == "LOCAL_KERNELS" else None,
        })
        procs[method] = subprocess.Popen(
            [sys.executable, str(script), method, str(tree), DEFAULT_REPO_ID, "1"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=script.parent,
        )
    results = {}
    for method, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        results[method] = (json.loads(lines[-1][len("RESULT "):]) if proc.returncode == 0 and lines
                           else {"error": f"exit {proc.returncode}\n{err[-4000:]}"})
    return results


@pytest.mark.parametrize("method", METHODS)
def test_loads_and_matches_reference(loads, tree, cache, method):
    r = loads[method]
    assert "error" not in r, r["error"]
    variant = Path(r["variant_dir"]).resolve()
    # CPU host: the torch-cpu variant, from where this method must load it.
    assert variant.name == "torch-cpu"
    root = cache.resolve() if method == "hub-cache" else tree.resolve()
    assert variant.is_relative_to(root)
    assert r["module"] == r["id"] and r["registered"]
    # The ops of this build are registered under its own namespace.
    built_ns = re.search(r'NAMESPACE = "([^"]+)"', (tree / "build/torch-cpu/_ops.py").read_text()).group(1)
    assert r["namespace"] == built_ns
    assert r["ops"], f"no op registered under {built_ns}"
    assert r["cases"]
    for case in r["cases"]:
        assert case["shape"] == [case["m"], 24], case
        assert case["dtype"] == "torch.float32", case
        assert case["tail_zero"], case
        assert case["max_err"] is not None and case["max_err"] < 1e-4, case


def test_kernels_refuses_to_load_a_changed_file(tampered):
    """kernels (0.18+) checks the digest when it loads a variant; a local tree has no
    verification receipt, so it is hashed on every load."""
    script = ("import pathlib, sys, kernels\n"
              "try:\n    kernels.get_local_kernel(pathlib.Path(sys.argv[1]))\n"
              "except RuntimeError as e:\n    print('REFUSED', e)\nelse:\n    print('LOADED')\n")
    r = subprocess.run([sys.executable, "-c", script, str(tampered)], capture_output=True, text=True,
                       env=hub.script_env({"HF_HUB_OFFLINE": "1", "LOCAL_KERNELS": None}), check=False, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.startswith("REFUSED"), r.stdout
    assert "do not match the digest" in r.stdout and "gmm/cpu_native.py" in r.stdout
