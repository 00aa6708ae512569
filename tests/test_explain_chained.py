"""Explanations from chain states (issue 56): the expected digests record each
key's SHA-256 chain at its block boundaries; the engine continues those states
over its own blocks, and the blocks that differ are told without either side
holding the other's bytes.

The oracles: hashlib over the tensors' bytes (a state finished is the digest of
the prefix; a state continued over a block finishes to the digest of the prefix
and that block), and the block-digest explanation (tests/test_explain.py checks
it against hashlib), which the chained one must equal for every fault. Real
vLLM servers explain through chain states in tests/test_explain_engines.py."""

from __future__ import annotations

import hashlib

import pytest
import torch
from weight_checker import _core
from weight_checker.errors import SettingsError, WeightCheckerError
from weight_checker.expected.manifest import ExpectedDigests
from weight_checker.hashing.block_states import (
    boundaries,
    continue_blocks,
    digests_with_states,
    worker_answer,
)
from weight_checker.hashing.blocks import block_bytes_for, block_ranges, flat_bytes
from weight_checker.verify.explain import TensorMap, Version, explain

TP0, TP1 = "dp0:pp0:pcp0:tp0:", "dp0:pp0:pcp0:tp1:"
KEY = TP0 + "w"


def raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(raw(t)).hexdigest()


def finished(state: bytes) -> str:
    return _core.MultiHasher.resume([state]).finish()[0][0]


def weights(seed: int, rows: int = 64, cols: int = 48, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 0.02).to(dtype)


def recorded(named: dict[str, torch.Tensor]) -> ExpectedDigests:
    """Expected digests of tensors held here, with their chain states (as expected_digests records them)."""
    digests, states = digests_with_states(named)
    out = ExpectedDigests(digests)
    out.block_states = states
    return out


def engine(held: dict[str, torch.Tensor], *, chains: bool = True, calls: list | None = None):
    """The engine's answers (the worker's own function over the tensors it holds)."""

    def fetch(keys, block_bytes, chain=None):
        if calls is not None:
            calls.append(("chain" if chain else "blocks", list(keys)))
        got = worker_answer([(k, held[k]) for k in keys], block_bytes, "engine", chain)
        if got["errors"]:
            raise WeightCheckerError(str(got["errors"]))
        return got["blocks"]

    if chains:
        fetch.chains = True  # type: ignore[attr-defined]
    return fetch


class Counting(TensorMap):
    """Expected tensors given, each request counted."""

    def __init__(self, tensors):
        super().__init__(tensors)
        self.asked: list[list[str]] = []

    def tensors(self, keys, transforms):
        self.asked.append(list(keys))
        return super().tensors(keys, transforms)


# --- the states themselves -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((64, 48), torch.bfloat16), ((1000,), torch.float32), ((7, 3), torch.float16), ((1, 5), torch.int8)],
)
def test_each_recorded_state_is_the_chain_after_its_blocks_and_the_last_the_digest(shape, dtype):
    t = (torch.arange(int(torch.tensor(shape).prod())) % 251).to(dtype).reshape(shape)
    digests, states = digests_with_states({"k": t})
    s = states["k"]
    data = raw(t)
    assert s.block_bytes == block_bytes_for(list(shape), t.element_size())
    assert (s.nbytes, s.shape, s.dtype) == (len(data), tuple(shape), str(dtype).removeprefix("torch."))
    at = boundaries(len(data), s.block_bytes)
    assert len(s.states) == len(at) == s.blocks + 1
    assert [finished(x) for x in s.states] == [hashlib.sha256(data[:n]).hexdigest() for n in at]
    assert digests["k"] == sha(t) == finished(s.states[-1])


def test_the_engine_continues_each_state_over_its_own_block_equal_only_where_the_block_is():
    want = weights(1)
    states = digests_with_states({"k": want})[1]["k"]
    held = want.clone()
    held[20:23] += 1  # rows 20-22: block 20-22 of 64 (one row a block)
    blocks = list(range(states.blocks))
    job = (flat_bytes(held), states.block_bytes, blocks, list(states.states[:-1]))
    ((got, zeros),) = continue_blocks([job])
    differ = [i for i in range(states.blocks) if got[i] != states.states[i + 1]]
    assert differ == [20, 21, 22]
    assert zeros == [False] * states.blocks
    # Independent of the recorded states: a continued state finishes to hashlib's digest of the prefix and the block.
    data, mine = raw(want), raw(held)
    for i, (a, b) in enumerate(block_ranges(len(data), states.block_bytes)):
        assert finished(got[i]) == hashlib.sha256(data[:a] + mine[a:b]).hexdigest()
    zeroed = held.clone()
    zeroed[5] = 0
    assert continue_blocks([(flat_bytes(zeroed), states.block_bytes, blocks, list(states.states[:-1]))])[0][1][5]


def test_a_bad_chain_request_is_an_error_naming_the_key_and_hashes_nothing():
    t = weights(2)
    block = block_bytes_for(list(t.shape), 2)
    state = digests_with_states({"k": t})[1]["k"].states[0].hex()
    cases = {
        "not pairs": "nope",
        "not hex": [[0, "zz"]],
        "not a state": [[0, "00" * 8]],
        "outside": [[64, state]],
        "twice": [[0, state], [0, state]],
    }
    for why, asked in cases.items():
        answer = worker_answer([("k", t)], block, "r", {"k": asked})
        assert set(answer["errors"]) == {"k"} and answer["blocks"] == {}, why
    outside = worker_answer([("k", t)], block, "r", {"k": [[64, state]]})["errors"]["k"]
    assert "outside the tensor held: shape [64, 48]" in outside
    assert worker_answer([("k", t)], 10**9, "r", {"k": [[0, state]]})["errors"]["k"].startswith("block_bytes")


def test_every_tensor_records_states_by_default_and_the_setting_leaves_small_ones_out(monkeypatch):
    small, big = torch.zeros(4096, dtype=torch.bfloat16), torch.ones(1024, 512, dtype=torch.bfloat16)  # 8 KB, 1 MiB
    monkeypatch.delenv("WEIGHT_CHECKER_BLOCK_STATES_MIN_MB", raising=False)
    assert set(digests_with_states({"small": small, "big": big})[1]) == {"small", "big"}
    monkeypatch.setenv("WEIGHT_CHECKER_BLOCK_STATES_MIN_MB", "1")
    digests, states = digests_with_states({"small": small, "big": big})
    assert set(states) == {"big"} and digests == {"small": sha(small), "big": sha(big)}
    monkeypatch.setenv("WEIGHT_CHECKER_BLOCK_STATES_MIN_MB", "2")
    assert digests_with_states({"small": small, "big": big})[1] == {}
    monkeypatch.setenv("WEIGHT_CHECKER_BLOCK_STATES_MIN_MB", "-1")
    with pytest.raises(SettingsError, match="WEIGHT_CHECKER_BLOCK_STATES_MIN_MB"):
        digests_with_states({"big": big})


def test_states_that_do_not_finish_to_the_expected_digest_are_not_used():
    """Expected digests edited since they were computed (a key's digest
    replaced, or merged from elsewhere) have no states for that key: its
    blocks are told by block digests."""
    want = weights(60)
    held = want.clone()
    held[3] = 0
    expected = recorded({KEY: want})
    other = weights(61)
    expected[KEY] = sha(other)  # the digest now describes another tensor; the states still the old one
    got = explain({KEY: "changed"}, {KEY: sha(held)}, expected, engine({KEY: held}), TensorMap({KEY: other}))
    assert got.keys[KEY].located_by == "block digests"


# --- the explanation: every cause as the block digests name it, without the expected tensors -----


def scenario(name: str):
    """(engine tensor, expected tensor, explain's keyword arguments) for one fault."""
    new, old = weights(10), weights(11)
    if name == "zeros":
        t = new.clone()
        t[10:20] = 0
        return t, new, {}
    if name == "stale-rows":
        t = new.clone()
        t[32:] = old[32:]
        return t, new, {"history": [Version("step-11", {KEY: sha(old)}, TensorMap({KEY: old}))]}
    if name == "fp16":  # values fp16 cannot hold, in rows 0 and 30
        e = new.clone()
        e[0, :8] = torch.tensor([1e-7, 3e-6, -2e-7, 7e4, 1e5, -9e4, 1e-8, 5e-6], dtype=torch.bfloat16)
        e[30, :2] = torch.tensor([1e-8, 8e4], dtype=torch.bfloat16)
        return e.float().half().bfloat16(), e, {}
    if name == "transposed":
        sq = weights(12, 48, 48)
        return sq.t().contiguous(), sq, {}
    if name == "unknown-and-zeros":
        t = new.clone()
        t[0:4] += 1
        t[40:44] = 0
        return t, new, {}
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["zeros", "stale-rows", "fp16", "transposed", "unknown-and-zeros"])
def test_every_cause_is_named_as_the_block_digests_name_it(name):
    held, want, kw = scenario(name)
    expected = recorded({KEY: want})
    calls: list = []
    chained = explain({KEY: "changed"}, {KEY: sha(held)}, expected, engine({KEY: held}, calls=calls),
                      TensorMap({KEY: want}), **kw).keys[KEY]  # fmt: skip
    plain = explain({KEY: "changed"}, {KEY: sha(held)}, expected, engine({KEY: held}, chains=False),
                    TensorMap({KEY: want}), **kw).keys[KEY]  # fmt: skip
    assert (chained.located_by, plain.located_by) == ("chain states", "block digests")
    assert {c for c, _ in calls} == {"chain"}
    a, b = chained.to_json(), plain.to_json()
    a.pop("located_by"), b.pop("located_by")
    assert a == b
    assert chained.cause != "unknown" or name == "unknown-and-zeros"


def test_zeros_a_version_and_another_ranks_shard_need_no_expected_tensor():
    """Where zeros, a previous version's recorded states and another rank's
    explain every differing block, the expected tensors are never asked for."""
    new, old = weights(20), weights(21)
    shard0 = weights(22)
    held = new.clone()
    held[0:8] = 0
    held[16:32] = old[16:32]
    held[48:] = shard0[48:]
    expected = recorded({KEY: new, TP1 + "w": shard0})
    previous = recorded({KEY: old})
    source = Counting({KEY: new, TP1 + "w": shard0})
    got = explain({KEY: "changed"}, {KEY: sha(held)}, expected, engine({KEY: held}), source,
                  history=[Version("step-11", previous, None)]).keys[KEY]  # fmt: skip
    row = 48 * 2
    assert got.block_causes == {
        "zeros": [(0, 8 * row)],
        "version:step-11": [(16 * row, 32 * row)],
        "shard-of:tp1": [(48 * row, 64 * row)],
    }
    assert got.cause == "mixed" and source.asked == []


def test_a_version_known_only_by_its_digests_and_states_is_named_where_the_block_digests_cannot():
    """The previous step's weights are gone (updated in place), its expected
    digests kept: its recorded states still name the stale rows."""
    new, old = weights(30), weights(31)
    held = new.clone()
    held[32:] = old[32:]
    expected, previous = recorded({KEY: new}), recorded({KEY: old})
    history = [Version("step-11", previous, None)]
    chained = explain({KEY: "changed"}, {KEY: sha(held)}, expected, engine({KEY: held}), TensorMap({KEY: new}),
                      history=history).keys[KEY]  # fmt: skip
    plain = explain({KEY: "changed"}, {KEY: sha(held)}, expected, engine({KEY: held}, chains=False),
                    TensorMap({KEY: new}), history=history).keys[KEY]  # fmt: skip
    assert chained.block_causes == {"version:step-11": [(32 * 96, 64 * 96)]}
    assert plain.block_causes == {"unknown": [(32 * 96, 64 * 96)]}


def test_an_engine_without_chain_states_is_asked_for_block_digests_and_a_key_without_states_too():
    new = weights(40)
    other = TP0 + "v"
    held = {KEY: new.clone(), other: new.clone()}
    held[KEY][3] = 0
    held[other][5] = 0
    expected = recorded({KEY: new, other: new})
    del expected.block_states[other]  # recorded for one key only
    calls: list = []
    got = explain(dict.fromkeys(held, "changed"), {k: sha(v) for k, v in held.items()}, expected,
                  engine(held, calls=calls), TensorMap({KEY: new, other: new}))  # fmt: skip
    assert (got.keys[KEY].located_by, got.keys[other].located_by) == ("chain states", "block digests")
    assert sorted(calls) == [("blocks", [other]), ("chain", [KEY])]
    assert {k: e.cause for k, e in got.keys.items()} == {KEY: "zeros", other: "zeros"}


def test_an_engine_holding_another_shape_is_said_and_never_compared():
    new = weights(50)
    held = weights(50, rows=32)
    got = explain({KEY: "changed"}, {KEY: sha(held)}, recorded({KEY: new}), engine({KEY: held}),
                  TensorMap({KEY: new})).keys[KEY]  # fmt: skip
    assert got.cause == "unknown" and "shape" in (got.note or "") and got.ranges == []


# --- the route: a chained request over two workers, and bad ones ---------------------------------


def chained_app(workers):
    import asyncio

    from fastapi import FastAPI
    from weight_checker.integrations.vllm.worker import weight_checker_block_digests, weight_checker_checksums
    from weight_checker.server import EngineAdapter, mount

    async def checksums():
        return [weight_checker_checksums(w) for w in workers]

    async def reset():
        raise AssertionError("not used")

    async def block_digests(keys, block_bytes, chain=None):
        await asyncio.sleep(0)
        return [weight_checker_block_digests(w, keys, block_bytes, chain) for w in workers]

    app = FastAPI()
    adapter = EngineAdapter(checksums=checksums, reset=reset, block_digests=block_digests)
    mount(app, lambda request: adapter)
    return app


def test_the_route_continues_the_states_each_worker_is_sent_over_its_own_blocks():
    from fastapi.testclient import TestClient

    from .test_block_digests import Worker

    workers = [Worker(0), Worker(1)]
    client = TestClient(chained_app(workers))
    keys = ["dp0:pp0:pcp0:tp0:0.weight", "dp0:pp0:pcp0:tp1:0.weight"]
    tensors = {k: dict(w.model.named_parameters())["0.weight"] for k, w in zip(keys, workers, strict=True)}
    want = {k: t.detach().clone() for k, t in tensors.items()}
    want[keys[1]][7] += 1  # tp1's expected row 7 differs from what tp1 holds
    states = digests_with_states(want)[1]
    block = states[keys[0]].block_bytes
    chain = {k: [[i, s.states[i].hex()] for i in range(s.blocks)] for k, s in states.items()}
    r = client.post("/weight_checker", json={"action": "block_digests", "keys": keys, "block_bytes": block,
                                             "chain": chain})  # fmt: skip
    assert r.status_code == 200, r.text
    got = r.json()["block_digests"]
    for key in keys:
        s = states[key]
        assert got[key]["blocks"] == list(range(s.blocks)) and got[key]["shape"] == [64, 48]
        differ = [i for i, x in enumerate(got[key]["states"]) if x != s.states[i + 1].hex()]
        assert differ == ([7] if key == keys[1] else [])
    # A key the chain does not name is answered with block digests, as before.
    r = client.post("/weight_checker", json={"action": "block_digests", "keys": keys, "block_bytes": block,
                                             "chain": {keys[0]: chain[keys[0]]}})  # fmt: skip
    assert "digests" in r.json()["block_digests"][keys[1]] and "states" in r.json()["block_digests"][keys[0]]


K = "dp0:pp0:pcp0:tp0:0.weight"
BAD_CHAINS = [
    ({K: [[0, "00"]]}, "not a weight-checker SHA-256 chain state"),
    ({K: [[0, "zz"]]}, "not hex"),
    ({K: [[99, "57435331" + "00" * 42]]}, "outside the tensor held"),
    ({"dp0:pp0:pcp0:tp0:1.weight": [[0, "00"]]}, "which 'keys' does not"),
    ({K: []}, "must list 1 to"),
    ({K: [[-1, "00"]]}, "must list 1 to"),
    ({K: [[True, "00"]]}, "must list 1 to"),
    ({K: [[0, "00" * 200]]}, "must list 1 to"),
    ({K: [[0, "00"], [0, "00"]]}, "names a block twice"),
    ([K], "must be an object"),
]


@pytest.mark.parametrize("chain,says", BAD_CHAINS)
def test_a_bad_chain_is_a_400_naming_why_and_the_engine_stays_healthy(chain, says):
    from fastapi.testclient import TestClient

    from .test_block_digests import Worker
    from .test_server import assert_vllm_error

    client = TestClient(chained_app([Worker(0), Worker(1)]))
    before = client.post("/weight_checker", json={"action": "checksum"}).json()
    r = client.post("/weight_checker", json={"action": "block_digests", "keys": [K], "block_bytes": 96, "chain": chain})
    assert_vllm_error(r, 400)
    assert says in r.json()["error"]["message"], r.json()
    assert client.post("/weight_checker", json={"action": "checksum"}).json() == before


def test_an_adapter_that_predates_chains_refuses_them_and_still_gives_block_digests():
    from fastapi.testclient import TestClient

    from .test_block_digests import Worker, make_app
    from .test_server import assert_vllm_error

    client = TestClient(make_app([Worker(0), Worker(1)]))
    r = client.post("/weight_checker", json={"action": "block_digests", "keys": [K], "block_bytes": 96,
                                             "chain": {K: [[0, "00"]]}})  # fmt: skip
    assert_vllm_error(r, 400)
    assert "cannot continue chain states" in r.json()["error"]["message"]
    r = client.post("/weight_checker", json={"action": "block_digests", "keys": [K], "block_bytes": 96})
    assert r.status_code == 200 and "digests" in r.json()["block_digests"][K]


# --- expected_digests records the states; a one-shot stream is explained without being read again ---


@pytest.mark.skipif(not __import__("weight_checker.testing.launch").testing.launch.vllm_available(),
                    reason="vLLM is not installed")  # fmt: skip
def test_an_update_stream_is_explained_from_its_states_without_being_read_again(tmp_path):
    """An update stream (weights from a callable) cannot be read again by
    the recompute, yet the recorded states still locate every differing
    block and name zeros and a previous step's rows (from that step's
    states), on both tensor-parallel ranks."""
    import weight_checker
    from safetensors.torch import load_file
    from weight_checker.expected.recompute import can_recompute, expected_tensors
    from weight_checker.verify.explain import ExpectedSource

    from .models import write_model

    path = write_model(tmp_path / "llama", "llama")
    state = load_file(str(path / "model.safetensors"))
    old = {k: v.clone() for k, v in state.items()}
    new = {k: (v.float() + 0.01).to(v.dtype) for k, v in state.items()}
    # Weights from a callable (a fresh stream each rank, as a trainer's update stream): never read again.
    previous = weight_checker.expected_digests(path, lambda: iter(list(old.items())), tp=2)
    expected = weight_checker.expected_digests(path, lambda: iter(list(new.items())), tp=2)
    assert set(expected.block_states) == set(expected)
    assert not can_recompute(expected) and not can_recompute(previous)
    # The engine's tensors: what a correct load of the new weights holds (a dict can be recomputed), then faults.
    held = {
        k: v[None]
        for k, v in expected_tensors(weight_checker.expected_digests(path, new, tp=2), list(expected)).items()
    }
    held_old = {
        k: v[None]
        for k, v in expected_tensors(weight_checker.expected_digests(path, old, tp=2), list(expected)).items()
    }
    down = [k for k in expected if k.endswith("layers.1.mlp.down_proj.weight")]
    gate = [k for k in expected if k.endswith("layers.0.mlp.gate_up_proj.weight")]
    for k in down:
        held[k] = held[k].clone()
        held[k][:4] = 0
    for k in gate:
        rows = held[k].shape[0]
        held[k] = torch.cat([held[k][: rows // 2], held_old[k][rows // 2 :]])
    wrong = down + gate
    current = {k: sha(v) for k, v in held.items()}
    assert all(current[k] != expected[k] for k in wrong)
    got = explain(dict.fromkeys(wrong, "changed"), current, expected, engine(held), ExpectedSource(expected),
                  history=[Version("step-11", previous, ExpectedSource(previous))])  # fmt: skip
    for k in down:
        e = got.keys[k]
        row = e.nbytes // e.shape[0]
        assert (e.located_by, e.block_causes) == ("chain states", {"zeros": [(0, 4 * row)]}), e
    for k in gate:
        e = got.keys[k]
        assert (e.located_by, e.cause) == ("chain states", "version:step-11"), e
        assert e.where == f"rows {e.shape[0] // 2}-{e.shape[0] - 1} of {e.shape[0]}"


@pytest.mark.skipif(not __import__("weight_checker.testing.launch").testing.launch.vllm_available(),
                    reason="vLLM is not installed")  # fmt: skip
def test_a_moe_models_experts_sent_through_fp16_are_named_from_states_as_from_block_digests(tmp_path):
    """The transforms' expected tensors come from an unchecked recompute
    (each block tried is checked against the recorded states instead): it
    loads the rank from all the weights, or a MoE's stacked experts would
    be left zero by the weights that feed them alone (a skeptical review
    found the candidate then never tried, and a false 'weights changed')."""
    import weight_checker
    from safetensors.torch import load_file
    from weight_checker.expected.recompute import expected_tensors
    from weight_checker.verify.explain import ExpectedSource

    from .models import write_model

    path = write_model(tmp_path / "mixtral", "mixtral")
    w = {k: (v.float() * 1e7).to(torch.bfloat16) for k, v in load_file(str(path / "model.safetensors")).items()}
    expected = weight_checker.expected_digests(path, w, tp=1)
    keys = [k for k in expected if "layers.0." in k and ("w13" in k or "qkv" in k)]
    assert len(keys) == 2
    through_fp16 = {k: v.float().half().to(torch.bfloat16) for k, v in w.items()}  # values fp16 cannot hold
    held = {k: v[None] for k, v in expected_tensors(weight_checker.expected_digests(path, through_fp16), keys).items()}
    current = {k: sha(v) for k, v in held.items()}
    both = [
        explain(dict.fromkeys(keys, "changed"), current, expected, engine(held, chains=c), ExpectedSource(expected))
        for c in (True, False)
    ]
    for got, how in zip(both, ("chain states", "block digests"), strict=True):
        assert {k: (e.cause, e.located_by) for k, e in got.keys.items()} == {
            k: ("dtype-roundtrip:float16", how) for k in keys
        }, got.notes
        assert got.notes == []


def test_an_engine_answer_in_other_blocks_or_upper_case_hex_is_judged_as_such():
    """A buggy engine that cuts its blocks at another size is never compared
    (the old path refuses it alike); states in upper-case hex are the same states."""
    want = weights(70)
    held = want.clone()
    held[10:20] = 0
    expected = recorded({KEY: want})
    real = engine({KEY: held})

    def doubled(keys, block_bytes, chain=None):
        return real(keys, block_bytes * 2, {k: [p for p in v if p[0] < 32] for k, v in chain.items()})

    def shouting(keys, block_bytes, chain=None):
        got = real(keys, block_bytes, chain)
        return {k: {**v, "states": [s.upper() for s in v["states"]]} for k, v in got.items()}

    doubled.chains = shouting.chains = True  # type: ignore[attr-defined]
    cut = explain({KEY: "changed"}, {KEY: sha(held)}, expected, doubled, TensorMap({KEY: want})).keys[KEY]
    assert cut.ranges == [] and "does not compare" in (cut.note or ""), cut
    loud = explain({KEY: "changed"}, {KEY: sha(held)}, expected, shouting, TensorMap({KEY: want})).keys[KEY]
    assert (loud.cause, loud.where, loud.located_by) == ("zeros", "rows 10-19 of 64", "chain states")


def test_an_engine_that_refuses_chains_is_asked_once_then_for_block_digests():
    keys = [f"{TP0}w{i}" for i in range(5)]
    want = {k: weights(80 + i) for i, k in enumerate(keys)}
    held = {k: v.clone() for k, v in want.items()}
    for t in held.values():
        t[3] = 0
    served = engine(held)
    calls: list = []

    def old_route(ks, block_bytes, chain=None):
        calls.append("chain" if chain else "blocks")
        if chain:
            raise WeightCheckerError("this engine cannot continue chain states")
        return served(ks, block_bytes)

    old_route.chains = True  # type: ignore[attr-defined]
    got = explain(dict.fromkeys(keys, "changed"), {k: sha(v) for k, v in held.items()}, recorded(want), old_route,
                  TensorMap(want))  # fmt: skip
    assert {e.cause for e in got.keys.values()} == {"zeros"}
    assert {e.located_by for e in got.keys.values()} == {"block digests"}
    assert calls == ["chain", "blocks"]


def test_a_malformed_engine_answer_is_a_note_never_a_traceback():
    want = weights(90)
    held = want.clone()
    held[1] = 0
    real = engine({KEY: held})
    answers = {
        "a list": lambda got: [1, 2],
        "nbytes not a number": lambda got: {**got, "nbytes": "abc"},
        "blocks not a list": lambda got: {**got, "blocks": 5},
        "states not strings": lambda got: {**got, "states": [1] * len(got["states"])},
    }
    for why, bad in answers.items():

        def broken(keys, block_bytes, chain=None, bad=bad):
            return {k: bad(v) for k, v in real(keys, block_bytes, chain).items()}

        broken.chains = True  # type: ignore[attr-defined]
        got = explain({KEY: "changed"}, {KEY: sha(held)}, recorded({KEY: want}), broken, TensorMap({KEY: want}))
        e = got.keys[KEY]
        assert e.ranges == [] and e.cause == "unknown" and e.note, (why, e)
