"""The launcher that starts every vLLM process of the tests, the demo and the
benchmarks: the CPU binding it derives, and the AMX tile request it puts on
``PYTHONPATH`` (checked against the kernel's own answer, ``ARCH_GET_XCOMP_PERM``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from weight_checker.testing.launch import AMX_SITE_DIR, local_workers, omp_threads_bind, vllm_env

ARCH_GET_XCOMP_PERM = 0x1022
XFEATURE_XTILEDATA = 18


def has_amx() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and "amx_tile" in line.split() for line in f)


@pytest.mark.parametrize(
    ("args", "workers"),
    [
        ([], 1),
        (["-tp", "2"], 2),
        (["--tensor-parallel-size=4"], 4),
        (["-dp", "2", "-tp", "2"], 4),
        (["--pipeline-parallel-size", "2", "--data-parallel-size", "3"], 6),
        (["--max-model-len", "256"], 1),
    ],
)
def test_local_workers_from_vllm_arguments(args, workers):
    assert local_workers(args) == workers


@pytest.mark.parametrize(
    ("workers", "cpus", "bind"),
    [
        (2, [0, 1], "0|1"),
        (2, [0, 1, 2, 3], "0,1|2,3"),
        (3, [4, 5, 6, 7, 8, 9, 10], "4,5,6|7,8|9,10"),
        (4, [0, 1], "0|1|0|1"),
        (1, [3, 7], "3,7"),
    ],
)
def test_omp_binding_splits_the_given_cpus(workers, cpus, bind):
    assert omp_threads_bind(workers, cpus) == bind


def test_omp_binding_covers_this_process_affinity_once():
    cpus = sorted(os.sched_getaffinity(0))
    bind = omp_threads_bind(2)
    groups = [[int(c) for c in g.split(",")] for g in bind.split("|")]
    assert len(groups) == 2
    if len(cpus) >= 2:
        assert sorted(c for g in groups for c in g) == cpus


def test_env_binds_only_several_workers_and_never_overrides_the_caller():
    base = {"PATH": "/usr/bin"}
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_env([], base=base)
    assert vllm_env(["-tp", "2"], base=base)["VLLM_CPU_OMP_THREADS_BIND"] == omp_threads_bind(2)
    mine = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert vllm_env(["-tp", "2"], mine, base=base)["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert vllm_env([], base=base)["PYTHONPATH"].split(os.pathsep)[0] == str(AMX_SITE_DIR)
    assert "PYTHONPATH" not in vllm_env([], base=base, amx_tile=False)


PROBE = f"""
import ctypes, json, sys
libc = ctypes.CDLL(None, use_errno=True)
mask = ctypes.c_uint64(0)
rc = libc.syscall(158, {ARCH_GET_XCOMP_PERM}, ctypes.byref(mask))
site = sys.modules.get("sitecustomize")
print(json.dumps({{"rc": rc, "mask": mask.value, "granted": getattr(site, "AMX_TILE_GRANTED", "absent")}}))
"""


def run_probe(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_launched_processes_hold_the_amx_tile_state_exactly_where_the_cpu_has_amx(tmp_path):
    without = run_probe(vllm_env([], amx_tile=False))
    launched = run_probe(vllm_env([]))
    tile = 1 << XFEATURE_XTILEDATA
    assert launched["rc"] == 0 and without["rc"] == 0
    if has_amx():
        assert launched["granted"] is True
        assert launched["mask"] & tile
        # (A plain child lacks it unless this process already asked and the
        # permission was inherited: then there is nothing to compare.)
        assert without["granted"] == "absent"
    else:
        assert without["mask"] & tile == 0
        assert launched["granted"] is None
        assert launched["mask"] & tile == 0


def test_another_sitecustomize_on_the_path_still_runs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['MARK'] = 'ran'\n")
    env = vllm_env([], {"PYTHONPATH": os.pathsep.join([str(AMX_SITE_DIR), str(tmp_path)])})
    code = "import os, sys; print(os.environ.get('MARK'), sys.modules['sitecustomize'].__file__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    mark, first = out.stdout.split()
    assert mark == "ran"
    assert first == str(AMX_SITE_DIR / "sitecustomize.py")


# A stand-in server process for the start's retry: the launcher's logic is
# under test here, and the real servers' starts run in their own suites.
_SERVES_HEALTH = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""
_HANGS = "print('imports done', flush=True); import time; time.sleep(600)"
_KEEPS_LOGGING = "import time\nwhile True:\n    print('loading', flush=True); time.sleep(0.1)"
# A loader that prints nothing while it works (in a child: the group's CPU counts).
_WORKS_QUIETLY = (
    "import subprocess, sys; print('loading', flush=True); subprocess.run([sys.executable, '-c', 'while True: pass'])"
)


def _launcher(tmp_path, scripts):
    """A ``launch`` for :func:`start_with_retry` that runs ``scripts`` in turn."""
    from weight_checker.testing.launch import Server, free_port

    started = []

    def launch():
        port = free_port()
        code = scripts[len(started)]
        log = tmp_path / "server.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-c", code, str(port)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        started.append(proc)
        return Server(f"http://127.0.0.1:{port}", "stand-in", log, proc)

    return launch, started


def test_a_hung_start_is_stopped_and_started_once_more(tmp_path, monkeypatch, capsys):
    from weight_checker.testing import launch as launcher

    monkeypatch.setattr(launcher, "STALL_S", 2.0)
    launch, started = _launcher(tmp_path, [_HANGS, _SERVES_HEALTH])
    server = launcher.start_with_retry(launch, "stand-in", 60, health_timeout=1, poll=0.1)
    try:
        assert len(started) == 2
        assert started[0].poll() is not None and not launcher._group_alive(started[0]), "the hung server was left"
        assert (tmp_path / "server.log.hung").read_text() == "imports done\n"
        assert server.get("/health")[0] == 200
        assert "its processes idle for 2s; starting it once more" in capsys.readouterr().err
    finally:
        server.stop()


def test_a_server_that_hangs_twice_fails_with_its_log(tmp_path, monkeypatch):
    from weight_checker.testing import launch as launcher

    monkeypatch.setattr(launcher, "STALL_S", 2.0)
    launch, started = _launcher(tmp_path, [_HANGS, _HANGS])
    with pytest.raises(launcher.ServerHung, match=r"(?s)idle for 2s.*imports done"):
        launcher.start_with_retry(launch, "stand-in", 60, health_timeout=1, poll=0.1)
    assert len(started) == 2 and all(p.poll() is not None for p in started)


@pytest.mark.parametrize(
    ("script", "error"),
    [
        (_KEEPS_LOGGING, "not healthy after 5s"),  # writes its log
        (_WORKS_QUIETLY, "not healthy after 5s"),  # writes nothing, but works
        ("raise SystemExit(3)", "exited with 3"),
    ],
)
def test_a_slow_or_failed_start_is_not_retried(tmp_path, monkeypatch, script, error):
    from weight_checker.testing import launch as launcher

    monkeypatch.setattr(launcher, "STALL_S", 2.0)
    launch, started = _launcher(tmp_path, [script, _SERVES_HEALTH])
    with pytest.raises(RuntimeError, match=error):
        launcher.start_with_retry(launch, "stand-in", 5, health_timeout=1, poll=0.1)
    assert len(started) == 1 and started[0].poll() is not None
    assert not launcher._group_alive(started[0]), "a process of the stopped start is left"
