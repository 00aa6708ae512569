"""Hostile input never becomes a 5xx on the route, nor a traceback in the CLI.

Route: raw request bytes from hypothesis and the named attacks (any nesting,
huge numbers, non-UTF-8, NUL bytes, duplicate keys, scalars as the body)
are 400 in vLLM's error shape, and the weights are unchanged afterwards.
CLI: manifest bytes and argument strings from hypothesis give exit 0, 1 or 2
and never a traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from weight_checker.cli.main import main as cli_main

from .test_server import Workers, assert_vllm_error, make_app

NAMED_ATTACKS = [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"action": "compare", "baseline": ' + b'{"a": ' * 50_000 + b'"x"' + b"}" * 50_001,
    b'{"action": ' + b"9" * 100_000 + b"}",
    b'{"action": "compare", "baseline": {"k": 1e999999}}',
    b'{"action": "checksum\xff\xfe"}',
    b'{"action": "check\x00sum"}',
    b"\x00" * 64,
    b'{"action": "checksum", "action": "reset"}',
    b'{"action": "compare", "baseline": {"k": "a", "k": "b"}}',
    b'"checksum"',
    b"42",
    b"null",
    b"true",
]


@pytest.fixture(scope="module")
def workers():
    return Workers()


@pytest.fixture(scope="module")
def client(workers):
    return TestClient(make_app(workers))


def weights(workers: Workers) -> list[dict[str, str]]:
    import weight_checker

    return [weight_checker.checksum(m, p) for m, p in zip(workers.models, workers.prefixes, strict=True)]


@pytest.mark.parametrize("body", NAMED_ATTACKS, ids=range(len(NAMED_ATTACKS)))
def test_named_attacks_are_400_and_change_nothing(client, workers, body):
    before = weights(workers)
    r = client.post("/weight_checker", content=body, headers={"Content-Type": "application/json"})
    assert_vllm_error(r, 400)
    assert weights(workers) == before


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.one_of(
        st.binary(max_size=400),
        st.builds(lambda b: b'{"action": "reset"' + b, st.binary(max_size=50)),
        st.builds(lambda b: b'{"action": "compare", "baseline": {' + b, st.binary(max_size=80)),
    ),
    st.sampled_from(["application/json", "text/plain", "application/json; charset=latin-1", ""]),
)
def test_random_bytes_never_5xx_and_weights_unchanged(client, workers, body, content_type):
    before = weights(workers)
    r = client.post("/weight_checker", content=body, headers={"Content-Type": content_type} if content_type else {})
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        assert_vllm_error(r, r.status_code)
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if not (isinstance(parsed, dict) and parsed.get("action") == "reset" and r.status_code == 200):
        assert weights(workers) == before


def test_a_million_key_baseline_compares_correctly(client, workers):
    current = client.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
    baseline = dict(current)
    baseline.update({f"dp9:pp0:pcp0:tp0:extra.{i}": "0" * 64 for i in range(1_000_000 - len(current))})
    changed = sorted(current)[0]
    baseline[changed] = "f" * 64
    r = client.post("/weight_checker", json={"action": "compare", "baseline": baseline})
    assert r.status_code == 200
    got = r.json()
    assert got["match"] is False
    assert len(got["mismatches"]) == 1_000_000 - len(current) + 1
    assert changed in got["mismatches"] and got["mismatches"] == sorted(got["mismatches"])


def run_cli(argv: list[str], stdin: str = "") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    old_stdin = os.sys.stdin
    os.sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli_main(argv)
            except SystemExit as e:  # argparse usage errors
                code = e.code if isinstance(e.code, int) else 2
    finally:
        os.sys.stdin = old_stdin
    return code, out.getvalue(), err.getvalue()


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.one_of(
        st.binary(max_size=300),
        st.just(b"[" * 50_000),
        st.just(b'{"k": ' + b"1" * 10_000 + b"}"),
        st.builds(lambda d: json.dumps(d).encode(), st.dictionaries(st.text(max_size=5), st.text(max_size=5))),
    )
)
def test_compare_on_any_manifest_bytes(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("m") / "m.json"
    path.write_bytes(data)
    good = path.with_name("good.json")
    good.write_text("{}")
    code, out, err = run_cli(["compare", str(good), str(path)])
    assert code in (0, 1, 2), (code, err)
    assert "Traceback" not in err and "Traceback" not in out
    if code == 2:
        assert len(err.strip().splitlines()) == 1 and str(path) in err


# No ':' and '/' in the generated strings: none can be a reachable URL, so
# nothing is ever sent; the named ones are the malformed URLs users type.
url_strings = st.one_of(
    st.text(alphabet=st.characters(blacklist_characters=":/"), max_size=40),
    st.sampled_from(["http://[::1", "http://", "ftp://x", "http://h:99999", "http://h:abc", "http://h/?q=1", ""]),
)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(url_strings, st.sampled_from(["verify", "replicas"]))
def test_any_url_string_exits_cleanly(url, command):
    argv = [command, f"--url={url}", "--timeout", "2"]
    if command == "verify":
        argv += ["--transfer-cmd", "true"]
    code, out, err = run_cli(argv)
    assert code == 2, (code, err)
    assert "Traceback" not in err and "Traceback" not in out
    assert len(err.strip().splitlines()) == 1 and "invalid URL" in err
