#!/usr/bin/env python
"""Load one built Hub kernel through the real `kernels` library and smoke test it.

Run by `build/hub.py all`, one process per (kernel, load method), with the
environment of scripts/env.sh, HF_HUB_OFFLINE=1 and HF_HUB_CACHE pointing at
the cache `hub.py install-cache` filled:

    python build/smoke.py --method get_local_kernel|LOCAL_KERNELS|hub-cache \
        --path DIST/<name> --repo-id ORG/NAME --version N --entry ragged_dot

Prints one line `SMOKE-RESULT {json}` (ok, max_err, variant, ...) and exits 0
only if the kernel loaded from where it should and matched the reference.
A manifest picks its check with `[smoke] entry`, a key of SMOKES below.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import sys
import traceback
from pathlib import Path


def _ragged_dot_reference(lhs, rhs_nk, group_sizes, m):
    import numpy as np

    out = np.zeros((m, rhs_nk.shape[1]), dtype=np.float64)
    start = 0
    for g, size in enumerate(group_sizes):
        out[start : start + size] = lhs[start : start + size].astype(np.float64) @ rhs_nk[g].astype(np.float64).T
        start += size
    return out


def smoke_ragged_dot(kernel) -> dict:
    """ragged_dot on small float32 CPU tensors, both rhs layouts, an empty group
    and rows past sum(group_sizes), against a float64 numpy reference; through
    the default CPU path and, if offered, the Pallas kernel in interpret mode."""
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    m, k, n = 20, 32, 48
    group_sizes = np.array([5, 0, 7, 3], dtype=np.int32)  # sum 15 < m: 5 rows must come out zero
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    rhs_nk = rng.standard_normal((len(group_sizes), n, k)).astype(np.float32)
    ref = _ragged_dot_reference(lhs, rhs_nk, group_sizes, m)
    total = int(group_sizes.sum())

    # The default path, and the Pallas kernel in interpret mode where the API offers it.
    impls = [{}]
    if "impl" in inspect.signature(kernel.ragged_dot).parameters:
        impls.append({"impl": "interpret"})
    layouts = (("nk", rhs_nk), ("kn", np.ascontiguousarray(rhs_nk.transpose(0, 2, 1))))
    max_err, problems = 0.0, []
    for extra, (layout, rhs) in itertools.product(impls, layouts):
        label = f"{layout}{' ' + extra['impl'] if extra else ''}"
        out = kernel.ragged_dot(
            torch.from_numpy(lhs), torch.from_numpy(rhs), torch.from_numpy(group_sizes), rhs_layout=layout, **extra
        )
        if tuple(out.shape) != (m, n):
            problems.append(f"{label}: shape {tuple(out.shape)}, want {(m, n)}")
            continue
        got = out.detach().to(torch.float64).cpu().numpy()
        if np.any(got[total:] != 0):
            problems.append(f"{label}: rows past sum(group_sizes) are not zero")
        err = float(np.max(np.abs(got - ref)))
        max_err = max(max_err, err)
        if not err <= 1e-3:
            problems.append(f"{label}: max abs error {err:.3g} > 1e-3")
    return {"ok": not problems, "max_err": max_err, "detail": problems, "cases": len(impls) * len(layouts)}


SMOKES = {"ragged_dot": smoke_ragged_dot}


def load(method: str, path: Path, repo_id: str, version: int):
    import kernels
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE:
        raise RuntimeError("refusing to run without HF_HUB_OFFLINE=1: the smoke test never contacts the Hub")
    if method == "get_local_kernel":
        return kernels.get_local_kernel(path)
    if method == "LOCAL_KERNELS":
        key, _, value = os.environ.get("LOCAL_KERNELS", "").partition("=")
        if key != repo_id or Path(value).resolve() != path:
            raise RuntimeError(f"LOCAL_KERNELS must map {repo_id} to {path}")
        return kernels.get_kernel(repo_id, version=version)
    if method == "hub-cache":
        return kernels.get_kernel(repo_id, version=version)
    raise ValueError(f"unknown method {method!r}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--method", required=True, choices=["get_local_kernel", "LOCAL_KERNELS", "hub-cache"])
    p.add_argument("--path", type=Path, required=True, help="the built repo tree")
    p.add_argument("--repo-id", required=True)
    p.add_argument("--version", type=int, required=True)
    p.add_argument("--entry", required=True, choices=sorted(SMOKES))
    args = p.parse_args()
    result: dict = {"method": args.method, "ok": False}
    try:
        module = load(args.method, args.path.resolve(), args.repo_id, args.version)
        variant_dir = Path(module.__file__).parent
        result["variant"] = variant_dir.name
        result["module"] = module.__name__
        # Where it must have come from: the tree for the local methods, the cache otherwise.
        if args.method == "hub-cache":
            from huggingface_hub import constants

            expected_root = Path(constants.HF_HUB_CACHE).resolve()
        else:
            expected_root = args.path.resolve()
        if not variant_dir.resolve().is_relative_to(expected_root):
            raise RuntimeError(f"loaded {variant_dir}, expected something under {expected_root}")
        metadata = json.loads((variant_dir / "metadata.json").read_text())
        if module.__name__ != metadata["id"] or sys.modules.get(metadata["id"]) is not module:
            raise RuntimeError(f"module {module.__name__} is not registered as its id {metadata['id']}")
        result.update(SMOKES[args.entry](module))
    except Exception as e:  # report, do not crash: the parent prints the table
        result["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    print("SMOKE-RESULT " + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
