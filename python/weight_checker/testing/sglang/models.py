"""Tiny local Llama and Qwen2 checkpoints (no hub) that a real SGLang server
can load on CPU and generate from, for the SGLang integration tests.

Sizes: hidden 64, 2 layers, 4 attention heads of 16 with 2 KV heads (so TP=2
splits q/k/v evenly), intermediate 128, vocabulary 1000. SGLang pads
``embed_tokens`` and ``lm_head`` to a multiple of 64 rows (1000 -> 1024), so
the padding shows in the digests. bf16 safetensors. Qwen2's q/k/v biases are
given random values (not zeros) so that their TP shards differ.

The tokenizer is a small byte-level BPE in Qwen2's style (Qwen2's split
regex, then ``ByteLevel``; ``ByteLevel`` decoder), with exactly ``vocab_size``
entries, so every id the model can emit decodes to printable ASCII text:
``<pad> <unk> <s> </s>`` (0-3; bos 2, eos 3), the bytes of tab, newline and
printable ASCII, then merges in a fixed order (``" a"``..``" z"``, the 676
two-letter words with a leading space, two-letter words without one, ...).
Both architectures get the same ``tokenizer.json``. Why not the word-level
tokenizer of :func:`weight_checker.testing.models.write_tiny_policy`:
transformers 5 forces ``Qwen2Tokenizer`` for ``model_type == "qwen2"`` (it is
in ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``, whatever
``tokenizer_config.json`` says), and that class rebuilds a byte-level BPE with
Qwen's regex from the file's vocab and merges: a word-level vocabulary then
encodes every prompt to ``[]``. A ``chat_template.jinja`` is written too, so
``/v1/chat/completions`` works. Prompts are made of :data:`WORDS`, e.g.
``"ab cd ef"`` (an empty prompt crashes SGLang's CPU path).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

#: The architecture shared by both tiny models (a ``LlamaConfig`` /
#: ``Qwen2Config`` keyword set).
TINY_SGLANG: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 3,
}
SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")
#: Two-letter words, each one token after a space (``" ab"``).
WORDS = tuple(a + b for a in "abcdefghijklmnopqrstuvwxyz" for b in "abcdefghijklmnopqrstuvwxyz")
#: A minimal chat template over the tokenizer's words.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
#: Qwen2's pre-tokenizer regex (transformers' ``Qwen2Tokenizer`` rebuilds it).
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

Arch = Literal["llama", "qwen2", "qwen3"]

#: What an architecture needs beyond TINY_SGLANG (Qwen3's head_dim is its own field, 128 by default).
ARCH_CONFIG: dict[str, dict[str, Any]] = {"qwen3": {"head_dim": 16}}


def _seed(model: Any, seed: int) -> None:
    """Every matrix and every bias N(0, 0.02) from a private generator
    (not the global one: tests write checkpoints on threads); norms stay 1."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def _byte_char(b: int) -> str:
    """GPT-2's ``bytes_to_unicode`` for tab, newline, space and printable ASCII."""
    return chr(b) if 33 <= b <= 126 else chr(256 + b)


def build_tokenizer(vocab_size: int = TINY_SGLANG["vocab_size"]) -> Any:
    """The ``tokenizers.Tokenizer`` described in the module docstring."""
    import itertools
    import string

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for b in (9, 10, *range(32, 127)):
        vocab[_byte_char(b)] = len(vocab)
    space, letters = _byte_char(32), string.ascii_lowercase

    def candidates() -> Any:
        yield from ((space, x) for x in letters)
        yield from ((space + x, y) for x, y in itertools.product(letters, letters))
        yield from ((x, y) for x, y in itertools.product(letters, letters))
        yield from ((space + x + y, z) for x, y, z in itertools.product(letters, letters, letters))

    merges = []
    for a, b in candidates():
        if len(vocab) >= vocab_size:
            break
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    if len(vocab) != vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is outside what this tokenizer builds")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    return tok


def write_tokenizer(path: Path, vocab_size: int = TINY_SGLANG["vocab_size"]) -> None:
    """:func:`build_tokenizer` saved in ``path`` as transformers saves a fast
    tokenizer (``tokenizer.json``, ``tokenizer_config.json``,
    ``chat_template.jinja``)."""
    import transformers

    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(vocab_size),
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def write_tiny_sglang_model(
    path: Path, arch: Arch = "llama", seed: int = 0, *, tokenizer_vocab: int | None = None, **config: Any
) -> Path:
    """A tiny ``arch`` checkpoint with its tokenizer in ``path`` (config.json,
    generation_config.json, model.safetensors, tokenizer files), bf16, fixed
    ``seed``; any config field overridable. ``tokenizer_vocab``: a tokenizer
    smaller than the model's vocabulary (as Qwen's: 151,936 embedding rows);
    default the same size. Written once (kept if present)."""
    import torch
    import transformers

    path = Path(path)
    if (path / "model.safetensors").exists():
        return path
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    cfg = cfg_cls(**(TINY_SGLANG | ARCH_CONFIG.get(arch, {}) | config))
    model: Any = model_cls(cfg)
    _seed(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path, tokenizer_vocab or cfg.vocab_size)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def write_tiny_sglang_models(root: Path, seed: int = 0) -> dict[str, Path]:
    """Both tiny checkpoints under ``root``: ``{"llama": root/"llama", "qwen2": root/"qwen2"}``."""
    root = Path(root)
    return {arch: write_tiny_sglang_model(root / arch, arch, seed) for arch in ("llama", "qwen2")}
