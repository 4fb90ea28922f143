"""Shared test set-up: the CPU-host environment, and the Hub packages assembled
by `build/hub.py dev` on sys.path, so the tests import what ships."""

import importlib.util
import os
import pathlib
import sys

# Same defaults as scripts/env.sh, for a bare `pytest` run: without them the
# first autograd backward stalls minutes on the cloud metadata server
# (docs/ARCHITECTURE.md, "A CPU host with torch-tpu").
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Tests may compile for TPUs from several processes at once (subprocess tests).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEV_TREE = ROOT / ".dev"


def _assemble_dev_tree() -> None:
    # build/ is not a package (PyPA's `build` owns that name): load the script by path.
    spec = importlib.util.spec_from_file_location("_hub_build_script", ROOT / "build" / "hub.py")
    hub = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = hub
    spec.loader.exec_module(hub)
    hub.dev(DEV_TREE)


_assemble_dev_tree()
sys.path.insert(0, str(DEV_TREE))


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs after each test module. The suite compiles
    thousands of programs in one process; each keeps memory mappings alive,
    and past the kernel's map limit (vm.max_map_count, 65530 here) the next
    compile crashed with a segmentation fault inside XLA (a full run died so
    in tests/test_torch_op.py, which passes alone)."""
    yield
    if "jax" in sys.modules:
        import gc

        sys.modules["jax"].clear_caches()
        gc.collect()
