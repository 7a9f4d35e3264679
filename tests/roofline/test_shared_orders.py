"""The window's sorts made once a tick and shared (issue 41: the roofline update's time):
each pass given an order reads what it read when it sorted for itself."""

import numpy as np
import pytest

from phasewatch.aggregation.columns import WindowColumns
from phasewatch.roofline.intervals import (
    Overlaps,
    busy_time,
    decodes,
    sorted_near,
    step_by_batch,
    union_length,
)
from phasewatch.roofline.step_count import decode_step_count, prefill_steps


def _columns(seed: int, n: int = 3000) -> WindowColumns:
    """Requests over 30 s with gaps in every time (NaN), some prompts unknown."""
    rng = np.random.default_rng(seed)
    arrival = np.sort(rng.uniform(0.0, 30.0, n))
    sched = arrival + rng.exponential(0.2, n)
    first = sched + rng.exponential(0.05, n)
    last = first + rng.exponential(2.0, n)
    for x, share in ((sched, 0.05), (first, 0.03), (last, 0.03)):
        x[rng.random(n) < share] = np.nan
    prompt = rng.integers(10, 2000, n)
    prompt[rng.random(n) < 0.05] = -1
    steps = rng.integers(1, 200, n)
    return WindowColumns.of({
        "arrival": arrival, "scheduled_at": sched, "first_token_at": first,
        "last_token_at": last, "end_at": np.fmax(last, first), "prompt": prompt,
        "output": steps + 1, "steps": steps})


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_an_order_within_rows_sorts_them_as_their_own_sort_would(seed):
    c = _columns(seed)
    rng = np.random.default_rng(seed)
    for name in ("first_token_at", "last_token_at", "scheduled_at", "arrival"):
        rows = rng.random(len(c)) < 0.7
        x = getattr(c, name)[rows]
        got = c.order_within(name, rows)
        assert sorted(got.tolist()) == list(range(rows.sum()))  # a permutation of them
        np.testing.assert_array_equal(x[got], np.sort(x))  # (NaN last, as argsort's)
    assert c.order("first_token_at") is c.order("first_token_at")  # sorted once
    assert "_memo" not in c.where(np.arange(10)).__dict__  # a copy sorts its own


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sorted_near_is_a_sort(seed):
    c = _columns(seed)
    opened = np.fmin(c.scheduled_at, c.first_token_at)
    got = sorted_near(opened, c.order("scheduled_at"))
    np.testing.assert_array_equal(opened[got], np.sort(opened))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_union_and_busy_time_read_the_same_with_an_order_given(seed):
    c = _columns(seed)
    first, last = c.first_token_at, c.last_token_at
    ok = ~np.isnan(first) & ~np.isnan(last) & (last > first) & (c.prompt >= 0)
    order = c.order_within("first_token_at", ok)
    for lo, hi in ((0.0, 30.0), (5.0, 12.0), (29.0, 40.0)):
        alone = union_length(first[ok], last[ok], lo, hi)
        assert alone > 0
        assert union_length(first[ok], last[ok], lo, hi, order) == pytest.approx(alone,
                                                                                  rel=1e-12)
        w = np.ones(ok.sum())
        assert busy_time(first[ok], last[ok], w, lo, hi, order) == pytest.approx(
            busy_time(first[ok], last[ok], w, lo, hi), rel=1e-12)
        w = np.random.default_rng(seed).choice([1.0, 10.0], ok.sum())  # sampled
        assert busy_time(first[ok], last[ok], w, lo, hi, order) == pytest.approx(
            busy_time(first[ok], last[ok], w, lo, hi), rel=1e-12)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_decodes_held_once_give_each_reader_its_own_figures(seed):
    c = _columns(seed)
    first, last = c.first_token_at, c.last_token_at
    both, shared = decodes(c)
    assert decodes(c)[1] is shared  # made once for the columns
    alone = Overlaps(first[both], last[both])
    a, b = first[both][:500], last[both][:500]
    weights = np.random.default_rng(seed).uniform(0.0, 5.0, both.sum())
    np.testing.assert_allclose(shared.integral(weights, a, b), alone.integral(weights, a, b),
                               rtol=1e-9, atol=1e-9)
    steps = c.steps.astype(float)
    assert step_by_batch(first, last, steps, 0.0, 30.0, overlaps=shared) == pytest.approx(
        step_by_batch(first, last, steps, 0.0, 30.0))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_decode_steps_count_the_same_from_merged_runs(seed):
    c = _columns(seed)
    first, last = c.first_token_at, c.last_token_at
    ok = ~np.isnan(first) & ~np.isnan(last) & (c.steps > 0)
    n_tokens = c.steps[ok].astype(float)
    ends, took = prefill_steps(c)
    assert len(ends) > 100
    for lo, hi in ((0.0, 30.0), (3.0, 20.0)):
        alone = decode_step_count(first[ok], last[ok], n_tokens, ends, took, lo, hi)
        assert alone > 0
        merged = decode_step_count(first[ok], last[ok], n_tokens, ends, took, lo, hi,
                                   c.order_within("first_token_at", ok),
                                   c.order_within("last_token_at", ok))
        assert merged == pytest.approx(alone, rel=1e-9)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_columns_order_puts_the_unknown_last_as_argsort_does(seed):
    """``WindowColumns.order`` sorts a column's known values apart from its NaNs
    (``argsort_nan_last``: numpy's SIMD sort skips a float array holding any NaN): the
    same values in the same order as ``np.argsort``, the NaNs last, every row once; an
    integer column and one with no NaN as argsort gives them."""
    from phasewatch.aggregation.columns import argsort_nan_last

    c = _columns(seed)
    for name in ("scheduled_at", "first_token_at", "last_token_at", "prompt", "arrival"):
        x = getattr(c, name)
        got, want = c.order(name), np.argsort(x)
        assert np.array_equal(x[got], x[want], equal_nan=True), name
        assert np.array_equal(np.sort(got), np.arange(len(x))), name
    rng = np.random.default_rng(seed)
    ties = rng.integers(0, 4, 500).astype(float)
    ties[rng.random(500) < 0.3] = np.nan
    assert np.array_equal(ties[argsort_nan_last(ties)], np.sort(ties), equal_nan=True)
    assert argsort_nan_last(np.array([])).size == 0
    assert list(argsort_nan_last(np.array([np.nan, np.nan]))) == [0, 1]


UNIX = 1.79e9  # (a Unix time of 2026: its seconds share one binary exponent till 2038)


def test_time_order_is_a_stable_argsort_of_unix_times():
    """``columns.time_order`` sorts Unix times as 64-bit integers (the offsets from the
    least, in the spacing of their binade, with the index in the low bits): the order of
    ``np.argsort(kind="stable")`` exactly, ties in index order; None for floats that are
    not all of one binary exponent, NaN among them, or too wide a range to hold beside
    the indices."""
    from phasewatch.aggregation.columns import time_order

    rng = np.random.default_rng(7)
    for n in (2, 3, 1000, 364_000):
        x = UNIX + np.round(rng.uniform(0.0, 90.0, n), 3)  # (ms: ties, many at 364,000)
        got = time_order(x)
        assert got is not None and got.dtype.kind == "i"
        np.testing.assert_array_equal(got, np.argsort(x, kind="stable"))
    assert list(time_order(np.array([UNIX + 1.0]))) == [0]
    assert list(time_order(np.array([2.0 ** 31 - 1.0, 2.0 ** 30, 2.0 ** 30]))) == [1, 2, 0]
    x = UNIX + rng.uniform(0.0, 30.0, 500)
    for other in (np.r_[x, np.nan], np.r_[x, 1.0], np.r_[x, -x[:3]], np.r_[x, 0.0],
                  x.astype(np.float32), 1.0 + rng.uniform(0.0, 0.999, 9000)):  # (the last:
        assert time_order(other) is None  # 2**52 spacings of [1, 2), past 64 - 14 bits)


def test_the_decode_steps_count_the_same_sorted_as_times_or_merged(monkeypatch):
    """The decode-step count's timeline sorted by ``time_order`` (Unix times) counts what
    it counted merged from the requests' orders, and what it counted from an argsort:
    equal times keep the events' order (a decode's start before its end)."""
    from phasewatch.roofline import step_count

    c = _columns(4)
    cols = {k: getattr(c, k) for k in ("arrival", "scheduled_at", "first_token_at",
                                       "last_token_at", "end_at", "prompt", "output", "steps")}
    for k in ("arrival", "scheduled_at", "first_token_at", "last_token_at", "end_at"):
        cols[k] = cols[k] + UNIX
    cols["last_token_at"][::50] = cols["first_token_at"][::50]  # (decodes of no length)
    c = WindowColumns.of(cols)
    first, last = c.first_token_at, c.last_token_at
    ok = ~np.isnan(first) & ~np.isnan(last) & (c.steps > 0)
    n_tokens = c.steps[ok].astype(float)
    ends, took = prefill_steps(c)
    orders = (c.order_within("first_token_at", ok), c.order_within("last_token_at", ok))
    for lo, hi in ((UNIX, UNIX + 30.0), (UNIX + 3.0, UNIX + 20.0)):
        args = (first[ok], last[ok], n_tokens, ends, took, lo, hi)
        as_times = decode_step_count(*args, *orders)
        assert as_times > 0
        with monkeypatch.context() as m:
            m.setattr(step_count, "time_order", lambda x: None)
            merged = decode_step_count(*args, *orders)
            alone = decode_step_count(*args)
        assert as_times == pytest.approx(merged, rel=1e-12)
        assert as_times == pytest.approx(alone, rel=1e-12)
