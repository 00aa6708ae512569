"""Shared test setup: hypothesis profiles, the vLLM reference digest, and the
session's shared vLLM servers (tests/servers.py): one fixture per
configuration, the order that keeps each server alive for one span, the check
after every test, and the summary of servers started."""

from __future__ import annotations

import hashlib
import os
import threading
import warnings
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, settings

from .jobs import Jobs
from .servers import CONFIGS, QUANTIZED_CONFIGS, Models, ServerPool, fixture_name

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
def tiny_llama(request):
    """A tiny Llama checkpoint written at test time with a fixed seed (the
    session's, tests/servers.py's Models: the one most servers load)."""
    return _models(request.config).path("tiny-llama")


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


def vllm031_interpreter() -> str | None:
    """The interpreter of the vLLM 0.31 environment (scripts/dev-env.sh makes
    .venv-vllm031), or None when there is none."""
    from pathlib import Path

    path = Path(
        os.environ.get("WEIGHT_CHECKER_VLLM031_PYTHON", Path(__file__).parent.parent / ".venv-vllm031/bin/python")
    )
    return str(path) if path.exists() else None


@pytest.fixture(scope="session")
def vllm031_python() -> str | None:
    return vllm031_interpreter()


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


# --- the shared vLLM servers (tests/servers.py) and background jobs (tests/jobs.py) -----------

_POOL = pytest.StashKey[ServerPool]()
_JOBS = pytest.StashKey[Jobs]()
_MODELS = pytest.StashKey[Models]()
#: Items that read a background job: ``@pytest.mark.uses_jobs("name", ...)``.
JOBS_MARK = "uses_jobs"


def pytest_configure(config):
    config.addinivalue_line("markers", f"{JOBS_MARK}(*names): reads these background jobs' results (tests/jobs.py)")


def _configs_of(item) -> list[str]:
    """The shared servers a collected test uses: through its fixtures, or a
    parameter of :data:`SERVER_PARAMS` (a test run once per configuration)."""
    names = [n for n in CONFIGS if fixture_name(n) in getattr(item, "fixturenames", ())]
    params = getattr(getattr(item, "callspec", None), "params", {})
    for key in SERVER_PARAMS:
        param = params.get(key)
        if isinstance(param, str) and param in CONFIGS and param not in names:
            names.append(param)
    return names


#: Parameters whose value names the shared server a test leases itself
#: (``vllm_servers.lease(value, ...)``): ordered with that server's tests,
#: which stop it after the last (a server leased by a test this does not know
#: stays alive to the session's end).
SERVER_PARAMS = ("vllm_config", "config", "lifecycle", "fp8")


def _jobs_of(item) -> list[str]:
    return [name for mark in item.iter_markers(JOBS_MARK) for name in mark.args]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Tests that need no shared server and no background job first, then
    those of each server in :data:`CONFIGS`'s order (so that a server is alive
    for one span, and only a few at once; each is stopped after the last test
    that uses it), then those that read background jobs (started with the
    session, they ran meanwhile)."""
    rank = {name: i for i, name in enumerate(CONFIGS)}

    def group(item) -> int:
        if _jobs_of(item):
            return len(CONFIGS)
        return min((rank[n] for n in _configs_of(item)), default=-1)

    items[:] = [item for _, item in sorted(enumerate(items), key=lambda p: (group(p[1]), p[0]))]
    last_use, order = {}, []
    jobs = Jobs()
    for item in items:
        for name in _configs_of(item):
            last_use[name] = item.nodeid
            if name not in order:
                order.append(name)
        for name in _jobs_of(item):
            make = getattr(item.module, "background_jobs", None)
            if make is not None and name not in jobs.planned:
                jobs.planned[name] = lambda make=make, name=name: make(_job_env(config))[name]()
    config.stash[_POOL] = ServerPool(last_use, order)
    config.stash[_JOBS] = jobs


def _job_env(config) -> SimpleNamespace:
    """What a module's ``background_jobs(env)`` gets: ``env.models`` (the
    session's checkpoints) and ``env.servers`` (the server pool, for a one-off
    server it starts)."""
    return SimpleNamespace(models=_models(config), servers=_pool(config))


#: Background jobs and the main thread may set the session's checkpoints and
#: pool up at once (the first ``mktemp`` creates pytest's base directory: two
#: at once collide).
_SETUP = threading.RLock()


def _models(config) -> Models:
    """The session's checkpoints (written once, on first use)."""
    with _SETUP:
        models = config.stash.get(_MODELS, None)
        if models is None:
            models = config.stash[_MODELS] = Models(config._tmp_path_factory.mktemp("models"))
        return models


def _pool(config) -> ServerPool | None:
    """The session's pool, set up (its folders, the vLLM 0.31 interpreter) once."""
    with _SETUP:
        from weight_checker.testing.launch import vllm_available

        pool = config.stash.get(_POOL, None)
        if pool is None:  # collected without our hook (a plugin reordered): no plan, stopped at the end
            pool = config.stash[_POOL] = ServerPool()
        if pool.root is None:
            if not vllm_available():
                return None
            pool.configure(config._tmp_path_factory.mktemp("servers"), _models(config), vllm031_interpreter())
        return pool


@pytest.hookimpl(hookwrapper=True)
def pytest_runtestloop(session):
    """The background jobs, and the first servers, start while the first tests run."""
    config = session.config
    if not config.option.collectonly:
        planned = config.stash.get(_POOL, None)
        if planned is not None and planned.order:
            pool = _pool(config)
            if pool is not None:
                pool.prefetch()
        jobs = config.stash.get(_JOBS, None)
        if jobs is not None:
            jobs.start()
    yield


@pytest.fixture(scope="session")
def jobs(request) -> Jobs:
    """The session's background jobs (tests/jobs.py)."""
    found = request.config.stash.get(_JOBS, None)
    if found is None:
        found = request.config.stash[_JOBS] = Jobs()
    return found


@pytest.fixture(scope="session")
def models(request) -> Models:
    """The session's checkpoints (tests/servers.py's Models: every family of tests/models.py)."""
    return _models(request.config)


@pytest.fixture(scope="session", autouse=True)
def vllm_imported_alone(request) -> None:
    """vLLM's quantization layers (and transformers under them) imported in
    this process before any test of a session that runs vLLM tests, while
    no checkpoint is being written: transformers' lazy imports are not
    thread-safe, and a server started ahead writes its model in another
    thread (a test's first import then failed, rarely, with "cannot import
    name 'PreTrainedConfig'")."""
    from weight_checker.testing.launch import vllm_available

    if not any(item.get_closest_marker("vllm") for item in request.session.items) or not vllm_available():
        return
    with _models(request.config).exclusive():
        import vllm.model_executor.layers.quantization.online.fp8  # noqa: F401


@pytest.fixture(scope="session")
def vllm_servers(request) -> ServerPool:
    """The session's shared servers (tests/servers.py)."""
    pool = _pool(request.config)
    if pool is None:
        pytest.skip("vLLM is not installed")
    return pool


def _server_fixture(name: str):
    @pytest.fixture(name=fixture_name(name))
    def fixture(vllm_servers, request):
        return vllm_servers.lease(name, request.node)

    fixture.__doc__ = f"The session's shared {name!r} server: {CONFIGS[name].purpose}"
    return fixture


for _name in CONFIGS:
    globals()[fixture_name(_name)] = _server_fixture(_name)


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test and its own fixtures: every server it leased is checked
    (resumed, same state as it started), and the servers no later test
    needs are stopped."""
    yield
    pool = item.config.stash.get(_POOL, None)
    if pool is None or pool.root is None:
        return
    for problem in pool.check(item.nodeid):
        warnings.warn(pytest.PytestWarning(f"{item.nodeid} left a shared vLLM server broken: {problem}"), stacklevel=1)


def pytest_sessionfinish(session, exitstatus):
    jobs = session.config.stash.get(_JOBS, None)
    if jobs is not None:
        jobs.close()
    pool = session.config.stash.get(_POOL, None)
    if pool is not None:
        pool.close()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    pool = config.stash.get(_POOL, None)
    jobs = config.stash.get(_JOBS, None)
    lines = (pool.summary() if pool is not None and pool.root is not None else []) + (jobs.summary() if jobs else [])
    if pool is not None and any(name in pool.summary_names() for name in QUANTIZED_CONFIGS):
        # What decides each quantized form on this host (docs/quantized.md), printed under CI too.
        from .test_quantized import cpu_features

        lines.append(f"quantized servers on this CPU: {cpu_features()}")
    if not lines:
        return
    terminalreporter.section("vLLM servers and background jobs")
    for line in lines:
        terminalreporter.write_line(line)
