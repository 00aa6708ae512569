"""Why a check failed (issue 43), the core: block digests against hashlib,
and each cause named exactly from tensors an engine would hold after a
faulty update (no engine here: the engine's side is the worker's own
block-digest function over the faulty tensors; the real engines are in
tests/test_explain_engines.py)."""

from __future__ import annotations

import hashlib

import pytest
import torch
from weight_checker.hashing.blocks import block_bytes_for, block_digests, block_ranges, rows_text
from weight_checker.verify.explain import TensorMap, Version, explain

TP0, TP1 = "dp0:pp0:pcp0:tp0:", "dp0:pp0:pcp0:tp1:"


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def engine_fetch(held: dict[str, torch.Tensor], calls: list | None = None):
    """What the worker answers, from the tensors the engine holds."""

    def fetch(keys, block_bytes):
        if calls is not None:
            calls.append((list(keys), block_bytes))
        digests = block_digests([held[k] for k in keys], [block_bytes] * len(keys), keys)
        return {
            k: {"digests": d, "block_bytes": block_bytes, "nbytes": held[k].nbytes, "shape": list(held[k].shape),
                "dtype": str(held[k].dtype).removeprefix("torch.")}
            for k, d in zip(keys, digests, strict=True)
        }  # fmt: skip

    return fetch


def weights(seed: int, rows: int = 64, cols: int = 48, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 0.02).to(dtype)


@pytest.mark.parametrize("shape,block", [((64, 48), 96 * 3), ((1000,), 7), ((5, 3), 100), ((0,), 1)])
def test_block_digests_are_hashlib_of_each_byte_range(shape, block):
    t = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.int16).reshape(shape)
    raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    want = [hashlib.sha256(raw[a:b]).hexdigest() for a, b in block_ranges(len(raw), block)]
    assert block_digests([t], [block])[0] == want
    assert block_digests([t.t()] if t.dim() == 2 else [t], [block])[0] == (
        [hashlib.sha256(t.t().contiguous().view(-1).view(torch.uint8).numpy().tobytes()[a:b]).hexdigest()
         for a, b in block_ranges(len(raw), block)] if t.dim() == 2 else want
    )  # fmt: skip


def test_blocks_are_whole_rows_and_ranges_name_rows():
    assert block_bytes_for([4096, 1024], 2) == 64 * 2048
    assert block_bytes_for([10], 4) == 4
    assert block_bytes_for([0, 4], 2) == 0
    assert rows_text([(2048 * 2048, 4096 * 2048)], [4096, 1024], 2) == "rows 2048-4095 of 4096"
    assert rows_text([(0, 8)], [100], 4) == "elements 0-1 of 100"


def check(engine_tensor, expected_tensor, key=TP0 + "w", history=(), others=None):
    held = {key: engine_tensor}
    expected = {key: sha(expected_tensor), **{k: sha(v) for k, v in (others or {}).items()}}
    source = TensorMap({key: expected_tensor, **(others or {})})
    result = explain({key: "changed"}, {key: sha(engine_tensor)}, expected, engine_fetch(held), source,
                     history=history)  # fmt: skip
    return result.keys[key]


def test_zero_bytes_delivered_is_zeros():
    e = weights(1)
    got = check(torch.zeros_like(e), e)
    assert (got.cause, got.whole) == ("zeros", True)
    assert got.where == "rows 0-63 of 64"


def test_an_fp32_fp16_bf16_round_trip_is_dtype_roundtrip_float16():
    e = weights(2)
    e[0, :8] = torch.tensor([1e-7, 3e-6, -2e-7, 7e4, 1e5, -9e4, 1e-8, 5e-6], dtype=torch.bfloat16)
    faulty = e.float().half().bfloat16()
    assert sha(faulty) != sha(e)
    got = check(faulty, e)
    assert got.cause == "dtype-roundtrip:float16"
    assert not got.whole and got.where is not None and got.where.startswith("rows 0")  # the rows fp16 cannot hold


def test_the_second_half_of_rows_left_from_the_previous_step_names_the_range_and_the_version():
    old, new = weights(3), weights(4)
    faulty = new.clone()
    faulty[32:] = old[32:]
    previous = Version("step-11", {TP0 + "w": sha(old)}, TensorMap({TP0 + "w": old}))
    got = check(faulty, new, history=[previous])
    assert got.cause == "version:step-11"
    assert not got.whole
    assert got.where == "rows 32-63 of 64"
    assert got.ranges == [(32 * 48 * 2, 64 * 48 * 2)]


def test_a_stale_tensor_is_the_previous_version_by_its_whole_digest_and_asks_for_no_blocks():
    old, new = weights(5), weights(6)
    calls: list = []
    key = TP0 + "w"
    result = explain({key: "stale"}, {key: sha(old)}, {key: sha(new)}, engine_fetch({key: old}, calls),
                     TensorMap({key: new}), history=[Version("step-11", {key: sha(old)})])  # fmt: skip
    assert (result.keys[key].cause, result.keys[key].whole) == ("version:step-11", True)
    assert calls == []


def test_another_ranks_shard_is_shard_of_that_rank():
    shard0, shard1 = weights(7), weights(8)
    got = check(shard0, shard1, key=TP1 + "w", others={TP0 + "w": shard0})
    assert (got.cause, got.whole) == ("shard-of:tp0", True)


def test_half_of_another_ranks_shard_is_named_by_block():
    shard0, shard1 = weights(7), weights(8)
    faulty = shard1.clone()
    faulty[:16] = shard0[:16]
    got = check(faulty, shard1, key=TP1 + "w", others={TP0 + "w": shard0})
    assert got.cause == "shard-of:tp0" and got.where == "rows 0-15 of 64"


def test_a_changed_key_is_wrong_shard_only_where_every_differing_block_is_another_ranks():
    """Issue 54: rows 0-15 tp0's and the rest right is ``wrong-shard``; the
    same rows tp0's and some rows zeros beside them stays ``changed``."""
    from weight_checker.verify.results import VerifyResult

    shard0, shard1 = weights(7), weights(8)
    key, other = TP1 + "w", TP0 + "w"
    outcomes = {}
    for name, zero_rows in (("tp0 rows only", False), ("tp0 rows and zeros", True)):
        faulty = shard1.clone()
        faulty[:16] = shard0[:16]
        if zero_rows:
            faulty[40:48] = 0
        found = explain({key: "changed"}, {key: sha(faulty)}, {key: sha(shard1), other: sha(shard0)},
                        engine_fetch({key: faulty}), TensorMap({key: shard1, other: shard0}))  # fmt: skip
        result = VerifyResult(mismatches={key: "changed"}, by_engine={"e": {key: "changed"}}, explanation=found)
        result.class_by_explanation()
        outcomes[name] = (result.mismatches[key], result.by_engine["e"][key], result.details.get(key))
    assert outcomes == {
        "tp0 rows only": ("wrong-shard", "wrong-shard", "holds tp0's bytes in rows 0-15 of 64; the rest as expected"),
        "tp0 rows and zeros": ("changed", "changed", None),
    }


def test_a_transposed_square_matrix_is_transposed():
    e = weights(9, 48, 48)
    got = check(e.t().contiguous(), e)
    assert (got.cause, got.whole) == ("transposed", True)


def test_bytes_no_candidate_gives_are_unknown_and_two_causes_are_mixed():
    e = weights(10)
    faulty = e.clone()
    faulty[5, 3] += 1
    got = check(faulty, e)
    assert got.cause == "unknown" and got.where == "rows 5 of 64"
    faulty[40:] = 0
    got = check(faulty, e)
    assert got.cause == "mixed"
    assert set(got.block_causes) == {"unknown", "zeros"}


def test_without_expected_tensors_only_whole_digests_are_compared_and_that_is_said():
    key = TP0 + "w"
    result = explain({key: "changed"}, {key: "a" * 64}, {key: "b" * 64}, None, None)
    assert result.keys[key].cause == "unknown"
    assert any("no expected tensors" in n for n in result.notes)


def test_the_limit_bounds_the_keys_explained():
    tensors = {f"{TP0}w{i}": weights(i) for i in range(5)}
    held = {k: torch.zeros_like(v) for k, v in tensors.items()}
    current, expected = {k: sha(v) for k, v in held.items()}, {k: sha(v) for k, v in tensors.items()}
    mismatches = {k: "changed" for k in tensors}
    result = explain(mismatches, current, expected, engine_fetch(held), TensorMap(tensors), limit=2)
    assert len(result.keys) == 2 and result.left_out == 3
    assert all(e.cause == "zeros" for e in result.keys.values())


def test_an_engine_tensor_of_another_shape_is_said_never_compared_block_by_block():
    e = weights(11, 64, 48)
    got = check(e.t().contiguous(), e)  # the same bytes count, another shape: nothing is claimed
    assert got.cause == "unknown" and got.ranges == [] and "shape [48, 64]" in (got.note or "")


def test_more_keys_than_a_request_takes_are_asked_in_chunks_and_one_refused_key_hides_no_other():
    """The route takes 64 keys a request and refuses one whose tensor is
    smaller than the block size asked: the explanation asks in chunks, and
    key by key where a chunk was refused."""
    from weight_checker.errors import VerifyError
    from weight_checker.hashing.blocks import MAX_KEYS

    tensors = {f"{TP0}w{i:03d}": weights(i, 8, 8) for i in range(MAX_KEYS + 6)}
    held = {k: torch.zeros_like(v) for k, v in tensors.items()}
    small = f"{TP0}w003"
    held[small] = torch.zeros(1, 4, dtype=torch.bfloat16)  # the engine holds less than one block
    served = engine_fetch(held)

    def route(keys, block_bytes):
        if len(keys) > MAX_KEYS:
            raise VerifyError("block digests", "server", "'keys' names too many keys")
        if any(held[k].nbytes < block_bytes for k in keys):
            raise VerifyError("block digests", "server", "block_bytes is above the tensor's bytes")
        return served(keys, block_bytes)

    current, expected = {k: sha(v) for k, v in held.items()}, {k: sha(v) for k, v in tensors.items()}
    result = explain({k: "changed" for k in tensors}, current, expected, route, TensorMap(tensors), limit=100)
    causes = result.causes()
    assert len(causes) == MAX_KEYS + 6 and causes[small] == "unknown"
    assert "above the tensor" in (result.keys[small].note or "")
    assert {c for k, c in causes.items() if k != small} == {"zeros"}


def test_an_explanation_that_fails_leaves_the_verdict_and_says_why(monkeypatch):
    import weight_checker
    from weight_checker.verify import explain as module

    from .fake_fleet import fake_fleet, reload_all

    def broken(*args, **kwargs):
        raise AssertionError("a bug of the explanation")

    monkeypatch.setattr(module, "explain_engines", broken)
    with fake_fleet(1) as fleet:
        expected = {k: "0" * 64 for k in fleet[0].loaded}
        result = weight_checker.verify([fleet[0].url], transfer=reload_all(fleet), expected=expected)
    assert not result.match and result.mismatches and result.explanation is None
    assert any("could not be explained: AssertionError: a bug of the explanation" in w for w in result.warnings)


def hashlib_blocks(t: torch.Tensor, block: int) -> list[str]:
    raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return [hashlib.sha256(raw[a:b]).hexdigest() for a, b in block_ranges(len(raw), block)]


@pytest.mark.parametrize("gathered", [False, True])
def test_zero_blocks_are_not_hashed_and_their_digests_are_hashlibs(monkeypatch, gathered):
    # Blocks of zeros (whole, or zero but for their first bytes, or but for
    # their last) in random places, any block size: the digests are
    # hashlib's, and only blocks with a non-zero byte reach the core.
    import random

    from weight_checker.hashing import blocks, digests

    hashed: list[int] = []
    real = digests.digest_tensors

    def counting(names, tensors):
        hashed.extend(int(t.numel()) for t in tensors)
        return real(names, tensors)

    monkeypatch.setattr(digests, "digest_tensors", counting)
    if gathered:  # a device's way (zero-headed blocks read a few at a time), here in host memory
        monkeypatch.setattr(blocks, "_one_at_a_time", lambda flat: False)
        monkeypatch.setattr(blocks, "ZERO_SCAN_BLOCKS", 3)
    rng = random.Random(7)
    for _ in range(200):
        n = rng.choice([1, 63, 64, 65, 1000, 4099])
        block = rng.choice([1, 3, 64, 100, 1000, n])
        t = torch.randint(1, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(rng.randrange(99)))
        ranges = block_ranges(n, block)
        zero = set()
        for i, (a, b) in enumerate(ranges):
            kind = rng.choice(["keep", "zero", "head", "tail"])
            if kind != "keep":
                t[a:b] = 0
                if kind == "head" and b - a > 1:
                    t[a] = 9  # nonzero at its start: never taken for zeros
                elif kind == "tail" and b - a > blocks.ZERO_PROBE_BYTES:
                    t[b - 1] = 9  # zero through the probe, not after it
                else:
                    zero.add(i)
        hashed.clear()
        assert block_digests([t], [block]) == [hashlib_blocks(t, block)], (n, block)
        assert sorted(hashed) == sorted(b - a for i, (a, b) in enumerate(ranges) if i not in zero)
        some = rng.sample(range(len(ranges)), k=min(3, len(ranges)))
        flat = blocks.flat_bytes(t)
        assert blocks.zero_blocks(flat, [ranges[i] for i in some]) == [i in zero for i in some]


def test_an_expected_block_the_engine_holds_as_zeros_is_scanned_not_hashed():
    # The engine has answered: where it holds zeros, this side's block is
    # scanned: zeros here too are equal (the zeros' digest), anything else
    # differs without being hashed.
    from weight_checker.verify.explain import blocks as ex

    e = weights(1, rows=64, cols=48)
    e[16:32] = 0  # zeros expected here too
    engine = e.clone()
    engine[:32] = 0
    block = block_bytes_for(list(e.shape), 2, target=8)
    b = ex.Blocks(e, block)
    answer = engine_fetch({"k": engine})(["k"], block)
    mine = ex._hash_expected([("k", b)], answer)["k"]
    want = hashlib_blocks(e, block)
    assert mine[:2] == [ex.NOT_HASHED] * 2  # rows 0-15: zeros there, not here
    assert mine[2:] == want[2:]  # rows 16-31 zeros on both sides; the rest hashed
    # Not yet answered (or not comparable): every block is hashed.
    assert ex._hash_expected([("k", b)], {})["k"] == want
    assert ex._hash_expected([("k", b)], {"k": {**answer["k"], "block_bytes": block * 2}})["k"] == want


@pytest.mark.parametrize("group_bytes", [1, 1 << 30])
def test_zeros_on_the_engine_are_explained_alike_whenever_its_answer_comes(monkeypatch, group_bytes):
    # One group (this side hashes all before looking at the answer) or one
    # key a group (the answer is used as soon as it is in): the same ranges
    # and causes, from hashlib's block digests of both sides.
    from weight_checker.verify.explain import blocks as ex

    monkeypatch.setattr(ex, "GROUP_BYTES", group_bytes)
    keys = [f"{TP0}layers.{i}.w" for i in range(4)]
    want = {k: weights(10 + i) for i, k in enumerate(keys)}
    want[keys[2]][8:24] = 0
    held = {k: v.clone() for k, v in want.items()}
    held[keys[0]].zero_()
    held[keys[1]][32:] = 0
    held[keys[2]][:16] = 0  # rows 8-15 zero on both sides: only 0-7 differ
    held[keys[3]][40:48] = 0
    result = explain(
        dict.fromkeys(keys, "changed"), {k: sha(v) for k, v in held.items()}, {k: sha(v) for k, v in want.items()},
        engine_fetch(held), TensorMap(want),
    )  # fmt: skip
    for k in keys:
        block = result.keys[k].block_bytes
        mine, theirs = hashlib_blocks(want[k], block), hashlib_blocks(held[k], block)
        ranges = block_ranges(want[k].nbytes, block)
        differ = [ranges[i] for i in range(len(ranges)) if mine[i] != theirs[i]]
        assert result.keys[k].ranges == ex.merge_ranges(differ), k
        assert result.keys[k].cause == "zeros", k
    assert result.keys[keys[0]].whole and not result.keys[keys[1]].whole
    assert result.keys[keys[2]].where == "rows 0-7 of 64"


@pytest.mark.parametrize("ranges", [[(3, 3)], [(8, 24)], [(0, 12), (12, 24)], [(20, 30)], [(3, 3), (0, 4)], [(-2, 4)]])
def test_zero_pieces_are_read_as_slicing_reads_them(ranges):
    # Empty ranges and ranges past the end: the digest of the bytes a slice
    # gives (hashlib's), whether they are zeros or not.
    from weight_checker.hashing.blocks import digest_pieces

    for t in (torch.zeros(16, dtype=torch.uint8), torch.arange(16, dtype=torch.uint8)):
        raw = t.numpy().tobytes()
        assert digest_pieces([(t, r) for r in ranges]) == [hashlib.sha256(raw[a:b]).hexdigest() for a, b in ranges]


def test_a_candidate_that_fails_while_read_is_a_note_and_the_rest_stands():
    # A candidate computed a block at a time reads the weights late; if they
    # changed by then it raises: that candidate is left out, said in the
    # notes, and the ranges and the other causes stand.
    from weight_checker.errors import ExpectedDigestsError

    class Failing:
        def __init__(self, nbytes):
            self.nbytes = nbytes

        def block(self, start, end):
            raise ExpectedDigestsError("weight 'w': it was written")

    class Source(TensorMap):
        def tensors(self, keys, transforms):
            got = super().tensors(keys, ())
            for k in got:
                got[k].update({name: Failing(got[k][None].nbytes) for name in transforms})
            return got

    e = weights(1)
    engine = e.clone()
    engine[:16] = 0  # zeros: named before any transform
    engine[40:] += 1  # no cause: every transform tried
    key = TP0 + "w"
    result = explain({key: "changed"}, {key: sha(engine)}, {key: sha(e)}, engine_fetch({key: engine}), Source({key: e}))
    got = result.keys[key]
    assert got.cause == "mixed" and set(got.block_causes) == {"zeros", "unknown"}
    assert any("not tried" in n and "it was written" in n for n in result.notes)


def test_the_digest_of_zeros_is_computed_once_per_length(monkeypatch):
    # Eight tensors of zeros, 64 blocks each, two lengths (the last block of
    # each is shorter): two SHA-256 computations of zeros in all.
    import types

    from weight_checker.hashing import blocks

    calls: list[int] = []

    def sha256(data):
        calls.append(len(data))
        return hashlib.sha256(data)

    monkeypatch.setattr(blocks, "hashlib", types.SimpleNamespace(sha256=sha256))
    blocks.zero_digest.cache_clear()
    zeros = [torch.zeros(129, 48, dtype=torch.bfloat16) for _ in range(8)]
    got = block_digests(zeros, [96 * 2] * 8)
    assert sorted(calls) == [96, 192]
    assert got == [hashlib_blocks(t, 192) for t in zeros]
    blocks.zero_digest.cache_clear()


def test_a_candidate_is_tried_on_later_runs_only_where_one_of_the_first_matched(monkeypatch):
    """Changes scattered over a tensor (every other row: 32 runs of one
    block) cost a candidate PROBE_RUNS blocks per key, not one per run;
    where one of those first runs matched, every run is tried and named."""
    from weight_checker.verify import explain as ex
    from weight_checker.verify.explain import blocks as blocks_mod

    old, new = weights(20), weights(21)
    key = TP0 + "w"
    hashed: list[int] = []
    real = blocks_mod._hash_blocks
    monkeypatch.setattr(blocks_mod, "_hash_blocks", lambda pieces: hashed.append(len(pieces)) or real(pieces))

    def run(faulty):
        hashed.clear()
        previous = Version("step-11", {key: sha(old)}, TensorMap({key: old}))
        return check(faulty, new, history=[previous]).block_causes

    # Rows 0-6 (the first four runs) changed with no cause, the later even rows stale.
    faulty = new.clone()
    for row in range(0, 64, 2):
        faulty[row] = old[row] if row >= 8 else new[row] + 1
    causes = run(faulty)
    assert set(causes) == {"unknown"}  # less said, never wrong: the stale rows are not tried
    # Expected blocks (one call per group) aside, each candidate hashed at most PROBE_RUNS blocks.
    assert max(hashed[1:]) <= ex.PROBE_RUNS, hashed

    # Row 0 stale too: the version is tried on every run of that key, and of
    # that key only: another key whose first four runs did not match is not.
    other = TP0 + "v"
    matched = faulty.clone()
    matched[0] = old[0]
    held = {key: matched, other: faulty}
    history = [Version("step-11", {key: sha(old), other: sha(old)}, TensorMap({key: old, other: old}))]
    got = explain(
        {key: "changed", other: "changed"}, {k: sha(v) for k, v in held.items()},
        {key: sha(new), other: sha(new)}, engine_fetch(held), TensorMap({key: new, other: new}), history=history,
    )  # fmt: skip
    causes = got.keys[key].block_causes
    assert causes["version:step-11"] == [(r * 96, (r + 1) * 96) for r in [0, *range(8, 64, 2)]]
    assert causes["unknown"] == [(r * 96, (r + 1) * 96) for r in (2, 4, 6)]
    assert set(got.keys[other].block_causes) == {"unknown"}


def test_candidates_a_source_fails_to_give_up_front_cost_nothing_else():
    """A source whose up-front candidates fail (``with_candidates`` raises)
    still gives the expected tensors, asked alone: the ranges are told, and
    the candidates come from the later call as before. One whose deferred
    candidate then fails gives a note, and the rest of the explanation."""
    from weight_checker.errors import ExpectedDigestsError
    from weight_checker.expected.recompute import DEFERRED, TRANSFORMS

    e = weights(30, 48, 48)
    key = TP0 + "w"

    class FailsUpFront(TensorMap):
        def with_candidates(self, keys):
            raise ExpectedDigestsError("the weights changed while the candidates were loaded")

    class DefersAndFails(TensorMap):
        def with_candidates(self, keys):
            return {k: {**v, "transposed": DEFERRED} for k, v in self.tensors(keys, TRANSFORMS[:3]).items()}

        def tensors(self, keys, transforms):
            if "transposed" in transforms:
                raise ExpectedDigestsError("no second load today")
            return super().tensors(keys, transforms)

    for faulty, cause, where in [
        (e.float().half().bfloat16(), "dtype-roundtrip:float16", None),
        (torch.cat([e[:10], torch.zeros_like(e[10:20]), e[20:]]), "zeros", "rows 10-19 of 48"),
        (e.t().contiguous(), "transposed", "rows 0-47 of 48"),
    ]:
        expected, current = {key: sha(e)}, {key: sha(faulty)}
        got = explain({key: "changed"}, current, expected, engine_fetch({key: faulty}), FailsUpFront({key: e}))
        assert got.keys[key].cause == cause
        assert where is None or got.keys[key].where == where
        got = explain({key: "changed"}, current, expected, engine_fetch({key: faulty}), DefersAndFails({key: e}))
        if cause == "transposed":  # the one candidate it could not give: less said, and why
            assert got.keys[key].cause == "unknown"
            assert any("transposed: not computed (no second load today)" in n for n in got.notes), got.notes
        else:
            assert got.keys[key].cause == cause and not got.notes
