"""This machine's SHA-256 ceiling, measured where the benchmark runs.

SHA-256 of one message is one sequential chain; a core's ceiling is its
best throughput with several independent streams interleaved (what the C
probe in shared/shani-probe measures; here the core's own calibration does
the same with its kernels). The machine's ceiling is that figure times the
threads the scheduler runs. Benchmarks print their figures as a fraction of it,
so that figures from different machines can be compared.
"""

from __future__ import annotations

import os
import platform

from weight_checker import _core


def cpu_model() -> str:
    """The CPU as /proc/cpuinfo names it: model name, vendor, family and model
    (AMD EPYC and Intel Xeon machines of one kind differ by ~2x in SHA-NI)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first CPU is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return platform.processor() or platform.machine()
    amx = " AMX" if "amx_tile" in fields.get("flags", "").split() else ""
    return (
        f"{fields.get('model name', '?')} ({fields.get('vendor_id', '?')} family {fields.get('cpu family', '?')} "
        f"model {fields.get('model', '?')}{amx})"
    )


def scheduler_choice() -> str:
    """The kernel and lane counts the scheduler runs with on this CPU."""
    small = _core.small_lanes()
    small_text = "16-lane AVX-512" if small == 16 else f"{small} lanes"
    lanes = _core.lanes()
    wide, four = _core.calibrate_wide()
    if lanes == 16:
        large = "16-lane AVX-512 for large tensors (asked for)"
    else:
        large = f"{lanes} lanes per thread for large tensors"
        if wide > four:
            large += f" (16-lane AVX-512 for runs of many, where it ends sooner: {wide:.2f} vs {four:.2f} GB/s)"
    return f"kernel {_core.kernel()}, {large}, {small_text} for small ones, {_core.threads()} threads"


def machine() -> str:
    """One line naming the CPU and the scheduler's choice on it: printed beside
    every figure so that figures from different CPUs are never mixed up."""
    return f"cpu: {cpu_model()}, {os.cpu_count()} CPUs; {scheduler_choice()}"


def per_core_gbps() -> tuple[float, int]:
    """(best GB/s of one core, the lane count that reached it)."""
    best = max(_core.calibrate(), key=lambda f: f[1])
    return best[1], best[0]


def per_cpu_gbps() -> dict[int, float]:
    """Each CPU's best GB/s, the calibration pinned to it in turn.

    On a shared machine one CPU can be slowed by another tenant for seconds
    at a time; a run on two cores then understates the scheduler while a
    one-thread reference does not notice. Measuring each CPU shows it.
    """
    if not hasattr(os, "sched_setaffinity"):
        return {-1: per_core_gbps()[0]}
    allowed = os.sched_getaffinity(0)
    out = {}
    try:
        for cpu in sorted(allowed):
            os.sched_setaffinity(0, {cpu})  # this thread only
            out[cpu] = max(g for _, g in _core.calibrate())
    finally:
        os.sched_setaffinity(0, allowed)
    return out


def describe() -> tuple[str, float]:
    """A one-line description and the machine ceiling in GB/s: per core, the
    best of the SHA-NI lane counts and, where the CPU has it, the 16-lane
    AVX-512 kernel streaming (which the scheduler uses for runs of many
    tensors where it is faster), times the threads."""
    figures = dict(_core.calibrate())
    shani = max(max(figures.values()), *per_cpu_gbps().values())
    wide, four = _core.calibrate_wide()
    core = max(shani, wide)
    threads = _core.threads()
    line = (
        machine()
        + f"\nceiling: one core {core:.2f} GB/s (SHA-NI, best of 1/2/4 streams: "
        + ", ".join(f"{k}: {v:.2f}" for k, v in sorted(figures.items()))
        + (f"; 16-lane AVX-512 streaming 16 x 256 KiB: {wide:.2f}, SHA-NI x4 beside it {four:.2f}" if wide else "")
        + f") x {threads} threads = {core * threads:.2f} GB/s"
    )
    small_wide, narrow = _core.calibrate_small()
    if small_wide:
        line += (
            f"\nsmall messages (64 x 4 KiB, one core, L2-hot): 16-lane AVX-512 {small_wide:.2f} GB/s,"
            f" {_core.kernel()} with its own lanes {narrow:.2f} GB/s"
        )
    return line, core * threads


def shani_core_gbps() -> float:
    """One core's best SHA-NI figure (what ``contention`` compares each CPU's
    calibration with: the same measurement)."""
    return max(g for _, g in _core.calibrate())


def contention(core_ceiling: float, threshold: float = 0.85) -> str | None:
    """A warning when a CPU now hashes below ``threshold`` of ``core_ceiling``
    (another tenant is using it), else None. Called right after a timed run."""
    slow = {cpu: g for cpu, g in per_cpu_gbps().items() if g < threshold * core_ceiling}
    if not slow:
        return None
    shown = ", ".join(f"CPU {cpu} at {g / core_ceiling:.2f}" for cpu, g in sorted(slow.items()))
    return f"contended: {shown} of its ceiling right after this run; its multi-core figures understate the scheduler"
