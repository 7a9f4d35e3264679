"""``intervals.Overlaps``: the integral over each query [a, b] of the weights of the
intervals open at each moment, each weight summed only up to the queries' places
(``sums_before``), against the sum over every interval of its weight times its overlap
with the query, as close on Unix times as from 0; and ``sums_before`` against the
cumulative sum it stands for."""

import numpy as np
import pytest

from phasewatch.roofline.intervals import Overlaps, prefix_sums, sums_before


def _overlap(starts, ends, w, a, b):
    """Each query's integral by the interval x query matrix (no cumulative sums)."""
    inside = np.clip(np.minimum(ends[None, :], b[:, None])
                     - np.maximum(starts[None, :], a[:, None]), 0.0, None)
    return (inside * w[None, :]).sum(axis=1)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("epoch", [0.0, 1.8e9])
def test_the_integral_over_each_query_is_every_intervals_overlap_with_it(seed, epoch):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3000))
    starts = epoch + np.round(rng.uniform(0.0, 30.0, n), 3)  # (ties among starts)
    ends = starts + rng.exponential(2.0, n)
    zero = rng.random(n) < 0.1
    ends[zero] = starts[zero]  # (zero-length intervals)
    k = int(rng.integers(1, 400))
    a = epoch + rng.uniform(-5.0, 35.0, k)
    a[: k // 4] = starts[rng.integers(0, n, k // 4)]  # queries on an interval's own start
    b = a + rng.exponential(3.0, k)
    w = rng.uniform(0.0, 5.0, n)
    shared = Overlaps(starts, ends)
    got_w, got_1 = shared.integrals([w, None], a, b)
    want_w, want_1 = _overlap(starts, ends, w, a, b), _overlap(starts, ends, np.ones(n), a, b)
    # (times kept from the earliest start: at a Unix epoch the sums of weights x times
    # no longer cancel to ~1e-16 of 1.8e9 s x the weights' sum, 0.37 s of a count once)
    atol = 1e-12 * 40.0 * (w.sum() + n)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-9, atol=atol)
    np.testing.assert_allclose(got_1, want_1, rtol=1e-9, atol=atol)
    np.testing.assert_allclose(shared.integral(w, a, b), got_w, rtol=0, atol=0)


def test_sums_before_are_the_cumulative_sums_at_those_places():
    rng = np.random.default_rng(3)
    for trial in range(2000):
        n = int(rng.integers(0, 300)) if trial % 3 else int(rng.integers(0, 4))
        x = rng.normal(size=n) * 10 ** rng.uniform(-3, 10)
        places = np.sort(rng.integers(0, n + 1, int(rng.integers(0, 50))))
        if trial % 4 == 0 and len(places):
            places[: len(places) // 2] = 0  # repeated, and at either end
        if trial % 5 == 0 and len(places):
            places[len(places) // 2:] = n
        np.testing.assert_allclose(sums_before(x, places), prefix_sums(x)[places],
                                   rtol=0, atol=1e-12 * (np.abs(x).sum() + 1e-300))
