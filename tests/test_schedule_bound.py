"""The benchmarks' schedule bound (benches/schedule_bound.py) against bounds
worked out by hand, and against the two facts any lower bound must respect:
no schedule beats the simple bound, and a schedule we can write down (every
tensor one after another on one lane) is never beaten by the bound."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

_path = Path(__file__).resolve().parent.parent / "benches" / "schedule_bound.py"
_spec = importlib.util.spec_from_file_location("schedule_bound", _path)
assert _spec is not None and _spec.loader is not None
schedule_bound_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(schedule_bound_module)
schedule_bound = schedule_bound_module.schedule_bound
simple_bound = schedule_bound_module.simple_bound

GB = 10**9


def test_one_tensor_streams_at_one_lanes_rate():
    assert schedule_bound([3 * GB], {1: 2.0, 2: 3.0, 4: 3.6}, threads=2) == pytest.approx(1.5)


def test_two_tensors_on_one_core_share_it_as_two_lanes():
    # x2: 1.5 GB/s each, both end at 2/3 s; one after the other at x1: 1 s.
    assert schedule_bound([GB, GB], {1: 2.0, 2: 3.0}, threads=1) == pytest.approx(2 / 3)


def test_three_tensors_on_two_cores_cannot_each_have_a_core():
    # The simple bound says 0.5 s (each alone at 2 GB/s). One of the three
    # always shares a core: at best the cores run at 2 + 3 GB/s, 3 GB in 0.6 s.
    sizes, rates = [GB] * 3, {1: 2.0, 2: 3.0}
    assert simple_bound(sizes, rates, 2) == pytest.approx(0.5)
    assert schedule_bound(sizes, rates, 2) == pytest.approx(0.6)


def test_a_wide_kernel_may_run_with_idle_lanes():
    # 9 tensors on a 16-lane kernel at 8 GB/s (0.5 a lane): 2 s, lanes idle;
    # a bound that insisted on full configurations would say 9 s (x1).
    assert schedule_bound([GB] * 9, {1: 1.0, 16: 8.0}, threads=1) == pytest.approx(2.0)


def test_bad_rates_are_refused():
    with pytest.raises(ValueError, match="positive rates"):
        schedule_bound([GB], {1: 0.0}, threads=1)
    with pytest.raises(ValueError, match="threads"):
        schedule_bound([GB], {1: 1.0}, threads=0)


@given(
    sizes=st.lists(st.integers(1, 4 * GB), min_size=1, max_size=12),
    threads=st.integers(1, 3),
    r1=st.floats(0.5, 3.0),
    more=st.lists(st.floats(1.0, 2.0), min_size=3, max_size=3),
)
def test_the_bound_lies_between_the_simple_bound_and_a_real_schedule(sizes, threads, r1, more):
    # Rates grow with lanes but each lane gets slower, as on real cores.
    rates = {1: r1, 2: r1 * min(more[0], 2.0), 4: r1 * min(more[0], 2.0) * more[1], 16: r1 * 4 * more[2]}
    best = schedule_bound(sizes, rates, threads)
    assert best >= simple_bound(sizes, rates, threads) * (1 - 1e-6)
    assert best <= sum(sizes) / GB / r1 * (1 + 1e-6)  # one lane, one tensor after another
