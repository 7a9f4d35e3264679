"""Closed-loop clients against open arrivals (``OperatingPoint.closed_loop``), on request
records made by a queue at 8 slots: clients that send on an answer, and Poisson
arrivals near the slots' capacity."""

from __future__ import annotations

import heapq
from dataclasses import replace

import numpy as np
import pytest

from phasewatch.aggregation.columns import WindowColumns
from phasewatch.roofline.operating_point import FOLLOW, arrival_lag, operating_point

SLOTS = 8


def _admit(free: list[float], t: float, service: float) -> tuple[float, float]:
    """First come, first served at the slots whose next free times are ``free``: the
    request arriving at ``t`` starts when the earliest slot frees; (start, end)."""
    k = int(np.argmin(free))
    start = max(t, free[k])
    free[k] = start + service
    return start, free[k]


def _served(arrivals, service, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """First come, first served at ``SLOTS`` slots: (arrival, scheduled, end) each."""
    free = [0.0] * SLOTS
    rows = [(t, *_admit(free, t, service(rng))) for t in arrivals]
    return tuple(np.array(x) for x in zip(*rows, strict=True))


def _closed(streams: int, think: float, seed: int, until: float = 120.0):
    """``streams`` clients, each sending its next request ``think`` (+-50 %) after its
    answer, equal requests of 1 s: they finish in cohorts."""
    rng = np.random.default_rng(seed)
    ready = [(rng.uniform(0.0, 0.2), i) for i in range(streams)]
    heapq.heapify(ready)
    free = [0.0] * SLOTS
    rows = []
    while ready:
        t, i = heapq.heappop(ready)
        if t > until:
            continue
        start, end = _admit(free, t, 1.0)
        rows.append((t, start, end))
        heapq.heappush(ready, (end + think * rng.uniform(0.5, 1.5), i))
    rows.sort()
    return tuple(np.array(x) for x in zip(*rows, strict=True))


def _open(load: float, seed: int, until: float = 120.0):
    """Poisson arrivals at ``load`` of the slots' capacity, 1 s each."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / (SLOTS * load), int(SLOTS * load * until * 1.2)))
    return _served(t[t < until], lambda _: 1.0, rng)


def _point(arrival, scheduled, end):
    n = len(arrival)
    cols = WindowColumns.of({"arrival": arrival, "scheduled_at": scheduled, "end_at": end,
                             "queue": scheduled - arrival, "e2e": end - arrival,
                             "output": np.full(n, 21.0), "prefill": np.zeros(n)})
    return operating_point(cols, 40.0, 100.0, 8.0, 0.05, None, None, SLOTS)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_clients_that_send_on_an_answer_are_a_closed_loop_however_the_count_swings(seed):
    """CI, stop 48: 24 equal streams at 8 slots on a host 3.1x slower than the reference
    varied 25 % in the system (the cohorts) and were taken for open arrivals; Erlang C
    then put the queue at 16 slots at 0.008 s where 0.45 s was measured. Their arrivals
    come on the heels of the finishes, which open arrivals do not."""
    point = _point(*_closed(24, 0.05, seed))
    assert point.arrival_lag < FOLLOW, point.arrival_lag
    assert point.closed_loop
    # the count's swing alone no longer decides
    assert replace(point, in_system_cv=0.4).closed_loop
    # nor does the lag without as many arriving as finish
    assert not replace(point, in_system_cv=0.4, arrivals_per_finish=1.5).closed_loop


@pytest.mark.parametrize(("load", "seed"), [(0.8, 1), (0.9, 2), (0.9, 3), (0.95, 1),
                                            (0.95, 3)])
def test_open_arrivals_near_capacity_do_not_heed_the_finishes(load, seed):
    """Poisson arrivals at 0.8-0.95 of the slots, whose queue forms and drains: the time
    back to the last finish is the same from an arrival as from any moment (0.85-1.2 over
    these seeds), and the swing in the system rules out a closed loop."""
    point = _point(*_open(load, seed))
    assert 0.75 < point.arrival_lag < 1.3, point.arrival_lag
    assert point.in_system > SLOTS * 0.9  # requests wait: a slot lever would be asked
    assert not point.closed_loop, point


def test_too_few_arrivals_or_finishes_tell_nothing():
    t = np.linspace(0.0, 10.0, 10)
    assert arrival_lag(t, t + 1.0, 0.0, 10.0) == 1.0
    assert arrival_lag(t, np.full(10, np.nan), 0.0, 10.0) == 1.0
