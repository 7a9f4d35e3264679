"""Tokens per emission: ITL per emission (vLLM's benchmark ``itl``) and per token.

An emission is what a client sees arrive at once: a streamed chunk, which may carry
several tokens (a server batching its output, speculative decoding). ``token_times``
are one per emission; ``token_counts`` (optional) the tokens each carried.
"""

from __future__ import annotations

import json
import time
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest

from phasewatch.aggregation.aggregate import Aggregator
from phasewatch.app import Exporter
from phasewatch.client import PhasewatchClient
from phasewatch.config import ServeConfig
from phasewatch.ingest import wire
from phasewatch.ingest.lifecycle import EventKind, LifecycleEvent, LifecycleJoiner
from phasewatch.requests.phases import split_phases
from phasewatch.requests.record import RequestBatch, RequestRecord
from phasewatch.selfstats import SelfStats
from tests.conftest import TEST_PORTS, scrape
from tests.support import FIXTURES

T = 1_700_000_000.0
FIXTURE = FIXTURES / "peers" / "requests.json"


def rec(times, counts=None, output=None, rid="r") -> RequestRecord:
    return RequestRecord("m", arrival=T, scheduled=T + 0.01, first_token=times[0],
                         last_token=times[-1], finish=times[-1] + 0.001, prompt_tokens=10,
                         output_tokens=output if output is not None else sum(counts or [1] *
                                                                             len(times)),
                         finish_reason="stop", request_id=rid, token_times=times,
                         token_counts=counts)


def test_each_gap_is_spread_over_the_tokens_of_the_emission_it_ends():
    times = [T + 0.1, T + 0.13, T + 0.15, T + 0.25]
    ph = split_phases(RequestBatch.from_records([rec(times, [2, 3, 1, 4])]))
    assert ph.kept.all()
    np.testing.assert_allclose(ph.itl, [0.03, 0.02, 0.1], rtol=1e-4)  # per emission
    np.testing.assert_allclose(ph.token_itl, [0.01] * 3 + [0.02] + [0.025] * 4, rtol=1e-4)
    assert ph.token_itl_counts.tolist() == [8]
    assert ph.tpot[0] == pytest.approx(0.15 / 9, rel=1e-4)  # TPOT is per token already


def test_without_counts_per_token_is_per_emission_only_where_that_is_certain():
    one_each = rec([T + 0.1, T + 0.12, T + 0.14], rid="a")  # 3 emissions, 3 tokens
    chunked = rec([T + 0.1, T + 0.2], output=5, rid="b")  # 2 emissions, 5 tokens
    ph = split_phases(RequestBatch.from_records([one_each]))
    assert ph.token_itl is None  # the same figures as per emission: nothing recomputed
    ph = split_phases(RequestBatch.from_records([one_each, chunked]))
    assert ph.token_itl_counts.tolist() == [2, 0]
    assert ph.unavailable[("itl_per_token", "token_counts_unknown")] == 1


@pytest.mark.parametrize(("counts", "output", "reason"), [
    ([1, 0, 1], None, "bad_token_counts"),  # one emission without tokens
    ([1, -2, 1], None, "bad_token_counts"),
    ([1, 2], None, "bad_token_counts"),  # not one per emission
    ([1, 2.5, 1], 5, "bad_token_counts"),  # not integers
    ([1, 4, 4], 6, "token_counts_exceed_output"),  # 8 tokens after the first, 5 allowed
])
def test_counts_that_contradict_the_request_reject_it(counts, output, reason):
    times = [T + 0.1, T + 0.2, T + 0.3]
    ph = split_phases(RequestBatch.from_records([rec(times, counts, output=output or 3)]))
    assert not ph.kept.any()
    assert ph.rejected == {reason: 1}


def test_counts_travel_on_the_wire_and_through_the_lifecycle_join():
    times = [T + 0.1, T + 0.13, T + 0.15, T + 0.25]
    batch = RequestBatch.from_records([rec(times, [2, 3, 1, 4]), rec(times, rid="plain")])
    back, _ = wire.decode_export(wire.encode_export(batch, "e"))
    assert back.gap_tokens.tolist() == [3, 1, 4, 0, 0, 0]
    plain = RequestBatch.from_records([rec(times, rid="plain")])
    assert wire.decode_export(wire.encode_export(plain, "e"))[0].gap_tokens is None  # absent

    got = []  # what the joiner hands its sink
    sink = SimpleNamespace(stats=SelfStats(), ingest=lambda batch, _protocol: got.append(batch))
    joiner = LifecycleJoiner(sink, grace=0.0)
    ns = [round(t * 1e9) for t in times]
    events = [LifecycleEvent("x", EventKind.ARRIVED, round(T * 1e9), model="m",
                             prompt_tokens=10),
              LifecycleEvent("x", EventKind.SCHEDULED, round((T + 0.01) * 1e9)),
              LifecycleEvent("x", EventKind.FIRST_TOKEN, ns[0], token_counts=(2,)),
              LifecycleEvent("x", EventKind.TOKENS, first_emission_index=1,
                             token_times_unix_nano=tuple(ns[1:3]), token_counts=(3, 1)),
              LifecycleEvent("x", EventKind.TOKENS, first_emission_index=3,
                             token_times_unix_nano=(ns[3],), token_counts=(4,)),
              LifecycleEvent("x", EventKind.FINISHED, ns[3] + 10**6, output_tokens=10,
                             finish_reason="stop", emission_count=4)]
    _, decoded, _ = wire.decode_lifecycle(wire.encode_lifecycle("e", events))
    joiner.add("e", decoded)
    joiner.sweep()
    (joined,) = got
    assert joined.gap_tokens.tolist() == [3, 1, 4]


def test_fixture_per_token_itl_with_and_without_counts():
    """The peers' workload (multi-token chunks in 69 of 390 requests), sent once with
    the tokens per chunk and once without: ITL per emission is vLLM's ``itl`` either
    way; per token it spreads each gap over its chunk's tokens, and without counts it
    leaves out (and counts) the requests whose chunks carried several tokens."""
    peers = json.loads(FIXTURE.read_text())
    reqs = peers["requests"]
    shift = round(time.time() - max(r["finish"] for r in reqs))
    gaps = [np.diff(r["chunk_times"]) for r in reqs]
    tokens = [np.asarray(r["chunk_tokens"][1:]) for r in reqs]
    want_tokens = int(sum(t.sum() for t in tokens))
    want_seconds = float(sum(g.sum() for g in gaps))
    for with_counts in (True, False):
        ex = Exporter(ServeConfig(**TEST_PORTS, window_seconds=600)).start()
        try:
            with PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine="vllm") as client:
                for r in reqs:
                    times = [shift + t for t in r["chunk_times"]]
                    client.record("m", arrival=shift + r["arrival"], first_token=times[0],
                                  last_token=times[-1], finish=shift + r["finish"],
                                  prompt_tokens=r["prompt_tokens"],
                                  output_tokens=r["output_tokens"],
                                  finish_reason=r["finish_reason"], token_times=times,
                                  token_counts=r["chunk_tokens"] if with_counts else None)
                assert client.flush(30)
                assert client.stats["accepted"] == len(reqs)
            page = scrape(ex.http_port)
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{ex.http_port}/api/v1/summary?window=600") as resp:
                (summary,) = json.load(resp)["models"]
        finally:
            ex.stop(grace=1)
        per_emission = page.total("phasewatch_inter_token_latency_seconds_count")
        assert per_emission == sum(len(g) for g in gaps)  # vLLM's itl count
        count = page.total("phasewatch_inter_token_latency_per_token_seconds_count")
        total = page.total("phasewatch_inter_token_latency_per_token_seconds_sum")
        if with_counts:
            assert count == want_tokens > per_emission
            assert total == pytest.approx(want_seconds, rel=1e-6)  # float32 gaps
            assert summary["itl_per_token_seconds"]["count"] == want_tokens
            assert summary["itl_per_token_seconds"]["mean"] == pytest.approx(
                want_seconds / want_tokens, rel=1e-6)
        else:
            multi = [i for i, t in enumerate(tokens) if (t > 1).any()]
            assert len(multi) > 40
            keep = [i for i in range(len(reqs)) if i not in multi]
            assert count == sum(len(gaps[i]) for i in keep)
            assert page.total("phasewatch_phase_unavailable_total", phase="itl_per_token",
                              reason="token_counts_unknown") == len(multi)
            assert summary["itl_per_token_seconds"]["count"] == count


def test_aggregator_reuses_the_per_emission_counts_when_every_emission_is_one_token():
    agg = Aggregator()
    times = [T + 0.1, T + 0.12, T + 0.14]
    agg.ingest(RequestBatch.from_records([rec(times)]), "t")
    snap = agg.snapshot()
    np.testing.assert_array_equal(snap.histograms["itl"][1], snap.histograms["itl_per_token"][1])
    assert snap.natives["itl"][1].sum() == snap.natives["itl_per_token"][1].sum() == 2
