"""Bucket sets: sorted, time metrics on time sets, the resolution the product needs."""

import numpy as np

from exporter import buckets
from exporter.aggregate import HISTOGRAMS
from exporter.metrics import HISTOGRAM_NAMES


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
