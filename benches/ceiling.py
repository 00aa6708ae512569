"""This machine's SHA-256 ceiling, measured where the benchmark runs.

SHA-256 of one message is one sequential chain; a core's ceiling is its
best throughput with several independent streams interleaved (what the C
probe in shared/shani-probe measures; here the core's own calibration does
the same with its kernels). The machine's ceiling is that figure times the
threads the engine runs. Benchmarks print their figures as a fraction of it,
so that figures from different machines can be compared.
"""

from __future__ import annotations

from weight_checker import _core


def per_core_gbps() -> tuple[float, int]:
    """(best GB/s of one core, the lane count that reached it)."""
    best = max(_core.calibrate(), key=lambda f: f[1])
    return best[1], best[0]


def describe() -> tuple[str, float]:
    """A one-line description and the machine ceiling in GB/s."""
    figures = dict(_core.calibrate())
    core = max(figures.values())
    threads = _core.threads()
    line = (
        f"ceiling: one core {core:.2f} GB/s (best of 1/2/4 streams: "
        + ", ".join(f"{k}: {v:.2f}" for k, v in sorted(figures.items()))
        + f"; engine uses {_core.lanes()} lanes) x {threads} threads = {core * threads:.2f} GB/s"
    )
    return line, core * threads
