"""One rank of a Transformers expert-parallel run (launched by test_expert_parallel.py).

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (Transformers itself
initialises torch.distributed: gloo on a CPU host), HUB_DEV_TREE (the shipped
packages). Arguments: a saved model folder, the ``ep_implementation`` of
``DistributedConfig`` ("all_to_all", "all_reduce" or "auto") and the output
file. Writes the logits, the greedy tokens, the local expert count and what
our experts function was given (ids, weights, top-k width).
"""

import os
import sys

import torch


def main(model_dir, ep_implementation, out_path):
    sys.path.insert(0, os.environ["HUB_DEV_TREE"])
    import moe_experts_tpu
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    seen = {"calls": 0, "rows": 0, "sentinel_picks": 0, "weighted_sentinel_picks": 0, "max_id": -1, "min_id": 1 << 30,
            "top_k_widths": set(), "non_unit_weights": 0}

    def ours(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        sentinel = top_k_index == self.num_experts
        seen["calls"] += 1
        seen["rows"] += hidden_states.shape[0]
        seen["sentinel_picks"] += int(sentinel.sum())
        seen["weighted_sentinel_picks"] += int((sentinel & (top_k_weights != 0)).sum())
        seen["top_k_widths"].add(top_k_index.shape[-1])
        seen["non_unit_weights"] += int((top_k_weights != 1).sum())
        if top_k_index.numel():
            seen["max_id"] = max(seen["max_id"], int(top_k_index.max()))
            seen["min_id"] = min(seen["min_id"], int(top_k_index.min()))
        return moe_experts_tpu.experts_forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)

    name = "ours_under_ep"
    ALL_EXPERTS_FUNCTIONS.register(name, ours)
    world = int(os.environ["WORLD_SIZE"])
    # The model's own ep_plan (grouped_gemm weights + ep_dispatch_experts); the
    # EP group is the TP group (tp_plan={}: no dense sharding), so every rank
    # holds the whole batch, the layout all three implementations accept.
    config = DistributedConfig(tp_size=world, ep_size=world, tp_plan={}, ep_implementation=ep_implementation)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                 distributed_config=config, experts_implementation=name).eval()
    ids = torch.load(os.path.join(model_dir, "input_ids.pt"))
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    seen["top_k_widths"] = sorted(seen["top_k_widths"])
    torch.save({"logits": logits, "tokens": tokens, "local_experts": model.model.layers[0].mlp.experts.num_experts,
                **seen}, out_path)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
