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
API key) and a Qwen2 at TP=2 (q/k/v biases, KV heads split, an MLP the CPU engine pads)."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import pytest
from weight_checker.engines.sglang import rank_digests
from weight_checker.testing.sglang.launch import sglang_env, sglang_python, sglang_server
from weight_checker.testing.sglang.models import write_tiny_sglang_model

from .cli import run_cli
from .pause_stress import stress
from .sglang_oracle import rank_tensors, sha256

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sglang_python(ROOT)
KEY = "sgl-s3cret"
HEX64 = re.compile(r"[0-9a-f]{64}\Z")
PROMPT = {"text": "ab cd ef", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}

needs_sglang = pytest.mark.skipif(PYTHON is None, reason="no SGLang environment (scripts/dev-env.sh makes one)")

#: name -> (architecture, tp, API key, config fields). The Qwen2's MLP (80)
#: is not a multiple of 32 x TP: SGLang's CPU engine pads it (to 128 at
#: TP=2), and the expected digests must too.
SERVERS = {
    "llama-tp1": ("llama", 1, KEY, {}),
    "qwen2-tp2": ("qwen2", 2, None, {"intermediate_size": 80}),
}


@pytest.fixture(scope="module", params=list(SERVERS))
def sglang(request, tmp_path_factory, models):
    arch, tp, key, config = SERVERS[request.param]
    root = tmp_path_factory.mktemp(f"sglang-{request.param}")
    with models.exclusive():  # transformers' lazy imports race the shared servers' checkpoint writers
        model = write_tiny_sglang_model(root / arch, arch, **config)
        seed1 = write_tiny_sglang_model(root / f"{arch}-seed1", arch, seed=1, **config)
    assert PYTHON is not None
    with sglang_server(model, root / "server.log", PYTHON, tp=tp, api_key=key) as server:
        server.tp = tp  # type: ignore[attr-defined]
        server.seed1 = str(seed1)  # type: ignore[attr-defined]
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


def in_sglangs_env(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python ARGS`` in SGLang's environment: the trainer side of the
    SGLang checks imports SGLang (its model classes, its serializer). Its
    output goes to files, not pipes: a process it leaves behind (torch's
    shared-memory manager) must not keep this waiting."""
    import tempfile

    assert PYTHON is not None
    env = {k: v for k, v in sglang_env(1).items() if k != "WEIGHT_CHECKER_SGLANG_DEV_MODE"}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        code = subprocess.run([str(PYTHON), *args], env=env, stdout=out, stderr=err, timeout=timeout, cwd=ROOT)
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess(code.args, code.returncode, out.read(), err.read())


def sglang_cli(server, *args: str) -> subprocess.CompletedProcess:
    key = ["--api-key", server.api_key] if server.api_key else []
    return in_sglangs_env("-m", "weight_checker.cli", *args, *key)


@needs_sglang
def test_block_digests_are_hashlibs_of_each_block_of_the_engines_tensor(sglang):
    keys, want = [], {}
    for rank in range(sglang.tp):
        tensors = rank_tensors(Path(sglang.model), sglang.tp, rank)
        for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight"):
            key = f"dp0:pp0:pcp0:tp{rank}:{name}"
            raw = tensors[name].contiguous().view(-1).view(torch_uint8()).numpy().tobytes()
            keys.append(key)
            want[key] = [hashlib.sha256(raw[i : i + 1024]).hexdigest() for i in range(0, len(raw), 1024)]
    status, body = sglang.post("/weight_checker", {"action": "block_digests", "keys": keys, "block_bytes": 1024})
    assert status == 200, body
    assert {k: v["digests"] for k, v in body["block_digests"].items()} == want
    status, body = sglang.post("/weight_checker", {"action": "block_digests", "keys": ["dp0:pp0:pcp0:tp0:nope"],
                                                   "block_bytes": 1024})  # fmt: skip
    assert status == 400 and "nope" in body["error"]["message"], body
    generates(sglang)


def torch_uint8():
    import torch

    return torch.uint8


@pytest.fixture(scope="module")
def updates(sglang):
    """The update scenarios of tests/sglang_updates.py, run once per server."""
    done = in_sglangs_env(
        str(ROOT / "tests" / "sglang_updates.py"), sglang.url, sglang.api_key or "", sglang.model, sglang.seed1
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_sglang
def test_expected_digests_like_the_server_equal_the_engine_key_for_key(sglang, updates):
    assert updates["expected0"] == ours(sglang)
    assert updates["expected1"] == {
        f"dp0:pp0:pcp0:tp{r}:{n}": sha256(t)
        for r in range(sglang.tp)
        for n, t in rank_tensors(Path(sglang.seed1), sglang.tp, r).items()
    }


@needs_sglang
@pytest.mark.parametrize("how", ["tensor", "distributed"])
def test_an_update_through_sglangs_session_matches_the_expected_digests(sglang, updates, how):
    result = updates[how]
    assert result["match"] is True and result["mismatches"] == [], result
    assert result["key_count"] == len(updates["expected1"])
    assert ours(sglang) == updates["expected0"], "seed 0 loaded back"


@needs_sglang
def test_a_tensor_left_out_of_the_update_is_stale_on_every_rank(sglang, updates):
    result = updates["stale"]
    stale = sorted(f"dp0:pp0:pcp0:tp{r}:model.layers.0.mlp.down_proj.weight" for r in range(sglang.tp))
    assert result["match"] is False and result["mismatches"] == stale, result["mismatches"]
    assert sorted(result["classes"]["stale"]) == stale


@needs_sglang
def test_zeroed_rows_are_named_zeros_with_their_rows(sglang, updates):
    result = updates["zeros"]
    key = "dp0:pp0:pcp0:tp0:model.embed_tokens.weight"  # rows 96-223 live on tp0 at TP=1 and TP=2
    assert result["mismatches"] == [key], result["mismatches"]
    (explained,) = result["explanation"]["keys"]
    assert explained["cause"] == "zeros", explained
    assert "rows 96-223" in explained["where"], explained["where"]
    assert explained["located_by"] == "chain states", explained  # issue 56: the ranks continued the recorded states


@needs_sglang
@pytest.mark.parametrize("sglang", ["qwen2-tp2"], indirect=True)
def test_tp1_given_tp0s_shard_is_wrong_shard(sglang, updates):
    result = updates["wrong-shard"]
    key = "dp0:pp0:pcp0:tp1:model.layers.1.self_attn.o_proj.weight"
    assert result["mismatches"] == [key], result["mismatches"]
    assert result["classes"]["wrong-shard"] == [key]
    (explained,) = result["explanation"]["keys"]
    assert explained["cause"] == "shard-of:tp0", explained
    assert explained["located_by"] in (None, "chain states"), explained  # None: told by whole digests


@needs_sglang
def test_expect_server_writes_the_engines_digests_and_refuses_a_contradiction(sglang, tmp_path):
    out = tmp_path / "expected.json"
    done = sglang_cli(sglang, "expect", "--server", sglang.url, "-o", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads(out.read_text())
    assert manifest["checksums"] == ours(sglang)
    assert manifest["layout"]["engine"] == "sglang" and manifest["layout"]["tp"] == sglang.tp
    wrong = sglang_cli(sglang, "expect", "--server", sglang.url, "--tp", str(sglang.tp + 1), "-o", str(out))
    assert wrong.returncode == 2, wrong.stdout + wrong.stderr
    last = wrong.stderr.strip().splitlines()[-1]
    assert "contradicts" in last and "Traceback" not in wrong.stderr, wrong.stderr[-2000:]


@needs_sglang
@pytest.mark.parametrize("sglang", ["llama-tp1"], indirect=True)
@pytest.mark.parametrize("pause", ["keep", "abort"])
def test_clients_generating_through_checks_in_a_loop_keep_every_completion_with_keep(sglang, pause):
    def generate(prompt: str):
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
        status, answer = sglang.post("/generate", body)
        assert status == 200, answer
        return answer["output_ids"], answer["meta_info"]["finish_reason"]["type"] == "abort"

    def check() -> bool:  # reset, reload from disk, compare: the weights are zeroed while requests wait
        done = cli_verify(sglang, "--transfer", "reload", "--pause", pause)
        assert done.returncode in (0, 1), done.stderr[-2000:]
        return done.returncode == 0

    out = stress(generate, check, seconds=12)
    assert not out.failed_checks and not out.errors, (out.failed_checks, out.errors[:3])
    assert out.completions > 0 and not out.different, out.different[:3]
    if pause == "keep":
        assert out.aborted == 0, f"{out.aborted} of {out.completions} completions aborted"
    else:  # today's behaviour: what is in flight at a pause is aborted
        assert out.aborted > 0, out
    generates(sglang)


@needs_sglang
def test_an_in_process_sglang_engine_is_verified_paused_and_explained(tmp_path_factory, models):
    root = tmp_path_factory.mktemp("sglang-engine")
    with models.exclusive():
        ckpt0 = write_tiny_sglang_model(root / "llama", "llama")
        ckpt1 = write_tiny_sglang_model(root / "llama-seed1", "llama", seed=1)
    done = in_sglangs_env(str(ROOT / "tests" / "sglang_engine_checks.py"), str(ckpt0), str(ckpt1))
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    oracle0 = {f"dp0:pp0:pcp0:tp0:{n}": sha256(t) for n, t in rank_tensors(ckpt0, 1, 0).items()}
    assert out["digests"] == oracle0 == out["expected0"]
    reload = out["reload"]
    assert reload["match"] is True and reload["key_count"] == len(oracle0), reload
    steps = [s["step"] for s in reload["steps"]]
    assert steps[0] == "pause" and steps[-1] == "resume" and "reset" in steps, steps
    assert out["seed1"]["match"] is True, out["seed1"]
    zeros = out["zeros"]
    assert zeros["mismatches"] == ["dp0:pp0:pcp0:tp0:model.embed_tokens.weight"], zeros["mismatches"]
    (explained,) = zeros["explanation"]["keys"]
    assert explained["cause"] == "zeros" and "rows 96-223" in explained["where"], explained
    assert explained["located_by"] == "chain states", explained
    assert out["short"] and "q_proj.weight' has shape [32, 64]" in out["short"], out["short"]
    assert len(out["generated"]) == 4


@needs_sglang
def test_replicas_reads_every_rank_of_an_sglang_server(sglang):
    key = ["--api-key", sglang.api_key] if sglang.api_key else []
    done = run_cli("replicas", "--url", sglang.url, *key, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["consistent"] is True and report["replicas"] == ["dp0"], report


# --- Sharded trainers (issue 56): SGLang engines' digests from dim-0 shards, nothing gathered ----------------------


@needs_sglang
def test_every_sglang_key_from_shards_equals_the_whole_tensor_path_and_hashlib(tmp_path):
    # tests/sglang_sharded.py: the layout from SGLang's own loaders fed with
    # shapes only, each key hashed holder by holder; a Llama whose dims do
    # not divide by the world, a Qwen2 whose MLP the CPU engine pads (zero
    # columns of down_proj), a Qwen3 with q_norm and k_norm (given values of
    # their own), a vocabulary padded from 1000 to 1024 rows; TP 1 and 2.
    done = in_sglangs_env(str(ROOT / "tests" / "sglang_sharded.py"), str(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    cases = json.loads(done.stdout.strip().splitlines()[-1])
    refused = cases.pop("refused")
    assert cases.pop("staged") is True  # a callable refilling its buffers for each rank
    for how in ("layout", "whole"):  # a missing weight: refused alike, naming what it never wrote
        assert refused[how] and "never wrote 2 parameter(s) of pp0:tp0" in refused[how], refused
        assert "qkv_proj.weight" in refused[how] and "model.norm.weight" in refused[how], refused
    assert len(cases) == 5
    for case, got in cases.items():
        assert got["not_pieces"] == [], case
        assert got["chained"] == got["whole"] == got["oracle"], case
        assert got["spans_holders"], case  # the chain really is handed on


def sglang_trainer(server, world: int, steps: int, perturb: int | None = None) -> dict:
    """tests/fsdp_worker.py's ``world`` ranks (a real ``fully_shard`` trainer on
    a gloo CPU mesh) in SGLang's environment, their digests collective from
    their shards for the engine ``server`` runs (``--like``); rank 0's result."""
    import shutil
    import socket
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp(prefix="fsdp-sglang-")) / "result.json"
    args = [str(ROOT / "tests" / "fsdp_worker.py"), server.model, str(out), "1", str(steps)]
    args += [str(perturb)] if perturb is not None else []
    base = {k: v for k, v in sglang_env(1).items() if k != "WEIGHT_CHECKER_SGLANG_DEV_MODE"}
    if server.api_key:
        base["VLLM_API_KEY"] = server.api_key  # what like=URL's /server_info request sends
    procs, logs = [], []
    for rank in range(world):
        env = {**base, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}  # fmt: skip
        log = tempfile.TemporaryFile("w+")  # files, not pipes: see in_sglangs_env
        logs.append(log)
        procs.append(subprocess.Popen([str(PYTHON), *args, "--like", server.url], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=ROOT))  # fmt: skip
    try:
        for p in procs:
            p.wait(timeout=600)
    finally:
        for p in procs:
            p.kill()
    text = []
    for log in logs:
        log.seek(0)
        text.append(log.read())
        log.close()
    try:
        assert all(p.returncode == 0 for p in procs), "\n".join(text)[-6000:]
        return json.loads(out.read_text())
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)  # the run's working directory, read


@needs_sglang
def test_fsdp2_shards_give_the_sglang_servers_own_digests_and_a_perturbed_row_exactly_its_keys(sglang):
    # The trainer's fp32 masters, fully_shard'ed over 4 ranks (TP=1 server)
    # or 2 (TP=2: padded MLP, padded vocabulary, biases), are the
    # checkpoint's: the digests from its shards, the engine's layout read
    # from the server, must be the server's own route's, key for key. At
    # TP=2, trainer rank 1 zeroes its first row of layer 0's down_proj: a
    # row that lies in both TP ranks' column slices, and nowhere else.
    perturb = 1 if sglang.tp == 2 else None
    result = sglang_trainer(sglang, 4 if sglang.tp == 1 else 2, steps=0, perturb=perturb)
    engine = ours(sglang)
    assert result["oracle"] == engine  # the gather, before the perturbation
    assert result["exchanged"] > 0  # chain states were handed on
    differ = sorted(k for k in engine if result["got"][k] != engine[k])
    assert set(result["got"]) == set(engine)
    if perturb is None:
        assert differ == []
    else:
        assert differ == [f"dp0:pp0:pcp0:tp{r}:model.layers.0.mlp.down_proj.weight" for r in (0, 1)]
