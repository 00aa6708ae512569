"""Every kernel against hashlib, whichever one the calibration picks on this
CPU: the digest suites (every dtype, view, stride, offset and length around
the block edges, the streaming and small-tensor paths, the module walk) run
again with the portable fallback forced, with the SHA-NI lanes fixed (no
16-lane AVX-512 at all), and with the 16-lane AVX-512 kernel asked for.

The core reads these settings once per process, so each runs in a process of
its own, as a background job from the session's start (tests/jobs.py): it
mostly hashes on one core, while the foreground waits for servers (it was a
fixture that blocked the foreground for 38-99 s under CI's load)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
from weight_checker import _core

ROOT = Path(__file__).resolve().parent.parent
DIGEST_SUITES = ["tests/test_digests.py", "tests/test_core.py", "tests/test_walk.py"]
SETTINGS = {
    "portable": {"WEIGHT_CHECKER_KERNEL": "portable"},
    "sha-ni-lanes": {"WEIGHT_CHECKER_LANES": "4"},
    "wide": {"WEIGHT_CHECKER_LANES": "16"},
}


def main_runs_it(name: str, session: pytest.Session) -> bool:
    """Whether this run's own digest suites ran under the setting: every one
    of them is collected here and this process's calibrated choice is the
    setting's (:func:`calibrated_as`)."""
    collected = {str(item.path.relative_to(ROOT)) for item in session.items}
    return set(DIGEST_SUITES) <= collected and calibrated_as(name)


def not_here(name: str) -> bool:
    """A setting this CPU cannot run: without AVX-512 the wide kernel asked
    for falls back to the narrow one, whose runs the others already are."""
    return name == "wide" and not _core.wide_kernel_available()


def calibrated_as(name: str) -> bool:
    """Whether this process's calibrated choice is the setting's (SHA-NI
    lanes, 4 a thread, for large and small tensors alike)."""
    return name == "sha-ni-lanes" and _core.kernel() == "sha-ni" and _core.lanes() == _core.small_lanes() == 4


def run_suites(name: str, always: bool = False) -> subprocess.CompletedProcess | None:
    """The digest suites under one setting, in a process of its own (the
    core reads its settings once per process); ``None`` where the setting
    needs no run of its own (:func:`calibrated_as`, :func:`not_here`),
    unless ``always``."""
    if not always and (calibrated_as(name) or not_here(name)):
        return None
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHT_CHECKER_")} | SETTINGS[name]
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *DIGEST_SUITES],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200,
    )  # fmt: skip


def background_jobs(env) -> dict[str, functools.partial]:
    """Each setting's run, in the background from the session's start (tests/jobs.py)."""
    return {f"kernel-{name}": functools.partial(run_suites, name) for name in SETTINGS}


@pytest.mark.parametrize("setting", [pytest.param(n, marks=pytest.mark.uses_jobs(f"kernel-{n}")) for n in SETTINGS])
def test_the_digest_suites_pass_with_the_kernel_forced(jobs, setting, request):
    if main_runs_it(setting, request.session):
        pytest.skip("the calibration chose SHA-NI lanes, 4 a thread: the main run's digest suites ran under it")
    if not_here(setting):
        pytest.skip("no AVX-512 on this CPU: the wide kernel is not tested (it would run the narrow one)")
    # None: calibrated as the setting, but this run did not collect the digest suites: run here.
    r = jobs.result(f"kernel-{setting}") or run_suites(setting, always=True)
    assert r is not None
    assert r.returncode == 0, r.stdout[-5000:]
    summary = r.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
