"""This package on a real SGLang 0.5.23 server (CPU, the test-only kernel
stand-in). The route: every rank's digests, against three oracles that do
not use this package's code: ``hashlib`` over the tensors SGLang's loader
makes of the checkpoint (tests/sglang_oracle.py), SGLang's own
``/weights_checker`` (whose value on CPU is the first 16 hex digits of the
same SHA-256), and the keys SGLang's checker walks; then reset, compare, bad
input and the API key. The check: ``weight-checker verify`` and
``weight_checker.verify`` on an SGLang URL, its family read from the server,
paused and resumed through SGLang's own calls in the mode asked for.

Two servers, each started once for this module: a Llama at TP=1 (behind an
API key) and a Qwen2 at TP=2 (q/k/v biases, KV heads split)."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import pytest
from weight_checker.integrations.sglang.endpoint import rank_digests
from weight_checker.testing.sglang.launch import sglang_python, sglang_server
from weight_checker.testing.sglang.models import write_tiny_sglang_model

from .cli import run_cli
from .sglang_oracle import rank_tensors, sha256

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sglang_python(ROOT)
KEY = "sgl-s3cret"
HEX64 = re.compile(r"[0-9a-f]{64}\Z")
PROMPT = {"text": "ab cd ef", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}

needs_sglang = pytest.mark.skipif(PYTHON is None, reason="no SGLang environment (scripts/dev-env.sh makes one)")

#: name -> (architecture, tp, API key)
SERVERS = {"llama-tp1": ("llama", 1, KEY), "qwen2-tp2": ("qwen2", 2, None)}


@pytest.fixture(scope="module", params=list(SERVERS))
def sglang(request, tmp_path_factory, models):
    arch, tp, key = SERVERS[request.param]
    root = tmp_path_factory.mktemp(f"sglang-{request.param}")
    with models.exclusive():  # transformers' lazy imports race the shared servers' checkpoint writers
        model = write_tiny_sglang_model(root / arch, arch)
    assert PYTHON is not None
    with sglang_server(model, root / "server.log", PYTHON, tp=tp, api_key=key) as server:
        server.tp = tp  # type: ignore[attr-defined]
        yield server


def prefix_of(info: dict) -> str:
    return f"dp{info['dp_rank']}:pp{info['pp_rank']}:pcp0:tp{info['tp_rank']}:"


def ours(server) -> dict[str, str]:
    status, body = server.post("/weight_checker", {"action": "checksum"})
    assert status == 200, body
    return body["checksums"]


def sglangs_own(server) -> dict[str, str]:
    """SGLang's ``/weights_checker`` values, keyed as this package keys them."""
    status, body = server.post("/weights_checker", {"action": "checksum", "selector": "target"})
    assert status == 200 and body["success"], body
    out = {}
    for rank in body["ranks"]:
        (info,) = rank["parallelism_info"]
        out.update({prefix_of(info) + name: value for name, value in rank["checksums"].items()})
    return out


def oracle(server) -> dict[str, str]:
    """hashlib over each rank's tensors as SGLang's loader lays them out."""
    out = {}
    for rank in range(server.tp):
        tensors = rank_tensors(Path(server.model), server.tp, rank)
        out.update({f"dp0:pp0:pcp0:tp{rank}:{name}": sha256(t) for name, t in tensors.items()})
    return out


def generates(server) -> None:
    status, body = server.post("/generate", PROMPT)
    assert status == 200 and len(body["output_ids"]) == 4, body
    assert server.get("/health", api_key=None)[0] == 200


@needs_sglang
def test_every_digest_is_hashlibs_of_the_engines_tensor_and_extends_sglangs_own_value(sglang):
    digests = ours(sglang)
    theirs = sglangs_own(sglang)
    assert set(digests) == set(theirs), "the keys must cover exactly what SGLang's checker walks"
    assert {k.split(":", 4)[3] for k in digests} == {f"tp{r}" for r in range(sglang.tp)}
    for key, digest in digests.items():
        assert HEX64.match(digest), (key, digest)
        assert digest[:16] == theirs[key], key
    assert digests == oracle(sglang)
    # The padded vocabulary rows are in the digest: 1000 rows padded to 1024.
    embed = rank_tensors(Path(sglang.model), sglang.tp, 0)["model.embed_tokens.weight"]
    assert embed.shape[0] == 1024 // sglang.tp


@needs_sglang
def test_two_checksums_agree_and_compare_names_exactly_the_changed_key(sglang):
    digests = ours(sglang)
    assert ours(sglang) == digests
    status, body = sglang.post("/weight_checker", {"action": "compare", "baseline": digests})
    assert (status, body) == (200, {"match": True, "mismatches": []})
    key = sorted(digests)[0]
    changed = dict(digests, **{key: "0" * 64})
    status, body = sglang.post("/weight_checker", {"action": "compare", "baseline": changed})
    assert (status, body) == (200, {"match": False, "mismatches": [key]})


@needs_sglang
def test_reset_zeroes_every_rank_and_an_update_from_disk_restores_the_digests(sglang):
    before = ours(sglang)
    sizes = {}
    for rank in range(sglang.tp):
        for name, t in rank_tensors(Path(sglang.model), sglang.tp, rank).items():
            sizes[f"dp0:pp0:pcp0:tp{rank}:{name}"] = t.numel() * t.element_size()
    try:
        status, body = sglang.post("/weight_checker", {"action": "reset"})
        assert (status, body) == (200, {"status": "reset"})
        zeroed = ours(sglang)
        assert zeroed == {k: hashlib.sha256(bytes(n)).hexdigest() for k, n in sizes.items()}
        status, body = sglang.post("/weight_checker", {"action": "compare", "baseline": before})
        assert status == 200 and body["mismatches"] == sorted(before)
    finally:
        status, body = sglang.post("/update_weights_from_disk", {"model_path": sglang.model})
        assert status == 200 and body["success"], body
    assert ours(sglang) == before
    generates(sglang)


@needs_sglang
@pytest.mark.parametrize(
    "body",
    [{}, {"action": "frobnicate"}, {"action": "compare"}, [], None, {"action": "compare", "baseline": {"k": 1}}],
    ids=["empty", "unknown-action", "compare-no-baseline", "list", "no-body", "non-string-digest"],
)
def test_bad_input_is_a_400_in_vllms_error_shape_and_the_engine_still_generates(sglang, body):
    status, answer = sglang.post("/weight_checker", body)
    assert status == 400, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["code"] == 400
    generates(sglang)


@needs_sglang
@pytest.mark.parametrize("sglang", ["llama-tp1"], indirect=True)
def test_the_route_is_behind_sglangs_api_key(sglang):
    assert sglang.api_key == KEY
    status, answer = sglang.post("/weight_checker", {"action": "checksum"}, api_key=None)
    assert status == 401, answer
    status, answer = sglang.post("/weight_checker", {"action": "checksum"}, api_key="wrong")
    assert status == 401, answer
    assert sglang.post("/weight_checker", {"action": "checksum"})[0] == 200


@needs_sglang
def test_an_sglang_the_plugin_does_not_know_is_refused_in_one_line():
    script = (
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stderr, level=logging.INFO, format='%(message)s')\n"
        "from weight_checker.integrations.sglang import plugin\n"
        "plugin.KNOWN_VERSIONS = ('0.0.1',)\n"
        "print(plugin.register())\n"
    )
    done = subprocess.run([str(PYTHON), "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    lines = [line for line in done.stderr.splitlines() if "weight_checker" in line]
    assert len(lines) == 1 and "not a version this plugin knows" in lines[0], done.stderr


def test_a_draft_models_keys_lose_the_role_sglang_puts_in_front():
    ranks = [
        {
            "checksums": {"dp0:pp0:pcp0:tp1:w": "a" * 64, "draft.dp0:pp0:pcp0:tp1:draft:w": "b" * 64},
            "parallelism_info": [{"role": "target"}, {"role": "draft"}],
        }
    ]
    assert rank_digests(ranks) == [{"dp0:pp0:pcp0:tp1:w": "a" * 64, "dp0:pp0:pcp0:tp1:draft:w": "b" * 64}]
    assert rank_digests([]) == []


def restore(server) -> None:
    """The server's weights loaded again from its checkpoint (after a check that left them reset)."""
    status, body = server.post("/update_weights_from_disk", {"model_path": server.model})
    assert status == 200 and body["success"], body


def cli_verify(server, *args: str):
    key = ["--api-key", server.api_key] if server.api_key else []
    return run_cli("verify", "--url", server.url, *key, *args)


@needs_sglang
@pytest.mark.parametrize("pause", ["abort", "keep"])
def test_verify_with_a_reload_matches_on_sglang_in_either_pause_mode(sglang, pause):
    before = ours(sglang)
    done = cli_verify(sglang, "--transfer", "reload", "--pause", pause)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "MATCH" in done.stdout and f"{len(before)} keys" in done.stdout, done.stdout
    assert ours(sglang) == before
    status, body = sglang.get("/model_info")
    assert status == 200 and body["model_path"] == sglang.model
    generates(sglang)


@needs_sglang
def test_a_transfer_that_did_nothing_is_every_key_untouched_since_reset(sglang):
    before = ours(sglang)
    try:
        done = cli_verify(sglang, "--transfer-cmd", "true", "--json")
        assert done.returncode == 1, done.stdout + done.stderr
        report = json.loads(done.stdout)
        assert report["match"] is False
        assert sorted(report["classes"]["untouched-since-reset"]) == sorted(before)
    finally:
        restore(sglang)
    assert ours(sglang) == before
    generates(sglang)


@needs_sglang
def test_the_library_reads_the_engine_from_the_server_and_verifies(sglang):
    import weight_checker
    from weight_checker.verify.targets.http import HttpTarget

    assert HttpTarget(sglang.url, api_key=sglang.api_key).family(sglang.url).name == "sglang"
    result = weight_checker.verify(
        sglang.url, lambda: restore(sglang), api_key=sglang.api_key, pause="keep", engine="sglang"
    )
    assert result.match and not result.mismatches, result.to_json()
    generates(sglang)


@needs_sglang
def test_a_pause_mode_sglang_lacks_is_refused_in_one_line_and_nothing_is_left_paused(sglang):
    before = ours(sglang)
    done = cli_verify(sglang, "--transfer", "reload", "--pause", "wait")
    assert done.returncode == 2, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "SGLang has no 'wait' pause" in last and "Traceback" not in done.stderr, done.stderr
    assert ours(sglang) == before
    generates(sglang)
    forced = cli_verify(sglang, "--transfer", "reload", "--pause", "wait", "--engine", "sglang")
    assert forced.returncode == 2 and "SGLang has no 'wait' pause" in forced.stderr, forced.stderr


@needs_sglang
def test_forcing_the_wrong_engine_fails_at_the_pause_and_changes_nothing(sglang):
    before = ours(sglang)
    done = cli_verify(sglang, "--transfer", "reload", "--engine", "vllm")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "pause" in done.stderr.strip().splitlines()[-1], done.stderr
    assert ours(sglang) == before
    generates(sglang)
