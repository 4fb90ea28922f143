"""Experts modules of several Transformers models, tiny and random, shared by the tests."""

import importlib

import torch
from transformers import AutoConfig, PretrainedConfig

# kind -> (class path, config); "model_type" builds the model's own config class.
MODULES = {
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts",
                  dict(model_type="qwen3_moe", hidden_size=32, moe_intermediate_size=24, num_experts=9)),
    "gpt_oss": ("transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts",  # transposed, biased
                dict(model_type="gpt_oss", hidden_size=32, intermediate_size=24, num_local_experts=7)),
    "nemotron_h": ("transformers.models.nemotron_h.modeling_nemotron_h.NemotronHExperts",  # has_gate=False
                   dict(n_routed_experts=6, hidden_size=32, moe_intermediate_size=24, moe_latent_size=None,
                        mlp_hidden_act="relu2")),
    "muse_spark": ("transformers.models.muse_spark.modeling_muse_spark.MuseSparkExperts",  # post norm
                   dict(num_local_experts=6, moe_hidden_size=32, moe_intermediate_size=24, hidden_act="silu",
                        post_norm_eps=1e-6)),
}
HIDDEN = 32


def build(kind, seed, dtype=torch.float32, std=0.2, **config):
    """A random ``kind`` module; ``config`` overrides entries of its config (e.g. the expert count)."""
    cls_path, cfg = MODULES[kind]
    module_name, cls_name = cls_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module_name), cls_name)
    cfg = dict(cfg, **config)
    model_type = cfg.pop("model_type", None)
    config = AutoConfig.for_model(model_type, **cfg) if model_type else PretrainedConfig(**cfg)
    torch.manual_seed(seed)
    module = cls(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, std)
    return module.to(dtype).eval()
