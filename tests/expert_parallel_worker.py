"""One rank of a Transformers expert-parallel run (launched by test_expert_parallel.py).

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (Transformers itself
initialises torch.distributed: gloo on a CPU host), HUB_DEV_TREE (the shipped
packages). Arguments: a saved model folder, the plan ("dispatch": Transformers'
default all-to-all token dispatch; "masked": every rank keeps every token, remote
picks get the sentinel id and a zero weight, an all_reduce combines) and the
output file. Writes the logits, the greedy
tokens, the local expert count and what our experts function was given.
"""

import os
import sys

import torch


def main(model_dir, plan, out_path):
    sys.path.insert(0, os.environ["HUB_DEV_TREE"])
    import moe_experts_tpu
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    seen = {"calls": 0, "sentinel_picks": 0, "max_id": -1}

    def ours(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        seen["calls"] += 1
        seen["sentinel_picks"] += int((top_k_index == self.num_experts).sum())
        seen["max_id"] = max(seen["max_id"], int(top_k_index.max()) if top_k_index.numel() else -1)
        return moe_experts_tpu.experts_forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)

    name = "ours_under_ep"
    ALL_EXPERTS_FUNCTIONS.register(name, ours)
    world = int(os.environ["WORLD_SIZE"])
    config = dict(tp_size=world, ep_size=world, tp_plan={})
    if plan == "masked":
        gate = "router" if "gpt" in os.path.basename(model_dir) else "gate"
        config["ep_plan"] = {f"model.layers.*.mlp.{gate}": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                 distributed_config=DistributedConfig(**config),
                                                 experts_implementation=name).eval()
    ids = torch.load(os.path.join(model_dir, "input_ids.pt"))
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    torch.save({"logits": logits, "tokens": tokens, "local_experts": model.model.layers[0].mlp.experts.num_experts,
                **seen}, out_path)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
