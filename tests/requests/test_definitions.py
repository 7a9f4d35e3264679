"""TTFT, pooled ITL and TPOT match the benchmark tools' definitions (vllm/benchmarks/serve.py)."""

import itertools

import numpy as np
import pytest

from phasewatch.requests.phases import split_phases
from phasewatch.requests.record import RequestBatch, RequestRecord

T = 1_700_000_000.0


def vllm_bench_metrics(start: float, token_times: list[float], output_len: int):
    """What vLLM's benchmark computes from one streamed request (its `itl` list, its TPOT)."""
    ttft = token_times[0] - start
    itl = [b - a for a, b in itertools.pairwise(token_times)]
    latency = token_times[-1] - start
    tpot = (latency - ttft) / (output_len - 1)
    return ttft, itl, tpot


def test_definitions_on_uneven_gaps():
    # A stall in request 1 (another request's prefill) shows in pooled ITL's tail,
    # not in TPOT's mean: the two are different figures and must stay so.
    reqs = [
        (T, [T + 0.2, T + 0.21, T + 0.22, T + 0.72, T + 0.73]),
        (T + 1, [T + 1.05, T + 1.06, T + 1.07]),
    ]
    recs = [RequestRecord("m", arrival=a, first_token=t[0], last_token=t[-1], finish=t[-1],
                          output_tokens=len(t), token_times=t) for a, t in reqs]
    ph = split_phases(RequestBatch.from_records(recs))
    pooled = []
    for i, (a, t) in enumerate(reqs):
        ttft, itl, tpot = vllm_bench_metrics(a, t, len(t))
        assert ph.ttft[i] == pytest.approx(ttft, abs=1e-6)
        assert ph.tpot[i] == pytest.approx(tpot, abs=1e-6)
        pooled += itl
    np.testing.assert_allclose(np.sort(ph.itl), np.sort(pooled), atol=1e-6)
    assert np.max(ph.itl) == pytest.approx(0.5, abs=1e-6)  # the stall, in ITL's tail
    assert ph.tpot[0] == pytest.approx(0.53 / 4, abs=1e-6)  # averaged away in TPOT


def test_speculative_emissions_of_several_tokens():
    # 9 output tokens in 5 emissions: ITL has 4 gaps, TPOT divides by 8 tokens.
    t = [T + 0.1, T + 0.11, T + 0.12, T + 0.13, T + 0.14]
    rec = RequestRecord("m", arrival=T, first_token=t[0], last_token=t[-1], output_tokens=9,
                        token_times=t)
    ph = split_phases(RequestBatch.from_records([rec]))
    assert ph.itl.size == 4
    assert ph.tpot[0] == pytest.approx(0.04 / 8, abs=1e-6)
