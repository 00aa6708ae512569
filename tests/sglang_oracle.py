"""What each rank of SGLang 0.5.23's Llama / Qwen2 loader holds, computed from
the checkpoint without SGLang: the independent oracle of the SGLang tests.

SGLang's layout (``sglang/srt/layers/vocab_parallel_embedding.py``,
``linear.py``, ``models/llama.py``): ``embed_tokens`` and ``lm_head``
zero-padded to a multiple of 64 rows (of ``64 * tp`` where the padded size
does not split evenly), then split by rows; ``qkv_proj`` is ``cat(q_r, k_r,
v_r)`` of each rank's rows (KV heads replicated where there are fewer than
ranks), weight and bias; ``gate_up_proj`` is ``cat(gate_r, up_r)``;
``o_proj`` and ``down_proj`` split on dim 1; norms whole. On a CPU engine
(``cpu_engine``) the MLP is zero-padded first to a multiple of ``32 * tp``
rows (``adjust_config_with_unaligned_cpu_tp``): ``gate`` and ``up`` gain zero
rows, ``down`` zero columns. No CPU repacking (the test-only kernel stand-in
registers none)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

PAD = 64


def sha256(t: Any) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def rank_tensors(
    checkpoint: Path, tp: int, rank: int, cpu_engine: bool = True, weights: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``{SGLang module name: the tensor rank ``rank`` of ``tp`` holds}``,
    loaded with ``weights`` (default the checkpoint's own)."""
    import torch
    from safetensors.torch import load_file

    sd = weights if weights is not None else load_file(str(checkpoint / "model.safetensors"))
    cfg = json.loads((checkpoint / "config.json").read_text())
    kv_heads = cfg["num_key_value_heads"]

    def rows(t: Any, n: int, i: int) -> Any:
        k = t.shape[0] // n
        return t[i * k : (i + 1) * k]

    def cols(t: Any, n: int, i: int) -> Any:
        k = t.shape[1] // n
        return t[:, i * k : (i + 1) * k]

    kv_parts = min(tp, kv_heads)
    kv_rank = rank * kv_parts // tp
    vocab = cfg["vocab_size"]
    pad = PAD if ((vocab + PAD - 1) // PAD * PAD) % tp == 0 else PAD * tp
    padded = (vocab + pad - 1) // pad * pad
    out: dict[str, Any] = {}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name not in sd:
            continue
        t = sd[name]
        full = torch.zeros(padded, t.shape[1], dtype=t.dtype)
        full[:vocab] = t
        out[name] = rows(full, tp, rank)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for suffix in ("weight", "bias"):
            q = sd.get(p + f"self_attn.q_proj.{suffix}")
            if q is None:
                continue
            k, v = sd[p + f"self_attn.k_proj.{suffix}"], sd[p + f"self_attn.v_proj.{suffix}"]
            out[p + f"self_attn.qkv_proj.{suffix}"] = torch.cat(
                [rows(q, tp, rank), rows(k, kv_parts, kv_rank), rows(v, kv_parts, kv_rank)]
            )
        out[p + "self_attn.o_proj.weight"] = cols(sd[p + "self_attn.o_proj.weight"], tp, rank)
        gate, up = sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]
        down = sd[p + "mlp.down_proj.weight"]
        if cpu_engine and gate.shape[0] % (32 * tp):
            size = -(-gate.shape[0] // (32 * tp)) * 32 * tp
            gate, up = (torch.cat([t, t.new_zeros(size - t.shape[0], t.shape[1])]) for t in (gate, up))
            down = torch.cat([down, down.new_zeros(down.shape[0], size - down.shape[1])], dim=1)
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([rows(gate, tp, rank), rows(up, tp, rank)])
        out[p + "mlp.down_proj.weight"] = cols(down, tp, rank)
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + norm] = sd[p + norm]
        for norm in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):  # Qwen3's, whole on every rank
            if p + norm in sd:
                out[p + norm] = sd[p + norm]
    out["model.norm.weight"] = sd["model.norm.weight"]
    return out
