"""Checks shared by the end-to-end modules (one real vLLM server each)."""

from __future__ import annotations

import hashlib
import re

from weight_checker.launch import Server

EMPTY = hashlib.sha256(b"").hexdigest()
#: The workflow's steps, in order, before the resume of a paused server.
VERIFY_STEPS = [
    "pause",
    "checksum (baseline)",
    "reset",
    "checksum (post-reset)",
    "transfer",
    "checksum (current)",
    "compare",
]
VLLM_BAD_PAYLOADS = [{}, {"action": "frobnicate"}, {"action": "compare"}, []]


def checksum(server: Server) -> dict[str, str]:
    status, body = server.post("/weight_checker", {"action": "checksum"})
    assert status == 200, body
    return body["checksums"]


def compare(server: Server, baseline: dict[str, str]) -> dict:
    status, body = server.post("/weight_checker", {"action": "compare", "baseline": baseline})
    assert status == 200, body
    return body


def check_bad_payloads(server: Server) -> None:
    for payload in VLLM_BAD_PAYLOADS:
        status, body = server.post("/weight_checker", payload)
        assert status == 400, (payload, body)
        assert set(body["error"]) >= {"message", "type", "code"} and body["error"]["code"] == 400
    status, body = server.post("/weight_checker")  # no body at all
    assert status == 400, body
    assert server.get("/health")[0] == 200


def check_digests(server: Server, ranks: set[str]) -> dict[str, str]:
    first = checksum(server)
    assert all(re.fullmatch(r"[0-9a-f]{64}", v) for v in first.values())
    assert {k.rsplit(":", 1)[0] for k in first} == ranks
    assert checksum(server) == first
    return first


def check_changed_and_deleted(server: Server) -> None:
    baseline = checksum(server)
    keys = sorted(baseline)
    changed, deleted = keys[0], keys[-1]
    baseline[changed] = "f" * 64
    del baseline[deleted]
    assert compare(server, baseline) == {"match": False, "mismatches": sorted([changed, deleted])}


def vllm_reference(server: Server) -> dict[str, str]:
    """vLLM's own compute_tensor_digests, run in the workers (first engine)."""
    status, body = server.post("/collective_rpc", {"method": "weight_checker_vllm_reference"})
    assert status == 200, body
    return merge_results(body)


def check_seed_flow(server: Server) -> None:
    """vLLM's own test flow: pause, checksum, reset, compare (every rank mismatches),
    reload_weights, compare (exact match), resume, and generation works."""
    assert server.post("/pause?mode=abort") == (200, {"status": "paused"})
    baseline = checksum(server)
    assert server.post("/weight_checker", {"action": "reset"}) == (200, {"status": "reset"})
    after = compare(server, baseline)
    # Every tensor with bytes changes (linear weights the CPU backend repacked
    # are empty and stay the empty digest).
    expect = sorted(k for k, v in baseline.items() if v != EMPTY)
    assert after == {"match": False, "mismatches": expect}
    assert {k.rsplit(":", 1)[0] for k in expect} == {k.rsplit(":", 1)[0] for k in baseline}
    status, body = server.post("/collective_rpc", {"method": "reload_weights"})
    assert status == 200, body
    assert compare(server, baseline) == {"match": True, "mismatches": []}
    assert server.post("/resume") == (200, {"status": "resumed"})
    status, body = server.post("/v1/completions", {"model": server.model, "prompt": [1, 2, 3, 4], "max_tokens": 5})
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] in ("length", "stop")


def check_rust_core_served(server: Server, workers: int) -> None:
    log = server.log_text()
    lines = [line for line in log.splitlines() if "by the Rust core" in line]
    assert lines, "no weight_checker INFO line in the server log"
    ranks = {re.search(r" on (dp\d+:pp\d+:pcp\d+:tp\d+) ", line).group(1) for line in lines}
    assert len(ranks) == workers, ranks


def merge_results(body: dict) -> dict[str, str]:
    """One map from a ``/collective_rpc`` answer's per-worker results."""
    merged: dict[str, str] = {}
    for worker in body["results"]:
        merged.update(worker)
    return merged
