"""The shape's bound: the soonest any scheduler of these kernels can end a run.

One tensor is one sequential SHA-256 chain, so it streams at one lane's rate,
and a lane's rate falls as a core interleaves more of them: on one core,
SHA-NI runs 1, 2 or 4 lanes at ``rate[1]``, ``rate[2]`` or ``rate[4]`` GB/s
in all, the 16-lane AVX-512 kernel 16 at ``rate[16]``. The simple bound that
the benchmarks also print, ``max(bytes / (threads x best core rate), largest /
one lane's rate)``, takes the best of both at once: every core at its
best rate (which needs 4 or 16 tensors on it) *and* the largest tensor alone
on a core. A few large tensors cannot have both. For three 448 MiB tensors
on two cores (a Llama-70B layer), one of the three always shares a core, so
the run ends well after that bound.

This module computes the bound as a linear program that any schedule must
satisfy, a relaxation of every real one (preemption and moving a tensor
between cores allowed for free). For tensor ``i`` and lane count ``k`` let
``y[i,k]`` be the wall-clock time ``i`` spends on a core that runs ``k``
lanes. Then, for a run of ``T`` seconds on ``threads`` cores:

- every tensor is hashed: ``sum_k y[i,k] * rate[k] / k >= bytes[i]``;
- a tensor is one chain, on one lane at a time: ``sum_k y[i,k] <= T``;
- a core running ``k`` lanes for ``z[k]`` seconds (summed over cores) serves
  at most ``k`` tensors at once, each of them at most that long: ``sum_i
  y[i,k] <= k * z[k]`` and ``y[i,k] <= z[k]`` (lanes may idle: 9 tensors
  on the 16-lane kernel is a schedule too);
- the cores' time is shared out: ``sum_k z[k] <= threads * T``.

The least ``T`` is the bound. No scheduler, whatever its rules, ends sooner
with these rates; a figure near 1.0 of it has nothing left to win by
scheduling. It leaves out the per-tensor costs (call overhead, padding),
so for many small tensors it is the looser of the two.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import lil_matrix


def schedule_bound(sizes: Sequence[int], rates: Mapping[int, float], threads: int) -> float:
    """The least run time in seconds (see the module's doc).

    ``sizes``: tensor sizes in bytes; ``rates``: lane count -> one core's
    GB/s in all with that many lanes busy; ``threads``: cores hashing.
    """
    sizes = [s for s in sizes if s > 0]
    if not sizes:
        return 0.0
    if threads < 1 or not rates or any(k < 1 or r <= 0 for k, r in rates.items()):
        raise ValueError(f"need threads >= 1 and positive rates, got threads={threads}, rates={dict(rates)}")
    ks = sorted(rates)
    n, m = len(sizes), len(ks)
    # Variables: y[i,k] at i*m + j, then z[k] at n*m + j, then T.
    z, t = n * m, n * m + m
    rows = 2 * n + n * m + m + 1
    a = lil_matrix((rows, t + 1))
    b = np.zeros(rows)
    row = 0
    for i, size in enumerate(sizes):
        for j, k in enumerate(ks):
            a[row, i * m + j] = -rates[k] / k * 1e9  # bytes per second of one lane
        b[row] = -size
        row += 1
        for j in range(m):
            a[row, i * m + j] = 1.0
        a[row, t] = -1.0
        row += 1
        for j in range(m):
            a[row, i * m + j] = 1.0
            a[row, z + j] = -1.0
            row += 1
    for j, k in enumerate(ks):
        for i in range(n):
            a[row, i * m + j] = 1.0
        a[row, z + j] = -float(k)
        row += 1
    for j in range(m):
        a[row, z + j] = 1.0
    a[row, t] = -float(threads)
    cost = np.zeros(t + 1)
    cost[t] = 1.0
    result = linprog(cost, A_ub=a.tocsr(), b_ub=b, bounds=(0, None), method="highs")
    if not result.success:
        raise RuntimeError(f"the schedule bound's LP failed: {result.message}")
    return float(result.x[t])


def simple_bound(sizes: Sequence[int], rates: Mapping[int, float], threads: int) -> float:
    """``max(bytes / (threads x best core rate), largest / one lane's rate)``."""
    if not sizes:
        return 0.0
    best_core = max(rates.values())
    one_lane = max(r / k for k, r in rates.items())
    return max(sum(sizes) / 1e9 / (threads * best_core), max(sizes) / 1e9 / one_lane)


def measured_rates() -> dict[int, float]:
    """This core's rates by lane count, as the scheduler calibrated them at
    first use: SHA-NI (or the portable kernel) with 1, 2 and 4 lanes, and the
    16-lane AVX-512 kernel where it may run."""
    from weight_checker import _core

    rates = {k: gbps for k, gbps in _core.calibrate()}
    wide, _four = _core.calibrate_wide()
    if wide > 0:
        rates[16] = wide
    return rates


def describe_bounds(sizes: Sequence[int], seconds: float, threads: int) -> str:
    """One line: a run of ``seconds`` on these tensors as a fraction of both
    bounds, with this core's measured rates."""
    rates = measured_rates()
    simple = simple_bound(sizes, rates, threads)
    best = schedule_bound(sizes, rates, threads)
    shown = ", ".join(f"{k}: {r:.2f}" for k, r in sorted(rates.items()))
    return (
        f"ours = {best / seconds:.2f} of the shape's schedule bound ({best:.3f} s: the soonest any scheduler of"
        f" these kernels ends, an LP), {simple / seconds:.2f} of the simple bound ({simple:.3f} s);"
        f" core GB/s by lanes {{{shown}}}, {threads} threads"
    )
