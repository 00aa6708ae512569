"""Shared test setup: hypothesis profiles and the vLLM reference digest."""

from __future__ import annotations

import hashlib
import os

import pytest
from hypothesis import HealthCheck, settings

# `fast` for CI (the default), `slow` for deep local runs:
#   HYPOTHESIS_PROFILE=slow pytest
settings.register_profile("fast", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("slow", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fast"))


def vllm_digest(t) -> str:
    """The digest vLLM 0.32's built-in checker computes for one tensor
    (`compute_tensor_digests`, per tensor): the oracle of every test."""
    import torch

    if t.numel() == 0:
        # vLLM's contract: an empty tensor hashes to the empty message. (vLLM's routine
        # itself raises on some empty views, e.g. expand(0, ...) of int16.)
        return hashlib.sha256(b"").hexdigest()
    try:
        data = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
    except RuntimeError:
        # vLLM's routine raises on a one-element view with a non-unit stride
        # (`.contiguous()` returns it unchanged); a fresh copy has the same
        # C-order bytes.
        data = torch.empty(t.shape, dtype=t.dtype).copy_(t).view(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny Llama checkpoint written at test time with a fixed seed."""
    from weight_checker.testing.models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test leaves ``os.environ`` as it found it. Libraries change it as
    they are imported or set up (``import trl`` sets VLLM_LOGGING_LEVEL=ERROR,
    TRL's colocated vLLM sets RANK, WORLD_SIZE, MASTER_PORT), and every server
    a later test starts would inherit that."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(scope="session")
def vllm031_python() -> str | None:
    """The interpreter of the vLLM 0.31 environment (scripts/dev-env.sh makes
    .venv-vllm031), or None when there is none."""
    from pathlib import Path

    path = Path(
        os.environ.get("WEIGHT_CHECKER_VLLM031_PYTHON", Path(__file__).parent.parent / ".venv-vllm031/bin/python")
    )
    return str(path) if path.exists() else None


def pytest_sessionstart(session):
    """``WEIGHT_CHECKER_LANES=16`` asks for the 16-lane wide kernel (the
    Makefile's third digest run). On a CPU without AVX-512 the core runs its
    narrow kernel instead: say so, loudly, rather than pass with the wide
    kernel untested; under CI a CPU that has it but a run that did not use
    it is a failure."""
    if os.environ.get("WEIGHT_CHECKER_LANES", "").strip() != "16":
        return
    from weight_checker import _core

    if not _core.wide_kernel_available():
        session.config.issue_config_time_warning(
            pytest.PytestWarning("WEIGHT_CHECKER_LANES=16: no AVX-512 on this CPU, the wide kernel is NOT tested"),
            stacklevel=2,
        )
        print("\nnote: WEIGHT_CHECKER_LANES=16 but this CPU has no AVX-512: the wide kernel is not tested in this run")
    elif _core.small_lanes() != 16 and os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        raise pytest.UsageError("CI=true: this CPU has the wide kernel but WEIGHT_CHECKER_LANES=16 did not select it")
