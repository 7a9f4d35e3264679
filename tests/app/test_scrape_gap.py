"""The engine scrapes' gaps are drawn around the interval (``app_loops.scrape_gap``), so
that a window's scrapes read a periodic engine (closed-loop clients in lock step) at
every phase of its period, not at one."""

from __future__ import annotations

import random

import numpy as np

from phasewatch.app_loops import JITTER, scrape_gap


def test_the_gaps_average_the_interval_and_spread_around_it():
    rng = random.Random(1)
    gaps = np.array([scrape_gap(1.0, 0.0, rng) for _ in range(2000)])
    assert abs(gaps.mean() - 1.0) < 0.02
    assert gaps.min() >= 1.0 - JITTER and gaps.max() <= 1.0 + JITTER and gaps.std() > 0.2


def test_a_slow_scrape_shortens_the_wait_never_below_zero():
    rng = random.Random(2)
    assert all(scrape_gap(1.0, 5.0, rng) == 0.0 for _ in range(100))
    assert all(scrape_gap(1.0, 0.3, rng) <= 1.0 + JITTER - 0.3 for _ in range(100))


def test_a_gauge_that_dips_once_a_period_is_read_at_its_time_average():
    """A gauge at 8 but for the last 0.25 s of every 1.0 s period (a wave's end to the
    next one's prefill): scrapes every 1.0 s from one phase read 0 or 8 all window long;
    drawn gaps read its mean, 6, within a few percent over 30 of them."""
    def gauge(t: float) -> float:
        return 0.0 if t % 1.0 >= 0.75 else 8.0

    fixed = [gauge(0.8 + k * 1.0) for k in range(30)]
    assert np.mean(fixed) == 0.0  # aliased: every scrape in the dip
    means = []
    for seed in range(20):
        rng, t, seen = random.Random(seed), 0.8, []
        for _ in range(30):
            seen.append(gauge(t))
            t += scrape_gap(1.0, 0.0, rng)
        means.append(np.mean(seen))
    assert abs(np.mean(means) - 6.0) < 0.3 and min(means) > 4.0
