"""Checks shared by the end-to-end modules (one real vLLM server each)."""

from __future__ import annotations

import hashlib
import re

from weight_checker.testing.launch import Server

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


#: The plugin's INFO line for one rank's checksum (integrations/vllm/worker.py):
#: the kernels this process may use, then what the run used.
SERVED = re.compile(
    r"weight_checker: (?P<tensors>\d+) tensors, (?P<bytes>\d+) bytes in \S+ s \(\S+ GB/s\) on "
    r"(?P<rank>dp\d+:pp\d+:pcp\d+:tp\d+) by the Rust core \(weight_checker \S+, kernel (?P<kernel>[\w+-]+): "
    r"(?P<run>.+)\)$",
    re.M,
)


def check_rust_core_served(server: Server, answer: dict[str, str], workers: int) -> None:
    """Each rank's latest log line says the Rust core hashed exactly the
    tensors that rank answered with (``answer``, from the checksum just
    made), with the kernel this CPU detects: the plugin, not vLLM's own
    routine, served the request."""
    import weight_checker

    latest = {m["rank"]: m for m in SERVED.finditer(server.log_text())}
    keys_per_rank: dict[str, int] = {}
    for key in answer:
        rank = ":".join(key.split(":")[:4])
        keys_per_rank[rank] = keys_per_rank.get(rank, 0) + 1
    assert len(keys_per_rank) == workers, sorted(keys_per_rank)
    assert set(latest) == set(keys_per_rank), (sorted(latest), sorted(keys_per_rank))
    for rank, count in keys_per_rank.items():
        line = latest[rank]
        assert int(line["tensors"]) == count, (rank, line.group(0), count)
        assert int(line["bytes"]) > 0, line.group(0)
        # The narrow kernel is the CPU's. Whether runs may also take the wide
        # one is each process's own calibration: where the two kernels are
        # close (AMD EPYC fam 25: 2.8 GB/s each), a loaded worker and this
        # process may decide differently.
        assert line["kernel"].split("+")[0] == weight_checker.kernel().split("+")[0], line.group(0)
        # What the run used, not the process's defaults: its own tensor count.
        assert line["run"].endswith(f"; {count} tensors"), line.group(0)


def reload_checkpoint(server: Server) -> None:
    """The server loads its own checkpoint again: what a test that pushed
    other weights does to leave a shared server as it found it. By path: a
    ``reload_weights`` without one reloads the latest path it was given."""
    body = {"method": "reload_weights", "kwargs": {"weights_path": server.model}}
    status, answer = server.post("/collective_rpc", body)
    assert status == 200, answer


def merge_results(body: dict) -> dict[str, str]:
    """One map from a ``/collective_rpc`` answer's per-worker results."""
    merged: dict[str, str] = {}
    for worker in body["results"]:
        merged.update(worker)
    return merged
