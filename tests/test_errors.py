"""Errors: every one the package raises is a WeightCheckerError of the
built-in type a caller expects, keeps its cause, and is never hidden: an
engine that cannot be paused fails the pause step; a broken vLLM is not a
skipped suite."""

from __future__ import annotations

import asyncio
import builtins
import subprocess
import sys

import pytest
import weight_checker
from weight_checker.testing import launch

CLI = [sys.executable, "-m", "weight_checker.cli"]


@pytest.mark.parametrize(
    "call, builtin",
    [
        (lambda: weight_checker.verify("ftp://x", transfer=lambda: None), ValueError),
        (lambda: weight_checker.verify(["http://a:1", "http://a:1"], transfer=lambda: None), ValueError),
        (lambda: weight_checker.rank_prefix(-1, 0, 0, 0), ValueError),
        (lambda: weight_checker.checksum([("w", b"a"), ("w", b"b")]), ValueError),
        (lambda: weight_checker.checksum(42), TypeError),
        (lambda: weight_checker.checksum({"w": b""}, prefix=3), TypeError),
        (lambda: weight_checker.verify(3.5, transfer=lambda: None), TypeError),
        (lambda: weight_checker.compare({"a": 1}, {}), TypeError),
    ],
)
def test_bad_input_raises_the_packages_error_of_the_expected_builtin_type(call, builtin):
    with pytest.raises(weight_checker.WeightCheckerError) as err:
        call()
    assert isinstance(err.value, builtin)


class AsyncEngine:
    """An engine client with an async collective_rpc (the shape of vLLM's
    AsyncLLM) whose workers answer in this process."""

    def __init__(self, pausable: bool):
        self.weights = {"dp0:pp0:pcp0:tp0:w": "a" * 64}
        self.calls: list[str] = []
        if pausable:
            self.pause_generation = self._pause
            self.resume_generation = self._resume

    async def _pause(self, mode: str = "abort") -> None:
        self.calls.append("pause")

    async def _resume(self) -> None:
        self.calls.append("resume")

    async def collective_rpc(self, method: str, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        if method == "weight_checker_checksums":
            return [dict(self.weights)]
        return [None]


def test_an_async_engine_that_cannot_be_paused_fails_the_pause_step_by_name():
    engine = AsyncEngine(pausable=False)
    with pytest.raises(
        weight_checker.VerifyError, match=r"step 'pause' on in-process AsyncEngine: .*no pause_generation"
    ):
        asyncio.run(weight_checker.verify_async(engine, transfer=lambda: None))
    assert "weight_checker_reset" not in engine.calls  # nothing was zeroed while it kept serving


def test_an_async_engine_is_paused_checked_and_resumed_on_its_own_loop():
    engine = AsyncEngine(pausable=True)

    async def transfer() -> None:
        engine.calls.append("transfer")
        engine.weights = {"dp0:pp0:pcp0:tp0:w": "a" * 64}

    result = asyncio.run(weight_checker.verify_async(engine, transfer=transfer))
    assert result.match, result.mismatches
    assert engine.calls[0] == "pause" and engine.calls[-1] == "resume" and "transfer" in engine.calls


def test_an_async_transfers_failure_is_the_cause_of_the_transfer_step():
    engine = AsyncEngine(pausable=True)

    async def transfer() -> None:
        raise ConnectionResetError("NCCL peer went away")

    with pytest.raises(weight_checker.VerifyError, match=r"step 'transfer'.*NCCL peer went away") as err:
        asyncio.run(weight_checker.verify_async(engine, transfer=transfer))
    assert isinstance(err.value.__cause__, ConnectionResetError)
    assert engine.calls[-1] == "resume"


def importing_vllm_raises(monkeypatch, error: Exception) -> None:
    """``import vllm`` raises ``error`` for the rest of the test."""
    real_import = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == "vllm":
            raise error
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(builtins, "__import__", fake)


def test_a_broken_vllm_is_an_error_not_a_skip(monkeypatch):
    importing_vllm_raises(monkeypatch, RuntimeError("vLLM's C extension failed to load"))
    with pytest.raises(RuntimeError, match="C extension"):
        launch.vllm_available()


def test_a_missing_vllm_is_a_skip_locally_and_an_error_under_ci(monkeypatch):
    importing_vllm_raises(monkeypatch, ModuleNotFoundError("No module named 'vllm'"))
    monkeypatch.setenv("CI", "false")
    assert launch.vllm_available() is False
    monkeypatch.setenv("CI", "true")
    with pytest.raises(RuntimeError, match="CI=true but vLLM cannot be imported"):
        launch.vllm_available()


def test_verify_refuses_a_baseline_with_a_transfer():
    r = subprocess.run(
        [*CLI, "verify", "--url", "http://127.0.0.1:9", "--baseline", "b.json", "--transfer-cmd", "true"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "--baseline" in r.stderr and "not allowed with" in r.stderr, r.stderr
    with pytest.raises(weight_checker.InputTypeError, match="takes no transfer"):
        weight_checker.verify("http://127.0.0.1:9", transfer=lambda: None, baseline={})


def test_debug_shows_the_whole_chain_of_causes(tmp_path):
    """A checkpoint error from the core, raised again as the CLI's: the debug
    traceback shows the core's SafetensorsError as the direct cause."""
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    r = subprocess.run([*CLI, "checksum", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    env = {"WEIGHT_CHECKER_DEBUG": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([*CLI, "checksum", str(bad)], capture_output=True, text=True, env=env)
    assert "SafetensorsError" in r.stderr and "direct cause of the following exception" in r.stderr, r.stderr
