"""Shared test set-up: CPU-host environment and the kernel sources on sys.path."""

import os
import pathlib
import sys

# Same defaults as scripts/env.sh, for a bare `pytest` run: without them the
# first autograd backward stalls minutes on the cloud metadata server
# (DESIGN.md section 8).
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "kernels" / "ragged-dot" / "torch-ext"))
