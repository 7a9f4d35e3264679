"""The phase split: definitions, missing data counted, contradictions rejected."""

import math

import numpy as np
import pytest

from exporter.phases import split_phases
from exporter.record import RequestBatch, RequestRecord

T = 1_700_000_000.0


def one(**kw) -> tuple:
    base = dict(model="m", arrival=T, scheduled=T + 0.1, first_token=T + 0.5,
                last_token=T + 1.5, finish=T + 1.6, prompt_tokens=1000, output_tokens=11)
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
    assert not ph.rejected and not ph.unavailable


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
