"""The phase split: definitions, missing data counted, contradictions rejected."""

import math

import numpy as np
import pytest

from phasewatch.requests.phases import split_phases
from phasewatch.requests.record import RequestBatch, RequestRecord

T = 1_700_000_000.0


def near(x: float):
    return pytest.approx(x, abs=1e-6)  # float epoch seconds resolve ~0.24 us


def one(**kw) -> tuple:
    base = dict(model="m", arrival=T, scheduled=T + 0.1, first_token=T + 0.5,
                last_token=T + 1.5, finish=T + 1.6, prompt_tokens=1000,
                cached_prompt_tokens=0, output_tokens=11)
    base.update(kw)
    ph = split_phases(RequestBatch.from_records([RequestRecord(**base)]))
    return ph, {k: float(getattr(ph, k)[0]) for k in
                ("queue", "prefill", "ttft", "decode", "tpot", "e2e", "decode_tps",
                 "prefill_spt")}


def test_full_record_gives_every_phase():
    ph, v = one(token_times=[T + 0.5 + 0.1 * i for i in range(11)])
    assert v["queue"] == pytest.approx(0.1)
    assert v["prefill"] == pytest.approx(0.4)
    assert v["ttft"] == pytest.approx(0.5)
    assert v["decode"] == pytest.approx(1.0)
    assert v["tpot"] == pytest.approx(0.1)  # 1.0 s over 10 tokens after the first
    assert v["e2e"] == pytest.approx(1.6)
    assert v["decode_tps"] == pytest.approx(10.0)
    assert v["prefill_spt"] == pytest.approx(0.4 / 1000)
    assert not ph.rejected
    assert ph.unavailable == {("preprocess", "no_queued"): 1}  # queue runs from arrival


def test_queued_splits_preprocess_from_the_engine_queue():
    ph, v = one(queued=T + 0.03)
    assert float(ph.preprocess[0]) == near(0.03)
    assert v["queue"] == near(0.07)  # scheduled - queued, not - arrival
    assert float(ph.preprocess[0]) + v["queue"] + v["prefill"] == near(v["ttft"])
    assert not ph.rejected and ("preprocess", "no_queued") not in ph.unavailable


def test_unknown_cached_tokens_leave_prefill_per_token_out_rather_than_guess_zero():
    ph, v = one(cached_prompt_tokens=None)
    assert math.isnan(v["prefill_spt"])
    assert ph.unavailable[("prefill_spt", "cached_tokens_unknown")] == 1
    assert int(ph.uncached_prompt_tokens[0]) == -1
    assert v["prefill"] == near(0.4)  # the interval itself is still known


def _two_clocks(tolerance_s: float, **kw):
    batch = RequestBatch.from_records([RequestRecord(**{**dict(
        model="m", arrival=T, queued=T + 0.01, scheduled=T + 0.02, first_token=T + 0.5,
        last_token=T + 1.5, finish=T + 1.6, prompt_tokens=10, output_tokens=11), **kw})])
    batch.clock_skew_tolerance_ns = round(tolerance_s * 1e9)
    return split_phases(batch)


def test_two_clock_disagreement_within_the_tolerance_is_kept_and_reported():
    # vLLM: the last token (engine clock) 4 ms after the finish (frontend clock)
    ph = _two_clocks(1.0, finish=T + 1.496)
    assert ph.kept.all() and not ph.rejected
    assert float(ph.decode[0]) == near(1.0)  # the engine's own decode, exact
    assert float(ph.e2e[0]) == near(1.496)  # the frontend's own e2e, exact
    assert float(ph.clock_skew[0]) == near(0.004)
    # the engine took it in "before" it arrived: preprocess floors at 0, queue stays exact
    ph = _two_clocks(1.0, queued=T - 0.002)
    assert float(ph.preprocess[0]) == 0.0 and float(ph.queue[0]) == near(0.022)
    assert float(ph.clock_skew[0]) == near(0.002)


def test_two_clock_disagreement_past_the_tolerance_or_within_one_chain_is_rejected():
    assert _two_clocks(1.0, finish=T + 0.4).rejected == {"clock_order": 1}  # before 1st token
    assert _two_clocks(1.0, last_token=T + 2.7).rejected == {"clock_order": 1}  # 1.1 s late
    assert _two_clocks(1.0, scheduled=T + 0.005).rejected == {"clock_order": 1}  # same chain
    assert _two_clocks(0.0, finish=T + 1.496).rejected == {"clock_order": 1}  # one clock


def test_one_output_token_has_no_tpot_and_no_itl():
    ph, v = one(output_tokens=1, last_token=T + 0.5, token_times=[T + 0.5])
    assert math.isnan(v["tpot"]) and math.isnan(v["decode_tps"])
    assert v["ttft"] == pytest.approx(0.5) and v["decode"] == 0.0
    assert ph.itl.size == 0
    assert ph.unavailable[("tpot", "single_output_token")] == 1
    assert ph.unavailable[("itl", "single_output_token")] == 1


def test_missing_first_token_leaves_ttft_prefill_decode_out():
    ph, v = one(first_token=None)
    for k in ("ttft", "prefill", "decode", "tpot"):
        assert math.isnan(v[k]), k
    assert v["queue"] == pytest.approx(0.1) and v["e2e"] == pytest.approx(1.6)
    assert ph.unavailable[("ttft", "no_first_token")] == 1
    assert ph.unavailable[("decode", "no_first_token")] == 1
    assert ph.kept.all()  # missing is not contradictory: the request still counts


def test_cached_prompt_tokens_normalise_prefill_per_uncached_token():
    _, v = one(cached_prompt_tokens=600)
    assert v["prefill_spt"] == pytest.approx(0.4 / 400)
    ph, v = one(cached_prompt_tokens=1000)
    assert math.isnan(v["prefill_spt"])
    assert ph.unavailable[("prefill_spt", "fully_cached_prompt")] == 1


def test_token_times_give_pooled_itl_and_absent_times_are_counted():
    times = [T + 0.5 + 0.1 * i for i in range(11)]
    ph, _ = one(token_times=times)
    # Float epoch seconds resolve ~0.24 us, hence the 1 us tolerance.
    np.testing.assert_allclose(ph.itl, np.full(10, 0.1), atol=1e-6)
    ph, _ = one(token_times=None)
    assert ph.itl.size == 0
    assert ph.unavailable[("itl", "no_token_times")] == 1


@pytest.mark.parametrize("kw,reason", [
    (dict(scheduled=T - 0.1), "clock_order"),
    (dict(queued=T + 0.2), "clock_order"),  # queued after scheduled
    (dict(first_token=T + 2.0), "clock_order"),  # first token after the last
    (dict(finish=T + 1.0), "clock_order"),
    (dict(cached_prompt_tokens=2000), "cached_exceeds_prompt"),
    (dict(output_tokens=-5), "negative_token_count"),
    (dict(token_times=[T + 0.5, T + 0.4]), "bad_token_gap"),
    (dict(token_times=[T + 0.5, T + 0.6]), "token_times_inconsistent"),
    (dict(output_tokens=2, token_times=[T + 0.5, T + 1.0, T + 1.5]),
     "token_gaps_exceed_output"),
])
def test_contradictions_are_rejected_and_counted(kw, reason):
    ph, v = one(**kw)
    assert not ph.kept[0]
    assert ph.rejected == {reason: 1}
    assert all(math.isnan(x) for x in v.values())
    assert ph.itl.size == 0


def test_rejected_rows_do_not_disturb_the_others():
    good = RequestRecord("m", arrival=T, first_token=T + 0.2, last_token=T + 0.4,
                         output_tokens=3, token_times=[T + 0.2, T + 0.3, T + 0.4])
    bad = RequestRecord("m", arrival=T + 1, first_token=T + 0.5)
    ph = split_phases(RequestBatch.from_records([bad, good, bad]))
    assert ph.kept.tolist() == [False, True, False]
    assert ph.rejected == {"clock_order": 2}
    np.testing.assert_allclose(ph.itl, [0.1, 0.1], atol=1e-6)
    assert ph.itl_counts.tolist() == [0, 2, 0]
