"""Tiny models the tests write themselves (no hub): one per family whose
loading vLLM fuses, shards, pads or ties differently."""

from __future__ import annotations

from pathlib import Path

from weight_checker.testing.models import TINY_LLAMA, seed_weights, write_tiny_llama

#: name -> (transformers config class, model class, config fields)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    # q/k/v biases (sharded with their columns)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    # tied lm_head, vocab 500 (padded per shard), one KV head (replicated at TP=2), q/k/v/o biases
    "tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"tie_word_embeddings": True, "vocab_size": 500, "num_key_value_heads": 1, "attention_bias": True},
    ),
    # dim-0 sizes no trainer world of 2-4 divides (vocabulary 502, intermediate 250)
    "odd": ("LlamaConfig", "LlamaForCausalLM", {"vocab_size": 502, "intermediate_size": 250}),
    # q_norm and k_norm per layer (replicated on every TP rank)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    # experts stacked into w13 / w2 and sharded per tp rank
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # q/k/v and gate/up fused on disk (loaded whole, with no shard id, then sharded)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    # persistent buffers loaded from the checkpoint (xIELU's beta and eps), and every attention layer's scales
    "apertus": (
        "ApertusConfig",
        "ApertusForCausalLM",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    ),
    # experts and a shared expert; at DP=2 the experts are sharded across the DP ranks too
    "qwen2moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 256,
            "shared_expert_intermediate_size": 256,
            "decoder_sparse_step": 1,
            "norm_topk_prob": False,
        },
    ),
}


def write_model(path: Path, family: str, seed: int = 0) -> Path:
    """A bf16 checkpoint (config.json + model.safetensors) of ``family``, fixed seed, written once.
    ``tied-copy``: the ``tied`` family whose checkpoint also keeps a copy of
    ``lm_head`` (as quantization and fine-tuning tools write them)."""
    if family == "llama":
        return write_tiny_llama(path, seed)
    if family == "tied-copy":
        from safetensors.torch import load_file, save_file

        if not (path / "model.safetensors").exists():
            write_model(path, "tied", seed)
            tensors = load_file(str(path / "model.safetensors"))
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
            save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    import torch
    import transformers

    if (path / "model.safetensors").exists():
        return path
    config_cls, model_cls, fields = FAMILIES[family]
    cfg = getattr(transformers, config_cls)(**(TINY_LLAMA | fields))
    model = getattr(transformers, model_cls)(cfg)
    seed_weights(model, seed, biases=True)  # biases start at zero; random ones tell shards apart
    model.to(torch.bfloat16).save_pretrained(path)
    return path
