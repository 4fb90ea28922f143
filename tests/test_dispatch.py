"""The one dispatch rule (common/dispatch.py), the route every public op takes in
each situation (device, gradients, torch.compile), the experts gate recognised by
what it computes, and the one Transformers registration helper."""

import warnings

import pytest
import torch

import tiny_experts
from moe_experts_tpu.common import dispatch, transformers_interface
from moe_experts_tpu.experts import forward, module_layout
from moe_experts_tpu.gmm import ops as gmm_ops
from attention_tpu.attention import ops as attention_ops
from transformers.integrations.moe import ExpertsInterface


def _toy(accepts=None):
    runs = []
    routes = (
        dispatch.Route("fast", "cpu", "native", lambda x: runs.append(("fast", x)), when=dispatch.EAGER),
        dispatch.Route("picky", "cpu", "native", lambda x, accepted: runs.append(("picky", accepted)),
                       when=dispatch.NO_GRAD, accepts=accepts, description="the general one"),
        dispatch.Route("general", "cpu", "native", lambda x: runs.append(("general", x)), description="general"),
        dispatch.Route("check", "cpu", "interpret", lambda x: runs.append(("check", x)), when=dispatch.NO_GRAD),
        dispatch.Route("device", "tpu", "pallas", lambda x: runs.append(("device", x))),
    )
    return dispatch.Dispatcher("toy", routes, {"cpu": "native", "tpu": "pallas"}), runs


@pytest.mark.parametrize("grad, compiling, want", [
    (False, False, "fast"), (False, True, "picky"), (True, False, "general"), (True, True, "general"),
])
def test_first_route_whose_condition_holds_runs(grad, compiling, want):
    toy, _ = _toy()
    assert toy.resolve(dispatch.Call("cpu", "auto", grad, compiling), 1).name == want


def test_a_route_that_refuses_is_passed_over_with_one_warning_per_reason():
    def accepts(x):
        if x < 0:
            raise NotImplementedError(f"negative input {x}")
        return x * 10

    toy, runs = _toy(accepts)
    compiled = dispatch.Call("cpu", "native", False, True)  # skips "fast" (eager only)
    toy(compiled, 2)
    with pytest.warns(UserWarning, match="negative input -1; general instead"):
        toy(compiled, -1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason warns once
        toy(compiled, -1)
    assert runs == [("picky", 20), ("general", -1), ("general", -1)]


def test_errors_name_devices_impls_and_conditions():
    toy, _ = _toy()
    with pytest.raises(ValueError, match=r"toy: tensors must be on a 'cpu' or 'tpu' device, got 'meta'"):
        toy.resolve(dispatch.Call("meta"))
    with pytest.raises(ValueError, match=r"toy: impl must be 'auto' or one of \('pallas',\) on 'tpu' tensors, "
                                         r"got 'native'"):
        toy.resolve(dispatch.Call("tpu", "native"))
    with pytest.raises(RuntimeError, match=r"impl='interpret' on 'cpu' tensors runs with no gradients"):
        toy.resolve(dispatch.Call("cpu", "interpret", grad=True))
    with pytest.raises(ValueError, match="default impl 'native' of 'tpu' has no route"):
        dispatch.Dispatcher("bad", (dispatch.Route("a", "cpu", "native", print),), {"tpu": "native"})


def test_call_reads_gradients_and_device():
    x = torch.ones(2, requires_grad=True)
    assert dispatch.Call.of(x.device, "auto", (x,)) == dispatch.Call("cpu", "auto", True, False)
    with torch.no_grad():
        assert not dispatch.Call.of(x.device, "auto", (x, None)).grad


# The picture of docs/ARCHITECTURE.md, section 2, as data: (device, impl, grad, compiling) -> route.
PICTURE = {
    "ragged_dot": {("tpu", "auto", False, False): "pallas", ("tpu", "auto", True, True): "pallas",
                   ("cpu", "auto", False, False): "native_eager", ("cpu", "auto", True, False): "native_op",
                   ("cpu", "auto", False, True): "native_op", ("cpu", "interpret", True, True): "interpret_op"},
    "attention": {("tpu", "auto", False, False): "pallas", ("tpu", "auto", True, False): "pallas",
                  ("cpu", "auto", True, True): "native", ("cpu", "interpret", False, False): "interpret"},
    "experts_forward": {("tpu", "auto", False, False): "tpu_program", ("tpu", "auto", False, True): "tpu_program",
                        ("tpu", "auto", True, False): "composed", ("cpu", "auto", False, False): "cpu_chunked",
                        ("cpu", "auto", False, True): "composed", ("cpu", "auto", True, False): "composed",
                        ("cpu", "interpret", False, False): "interpret_program"},
}


@pytest.mark.parametrize("op", sorted(PICTURE))
def test_each_op_routes_as_the_architecture_picture_says(op):
    qwen = tiny_experts.build("qwen3_moe", 0)
    dispatcher = {"ragged_dot": gmm_ops.DISPATCH, "attention": attention_ops.DISPATCH,
                  "experts_forward": forward.DISPATCH}[op]
    for (device, impl, grad, compiling), want in PICTURE[op].items():
        args = (qwen,) if op == "experts_forward" else ()
        assert dispatcher.resolve(dispatch.Call(device, impl, grad, compiling), *args).name == want, \
            (op, device, impl, grad, compiling)


# ---------------------------------------------------------------------------
# The experts gate, recognised by what _apply_gate computes
# ---------------------------------------------------------------------------


def _subclass(module, name, apply_gate):
    cls = type(name, (type(module),), {"_apply_gate": apply_gate})
    other = cls.__new__(cls)
    other.__dict__.update(module.__dict__)
    return other


def test_a_renamed_gpt_oss_gate_is_recognised_with_its_own_constants():
    gpt_oss = tiny_experts.build("gpt_oss", 0)
    assert module_layout.gate_of_module(gpt_oss) == ("gpt_oss", gpt_oss.alpha, gpt_oss.limit)
    # Same math under another class name and qualname (a model that copies gpt-oss's gate).
    renamed = _subclass(gpt_oss, "CopiedExperts", lambda self, x: type(gpt_oss)._apply_gate(self, x))
    renamed.limit = 3.0
    assert module_layout.gate_of_module(renamed) == ("gpt_oss", gpt_oss.alpha, 3.0)
    args = module_layout.program_args(renamed)
    assert (args.gate, args.limit, args.rhs_layout) == ("gpt_oss", 3.0, "kn") and args.up_bias is not None


def test_a_gate_close_to_a_known_one_is_refused_naming_the_override():
    gpt_oss = tiny_experts.build("gpt_oss", 0)

    def without_the_plus_one(self, gate_up):
        gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return up * gate * torch.sigmoid(gate * self.alpha)

    almost = _subclass(gpt_oss, "AlmostExperts", without_the_plus_one)
    with pytest.raises(NotImplementedError, match="AlmostExperts overrides _apply_gate .* none of the program's"):
        module_layout.gate_of_module(almost)


def test_an_override_computing_a_plain_glu_is_recognised():
    qwen = tiny_experts.build("qwen3_moe", 0)

    def gelu_glu(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate) * up

    assert module_layout.gate_of_module(_subclass(qwen, "GeluExperts", gelu_glu)) == ("glu_gelu", 0.0, 0.0)


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------


def test_functions_of_earlier_builds_may_be_replaced_others_not():
    def earlier_build(*args):
        pass

    earlier_build._tpu_kernel_hub_experts = True  # the tag builds before the shared helper set
    ExpertsInterface.register("dispatch_test_earlier", earlier_build)
    assert transformers_interface.refusal("dispatch_test_earlier", dict(ExpertsInterface().items())) is None
    ExpertsInterface.register("dispatch_test_other", lambda *a: None)
    assert "already registered to another function" in transformers_interface.refusal(
        "dispatch_test_other", dict(ExpertsInterface().items()))
