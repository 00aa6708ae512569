"""End to end, TP=2: every key exists once per TP rank (tp0, tp1)."""

from __future__ import annotations

import pytest
from weight_checker.testing.launch import vllm_available

from . import vllm_checks as checks

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]


@pytest.fixture
def server(vllm_tp2):
    """The shared TP=2 server (started with an API key, which ``post`` sends)."""
    return vllm_tp2


def test_both_tp_ranks_and_identity(server):
    ours = checks.check_digests(server, {"dp0:pp0:pcp0:tp0", "dp0:pp0:pcp0:tp1"})
    assert ours == checks.vllm_reference(server)
    names = {
        r: {k.split(":", 4)[4] for k in ours if k.startswith(r)} for r in ("dp0:pp0:pcp0:tp0:", "dp0:pp0:pcp0:tp1:")
    }
    assert names["dp0:pp0:pcp0:tp0:"] == names["dp0:pp0:pcp0:tp1:"]


def test_seed_flow(server):
    checks.check_seed_flow(server)


def test_rust_core_served_both_ranks(server):
    checks.check_rust_core_served(server, checks.checksum(server), workers=2)
