"""Every kernel against hashlib, whichever one the calibration picks on this
CPU: the digest suites (every dtype, view, stride, offset and length around
the block edges, the streaming and small-tensor paths, the module walk) run
again with the portable fallback forced, with the SHA-NI lanes fixed (no
16-lane AVX-512 at all), and with the 16-lane AVX-512 kernel asked for.

The core reads these settings once per process, so each runs in a process of
its own; the three run at once (each mostly hashes on one core), as part of
the main run (they were three more ``pytest`` runs after it)."""

from __future__ import annotations

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
    setting's (SHA-NI lanes, 4 a thread, for large and small tensors alike)."""
    collected = {str(item.path.relative_to(ROOT)) for item in session.items}
    return (
        name == "sha-ni-lanes"
        and set(DIGEST_SUITES) <= collected
        and _core.kernel() == "sha-ni"
        and _core.lanes() == _core.small_lanes() == 4
    )


def not_here(name: str) -> bool:
    """A setting this CPU cannot run: without AVX-512 the wide kernel asked
    for falls back to the narrow one, whose runs the others already are."""
    return name == "wide" and not _core.wide_kernel_available()


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> dict[str, subprocess.CompletedProcess]:
    """The digest suites under each setting not already this run's, run at once."""
    procs = {}
    for name, setting in SETTINGS.items():
        if main_runs_it(name, request.session) or not_here(name):
            continue
        env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHT_CHECKER_")} | setting
        env.pop("PYTEST_ADDOPTS", None)
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *DIGEST_SUITES],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    out = {}
    for name, proc in procs.items():
        stdout, _ = proc.communicate(timeout=1200)
        out[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, "")
    return out


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_the_digest_suites_pass_with_the_kernel_forced(runs, setting, request):
    if main_runs_it(setting, request.session):
        pytest.skip("the calibration chose SHA-NI lanes, 4 a thread: the main run's digest suites ran under it")
    if not_here(setting):
        pytest.skip("no AVX-512 on this CPU: the wide kernel is not tested (it would run the narrow one)")
    r = runs[setting]
    assert r.returncode == 0, r.stdout[-5000:]
    summary = r.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
