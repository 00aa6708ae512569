"""Verify an RL step with no reset: the trainer's own tensors (a state dict
changed in memory), pushed to a real TP=2 engine (the shared one of tests/servers.py), checked against
expected_digests of those tensors. On CPU the push is a checkpoint written
from the state dict and ``reload_weights`` with its path.

A push that skips one tensor is ``stale`` for exactly that key on every rank;
every rank loading tp0's shard (a test-only worker hook) is ``wrong-shard``
naming tp0.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import weight_checker
from weight_checker.testing.launch import vllm_available

from . import vllm_checks as checks
from .cli import run_cli

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

SKIPPED = "model.layers.0.mlp.down_proj.weight"


def train_step(state: dict, seed: int) -> dict:
    """One "step": every tensor changes."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {k: (v.float() + 0.01 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in state.items()}


def push(state: dict, config_dir: Path, out: Path) -> Path:
    """What a CPU trainer can push: a checkpoint written from the tensors."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(config_dir / "config.json", out / "config.json")
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out


@pytest.fixture
def engine(vllm_qwen2_tp2, tmp_path):
    """The shared TP=2 qwen2 server (GPU layout), its checkpoint and tensors;
    it loads its own checkpoint again after the test."""
    from safetensors.torch import load_file

    model = Path(vllm_qwen2_tp2.model)
    yield vllm_qwen2_tp2, model, load_file(str(model / "model.safetensors")), tmp_path
    checks.reload_checkpoint(vllm_qwen2_tp2)


def reload(server, path: Path):
    def transfer() -> None:
        status, body = server.post(
            "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        )
        assert status == 200, body

    return transfer


def test_a_step_pushed_from_the_trainers_tensors_matches(engine):
    server, model, state, root = engine
    step1 = train_step(state, 1)
    expected = weight_checker.expected_digests(model, step1.items(), tp=2)
    result = weight_checker.verify(
        server.url, transfer=reload(server, push(step1, model, root / "step1")), expected=expected
    )
    assert result.mismatches == {}
    assert result.match and result.key_count == len(expected)
    assert [s.name for s in result.steps] == [
        "pause", "checksum (before)", "transfer", "checksum (after)", "compare", "resume",
    ]  # fmt: skip
    assert not any("reset" in s.name for s in result.steps)
    assert server.get("/is_paused")[1] == {"is_paused": False}


def test_a_push_that_skips_one_tensor_is_stale_on_every_rank(engine):
    server, model, state, root = engine
    before = train_step(state, 1)  # what the engine holds now (the previous test's step)
    weight_checker.verify(
        server.url,
        transfer=reload(server, push(before, model, root / "step1b")),
        expected=weight_checker.expected_digests(model, before.items(), tp=2),
    )
    step2 = train_step(state, 2)
    pushed = {**step2, SKIPPED: before[SKIPPED]}
    expected = weight_checker.expected_digests(model, step2.items(), tp=2)
    result = weight_checker.verify(
        server.url, transfer=reload(server, push(pushed, model, root / "step2")), expected=expected
    )
    assert result.mismatches == {f"dp0:pp0:pcp0:tp{t}:{SKIPPED}": "stale" for t in range(2)}


def test_every_rank_loading_tp0s_shard_is_wrong_shard_naming_tp0(engine):
    server, model, state, root = engine
    step3 = train_step(state, 3)
    path = push(step3, model, root / "step3")
    expected = weight_checker.expected_digests(model, step3.items(), tp=2)

    def load_tp0_shard() -> None:
        body = {"method": "weight_checker_test_load_tp0_shard", "kwargs": {"weights_path": str(path)}}
        status, answer = server.post("/collective_rpc", body)
        assert status == 200, answer

    result = weight_checker.verify(server.url, transfer=load_tp0_shard, expected=expected)
    classes = result.classes()
    assert set(classes) == {"wrong-shard"}, classes
    wrong = classes["wrong-shard"]
    # Only tp1's sharded tensors are wrong; tp0 loaded its own shard, norms are replicated.
    assert wrong and all(":tp1:" in k for k in wrong)
    assert any(k.endswith("qkv_proj.weight") for k in wrong) and any(k.endswith("down_proj.weight") for k in wrong)
    assert not any("layernorm" in k or k.endswith("model.norm.weight") for k in wrong)
    for k in wrong:
        assert "tp0" in result.details[k]


def test_cli_expect_then_verify_without_reset(engine, tmp_path):
    server, model, state, root = engine
    step4 = train_step(state, 4)
    path = push(step4, model, root / "step4")
    manifest = tmp_path / "expected.json"
    cli = [sys.executable, "-m", "weight_checker.cli"]
    r = run_cli("expect", path, "--tp", "2", "-o", manifest)
    assert r.returncode == 0, r.stderr
    body = json.dumps({"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
    post = (
        "import sys, urllib.request as u; u.urlopen(u.Request(sys.argv[1] + '/collective_rpc', sys.argv[2].encode(),"
        " {'Content-Type': 'application/json'}), timeout=300)"
    )
    transfer = shlex.join([sys.executable, "-c", post, server.url, body])
    r = subprocess.run(
        [*cli, "verify", "--url", server.url, "--expected", str(manifest), "--transfer-cmd", transfer, "--json"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["match"] is True and report["key_count"] == len(json.loads(manifest.read_text())["checksums"])
    # The same manifest after a push that changes nothing: every key is stale, exit 1.
    path5 = push(train_step(state, 5), model, root / "step5")
    r = run_cli("expect", path5, "--tp", "2", "-o", manifest)
    r = subprocess.run(
        [*cli, "verify", "--url", server.url, "--expected", str(manifest), "--transfer-cmd", "true"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "stale" in r.stdout and "changed" not in r.stdout
