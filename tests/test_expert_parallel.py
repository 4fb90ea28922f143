"""Transformers' own expert parallelism with our experts function, on CPU with real
torch.distributed (gloo; 2 and 4 processes launched here): tiny Qwen3-MoE and
gpt-oss saved to disk, loaded by each rank with ``DistributedConfig(ep_size=W,
ep_implementation=...)`` so it holds only its experts, give the single-process
eager logits and greedy tokens under each of Transformers' expert-parallel
implementations, and our function is handed what the README says each hands it."""

import os
import socket
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, GptOssConfig, Qwen3MoeConfig

pytest.importorskip("accelerate")  # Transformers needs it for any distributed load

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {
    "qwen3_moe": lambda: Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=64, decoder_sparse_step=1, mlp_only_layers=[]),
    "gpt_oss": lambda: GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"], sliding_window=8),
}


def _saved_model(kind, folder):
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(CONFIGS[kind](), dtype=torch.float32)
    with torch.no_grad():  # larger than the default init: every expert's term counts
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
    path = str(folder / kind)
    model.save_pretrained(path)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    torch.save(ids, os.path.join(path, "input_ids.pt"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    with torch.no_grad():
        return path, model(ids).logits, model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(world, path, plan, out_dir, dev_tree):
    """Launch ``world`` worker processes (logs to files: a full pipe would block a
    rank inside a collective) and return each rank's results."""
    port = _free_port()
    procs, outs, logs = [], [], []
    for rank in range(world):
        stem = out_dir / f"{os.path.basename(path)}_{plan}_{world}_{rank}"
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), HUB_DEV_TREE=dev_tree, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        logs.append(open(f"{stem}.log", "wb"))
        outs.append(f"{stem}.pt")
        command = [sys.executable, os.path.join(HERE, "expert_parallel_worker.py"), path, plan, outs[-1]]
        procs.append(subprocess.Popen(command, env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
    for rank, (p, log) in enumerate(zip(procs, logs)):
        code = p.wait(timeout=600)
        log.close()
        assert code == 0, f"rank {rank} failed:\n{open(log.name, errors='replace').read()[-4000:]}"
    return [torch.load(o) for o in outs]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ep_models")
    return {kind: _saved_model(kind, folder) for kind in CONFIGS}


# What each implementation hands the experts function (transformers 5.25,
# distributed/expert_parallel.py); "auto" at inference on a shared batch is all_reduce.
HANDS_SENTINELS = {"all_to_all": False, "all_reduce": True, "auto": True}


# Each plan with both models (each run ~25 s: processes that load torch-tpu);
# 4 ranks for one pair of each plan.
@pytest.mark.parametrize("world,kind,plan", [
    (2, "gpt_oss", "all_to_all"), (2, "qwen3_moe", "all_reduce"),
    (2, "gpt_oss", "auto"),
    (4, "qwen3_moe", "all_to_all"), (4, "gpt_oss", "all_reduce"),
])
def test_expert_parallel_matches_one_process_eager(saved, world, kind, plan, tmp_path):
    from conftest import DEV_TREE

    path, want_logits, want_tokens = saved[kind]
    results = _run_ranks(world, path, plan, tmp_path, str(DEV_TREE))
    local = 8 // world
    for rank, got in enumerate(results):
        assert got["local_experts"] == local, f"rank {rank} holds {got['local_experts']} experts"
        assert got["calls"] > 0, f"rank {rank}: our experts function was never called"
        assert got["min_id"] >= 0, f"rank {rank}: negative expert id {got['min_id']}"
        if HANDS_SENTINELS[plan]:
            # the whole batch, router's top-k, remote picks as the sentinel id
            # (= local count) with weight 0; an all_reduce sums the ranks' outputs
            assert got["sentinel_picks"] > 0 and got["max_id"] == local, f"rank {rank}: {got}"
            assert got["weighted_sentinel_picks"] == 0, f"rank {rank}: {got}"
            assert got["top_k_widths"] == [2], f"rank {rank}: {got}"
        else:
            # only the picks of this rank's experts, one per row, local ids, unit
            # weights (the sender applies the routing weights after the return trip)
            assert got["sentinel_picks"] == 0 and got["max_id"] < local, f"rank {rank}: {got}"
            assert got["top_k_widths"] == [1] and got["non_unit_weights"] == 0, f"rank {rank}: {got}"
        torch.testing.assert_close(got["logits"], want_logits, rtol=1e-5, atol=1e-5, msg=f"rank {rank}")
        assert torch.equal(got["tokens"], want_tokens), f"rank {rank}"
