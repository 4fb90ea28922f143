"""The built Hub repos with the older pair users still pin: kernels 0.17.2 and
transformers 5.22.2 (requirements-compat.lock), in an environment of their own.

scripts/bootstrap_compat.sh makes .venv-compat (cached by a stamp, like .venv):
only the pinned set is installed there, .venv's site-packages (torch, jax, libtpu,
torch-tpu, huggingface_hub, ...) is read after it, and `pip check` must pass for
the combination. Then `build/hub.py all --python .venv-compat/bin/python` builds
every repo, loads each with get_local_kernel and all of them from an offline Hub
cache into one process, and runs every smoke case (build/smoke.py) there."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HUB_PY = ROOT / "build" / "hub.py"
COMPAT_PYTHON = ROOT / ".venv-compat" / "bin" / "python"

hub = sys.modules["_hub_build_script"]  # build/hub.py, loaded by conftest.py


def compat_pins() -> dict[str, str]:
    lines = (ROOT / "requirements-compat.lock").read_text().splitlines()
    return dict(line.split("#")[0].strip().split("==") for line in lines if "==" in line.split("#")[0])


def test_builds_load_with_the_older_kernels_and_transformers(tmp_path):
    pins = compat_pins()
    assert pins["kernels"] == hub.KERNELS_MINVER  # the oldest kernels the builds declare, tested here
    r = subprocess.run(["bash", str(ROOT / "scripts" / "bootstrap_compat.sh")], capture_output=True, text=True,
                       cwd=ROOT, check=False, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]

    env = {k: v for k, v in hub.script_env().items() if k != hub.ORG_ENV}
    r = subprocess.run(
        [sys.executable, str(HUB_PY), "all", "--out", str(tmp_path / "hub"), "--python", str(COMPAT_PYTHON),
         "--methods", "get_local_kernel", "--jobs", "2"],
        capture_output=True, text=True, env=env, cwd=ROOT, check=False, timeout=1800,
    )
    report = r.stdout + r.stderr[-6000:]
    assert f"kernels {pins['kernels']}, transformers {pins['transformers']}" in r.stdout, report
    assert r.returncode == 0, report
    for m in hub.load_manifests():  # one row per kernel, loaded by get_local_kernel, all smoke cases passed
        rows = [line for line in r.stdout.splitlines() if re.match(rf"{m.name}\s+get_local_kernel\s", line)]
        assert len(rows) == 1 and re.search(r"\storch-cpu\s+ok \(\d+ cases", rows[0]), report
    together = [line for line in r.stdout.splitlines() if "hub-cache, one process" in line]
    assert len(together) == 1 and re.search(r"torch-cpu\s+ok \(10 cases", together[0]), report
