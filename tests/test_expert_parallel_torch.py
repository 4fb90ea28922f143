"""``expert_parallel_experts_forward``: the SPMD experts layer called from torch.

* On CPU, over 4 JAX CPU devices (a fresh process: the device count is fixed
  when JAX starts): tiny Qwen3-MoE and gpt-oss modules, tokens replicated and
  sharded, against a float64 loop, elementwise (expert_parallel_torch_check.py).
* The TPU branch's ``jax_op`` with a mesh: registered on this CPU host with
  torch_tpu, its fake kernel giving each rank's output shape, over a mesh of
  JAX CPU devices and over a mesh of torch_tpu's own device stand-ins (what
  ``torch.tpu.pallas.get_pallas_mesh`` builds). Running it needs a TPU slice.
* Bad arguments: errors naming the argument, before any program runs.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
import torch

import moe_experts_tpu
import tiny_experts
from conftest import DEV_TREE

SEED = int(os.environ.get("TEST_SEED", np.random.SeedSequence().entropy % (2**31)))
HERE = pathlib.Path(__file__).parent
ENV = dict(os.environ, PYTHONPATH=str(HERE), ALLOW_MULTIPLE_LIBTPU_LOAD="1",
           XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
forward = moe_experts_tpu.expert_parallel_experts_forward


def test_cpu_devices_match_a_float64_loop_in_both_token_modes():
    proc = subprocess.run([sys.executable, str(HERE / "expert_parallel_torch_check.py"), str(DEV_TREE), str(SEED)],
                          env=ENV, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    cases = result["cases"]
    assert set(cases) == {f"{kind}_{mode}" for kind in ("qwen3_moe", "gpt_oss") for mode in ("replicated", "sharded")}
    for name, case in cases.items():
        assert case["shape"] == [12, 32] and case["dtype"] == "torch.float32" and case["device"] == "cpu", name
        assert case["finite"], (name, SEED)  # NaN-poisoned interpreter memory and a NaN remote weight stay out
        assert case["elementwise_ok"], (name, case["max_rel_error"], SEED)  # f32, 1e-5 relative
        # Not an untouched or partial output: every row the reference fills is filled, the all-remote row is 0.
        assert case["nonzero_rows"] == case["want_nonzero_rows"] == 11, (name, SEED)
        assert case["all_remote_row_zero"], name
    errors = result["errors"]
    assert errors["experts_do_not_split"].startswith(
        "ValueError: expert_parallel_experts_forward: module holds 9 experts, which do not split over the 4 devices "
        "of mesh axis 'ep'")
    assert errors["tokens_do_not_split"].startswith(
        "ValueError: expert_parallel_experts_forward: tokens='sharded' needs a token count that divides by the 4 "
        "devices of mesh axis 'ep'; hidden_states has 10 rows")
    assert errors["dtensor"].startswith(
        "TypeError: expert_parallel_experts_forward: module.gate_up_proj is a DTensor")
    assert errors["id_out_of_range"].startswith(
        "ValueError: expert_parallel_experts_forward: top_k_index holds expert ids in [9, 9]")


JAX_OP_CHECK = """
    import sys
    import numpy as np, torch, jax
    import torch_tpu
    from torch_tpu._internal.pallas._mock_device import _PallasDevice
    import moe_experts_tpu, tiny_experts
    from moe_experts_tpu.experts import expert_parallel_torch as ept

    def mock_mesh(kind):  # what torch.tpu.pallas.get_pallas_mesh builds on a TPU host
        return jax.sharding.Mesh(np.array([_PallasDevice(id=i, process_index=i, device_kind=kind)
                                           for i in range(4)]), ("ep",))

    meshes = {"cpu": jax.make_mesh((4,), ("ep",)), "tpu_v6e": mock_mesh("TPU v6 lite")}
    print("generation", ept._mesh_generation(mock_mesh("TPU v5 lite")), ept._mesh_generation(meshes["tpu_v6e"]))
    for mesh_name, mesh in meshes.items():
        for kind, config, dtype in (("qwen3_moe", dict(num_experts=2), torch.bfloat16),
                                    ("gpt_oss", dict(num_local_experts=2), torch.float32)):
            # This rank's shard: 2 of the 8 experts; its tokens (all, or 3 of 12 when sharded).
            module = tiny_experts.build(kind, 0, dtype=dtype, **config).to("meta")
            for mode, rows in (("replicated", 12), ("sharded", 3)):
                meta = lambda *shape, dtype: torch.empty(*shape, dtype=dtype, device="meta")
                params = ept.program_params(module, meta(rows, 32, dtype=dtype), meta(rows, 3, dtype=torch.int64),
                                            meta(rows, 3, dtype=torch.float32))
                op = ept.tpu_op(mesh, "ep", mode)
                out = op(*ept.PROGRAM.args(params))
                print("OUT", mesh_name, kind, mode, tuple(out.shape), out.dtype, op._qualname)
    try:
        module = tiny_experts.build("qwen3_moe", 0, num_experts=8)
        with torch.no_grad():
            moe_experts_tpu.expert_parallel_experts_forward(
                module, torch.zeros(4, 32), torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2),
                mesh=meshes["tpu_v6e"], axis="ep")
    except ValueError as e:
        print("CPU TENSORS ON A TPU MESH:", e)
"""


def test_tpu_jax_op_with_a_mesh_registers_and_infers_each_ranks_shapes():
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(JAX_OP_CHECK)],
                          env=dict(ENV, PYTHONPATH=os.pathsep.join([str(DEV_TREE), str(HERE)])),
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "TPU_LIBRARY_PATH" in proc.stderr:
        pytest.skip("torch_tpu aborted on this CPU host (docs/ARCHITECTURE.md)")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "generation v5e v6e" in proc.stdout
    outs = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("OUT ")]
    assert len(outs) == 8, proc.stdout
    for mesh_name, kind, mode, *shape, dtype, qualname in outs:
        # Each rank's rows: all 12 when replicated, its 3 of 12 when sharded.
        assert "".join(shape) == ("(12,32)" if mode == "replicated" else "(3,32)"), (mesh_name, kind, mode)
        assert dtype == ("torch.bfloat16" if kind == "qwen3_moe" else "torch.float32")
        assert qualname.startswith(f"{moe_experts_tpu.NAMESPACE}::expert_parallel_experts_forward_tpu_{mode}_")
    assert "CPU TENSORS ON A TPU MESH: expert_parallel_experts_forward: cpu tensors run over a mesh of JAX CPU " \
        "devices; mesh holds ['tpu'] devices" in proc.stdout


@pytest.fixture(scope="module")
def case():
    module = tiny_experts.build("qwen3_moe", 0, num_experts=8)
    ids = torch.tensor([[0, 3], [7, 8], [1, 2]])
    return module, torch.randn(3, tiny_experts.HIDDEN), ids, torch.rand(3, 2)


@pytest.mark.parametrize("change, error, message", [
    (dict(mesh="ep"), TypeError, "mesh must be a jax.sharding.Mesh"),
    (dict(axis="tp"), ValueError, "axis 'tp' is not an axis of mesh (axes ('ep',))"),
    (dict(tokens="scattered"), ValueError, "tokens must be one of ('replicated', 'sharded'), got 'scattered'"),
    (dict(module=torch.nn.Linear(4, 4)), TypeError, "Linear is not a Transformers experts module"),
    (dict(module="nemotron_h"), ValueError, "module (NemotronHExperts) is a layer the SPMD program cannot express: "
     "experts_forward (fused TPU program): activation Tanh"),
    (dict(module="muse_spark"), ValueError, "module (MuseSparkExperts) is a layer the SPMD program cannot express: "
     "experts_forward (fused TPU program): post-expert norm"),
    (dict(hidden=lambda h: h.double()), ValueError, "hidden_states dtype must be one of"),
    (dict(hidden=lambda h: h[:, :31]), ValueError, "hidden_states must be [tokens, 32]"),
    (dict(hidden=lambda h: h.to("meta")), ValueError, "hidden_states must be on 'tpu' (torch_tpu) or 'cpu', got meta"),
    (dict(ids=lambda i: i.float()), ValueError, "top_k_index must be int32 or int64, got torch.float32"),
    (dict(weights=lambda w: w.to("meta")), ValueError, "must be on one device"),
    (dict(module="float64"), ValueError, "module.gate_up_proj dtype must be one of"),
    (dict(grad=True), RuntimeError, "inference only"),
])
def test_bad_arguments_raise_errors_naming_them(case, change, error, message):
    module, hidden, ids, weights = case
    kinds = {"nemotron_h": lambda: tiny_experts.build("nemotron_h", 0, n_routed_experts=8, mlp_hidden_act="tanh"),
             "muse_spark": lambda: tiny_experts.build("muse_spark", 0, num_local_experts=8),
             "float64": lambda: tiny_experts.build("qwen3_moe", 0, dtype=torch.float64, num_experts=8)}
    module = change.get("module", module)
    module = kinds[module]() if isinstance(module, str) else module
    kwargs = dict(mesh=change.get("mesh", jax.make_mesh((1,), ("ep",))), axis=change.get("axis", "ep"),
                  tokens=change.get("tokens", "replicated"))
    args = [change.get(name, lambda t: t)(t) for name, t in (("hidden", hidden), ("ids", ids), ("weights", weights))]
    with torch.set_grad_enabled(change.get("grad", False)):
        with pytest.raises(error) as info:
            forward(module, *args, **kwargs)
    assert str(info.value).startswith("expert_parallel_experts_forward: ")
    assert message in str(info.value)
