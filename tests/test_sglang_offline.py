"""The SGLang paths that need no SGLang: an SGLang server's ``/server_info``
read and refused by name (canned bodies, as SGLang 0.5.23 states them, on a
local HTTP server), the dtype SGLang's ``--dtype auto`` picks, the
never-written check of expected digests (float16 weights included), and a
bad block request answered by every rank instead of raised (an exception in
one rank would leave the others waiting in SGLang's gather)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected.server_config import reconcile, server_engine
from weight_checker.expected.sglang.server import config_dtype

from .test_expect_server import serving

#: The fields of SGLang 0.5.23's GET /server_info read here, as a TP=2 server
#: on a local checkpoint states them (its other 500-odd fields left out).
SGLANG_INFO: dict[str, Any] = {
    "version": "0.5.23", "model_path": "/models/qwen2", "tp_size": 2, "pp_size": 1, "dp_size": 1, "dtype": "auto",
    "quantization": None, "modelopt_quant": None, "quantize_and_serve": False, "rl_quant_profile": None,
    "enable_lora": None, "speculative_algorithm": None, "enable_dp_attention": False, "enable_dp_lm_head": False,
    "moe_dense_tp_size": None, "custom_weight_loader": [], "is_embedding": False, "ep_size": 1, "attn_cp_size": 1,
    "dcp_size": 1, "model_impl": "auto", "model_loader_extra_config": "{}", "json_model_override_args": "{}",
    "load_format": "auto", "revision": None, "device": "cpu",
}  # fmt: skip


def with_(**fields: Any) -> dict[str, Any]:
    return {**copy.deepcopy(SGLANG_INFO), **fields}


def test_an_sglang_server_is_read_as_one():
    with serving(SGLANG_INFO) as url:
        engine = server_engine(url)
    assert (engine.model, engine.tp, engine.pp, engine.dp) == ("/models/qwen2", 2, 1, 1)
    assert engine.arguments["engine"] == "sglang"
    assert engine.arguments["dtype"] == "auto"  # no config.json on this host: SGLang's own choice, unread


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("quantization", "fp8", "quantization"),
        ("modelopt_quant", "fp4", "modelopt_quant"),
        ("enable_lora", True, "LoRA"),
        ("speculative_algorithm", "EAGLE", "speculative"),
        ("enable_dp_attention", True, "enable_dp_attention"),
        ("ep_size", 2, "ep_size"),
        ("attn_cp_size", 2, "attn_cp_size"),
        ("pp_size", 2, "pipeline"),
        ("json_model_override_args", '{"num_hidden_layers": 1}', "json_model_override_args"),
        ("load_format", "gguf", "load_format"),
        ("model_impl", "transformers", "model_impl"),
        ("custom_weight_loader", ["my.loader"], "custom_weight_loader"),
        ("version", "0.5.24", "SGLang 0.5.24"),
    ],
)
def test_what_expected_digests_cannot_reproduce_on_sglang_is_refused_by_name(field, value, named):
    with serving(with_(**{field: value})) as url, pytest.raises(ExpectedDigestsError, match=named):
        server_engine(url)


def test_a_hand_flag_that_contradicts_an_sglang_server_names_both():
    with serving(SGLANG_INFO) as url:
        engine = server_engine(url)
    with pytest.raises(ExpectedDigestsError, match="contradicts"):
        reconcile(engine, {"tp": 1})
    with pytest.raises(ExpectedDigestsError, match="engine"):
        reconcile(engine, {"engine": "vllm"})
    assert reconcile(engine, {"tp": 2, "engine": "sglang"})["engine"] == "sglang"


@pytest.mark.parametrize(
    ("config", "dtype"),
    [
        ({"torch_dtype": "bfloat16"}, "bfloat16"),
        ({"dtype": "float16"}, "float16"),
        ({"torch_dtype": "float32"}, "float16"),
        ({"torch_dtype": "float32", "model_type": "gemma2"}, "bfloat16"),
        ({}, "float16"),
        ({"torch_dtype": "half"}, "float16"),
        ({"torch_dtype": "bfloat16", "text_config": {"dtype": "float16"}}, "float16"),
    ],
)
def test_sglangs_auto_dtype_is_the_configs(tmp_path: Path, config, dtype):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert config_dtype(str(tmp_path)) == dtype
    with serving(with_(model_path=str(tmp_path))) as url:
        assert server_engine(url).arguments["dtype"] == dtype


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_never_written_check_flags_only_rows_the_loader_left(dtype):
    import torch
    from weight_checker.expected.sglang.digests import _has_unwritten_row

    torch.manual_seed(0)
    for _ in range(200):  # ordinary biases and weights of every float dtype: never flagged
        assert not _has_unwritten_row(torch.randn(1152, dtype=getattr(torch, dtype)) * 0.02)
        assert not _has_unwritten_row(torch.randn(16, 8, dtype=getattr(torch, dtype)))
    fused = torch.randn(12, 8, dtype=getattr(torch, dtype))
    fused[8:12] = float("nan")  # k rows of a qkv the weights never wrote
    assert _has_unwritten_row(fused)
    bias = torch.randn(12, dtype=getattr(torch, dtype))
    bias[3] = float("nan")
    assert _has_unwritten_row(bias)
    assert not _has_unwritten_row(torch.empty(0, dtype=getattr(torch, dtype)))


class _Info:
    def __init__(self, tp_rank: int):
        self.tp_rank = tp_rank

    def model_dump(self) -> dict[str, Any]:
        return {"role": "target", "tp_rank": self.tp_rank}


class _Checker:
    """What the plugin's block answer reads of SGLang's checker, without SGLang."""

    def __init__(self, tp_rank: int):
        self._placement = {"dp_rank": None, "pp_rank": 0, "tp_rank": tp_rank}
        self.tp_rank = tp_rank

    def _parallelism_info(self, role: str) -> _Info:
        return _Info(self.tp_rank)


@pytest.mark.parametrize("size", ["0", "-4096", "many", ""])
def test_a_bad_block_request_is_an_answer_from_every_rank_never_an_exception(size):
    from weight_checker.engines.sglang import BLOCKS_ENTRY, rank_blocks
    from weight_checker.integrations.sglang.worker import blocks

    keys = ["dp0:pp0:pcp0:tp0:w", "dp0:pp0:pcp0:tp1:w"]
    answers = [blocks(_Checker(rank), "target", [size, *keys]) for rank in (0, 1)]
    assert all(set(a["checksums"]) == {BLOCKS_ENTRY} for a in answers)
    for rank, answer in enumerate(rank_blocks(answers)):
        assert answer["blocks"] == {}
        assert list(answer["errors"]) == [keys[rank]]
        assert "block_bytes must be a positive integer" in answer["errors"][keys[rank]]


def test_dtype_auto_given_asks_for_what_the_server_runs():
    with serving(with_(dtype="bfloat16")) as url:
        engine = server_engine(url)
    assert reconcile(engine, {"dtype": "auto"})["dtype"] == "bfloat16"
    with pytest.raises(ExpectedDigestsError, match="--dtype float16 contradicts"):
        reconcile(engine, {"dtype": "float16"})
