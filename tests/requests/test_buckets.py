"""Bucket sets: sorted, time metrics on time sets, the resolution the product needs."""

import numpy as np
import pytest

from phasewatch.aggregation.aggregate import HISTOGRAMS
from phasewatch.catalog import HISTOGRAMS as HISTOGRAM_NAMES
from phasewatch.requests import buckets
from phasewatch.requests.gaps import GapBins, row_sums


def test_every_set_is_strictly_increasing_and_positive():
    for s in buckets.ALL:
        b = np.array(s.bounds)
        assert (np.diff(b) > 0).all(), s.name
        assert b[0] > 0, s.name


def test_every_seconds_metric_uses_a_time_bucket_set():
    for spec in HISTOGRAMS:
        name = HISTOGRAM_NAMES[spec.key][0]
        if name.endswith("_seconds"):
            assert spec.buckets.unit == "seconds", name
        else:
            assert spec.buckets.unit != "seconds", name


def test_itl_resolves_1ms_steps_below_10ms():
    itl = next(s for s in HISTOGRAMS if s.key == "itl").buckets.bounds
    for ms in range(1, 11):
        assert any(abs(b - ms / 1000) < 1e-12 for b in itl), ms


def test_ttft_reaches_2560_seconds():
    ttft = next(s for s in HISTOGRAMS if s.key == "ttft").buckets.bounds
    assert max(ttft) >= 2560


def test_prompt_classes_cover_every_length():
    bounds = [b for b, _ in buckets.PROMPT_CLASSES]
    assert bounds == sorted(bounds) and bounds[-1] > 10**9


def test_bucketer_equals_searchsorted_everywhere():
    rng = np.random.default_rng(0)
    for s in buckets.ALL:
        b = s.array()
        values = np.concatenate([
            b, np.nextafter(b, 0), np.nextafter(b, np.inf), [0.0, 1e-300, 1e300],
            np.exp(rng.uniform(np.log(b[0] / 100), np.log(b[-1] * 100), 200_000))])
        np.testing.assert_array_equal(buckets.Bucketer(b)(values),
                                      np.searchsorted(b, values, side="left"), err_msg=s.name)


def test_window_index_is_monotonic_and_fine():
    idx = buckets.WINDOW_INDEX
    v = np.logspace(-6, 4, 10_000)
    i = idx.index(v)
    assert (np.diff(i) >= 0).all() and i[0] == 0 and i[-1] == idx.size - 1
    lo, hi = idx.bounds()
    assert (hi / lo).max() < 1.07  # 16 linear bins per octave: 3.1% to 6.25% wide


def _gap_values(rng, b):
    return np.concatenate([
        b, np.nextafter(b, 0), np.nextafter(b, np.inf), [0.0, -0.0, 1e-300, 1e30, 5e-6, 2e3],
        np.exp(rng.uniform(np.log(b[0] / 100), np.log(b[-1] * 100), 100_000))])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("n_series", [1, 3, 200])  # 200: past the dense histogram's limit
def test_gap_bins_equal_searchsorted_and_the_window_index(dtype, n_series):
    """One pass of phasewatch.requests.gaps gives, per series, exactly the Prometheus buckets of
    searchsorted and the window bins of WINDOW_INDEX, for float32 and float64 gaps."""
    rng = np.random.default_rng(n_series)
    b = buckets.TOKEN_LATENCY.array()
    values = _gap_values(rng, b).astype(dtype)
    rng.shuffle(values)
    counts = rng.multinomial(values.size, np.ones(500) / 500)
    counts[::7] = 0  # rows without gaps
    counts[0] += values.size - counts.sum()
    row_series = rng.integers(0, n_series, 500) * 3 + 5  # sparse label-set ids
    got, _ = GapBins(b, buckets.WINDOW_INDEX).count(values, row_series, counts)
    series_of_gap = np.repeat(row_series, counts)
    assert got.series.tolist() == sorted(set(row_series[counts > 0].tolist()))
    v64 = values.astype(np.float64)
    for j, s in enumerate(got.series):
        mine = v64[series_of_gap == s]
        want = np.bincount(np.searchsorted(b, mine, side="left"), minlength=len(b) + 1)
        np.testing.assert_array_equal(got.buckets[j], want)
        idx = buckets.WINDOW_INDEX
        np.testing.assert_array_equal(
            got.window[j], np.bincount(idx.index(mine), minlength=idx.size))
        assert got.sums[j] == pytest.approx(mine.sum(), rel=1e-12)


def test_gap_row_sums_flag_bad_gaps_only_in_their_rows():
    gaps = np.array([0.1, 0.2, np.nan, 0.3, -0.1, 0.4, np.inf, 0.5], dtype=np.float32)
    counts = np.array([2, 0, 2, 2, 1, 1])
    sums, bad = row_sums(gaps, counts)
    assert bad.tolist() == [False, False, True, True, True, False]
    np.testing.assert_allclose(sums, [0.3, 0, 0.3, 0.4, 0, 0.5], rtol=1e-6)
    sums, bad = row_sums(gaps[:2], np.array([0, 2, 0]))
    assert not bad.any() and sums.tolist() == pytest.approx([0, 0.3, 0])
