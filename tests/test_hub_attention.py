"""The attention-tpu Hub kernel: its build, and the two user routes offline in a
fresh process (get_kernel + register(), and attn_implementation="<org>/attention-tpu")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_build import COMMON, expected_package, hub, run_hub, tree_bytes

ROOT = Path(__file__).resolve().parent.parent
ORG = "hub-test-org"
NAME = "attention-tpu"
PKG = ROOT / "kernels" / "attention" / "torch-ext" / "attention_tpu"


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hub-attention-build")
    r = run_hub("build", "--out", str(out), "--org", ORG, "--manifest", NAME)
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.parametrize("backend", ["tpu", "cpu"])
def test_variant_holds_attention_and_common_but_no_dev_tools(out, backend):
    files = tree_bytes(out / NAME / "build" / f"torch-{backend}")
    want = expected_package(PKG, {"common": COMMON})
    assert sorted(files) == sorted({*want, "_ops.py", "metadata.json", "symbols.json"})
    assert all(files[rel] == content for rel, content in want.items())
    assert "common/aot.py" not in files


USER_SCRIPT = r'''
import json, sys
import torch
from kernels import get_kernel
from transformers import AutoModelForCausalLM

org, model_dir = sys.argv[1], sys.argv[2]
ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
mask = torch.ones(2, 9, dtype=torch.long)
mask[1, :3] = 0

def logits(impl):
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=impl).eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[mask.bool()]

eager = logits("eager")
k = get_kernel(f"{org}/attention-tpu", version=1)
registered = k.register()
info = {"registered": registered, "err_register": float((logits(registered) - eager).abs().max()),
        "err_hub_string": float((logits(f"{org}/attention-tpu") - eager).abs().max())}
print("RESULT " + json.dumps(info))
'''


def test_register_and_hub_string_route_offline(out, tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cache = tmp_path / "cache"
    r = run_hub("install-cache", "--tree", str(out / NAME), "--cache", str(cache))
    assert r.returncode == 0, r.stderr
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tiny-llama")
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    env = hub.smoke_env(cache)
    proc = subprocess.run([sys.executable, str(script), ORG, str(tmp_path / "tiny-llama")], env=env,
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    info = json.loads(lines[-1][len("RESULT "):])
    assert info["registered"] == "attention_tpu"
    assert info["err_register"] < 1e-4 and info["err_hub_string"] < 1e-4, info
