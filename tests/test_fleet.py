"""A fleet of engines in one check: every step on all servers at once, a hung
server costing its timeout and naming itself, pause and resume all or none,
independent replicas kept apart (local fake servers; the real vLLM fleet is in
test_vllm_verify.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import weight_checker
from weight_checker.verify.engine_digests import decide_layout
from weight_checker.verify.fanout import Progress

from .fake_fleet import HANG_S, InFlight, fake_fleet, reload_all

CLI = [sys.executable, "-m", "weight_checker.cli"]


def timed_verify(servers, **kw) -> tuple[float, weight_checker.VerifyResult]:
    start = time.perf_counter()
    result = weight_checker.verify([s.url for s in servers], transfer=reload_all(servers), **kw)
    return time.perf_counter() - start, result


def test_32_servers_are_asked_at_once():
    """Every checksum of 32 servers is in flight at once (each waits until
    all 32 are: a client asking one after another never gets there), so 32
    take about as long as one; the time is printed, not asserted (it
    depends on the machine's load)."""
    with fake_fleet(1, **{"0": {"delay": 1.0}}) as one:
        t1, r1 = timed_verify(one)
    special = {str(i): {"delay": 1.0} for i in range(32)}
    in_flight = InFlight(meet=32, only="checksum")
    with fake_fleet(32, in_flight=in_flight, **special) as fleet:
        t32, r32 = timed_verify(fleet)
    assert r1.match and r32.match and r32.key_count == 32 * 3
    print(f"\nverify: 1 server {t1:.2f} s, 32 servers {t32:.2f} s: ratio {t32 / t1:.2f} (one after another: ~32)")
    assert in_flight.peak == 32
    baseline = next(s for s in r32.steps if s.name == "checksum (baseline)")
    assert baseline.slowest is not None and baseline.slowest[1] >= 1.0


def test_bounded_concurrency_is_respected():
    """concurrency=2: two checksums in flight at once (each waits for a
    second), never three."""
    special = {str(i): {"delay": 0.5} for i in range(4)}
    in_flight = InFlight(meet=2, only="checksum")
    with fake_fleet(4, in_flight=in_flight, **special) as fleet:
        _, result = timed_verify(fleet, concurrency=2)
    assert result.match
    assert in_flight.peak == 2


def test_a_hung_server_fails_within_its_timeout_names_itself_and_the_others_resume():
    with fake_fleet(4, **{"2": {"hang": True}}) as fleet:
        urls = [a for s in fleet for a in ("--url", s.url)]
        start = time.perf_counter()
        r = subprocess.run(
            [*CLI, "verify", *urls, "--timeout", "2", "--transfer-cmd", "true"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        elapsed = time.perf_counter() - start
        assert r.returncode == 2, r.stdout + r.stderr
        assert fleet[2].url in r.stderr and "checksum (baseline)" in r.stderr
        # The timeout (2 s) plus start-up and the resumes, not the hang: the
        # one bound here that no load reaches (HANG_S is the hang's end).
        assert elapsed < HANG_S, elapsed
        assert [s.paused for i, s in enumerate(fleet) if i != 2] == [False] * 3
        assert all(s.weights == s.loaded for s in fleet)  # nothing was reset


def test_a_failed_pause_resumes_every_server_that_did_pause():
    with fake_fleet(5, **{"3": {"fail_pause": True}}) as fleet:
        with pytest.raises(weight_checker.VerifyError, match="step 'pause'") as err:
            timed_verify(fleet)
        assert fleet[3].url in str(err.value)
        assert not any(s.paused for s in fleet)
        assert all(s.weights == s.loaded for s in fleet)
        assert err.value.result.steps[-1].name == "resume" and err.value.result.steps[-1].ok


def test_independent_replicas_are_kept_apart_and_a_mismatch_names_its_engine():
    with fake_fleet(3, independent=True) as fleet:

        def transfer_skipping_one() -> None:
            for s in fleet[:2]:
                s.weights = dict(s.loaded)

        result = weight_checker.verify([s.url for s in fleet], transfer=transfer_skipping_one)
        assert result.classes() == {
            "untouched-since-reset": sorted(f"{fleet[2].url} dp0:pp0:pcp0:tp0:w{j}" for j in range(3))
        }
        reload_all(fleet)()  # the engine the transfer skipped is still zeroed
        assert weight_checker.verify([s.url for s in fleet], transfer=reload_all(fleet)).match
        fleet[1].weights["dp0:pp0:pcp0:tp0:w0"] = "0" * 64
        rep = weight_checker.replicas([s.url for s in fleet])
        assert not rep.consistent
        assert list(rep.inconsistent) == ["pp0:pcp0:tp0:w0"]
        assert rep.inconsistent["pp0:pcp0:tp0:w0"][f"{fleet[1].url} dp0"] == "0" * 64


def test_expected_digests_apply_to_every_engine_of_a_fleet():
    with fake_fleet(2, independent=True) as fleet:
        expected = dict(fleet[0].loaded)

        def push_first_only() -> None:
            fleet[0].weights = dict(fleet[0].loaded)

        for s in fleet:
            s.weights = {k: "1" * 64 for k in s.weights}
        result = weight_checker.verify([s.url for s in fleet], transfer=push_first_only, expected=expected)
        assert result.classes() == {"stale": sorted(f"{fleet[1].url} dp0:pp0:pcp0:tp0:w{j}" for j in range(3))}


def test_a_pause_that_times_out_after_the_server_paused_is_resumed_too():
    with fake_fleet(2) as fleet:
        fleet[1].pause_delay = 5.0
        with pytest.raises(weight_checker.VerifyError, match="step 'pause'"):
            weight_checker.verify([s.url for s in fleet], transfer=reload_all(fleet), timeout=1)
        assert not any(s.paused for s in fleet)


def test_lora_keys_do_not_decide_a_fleet():
    target = {"dp0:pp0:pcp0:tp0:w": "1"}
    adapter = {"dp0:pp0:pcp0:tp0:lora:a:m.lora_a": "2"}
    assert decide_layout({"a": target | adapter, "b": dict(target)}, None) == "fleet"
    with pytest.raises(weight_checker.InputError, match=r"--fleet.*--merge"):
        decide_layout({"a": adapter, "b": {}}, None)
    assert decide_layout({"a": adapter, "b": {}}, "fleet") == "fleet"


def test_a_server_given_twice_is_refused_before_anything_is_paused():
    with fake_fleet(1) as fleet:
        with pytest.raises(ValueError, match="given twice"):
            weight_checker.verify([fleet[0].url, fleet[0].url], transfer=reload_all(fleet))
        assert not fleet[0].paused


def test_the_key_sets_decide_merge_or_fleet_and_a_partial_overlap_is_an_error():
    a, b = {"dp0:x": "1"}, {"dp1:x": "2"}
    assert decide_layout({"a": a}, None) == "single"
    assert decide_layout({"a": a, "b": b}, None) == "merge"
    assert decide_layout({"a": a, "b": dict(a)}, None) == "fleet"
    with pytest.raises(weight_checker.InputError, match=r"a serves dp0:y but b does not"):
        decide_layout({"a": {**a, "dp0:y": "3"}, "b": dict(a)}, None)
    with pytest.raises(weight_checker.InputError, match=r"a and b both serve dp0:x.*same data-parallel rank"):
        decide_layout({"a": a, "b": dict(a)}, "merge")
    with pytest.raises(weight_checker.InputError, match=r"--fleet: a serves dp0:x but b does not"):
        decide_layout({"a": a, "b": b}, "fleet")


def test_a_fleet_where_every_rank_loaded_tp0s_shard_is_wrong_shard_naming_tp0():
    """Server URLs hold colons: the classes must see the keys, not "{url} {key}"."""
    with fake_fleet(2, independent=True, tp=2) as fleet:
        expected = dict(fleet[0].loaded)

        def every_rank_loads_tp0() -> None:
            for s in fleet:
                s.weights = {k: expected[k.replace(":tp1:", ":tp0:")] for k in s.weights}

        every_rank_loads_tp0()  # the step before went wrong the same way: "before" equals "after"
        result = weight_checker.verify([s.url for s in fleet], transfer=every_rank_loads_tp0, expected=expected)
    assert result.layout == "fleet"
    wrong = {f"{s.url} dp0:pp0:pcp0:tp1:w{j}" for s in fleet for j in range(3)}
    assert result.mismatches == dict.fromkeys(wrong, "wrong-shard")
    assert all(result.details[k].startswith("holds the expected digest of tp0 ") for k in wrong)
    assert result.by_engine[fleet[0].url] == {f"dp0:pp0:pcp0:tp1:w{j}": "wrong-shard" for j in range(3)}


def test_partly_shared_key_sets_fail_naming_both_servers_and_a_key_and_every_server_is_resumed():
    with fake_fleet(2) as fleet:
        fleet[1].loaded = {**fleet[1].loaded, "dp0:pp0:pcp0:tp0:w0": fleet[0].loaded["dp0:pp0:pcp0:tp0:w0"]}
        fleet[1].weights = dict(fleet[1].loaded)
        urls = [a for s in fleet for a in ("--url", s.url)]
        r = subprocess.run(
            [*CLI, "verify", *urls, "--transfer-cmd", "true"], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 2, r.stdout + r.stderr
        assert fleet[0].url in r.stderr and fleet[1].url in r.stderr and "dp0:pp0:pcp0:tp0:w1" in r.stderr
        assert not any(s.paused for s in fleet) and not any(s.resets for s in fleet)


def test_merge_of_two_servers_started_as_the_same_rank_fails_and_every_server_is_resumed():
    with fake_fleet(2, independent=True) as fleet:
        urls = [a for s in fleet for a in ("--url", s.url)]
        r = subprocess.run(
            [*CLI, "verify", *urls, "--merge", "--transfer-cmd", "true"], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"{fleet[0].url} and {fleet[1].url} both serve dp0:pp0:pcp0:tp0:w0" in r.stderr
        assert not any(s.paused for s in fleet) and not any(s.resets for s in fleet)
        # The library takes the same request.
        with pytest.raises(weight_checker.VerifyError, match="both serve"):
            weight_checker.verify([s.url for s in fleet], transfer=reload_all(fleet), merge=True)
        with pytest.raises(weight_checker.InputError, match="exclude each other"):
            weight_checker.verify([s.url for s in fleet], transfer=reload_all(fleet), merge=True, fleet=True)


def test_fleet_requested_for_servers_of_disjoint_ranks_fails():
    with fake_fleet(2) as fleet:
        with pytest.raises(weight_checker.VerifyError, match=r"--fleet: .* serves dp0:pp0:pcp0:tp0:w0 but"):
            weight_checker.verify([s.url for s in fleet], transfer=reload_all(fleet), fleet=True)
        assert not any(s.paused for s in fleet)


def test_reload_transfer_posts_to_every_server_at_once():
    special = {str(i): {"delay": 0.0} for i in range(3)}
    in_flight = InFlight(meet=3, only="reload")  # each reload waits until all three are in flight
    with fake_fleet(3, in_flight=in_flight, **special) as fleet:
        for s in fleet:
            s.reload_delay = 1.0
        urls = [a for s in fleet for a in ("--url", s.url)]
        r = subprocess.run(
            [*CLI, "verify", *urls, "--transfer", "reload", "--json"], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, r.stdout + r.stderr
        transfer = next(s for s in json.loads(r.stdout)["steps"] if s["step"] == "transfer")
        assert transfer["ok"] and in_flight.peak == 3, (transfer, in_flight.peak)  # one after another: never


def test_progress_line_names_done_total_and_the_slowest(capsys, monkeypatch):
    update = Progress(enabled=True).start("checksum (baseline)", 3)
    monkeypatch.setattr(time, "monotonic", lambda: 1e9)  # past the one-second delay
    update(2, ("http://127.0.0.1:1", 1.5))
    err = capsys.readouterr().err
    assert "checksum (baseline): 2/3 engines done" in err and "slowest so far http://127.0.0.1:1 1.5 s" in err


def test_cli_report_shows_the_slowest_server():
    with fake_fleet(3, **{"1": {"delay": 0.3}}) as fleet:
        urls = [a for s in fleet for a in ("--url", s.url)]
        r = subprocess.run(
            [*CLI, "verify", *urls, "--transfer-cmd", "true", "--json"], capture_output=True, text=True, timeout=60
        )
        report = json.loads(r.stdout)
        assert r.returncode == 1  # the command did not reload: untouched-since-reset
        baseline = next(s for s in report["steps"] if s["step"] == "checksum (baseline)")
        assert baseline["slowest"]["engine"] == fleet[1].url


def test_keys_that_hold_no_bytes_on_the_engine_are_flagged_in_the_report():
    import hashlib

    with fake_fleet(1) as fleet:
        expected = dict(fleet[0].loaded)
        fleet[0].loaded["dp0:pp0:pcp0:tp0:w1"] = hashlib.sha256(
            b""
        ).hexdigest()  # what a CPU backend leaves of a linear weight
        fleet[0].weights = dict(fleet[0].loaded)
        result = weight_checker.verify([fleet[0].url], transfer=reload_all(fleet), expected=expected)
    assert result.mismatches == {"dp0:pp0:pcp0:tp0:w1": "stale"}
    assert any("hold no bytes" in w and "dp0:pp0:pcp0:tp0:w1" in w for w in result.warnings)


@pytest.mark.parametrize("says", [True, False], ids=["the-engine-says", "vllms-expert-names"])
def test_a_moe_engines_dp_ranks_are_not_replicas_but_two_engines_are(says):
    """A MoE engine at DP=2 holds each DP rank's own part of the experts:
    its DP ranks are replicas for every other key only. Two such engines are
    replicas of each other, DP rank by DP rank, experts included."""
    with fake_fleet(1, **{"0": {"moe_dp": 2, "says_sharded": says}}) as one:
        result = weight_checker.replicas(one[0].url)
        assert result.consistent, result.inconsistent
        assert result.replicas == ["dp0", "dp1"] and result.sharded == 4
    with fake_fleet(2, **{str(i): {"moe_dp": 2, "says_sharded": says} for i in range(2)}) as two:
        assert weight_checker.replicas([s.url for s in two]).consistent
        two[1].weights["dp1:pp0:pcp0:tp0:layers.0.experts.w2_weight"] = "0" * 64
        result = weight_checker.replicas([s.url for s in two])
        assert not result.consistent
        assert list(result.inconsistent) == ["dp1:pp0:pcp0:tp0:layers.0.experts.w2_weight"]
        two[1].weights = dict(two[1].loaded)
        two[0].weights["dp1:pp0:pcp0:tp0:w0"] = "0" * 64  # a dense weight: compared across DP ranks too
        assert list(weight_checker.replicas([s.url for s in two]).inconsistent) == ["pp0:pcp0:tp0:w0"]


@pytest.mark.parametrize("when", ["always", "after-the-transfer"])
def test_an_engine_that_answers_no_digests_is_an_error_naming_it_never_skipped(when):
    """Issue 42: a fleet engine answering an empty digest map (an engine
    serving no model, a checksum that covered nothing) proves nothing: every
    entry point fails naming it, instead of a match over the others' keys."""
    with fake_fleet(2, independent=True) as fleet:
        empty = fleet[1]
        expected = dict(fleet[0].loaded)

        def transfer() -> None:
            reload_all(fleet)()
            empty.weights = {}

        if when == "always":
            empty.weights, empty.loaded = {}, {}
        urls = [s.url for s in fleet]
        for kw in ({"expected": expected}, {}):
            with pytest.raises(weight_checker.VerifyError, match=f"on {empty.url}: answered no digests"):
                weight_checker.verify(urls, transfer=transfer, **kw)
            assert not any(s.paused for s in fleet)  # every server resumed
            empty.weights = {} if when == "always" else dict(empty.loaded)
        if when == "always":
            with pytest.raises(weight_checker.VerifyError, match=f"on {empty.url}: answered no digests"):
                weight_checker.replicas(urls)
            args = [a for u in urls for a in ("--url", u)]
            done = subprocess.run([*CLI, "replicas", *args], capture_output=True, text=True, timeout=120)
            assert done.returncode == 2 and empty.url in done.stderr and "answered no digests" in done.stderr, done
            assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


class _SyncClient:
    """A ``VLLMWeightSyncClient`` that moves nothing (``base_url``: vLLM's
    HTTP client, whose digests the wrapper asks the server for)."""

    def __init__(self, base_url: str | None = None):
        if base_url is not None:
            self.base_url, self.timeout = base_url, 30

    def init_weight_transfer_engine(self, init_info):
        pass

    def start_weight_update(self):
        pass

    def update_weights(self, update_info):
        pass

    def finish_weight_update(self, weight_version=None):
        pass


@pytest.mark.parametrize("client", ["checksum_from", "http"])
def test_a_weight_transfer_engine_that_answers_no_digests_fails_naming_it(client):
    """``verified()`` takes the engine's digests before the first update
    (what tells a key ``stale``), from ``checksum_from`` or, over vLLM's HTTP
    client, from the server itself: an empty answer is an error naming it,
    never a baseline of nothing."""
    from weight_checker.integrations.weight_transfer import verified

    with fake_fleet(1) as fleet:
        fleet[0].weights = {}
        if client == "http":
            wrapped = verified(_SyncClient(fleet[0].url), dict(fleet[0].loaded))
        else:
            wrapped = verified(_SyncClient(), dict(fleet[0].loaded), checksum_from=fleet[0].url)
        with pytest.raises(weight_checker.VerifyError, match=f"on {fleet[0].url}: answered no digests"):
            wrapped.start_weight_update()


def test_a_draft_asked_for_that_no_key_covers_fails_naming_the_engine():
    """An engine without a draft answers a checksum of ``target,draft`` with
    its target keys: the draft was not checked, and the check says so."""
    with fake_fleet(2, independent=True) as fleet:
        urls = [s.url for s in fleet]
        with pytest.raises(weight_checker.VerifyError, match="no digests of the scope draft"):
            weight_checker.replicas(urls, include=["target", "draft"])
        with pytest.raises(weight_checker.VerifyError, match="no digests of the scope draft"):
            weight_checker.verify(urls, transfer=lambda: None, include=["target", "draft"], expected=fleet[0].loaded)
        assert weight_checker.replicas(urls).consistent  # the target alone is fine
