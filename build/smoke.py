#!/usr/bin/env python
"""Load one built Hub kernel through the real `kernels` library and smoke test it.

Run by `build/hub.py all`, one process per (kernel, load method), with the
environment of scripts/env.sh, HF_HUB_OFFLINE=1 and HF_HUB_CACHE pointing at
the cache `hub.py install-cache` filled:

    python build/smoke.py --method get_local_kernel|LOCAL_KERNELS|hub-cache \
        --path DIST/<name> --repo-id ORG/NAME --version N --entry ragged_dot|moe_experts|attention

or, to load several kernels from the cache into one process (their torch ops
must not collide) and smoke each there:

    python build/smoke.py --method one-process --kernel ORG/NAME:N:ENTRY --kernel ...

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


def _op_calls(prefix: str):
    """A dispatch mode recording the torch ops whose name starts with prefix."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCalls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.name().startswith(prefix):
                self.names.append(func.name())
            return func(*args, **(kwargs or {}))

    return OpCalls()


# A tiny Qwen3-MoE: one decoder layer, 8 experts, 2 per token.
TINY_QWEN3_MOE = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
    decoder_sparse_step=1, mlp_only_layers=[],
)


def smoke_moe_experts(kernel) -> dict:
    """experts_forward on the experts module of a tiny random float32 Qwen3-MoE
    against the module's eager forward (and, if offered, the fused TPU program
    in interpret mode); then register() and the whole model's logits with the
    registered implementation against eager ones."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_moe", **TINY_QWEN3_MOE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager").eval()
    with torch.no_grad():  # larger than the default init (norms kept at one), so every term counts
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.1)
    experts = model.model.layers[0].mlp.experts

    gen = torch.Generator().manual_seed(1)
    tokens = 12
    hidden = torch.randn(tokens, config.hidden_size, generator=gen)
    top_k_index = torch.randn(tokens, config.num_experts, generator=gen).topk(config.num_experts_per_tok).indices
    top_k_weights = torch.randn(tokens, config.num_experts_per_tok, generator=gen).softmax(-1)

    fns = {"experts_forward": kernel.experts_forward}
    if hasattr(kernel, "fused_experts_forward_interpret"):
        fns["fused interpret"] = kernel.fused_experts_forward_interpret
    max_err, problems = 0.0, []

    def compare(label, got, want):
        nonlocal max_err
        if got.shape != want.shape or got.dtype != want.dtype:
            problems.append(f"{label}: {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}")
            return
        err = float((got.double() - want.double()).abs().max())
        max_err = max(max_err, err)
        tol = 1e-5 * max(1.0, float(want.abs().max()))
        if not err <= tol:
            problems.append(f"{label}: max abs error {err:.3g} > {tol:.3g}")

    with torch.no_grad():
        want = experts(hidden, top_k_index, top_k_weights)  # the module's eager forward
        for label, fn in fns.items():
            compare(label, fn(experts, hidden, top_k_index, top_k_weights), want)

        ids = torch.randint(0, config.vocab_size, (2, 7), generator=gen)
        want_logits = model(ids).logits
        name = kernel.register("moe_experts_tpu_smoke")
        if name != "moe_experts_tpu_smoke":
            problems.append(f"register returned {name!r}")
        model.set_experts_implementation(name)
        got_logits = model(ids).logits
        compare(f"model logits ({name})", got_logits, want_logits)
    # With gradients on, the experts path runs this kernel's registered ops
    # (eager CPU inference calls the native kernel directly).
    with _op_calls(kernel.NAMESPACE + "::") as calls:
        model(ids).logits.sum()
    if not calls.names:
        problems.append(f"the model with experts_implementation={name!r} ran no op of {kernel.NAMESPACE}")
    return {"ok": not problems, "max_err": max_err, "detail": problems, "cases": len(fns) + 1}


def smoke_attention(kernel) -> dict:
    """attention (GQA, causal, left padding) against a float64 loop on the
    default CPU path and the Pallas kernel in interpret mode; then register()
    and a tiny random Llama's logits on a left-padded batch against eager."""
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, sq, d = 2, 4, 2, 7, 16
    q, k, v = (torch.randn(b, h, sq, d, generator=gen) for h in (hq, hkv, hkv))
    pad = [0, 3]
    visible = torch.tensor([[[[pad[i] <= j <= t for j in range(sq)] for t in range(sq)]] for i in range(b)])
    want = np.zeros((b, hq, sq, d))
    q64, k64, v64 = (t.double().numpy() for t in (q, k, v))
    for i in range(b):
        for h in range(hq):
            for t in range(sq):
                keys = visible[i, 0, t].numpy()
                if keys.any():
                    s = k64[i, h // (hq // hkv)][keys] @ q64[i, h, t] * d ** -0.5
                    w = np.exp(s - s.max())
                    want[i, h, t] = (w / w.sum()) @ v64[i, h // (hq // hkv)][keys]
    max_err, problems = 0.0, []
    for impl in ("auto", "interpret"):
        got = kernel.attention(q, k, v, attention_mask=visible, impl=impl).double().numpy()
        err = float(np.abs(got - want).max())
        max_err = max(max_err, err)
        if not err <= 1e-4:
            problems.append(f"attention impl={impl}: max abs error {err:.3g} > 1e-4")

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 128, (2, 9), generator=gen)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        model.set_attn_implementation("eager")
        eager = model(input_ids=ids, attention_mask=mask).logits
        name = kernel.register("attention_tpu_smoke")
        model.set_attn_implementation(name)
        ours = model(input_ids=ids, attention_mask=mask).logits
    err = float((ours - eager)[mask.bool()].abs().max())
    max_err = max(max_err, err)
    if not err <= 1e-4:
        problems.append(f"model logits ({name}): max abs error {err:.3g} > 1e-4")
    return {"ok": not problems, "max_err": max_err, "detail": problems, "cases": 3}


SMOKES = {"ragged_dot": smoke_ragged_dot, "moe_experts": smoke_moe_experts, "attention": smoke_attention}


def load(method: str, path: Path | None, repo_id: str, version: int):
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


def _checked_module(module, method: str, path: Path | None) -> dict:
    """Where the module came from and under which id and op namespace; raises if wrong."""
    variant_dir = Path(module.__file__).parent
    # Where it must have come from: the tree for the local methods, the cache otherwise.
    if method in ("hub-cache", "one-process"):
        from huggingface_hub import constants

        expected_root = Path(constants.HF_HUB_CACHE).resolve()
    else:
        expected_root = path.resolve()
    if not variant_dir.resolve().is_relative_to(expected_root):
        raise RuntimeError(f"loaded {variant_dir}, expected something under {expected_root}")
    metadata = json.loads((variant_dir / "metadata.json").read_text())
    if module.__name__ != metadata["id"] or sys.modules.get(metadata["id"]) is not module:
        raise RuntimeError(f"module {module.__name__} is not registered as its id {metadata['id']}")
    ops = sys.modules.get(metadata["id"] + "._ops")
    return {"variant": variant_dir.name, "module": module.__name__, "namespace": getattr(ops, "NAMESPACE", None)}


def run_one_process(kernel_specs: list[str]) -> dict:
    """Load several kernels from the cache into this one process and smoke each:
    their torch ops must be registered under distinct namespaces."""
    import torch

    specs = []
    for spec in kernel_specs:
        repo_id, version, entry = spec.rsplit(":", 2)
        if entry not in SMOKES:
            raise ValueError(f"--kernel {spec}: unknown entry {entry!r} (known: {sorted(SMOKES)})")
        specs.append((repo_id, int(version), entry))
    loaded = [(repo_id, entry, load("hub-cache", None, repo_id, version)) for repo_id, version, entry in specs]
    infos = {repo_id: _checked_module(module, "one-process", None) for repo_id, _, module in loaded}
    names = [info["namespace"] for info in infos.values()]
    problems = []
    if len(set(names)) != len(names) or None in names:
        problems.append(f"op namespaces not distinct: {names}")
    all_ops = torch._C._dispatch_get_all_op_names()
    for repo_id, info in infos.items():
        if not any(op.startswith(f"{info['namespace']}::") for op in all_ops):
            problems.append(f"{repo_id}: no op registered under {info['namespace']}")
    max_err, cases = 0.0, 0
    for repo_id, entry, module in loaded:  # each smoke after all are loaded
        r = SMOKES[entry](module)
        max_err, cases = max(max_err, r["max_err"]), cases + r.get("cases", 0)
        problems += [f"{repo_id}: {d}" for d in r["detail"]] + ([] if r["ok"] else [f"{repo_id}: failed"])
    variants = sorted({info["variant"] for info in infos.values()})
    return {
        "ok": not problems, "max_err": max_err, "cases": cases, "detail": problems,
        "variant": ",".join(variants), "namespaces": names,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--method", required=True, choices=["get_local_kernel", "LOCAL_KERNELS", "hub-cache", "one-process"])
    p.add_argument("--path", type=Path, help="the built repo tree")
    p.add_argument("--repo-id")
    p.add_argument("--version", type=int)
    p.add_argument("--entry", choices=sorted(SMOKES))
    p.add_argument("--kernel", action="append", default=[], metavar="REPO_ID:VERSION:ENTRY",
                   help="one-process: a kernel to load from the cache (repeat, at least two)")
    args = p.parse_args()
    if args.method == "one-process":
        if len(args.kernel) < 2:
            p.error("--method one-process needs at least two --kernel")
    elif None in (args.path, args.repo_id, args.version, args.entry):
        p.error(f"--method {args.method} needs --path, --repo-id, --version and --entry")
    result: dict = {"method": args.method, "ok": False}
    try:
        if args.method == "one-process":
            result.update(run_one_process(args.kernel))
        else:
            module = load(args.method, args.path.resolve(), args.repo_id, args.version)
            result.update(_checked_module(module, args.method, args.path))
            result.update(SMOKES[args.entry](module))
    except Exception as e:  # report, do not crash: the parent prints the table
        result["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    print("SMOKE-RESULT " + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
