"""The rolling window's rates follow the requests' own finish times."""

from __future__ import annotations

import numpy as np
import pytest

from phasewatch.aggregation.aggregate import Aggregator
from phasewatch.aggregation.window import RollingWindow
from phasewatch.requests.record import RequestBatch, RequestRecord

T0 = 1_790_000_000.0


def records(rate: float, seconds: float, start: float = T0) -> list[RequestRecord]:
    """A steady workload: ``rate`` requests a second for ``seconds``, 10 output tokens."""
    out = []
    for k in range(int(rate * seconds)):
        a = start + k / rate
        out.append(RequestRecord(model="m", engine="e", request_id=f"r{k}", arrival=a,
                                 scheduled=a + 0.01, first_token=a + 0.05,
                                 last_token=a + 0.5, finish=a + 0.5, prompt_tokens=100,
                                 cached_prompt_tokens=0, output_tokens=10,
                                 finish_reason="stop"))
    return out


def fed(recs: list[RequestRecord], wall: list[float], per_batch: int = 50,
        advance: float = 0.1) -> Aggregator:
    agg = Aggregator(window=RollingWindow(seconds=30, clock=lambda: wall[0]))
    for i in range(0, len(recs), per_batch):
        agg.ingest(RequestBatch.from_records(recs[i:i + per_batch]), "phasewatch")
        wall[0] += advance
    return agg


def summary(agg: Aggregator) -> dict:
    (m,) = agg.window.summary(agg.labels.pairs())["models"]
    return m


def test_a_replay_is_rated_over_its_own_time_not_its_delivery():
    """A minute of a 5 req/s workload delivered in 1.2 s (a replay, a burst): 5 req/s
    over the last 30 s of the requests' clock, not 300 / 1.2 s."""
    wall = [2_000_000_000.0]  # phasewatch's clock: nothing to do with the requests'
    m = summary(fed(records(5, 60), wall))
    assert m["request_rate"] == pytest.approx(5.0, rel=0.05)
    assert m["output_tokens_per_second"] == pytest.approx(50.0, rel=0.05)
    assert m["covered_seconds"] == pytest.approx(30.0)
    assert m["ttft_seconds"]["count"] == pytest.approx(150, abs=5)  # the same 30 s


def test_live_traffic_rates_and_stopped_traffic_falls_to_zero():
    """Live (finish times on phasewatch's clock): the rate over the last 30 s; once
    traffic stops the window moves on and the rate falls to 0."""
    wall = [T0 + 60.5]
    agg = fed(records(5, 60), wall, per_batch=300, advance=0.0)
    assert summary(agg)["request_rate"] == pytest.approx(5.0, rel=0.05)
    wall[0] += 15  # 15 s without requests: half the window is empty
    assert summary(agg)["request_rate"] == pytest.approx(2.5, rel=0.1)
    wall[0] += 20
    assert agg.window.summary(agg.labels.pairs())["models"] == []


def test_a_young_workload_divides_by_what_its_clock_covered():
    """10 s of requests into a fresh exporter: rated over 10 s, not 30."""
    wall = [T0 + 10.5]
    agg = Aggregator(window=RollingWindow(seconds=30, clock=lambda: wall[0]))
    agg.window._started = T0  # up as long as the traffic
    agg.ingest(RequestBatch.from_records(records(4, 10)), "phasewatch")
    assert summary(agg)["request_rate"] == pytest.approx(4.0, rel=0.1)


def test_one_future_finish_does_not_empty_the_window():
    """A request stamped in the far future (a bogus clock) counts at its ingest time:
    the label set's window stays where its other requests are."""
    wall = [T0 + 60.5]
    recs = records(5, 60)
    bogus = recs[-1]
    recs[-1] = RequestRecord(**{**bogus.__dict__, "finish": T0 + 10 * 365 * 86400.0})
    agg = fed(recs, wall, per_batch=300, advance=0.0)
    assert summary(agg)["request_rate"] == pytest.approx(5.0, rel=0.05)


def test_bench_requests_and_every_quantile_count_one_population():
    """Issue 37: the demo's /api/v1/bench said 40 requests beside a TTFT count of 42.
    The request count came from the window's one-second slices (whole seconds after
    the window's start second), the quantiles from the ring (every finish after the
    window's start instant): the fraction of a second between them was counted in one
    and not the other. Live traffic whose window starts mid-second, through the real
    HTTP API: the same requests behind both."""
    import json
    import urllib.request

    from phasewatch.app import Exporter
    from phasewatch.config import ServeConfig

    wall = [T0 + 60.5]  # the newest finish at T0 + 60.3: the window starts at T0 + 30.3
    config = ServeConfig(grpc_port=0, http_port=0, otlp_grpc_port=0, otlp_http_port=0,
                         http_host="127.0.0.1")
    with Exporter(config, clock=lambda: wall[0]) as ex:
        ex.aggregator.ingest(RequestBatch.from_records(records(5, 60)), "phasewatch")
        with urllib.request.urlopen(f"http://127.0.0.1:{ex.http_port}/api/v1/bench",
                                    timeout=10) as r:
            (bench,) = json.load(r)["models"]
        (summary,) = ex.aggregator.window.summary(ex.aggregator.labels.pairs())["models"]
    f = bench["figures"]
    assert 145 <= f["requests"] <= 155  # 5 req/s over 30 s
    assert f["ttft"]["count"] == f["tpot"]["count"] == f["e2e"]["count"] == f["requests"]
    assert f"Successful requests:                     {f['requests']}" in bench["text"]
    assert summary["requests_in_window"] == summary["sampled_requests"] == f["requests"]
    assert summary["ttft_seconds"]["count"] == f["requests"]


def test_a_label_set_newer_than_the_window_is_left_out_not_an_error():
    """The roofline's tick reads the label sets, then the window: a label set made in
    between (its first batch still on its way in) is one the window has no arrays for
    yet. It is left out of that summary; the others are summarized (before the fix, the
    first batch of a new model failed the whole update with an IndexError)."""
    wall = [T0 + 60.5]
    agg = fed(records(5, 60), wall, per_batch=300, advance=0.0)
    later = [*agg.labels.pairs(), ("m2", "e")]  # not yet in the window
    (m,) = agg.window.summary(later)["models"]
    assert m["model"] == "m" and m["request_rate"] == pytest.approx(5.0, rel=0.05)


def test_the_window_rows_by_slices_equal_the_masks():
    """window_rows.rows_of: one run, a wrapped ring's two, none, all, and masks of more runs
    (a clock that stepped back) give the mask's rows, in its order, as copies."""
    from phasewatch.aggregation.window_rows import rows_of

    rng = np.random.default_rng(7)
    cols = {"f": rng.random(64), "i": rng.integers(0, 9, 64), "b": rng.random(64) > 0.5}
    masks = [np.zeros(64, bool), np.ones(64, bool)]
    for _ in range(300):
        m = np.zeros(64, bool)
        for _ in range(int(rng.integers(1, 4))):
            a = int(rng.integers(0, 64))
            m[a:a + int(rng.integers(1, 40))] = True
        masks.append(m)
    masks.append(np.r_[np.ones(5, bool), np.zeros(50, bool), np.ones(9, bool)])  # wrapped
    for m in masks:
        got = rows_of(cols, m)
        for k, v in cols.items():
            assert got[k].dtype == v.dtype and np.array_equal(got[k], v[m]), (k, m)
            assert not np.shares_memory(got[k], v)
