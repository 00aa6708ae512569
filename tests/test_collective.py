"""Expected digests from a real FSDP2 trainer's shards, collectively, no
gather (issue 56): tests/fsdp_worker.py runs a trainer of 2 or 4 processes
on a gloo CPU mesh (``fully_shard`` on every layer, uneven dim-0 shards, a
real optimizer step on fp32 masters), and each rank hands only chain
states on. The oracle is the whole-tensor path over the gathered tensors.
The refusals are tested here on shard metadata, with no process group."""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected.collective import (
    PIPELINED_BATCHES,
    LocalShard,
    _legs,
    _local,
    is_sharded,
)
from weight_checker.expected.sharded import Segment, check_agreement, sharing_cores
from weight_checker.testing.launch import vllm_available, vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")]

WORKER = Path(__file__).with_name("fsdp_worker.py")


def trainer(
    checkpoint: Path,
    world: int,
    tp: int,
    steps: int,
    perturb: int | None = None,
    server: tuple | None = None,
    pin: bool = False,
) -> tuple[dict, str]:
    """Runs the ``world`` ranks of tests/fsdp_worker.py (torchrun's
    environment); rank 0's result and the logs. ``server``: ``(url, workers)``
    of a real vLLM server the trainer updates and verifies. ``pin``: rank
    ``r`` on core ``r`` alone (ranks with cores of their own hash each round
    in batches, handing states on between them: expected/collective.py)."""

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp(prefix="fsdp-")) / "result.json"
    args = [str(checkpoint), str(out), str(tp), str(steps)] + ([str(perturb)] if perturb is not None else [])
    args += ["--server", server[0], str(server[1])] if server else []
    procs = []
    for rank in range(world):
        env = vllm_env(env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                            "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})  # fmt: skip
        cores = sorted(os.sched_getaffinity(0))
        taskset = ["taskset", "-c", str(cores[rank % len(cores)])] if pin else []
        procs.append(subprocess.Popen([*taskset, sys.executable, str(WORKER), *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    log = "\n".join(logs)
    try:
        assert all(p.returncode == 0 for p in procs), log[-6000:]
        return json.loads(out.read_text()), log
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)  # the run's working directory, read


def background_jobs(env) -> dict[str, functools.partial]:
    """The trainers, in the background from the session's start (tests/jobs.py)."""
    odd = env.models.path("odd")  # written here, in the main thread (transformers' lazy imports are not thread-safe)
    return {
        # Two ranks on cores of their own (where the host has two): the rounds in batches.
        "fsdp-world2-tp2": functools.partial(trainer, odd, 2, 2, 1, pin=True),
        "fsdp-world4-tp1-perturbed": functools.partial(trainer, odd, 4, 1, 1, 1),
    }


@pytest.mark.uses_jobs("fsdp-world2-tp2")
def test_fsdp2_shards_after_a_training_step_give_the_whole_tensor_paths_digests(jobs):
    result, log = jobs.result("fsdp-world2-tp2")
    assert result["got"] == result["oracle"], log[-3000:]
    # The next calls with the same shards keep the layout: the same digests,
    # then, with new bytes in the shards, the whole path's digests of them.
    assert result["again"] == result["got"] and result["stepped"] == result["doubled"]
    assert sum(result["stepped"][k] != result["got"][k] for k in result["got"]) > len(result["got"]) // 2
    made, *kept = result["layout_seconds"]
    assert made > 0 and all(s < made / 3 for s in kept), result["layout_seconds"]
    # The engine's loaders ran in the first call only, and the kept calls say so.
    loaded, *again = result["load_seconds"]
    assert loaded > 0 and again == [0.0, 0.0], result["load_seconds"]
    assert result["versions"] == [None, "2"]
    # A core a rank: each round hashed in batches, states handed on between them.
    assert result["batches"] == (1 if len(os.sched_getaffinity(0)) < 2 else PIPELINED_BATCHES)
    assert len(result["got"]) == 30  # 15 parameters on each of 2 TP ranks
    # Uneven shards: vocabulary 502 and intermediate 250 split 251/251 and 125/125, gate 250 rows.
    assert result["rows"]["model.embed_tokens.weight"] == 251
    # Only chain states travelled: at most 109 bytes a hand-over, no weight.
    assert 0 < result["exchanged"] <= 109 * 4 * len(result["got"])
    print(f"\nworld 2, TP 2: {len(result['got'])} keys, {result['exchanged']} bytes of chain state exchanged")


@pytest.mark.uses_jobs("fsdp-world4-tp1-perturbed")
def test_one_ranks_perturbed_shard_changes_exactly_the_keys_holding_its_rows(jobs):
    result, log = jobs.result("fsdp-world4-tp1-perturbed")
    assert result["batches"] == 1  # four ranks on this host's cores: each round in one run
    differ = sorted(k for k in result["oracle"] if result["got"][k] != result["oracle"][k])
    assert differ == ["dp0:pp0:pcp0:tp0:model.layers.0.mlp.down_proj.weight"], log[-3000:]
    # The next step's call keeps the layout and still finds exactly that key.
    assert sorted(k for k in result["doubled"] if result["stepped"][k] != result["doubled"][k]) == differ
    assert set(result["got"]) == set(result["oracle"])


def test_an_fsdp2_trainer_updates_a_real_vllm_server_and_verify_checks_the_update_against_its_shards(
    vllm_qwen2_tp2,
):
    """A real trainer loop: a 2-process FSDP2 step, the engine's digests
    from the shards (no gather, the server's layout: TP=2), then an update of
    a real vLLM server through vLLM's own sync client: MATCH. Rank 1 zeroes
    its first row of layer 0's down_proj and sends again: MISMATCH of exactly
    the keys a whole-tensor oracle says hold that row (down_proj is
    row-parallel: both TP ranks hold a part of every row)."""
    from .test_weight_transfer import Lifecycle

    server = vllm_qwen2_tp2
    life = Lifecycle(server, 2)  # puts the server back as it was, after
    try:
        result, log = trainer(Path(server.model), 2, 2, 1, perturb=1, server=(server.url, 2))
    finally:
        life.close()
    good, bad, expected = result["good"], result["bad"], result["expected"]
    assert good["match"] and good["keys"] == len(expected) > 0, (good, log[-3000:])
    # The step moved the weights the server started with (so MATCH says the update landed),
    # and only chain states travelled between the trainer's ranks.
    assert sum(expected[k] != result["before"][k] for k in expected) > len(expected) // 2
    assert 0 < result["exchanged"] <= 109 * 4 * len(expected)
    down = [f"dp0:pp0:pcp0:tp{t}:model.layers.0.mlp.down_proj.weight" for t in (0, 1)]
    assert not bad["match"] and sorted(bad["mismatches"]) == result["oracle_differs"] == down, (bad, log[-3000:])


def test_shard_metadata_that_does_not_tile_or_agree_is_refused_naming_the_tensor_and_the_rank():
    w = ([4, 2], "torch.bfloat16")
    ok = [{"w": (*w, 0, 4)}, {"w": (*w, 4, 4)}]
    assert [(h.rank, h.start, h.end) for h in check_agreement(ok)["w"]] == [(0, 0, 4), (1, 4, 8)]
    with pytest.raises(ExpectedDigestsError, match=r"weight 'w': the shard of rank 1 at element 2 overlaps"):
        check_agreement([{"w": (*w, 0, 4)}, {"w": (*w, 2, 6)}])
    with pytest.raises(ExpectedDigestsError, match=r"weight 'w': the shards hold 4 of its 8 elements"):
        check_agreement([{"w": (*w, 0, 4)}, {"w": (*w, 0, 0)}])
    with pytest.raises(ExpectedDigestsError, match=r"weight 'w': rank 1 has shape \[4, 3\]"):
        check_agreement([{"w": (*w, 0, 4)}, {"w": ([4, 3], w[1], 4, 4)}])
    with pytest.raises(ExpectedDigestsError, match=r"weight 'v': rank 1 gives it, rank 0 does not"):
        check_agreement([{"w": (*w, 0, 8)}, {"w": (*w, 8, 0), "v": (*w, 0, 8)}])


def test_local_shards_are_whole_rows_of_their_tensor():
    t = torch.arange(12.0).reshape(4, 3)
    shape, dtype, first, flat = _local("w", LocalShard(t[2:], 2, (4, 3)), me=1)
    assert (shape, dtype, first, flat.tolist()) == ((4, 3), torch.float32, 6, t[2:].reshape(-1).tolist())
    with pytest.raises(ExpectedDigestsError, match=r"weight 'w' on rank 1: a shard of shape \[2, 3\] at row 3"):
        _local("w", LocalShard(t[2:], 3, (4, 3)), me=1)
    with pytest.raises(ExpectedDigestsError, match=r"weight 'w' on rank 0: list is not a tensor or a shard"):
        _local("w", [1, 2], me=0)
    # A whole tensor every rank passes (not sharded) is rank 0's to hash.
    assert _local("w", t, me=1)[3] is None and _local("w", t, me=0)[2] == 0
    assert is_sharded({"w": LocalShard(t, 0, (4, 3))}) and not is_sharded({"w": t})


def test_legs_join_zero_padding_to_the_holder_beside_it():
    segs = [Segment(None, None, 0, 4), Segment(1, "w", 0, 2), Segment(1, "w", 4, 2), Segment(None, None, 0, 2),
            Segment(0, "v", 0, 3)]  # fmt: skip
    legs = _legs(7, segs)
    assert [(leg.key, leg.rank, len(leg.segments)) for leg in legs] == [(7, 1, 4), (7, 0, 1)]
    assert [(leg.rank, len(leg.segments)) for leg in _legs(0, [Segment(None, None, 0, 8)])] == [(0, 1)]


def test_shards_given_as_items_or_a_generator_are_seen_and_whole_tensors_stay_a_stream():
    from collections.abc import Mapping

    from weight_checker.expected.collective import sharded_weights

    t = torch.arange(12.0).reshape(4, 3)
    shards = {"w": LocalShard(t[:2], 0, (4, 3)), "v": LocalShard(t[2:], 2, (4, 3))}
    for given in (shards.items(), (p for p in shards.items()), iter(list(shards.items()))):
        got, sharded = sharded_weights(given)
        assert sharded and got == list(shards.items())
    whole = [("w", t), ("v", t + 1)]
    stream, sharded = sharded_weights(p for p in whole)
    assert not sharded and not isinstance(stream, list | tuple)  # still read one pair at a time
    assert [(n, x.tolist()) for n, x in stream] == [(n, x.tolist()) for n, x in whole]
    assert sharded_weights(iter(()))[1] is False and list(sharded_weights(iter(()))[0]) == []
    assert sharded_weights(dict(whole).items()) == (whole, False)

    class Staged(Mapping):
        """A mapping that refills one buffer for each value asked for."""

        def __init__(self):
            self.buffer, self.reads = torch.zeros(3), 0

        def __getitem__(self, name):
            self.reads += 1
            return self.buffer.fill_(float(name))

        def __iter__(self):
            return iter(["0", "1", "2"])

        def __len__(self):
            return 3

    staged = Staged()
    items = staged.items()
    assert sharded_weights(items) == (items, False)  # handed on as it came: the loader reads each value afresh
    assert staged.reads == 1
    # A first item that is not a pair is put back for the loader to refuse, never dropped.
    rest, sharded = sharded_weights(p for p in [None, ("w", t)])
    assert not sharded and [p if p is None else p[0] for p in rest] == [None, "w"]

    def failing():
        raise OSError("disk gone")
        yield

    with pytest.raises(ExpectedDigestsError, match=r"the weights: reading the first pair failed: OSError: disk gone"):
        sharded_weights(failing())


def test_ranks_share_cores_only_on_one_host_with_overlapping_affinities():
    assert sharing_cores([("a", [0]), ("a", [0, 1])]) is True
    assert sharing_cores([("a", [0]), ("a", [1])]) is False
    assert sharing_cores([("a", [0, 1]), ("b", [0, 1])]) is False
    assert sharing_cores([("a", None), ("a", [3])]) is True  # unknown affinity: assume shared


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_equally_spaced_segments_read_as_one_strided_view_give_the_same_bytes_in_order(dtype):
    # A row-parallel shard's key is a column slice of every row: one segment
    # a row, read as one 2-D view. Its bytes must be exactly the segments'
    # own, in order, cast to the key's dtype, whatever the spacing between them.
    from weight_checker.expected.sharded import compact, leg_buffers

    local = torch.randn(64 * 48, dtype=torch.float32)
    mine = {"w": ((64, 48), torch.float32, 480, local), "z": ((8,), torch.float32, 0, torch.randn(8))}
    segs = [Segment(0, "w", 480 + 48 * r + 8, 16) for r in range(10)]  # a column slice of 10 rows
    segs += [Segment(0, "w", 480 + 48 * 11 + 8, 16), Segment(0, "w", 480 + 48 * 11 + 40, 8)]  # spacing, length change
    segs += [Segment(None, None, 0, 12), Segment(0, "w", 480 + 48 * 20, 48), Segment(0, "w", 480 + 48 * 21, 48)]
    segs += [Segment(0, "z", 0, 4), Segment(0, "w", 480 + 48 * 30, 5), Segment(0, "w", 480 + 48 * 30 + 5, 5)]
    got = b"".join(bytes(b.contiguous().reshape(-1).numpy()) for b, _ in leg_buffers(compact(segs), dtype, mine))
    want = b""
    for s in segs:
        if s.source is None:
            want += bytes(s.length)
            continue
        first, t = mine[s.source][2], mine[s.source][3]
        want += bytes(t[s.start - first : s.start - first + s.length].to(dtype).view(torch.uint8).numpy())
    assert got == want


def test_a_layout_is_kept_only_for_the_same_config_arguments_and_shards(tmp_path):
    from weight_checker.expected import layout_cache

    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    every = [{"w": ([4, 3], "torch.float32", 0, 6)}, {"w": ([4, 3], "torch.float32", 6, 6)}]
    sig = layout_cache.signature(str(tmp_path), every, "engine", {"tp": 2, "weight_version": "1"})
    # The weight version changes every call, not the layout; a tokenizer's file neither.
    assert sig == layout_cache.signature(str(tmp_path), every, "engine", {"tp": 2, "weight_version": "7"})
    moved = [{"w": ([4, 3], "torch.float32", 0, 9)}, {"w": ([4, 3], "torch.float32", 9, 3)}]
    others = [
        layout_cache.signature(str(tmp_path), moved, "engine", {"tp": 2}),  # uneven shards now
        layout_cache.signature(str(tmp_path), every, None, {"tp": 2}),
        layout_cache.signature(str(tmp_path), every, "engine", {"tp": 1}),
        layout_cache.signature({"model": str(tmp_path)}, every, "engine", {"tp": 2}),
    ]
    assert None not in others and len({sig, *others}) == 5
    # An edited config is a new layout, even of the same size and time (copied with
    # ``cp -p``), and so are the rank models it is built from.
    from weight_checker.expected.vllm.rank_model import cache_key

    stat, built = os.stat(tmp_path / "config.json"), cache_key(str(tmp_path), {"tp": 2})
    (tmp_path / "config.json").write_text('{"hidden_size": 9}')
    os.utime(tmp_path / "config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert layout_cache.signature(str(tmp_path), every, "engine", {"tp": 2}) != sig
    assert cache_key(str(tmp_path), {"tp": 2}) != built
    # An argument told only by its address is never kept.
    assert layout_cache.signature(str(tmp_path), every, "engine", {"tp": 2, "hook": object()}) is None
    layout_cache.keep(None, ({}, None, [], [], {}))
    assert layout_cache.kept(None, {}) is None
    # A kept layout's plans go with it to the next call (each rank plans once a layout).
    from weight_checker.expected.digests import ExpectedDigests

    plans: dict = {}
    layout_cache.keep(sig, ({}, ExpectedDigests({}), [], [], plans))
    plans[(1, 4)] = [[(0, 1)]]  # planned by the first call, after the layout was kept
    again = layout_cache.kept(sig, {"weight_version": "8"})
    assert again is not None and again[4] is plans and again[1].weight_version == "8"
    layout_cache.forget()


def _runs_to_the_end(chains: list, plans: list) -> bool:
    """Every rank runs its batches in order, a batch once the legs before
    its own (on other ranks) are hashed: whether all end (no rank waits on
    a batch that waits on it)."""
    done: set = set()
    at = [0] * len(plans)
    moved = True
    while moved:
        moved = False
        for rank, plan in enumerate(plans):
            while at[rank] < len(plan) and all(j == 0 or (i, j - 1) in done for i, j in plan[at[rank]]):
                done.update(plan[at[rank]])
                at[rank] += 1
                moved = True
    return all(at[r] == len(p) for r, p in enumerate(plans))


@pytest.mark.parametrize("seed", range(40))
def test_every_plan_hashes_each_leg_once_on_its_holder_and_never_waits_on_itself(seed):
    import random

    from weight_checker.expected.run_plan import plan_batches

    rng = random.Random(seed)
    world = rng.choice([2, 3, 4])
    chains = []
    for _ in range(rng.randint(1, 30)):
        holder, chain = rng.randrange(world), []
        for _ in range(rng.randint(1, 6)):
            chain.append((holder, rng.choice([0, 64, 4096, 1 << 20, 40 << 20])))
            holder = rng.choice([r for r in range(world) if r != holder])
        chains.append(chain)
    for batches in (1, 4):
        plans = [plan_batches(chains, me, batches) for me in range(world)]
        for me, plan in enumerate(plans):
            legs = [leg for batch in plan for leg in batch]
            assert sorted(legs) == sorted((i, j) for i, c in enumerate(chains) for j, (r, _) in enumerate(c) if r == me)
            assert all(batch for batch in plan)
        assert _runs_to_the_end(chains, plans), (chains, plans)


def test_a_tp2_like_plan_hashes_what_others_continue_first_and_a_tp1_like_one_in_batches():
    from weight_checker.expected.run_plan import plan_batches

    mb = 1 << 20
    # Each rank starts chains of its own (TP=2 from two trainer ranks): two
    # long column-parallel shards, four medium ones, and row-parallel keys
    # whose first half is rank 0's.
    chains = [[(0, 64 * mb)], [(1, 64 * mb)], *[[(r, 8 * mb)] for r in (0, 0, 0, 1, 1, 1)]]
    chains += [[(0, 3 * mb), (1, 3 * mb)] for _ in range(3)]
    zero, one = plan_batches(chains, 0, 4), plan_batches(chains, 1, 4)
    assert zero == [[(8, 0), (9, 0), (10, 0)], [(0, 0), (2, 0), (3, 0), (4, 0)]]
    # Rank 1 runs its long shard while rank 0 hashes what it continues, then
    # the rest of its own with those, in one run.
    assert one == [[(1, 0)], [(8, 1), (9, 1), (10, 1), (5, 0), (6, 0), (7, 0)]]
    # Every chain starts on rank 0 (TP=1): rounds cut into batches of about equal bytes.
    tp1 = [[(0, 10 * mb), (1, 10 * mb)] for _ in range(8)]
    assert [len(b) for b in plan_batches(tp1, 0, 4)] == [2, 2, 2, 2]
    assert [len(b) for b in plan_batches(tp1, 1, 4)] == [2, 2, 2, 2]
    assert plan_batches(tp1, 1, 1) == [[(i, 1) for i in range(8)]]


def test_a_tp1_like_plan_runs_sixteen_legs_of_a_size_together_and_the_next_holder_relays_each_run():
    from weight_checker.expected.run_plan import plan_batches

    mb = 1 << 20
    # A Llama at TP=1 from two trainer ranks: every chain starts on rank 0.
    # Per layer: o_proj and down_proj halves (2 legs), q|k|v halves (6 legs),
    # gate|up halves (4 legs), a norm; then the embedding and the LM head.
    chains: list[list[tuple[int, int]]] = []
    for _ in range(8):
        chains.append([(0, 4 * mb), (1, 4 * mb)])  # o_proj
        chains.append([(0, 4 * mb), (1, 4 * mb), (0, mb), (1, mb), (0, mb), (1, mb)])  # qkv
        chains.append([(0, 11 * mb), (1, 11 * mb), (0, 11 * mb), (1, 11 * mb)])  # gate_up
        chains.append([(0, 11 * mb), (1, 11 * mb)])  # down_proj
        chains.append([(0, 4096), (1, 4096)])  # a norm
    chains += [[(0, 64 * mb), (1, 64 * mb)], [(0, 64 * mb), (1, 64 * mb)]]
    zero, one = plan_batches(chains, 0, 4), plan_batches(chains, 1, 4)
    sizes = [sorted({chains[i][j][1] for i, j in run}) for run in zero]
    # Short legs first, so that rank 1 begins soon; the 16 legs of 4 MB,
    # then of 11 MB, each one run (all 16 lanes busy to the end); the two
    # long legs last, together.
    assert sizes[:4] == [[4096], [4 * mb], [11 * mb], [64 * mb]], sizes
    assert [len(run) for run in zero[:4]] == [8, 16, 16, 2]
    # Rank 1 relays each of rank 0's runs as one run, in the same order.
    assert [[i for i, _ in run] for run in one[:4]] == [[i for i, _ in run] for run in zero[:4]]
    assert all(j == 1 for run in one[:4] for _, j in run)
    # Later rounds follow the runs their previous legs ended in.
    assert [sorted({j for _, j in run}) for run in zero[4:]] == [[2], [2], [4]]


def test_copies_are_made_a_bounded_piece_at_a_time_and_fed_in_bounded_runs(monkeypatch):
    # fp32 masters into a bf16 engine: each piece is cast where it lies. A
    # rank must never hold more than its shards and a bounded buffer, so a
    # cast (or zero padding) comes a piece at a time and a run takes a
    # bounded number of copied bytes; the digests stay hashlib's.
    import hashlib

    from weight_checker import _core
    from weight_checker.expected import sharded

    monkeypatch.setattr(sharded, "COPY_PIECE", 1000)
    monkeypatch.setattr(sharded, "COPIES_A_RUN", 3000)
    local = torch.randn(300 * 40, dtype=torch.float32)
    mine = {"w": ((300, 40), torch.float32, 0, local)}
    legs = [
        [Segment(0, "w", 0, 40 * 100), Segment(None, None, 0, 2500)],  # 100 rows, then padding
        [Segment(0, "w", 40 * r + 8, 16) for r in range(100, 300)],  # a column slice of 200 rows
    ]
    pieces = [list(sharded.leg_buffers(sharded.compact(segs), torch.bfloat16, mine)) for segs in legs]
    for leg in pieces:
        # Whole rows of at most COPY_PIECE bytes (a row of 16 bf16 is 32 bytes).
        assert all(b.numel() <= 1000 for b, copied in leg if copied) and all(copied for _, copied in leg)
    runs: list = []

    class Recorder:
        def update(self, feeds):
            runs.append(sum(b.numel() for _, b in feeds))

    sharded.feed_in_pieces(Recorder(), [(n, p) for n, leg in enumerate(pieces) for p in leg])
    assert len(runs) > 3 and all(r < 3000 + 1000 for r in runs)
    hasher = _core.MultiHasher(2)
    sharded.feed_in_pieces(hasher, [(n, p) for n, leg in enumerate(pieces) for p in leg])
    bf16 = local.to(torch.bfloat16).view(torch.uint8).reshape(300, 80)
    want = [
        hashlib.sha256(bytes(bf16[:100].reshape(-1).numpy()) + bytes(2500)).hexdigest(),
        hashlib.sha256(bytes(bf16[100:, 16:48].contiguous().reshape(-1).numpy())).hexdigest(),
    ]
    assert hasher.finish()[0] == want


def test_a_run_of_rows_past_the_end_of_this_ranks_shard_is_refused_never_read():
    # A strided view reads where its storage goes: a layout that asked for
    # rows past this rank's shard must be refused, not read as padding.
    from weight_checker.expected.sharded import Rows, leg_buffers

    local = torch.zeros(100, dtype=torch.bfloat16)
    mine = {"w": ((20, 10), torch.bfloat16, 50, local)}
    assert len(list(leg_buffers([Rows("w", 50, 5, 10, 10)], torch.bfloat16, mine))) == 1  # rows 5..14 of 10
    for run in (Rows("w", 50, 5, 11, 10), Rows("w", 40, 5, 1, 0), Rows("w", 145, 6, 1, 0)):
        with pytest.raises(ExpectedDigestsError, match=r"weight 'w': elements .* are not in this rank's shard"):
            list(leg_buffers([run], torch.bfloat16, mine))


RANKS_DISAGREE = r"""
import os, sys, json, torch, torch.distributed as dist
import weight_checker
from safetensors.torch import load_file
from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected import collective
from weight_checker.expected.collective import LocalShard
ckpt, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
full = load_file(os.path.join(ckpt, "model.safetensors"))
def shards():
    out = {}
    for n, t in full.items():
        half = -(-t.shape[0] // 2)
        out[n] = LocalShard(t[rank * half : (rank + 1) * half], min(rank * half, t.shape[0]), tuple(t.shape))
    return out
said = []
# The waits are bounds, not what a call takes: on a busy machine one rank's
# first layout (vLLM's imports, its loaders on address space) can take a minute.
def attempt(**args):
    try:
        weight_checker.expected_digests(ckpt, shards(), timeout=300, **args)
        said.append("ok")
    except ExpectedDigestsError as e:
        said.append(str(e))
# Rank 1 asks for another engine: refused on both, never chains cut for one dtype continued in another.
attempt(**({"dtype": "float16"} if rank == 1 else {}))
# The layout fails on rank 1 alone (after the shapes were exchanged): both say so at once.
if rank == 1:
    real, collective._layout = collective._layout, lambda *a: (_ for _ in ()).throw(TypeError("injected"))
attempt()
if rank == 1:
    collective._layout = real
# And the group still serves a correct call.
got = weight_checker.expected_digests(ckpt, shards(), timeout=300)
whole = weight_checker.expected_digests(ckpt, full) if rank == 0 else None
if rank == 0:
    json.dump({"said": said, "equal": dict(got) == dict(whole)}, open(out, "w"))
else:
    json.dump({"said": said}, open(out + ".1", "w"))
dist.destroy_process_group()
"""


def test_ranks_that_ask_for_other_engines_or_fail_alone_are_refused_on_every_rank_at_once(models, tmp_path):
    odd = models.path("odd")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out.json"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANKS_DISAGREE, str(odd), str(out)],
            env=vllm_env(env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r), "WORLD_SIZE": "2"}),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    zero, one = json.loads(out.read_text()), json.loads(Path(str(out) + ".1").read_text())
    assert zero["equal"]
    for said in (zero["said"], one["said"]):
        assert said[0].startswith("rank 1 asks for another engine than rank 0") and "dtype='float16'" in said[0]
    assert zero["said"][1] == "rank 1 failed: TypeError: injected" and one["said"][1] == "TypeError: injected"
