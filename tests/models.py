"""Tiny models the tests write themselves (no hub): one per family whose
loading vLLM fuses, shards, pads or ties differently."""

from __future__ import annotations

from pathlib import Path

from weight_checker.testing.models import TINY_LLAMA, write_tiny_llama

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
    # experts stacked into w13 / w2 and sharded per tp rank
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


def write_model(path: Path, family: str, seed: int = 0) -> Path:
    """A bf16 checkpoint (config.json + model.safetensors) of ``family``, fixed seed, written once."""
    if family == "llama":
        return write_tiny_llama(path, seed)
    import torch
    import transformers

    if (path / "model.safetensors").exists():
        return path
    config_cls, model_cls, fields = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**(TINY_LLAMA | fields))
    model = getattr(transformers, model_cls)(cfg).to(torch.bfloat16)
    with torch.no_grad():  # biases start at zero; make them tell shards apart
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_()
    model.save_pretrained(path)
    return path
