"""Conservation: N simulated requests through the client over real gRPC show up exactly."""

import math

import pytest

from phasewatch.client import PhasewatchClient
from phasewatch.sim.scenarios import scenario
from tests.conftest import scrape


def expected_from_records(records):
    """Independent arithmetic on the records (plain Python, not the phase split)."""
    e = dict(n=len(records), ttft=0.0, e2e=0.0, preprocess=0.0, queue=0.0, prefill=0.0,
             decode=0.0,
             tpot=0.0, tpot_n=0, gaps=0, gap_sum=0.0, prompt=0, cached=0, output=0)
    for r in records:
        e["ttft"] += r.first_token - r.arrival
        e["e2e"] += r.finish - r.arrival
        e["preprocess"] += r.queued - r.arrival
        e["queue"] += r.scheduled - r.queued
        e["prefill"] += r.first_token - r.scheduled
        e["decode"] += r.last_token - r.first_token
        if r.output_tokens > 1:
            e["tpot"] += (r.last_token - r.first_token) / (r.output_tokens - 1)
            e["tpot_n"] += 1
        t = r.token_times
        e["gaps"] += len(t) - 1
        e["gap_sum"] += t[-1] - t[0]
        e["prompt"] += r.prompt_tokens
        e["cached"] += r.cached_prompt_tokens
        e["output"] += r.output_tokens
    return e


@pytest.fixture(scope="module")
def records():
    engine = scenario("chat").build(seed=7)
    recs = engine.run(40.0)
    assert len(recs) > 150
    return recs


def test_counts_and_sums_survive_the_trip(exporter, records):
    with PhasewatchClient(f"127.0.0.1:{exporter.grpc_port}", engine="vllm",
                          max_batch=97) as client:  # several batches, uneven sizes
        for r in records:
            assert client.record_request(r)
        assert client.flush(30)
    assert client.stats["accepted"] == len(records) and client.stats["rejected"] == 0
    e = expected_from_records(records)
    m = scrape(exporter.http_port)
    lbl = dict(model="Llama-3.1-8B", engine="vllm")

    def hist(name, **extra):
        return m.total(name + "_count", **lbl, **extra), m.total(name + "_sum", **lbl, **extra)

    def close(a, b, rel=1e-6):
        # Float epoch seconds quantise each timestamp to ~0.24 us.
        return math.isclose(a, b, rel_tol=rel, abs_tol=1e-6 * e["n"])

    n, s = hist("gen_ai_server_time_to_first_token_seconds")  # summed over prompt classes
    assert n == e["n"] and close(s, e["ttft"])
    n, s = hist("gen_ai_server_request_duration_seconds")
    assert n == e["n"] and close(s, e["e2e"])
    n, s = hist("gen_ai_server_time_per_output_token_seconds")
    assert n == e["tpot_n"] and close(s, e["tpot"])
    for phase in ("preprocess", "queue", "prefill", "decode"):
        n, s = hist("phasewatch_phase_duration_seconds", phase=phase)
        assert n == e["n"] and close(s, e[phase]), phase
    n, s = hist("phasewatch_inter_token_latency_seconds")
    assert n == e["gaps"]
    assert math.isclose(s, e["gap_sum"], rel_tol=1e-5)  # float32 gaps on the wire
    assert m.value("phasewatch_tokens_total", kind="prompt", **lbl) == e["prompt"]
    assert m.value("phasewatch_tokens_total", kind="cached_prompt", **lbl) == e["cached"]
    assert m.value("phasewatch_tokens_total", kind="output", **lbl) == e["output"]
    assert m.total("phasewatch_requests_total", **lbl) == e["n"]
    assert m.value("phasewatch_ingest_accepted_total", protocol="phasewatch") == e["n"]
    # Every bucket series is cumulative and ends at the count.
    buckets = [x for x in m.samples if x.name == "phasewatch_inter_token_latency_seconds_bucket"]
    values = [b.value for b in buckets]
    assert values == sorted(values) and values[-1] == e["gaps"]


def test_a_resent_batch_is_counted_once(exporter, records):
    import grpc

    from phasewatch.ingest import wire
    from phasewatch.requests.record import RequestBatch

    payload = wire.encode_export(RequestBatch.from_records(records[:10]), "vllm",
                                 batch_id=1234)
    with grpc.insecure_channel(f"127.0.0.1:{exporter.grpc_port}") as ch:
        export = ch.unary_unary("/phasewatch.v1.Phasewatch/Export")
        first = wire.decode_export_response(export(payload, timeout=5))
        second = wire.decode_export_response(export(payload, timeout=5))
    assert first.accepted == 10 and not first.duplicate
    # the first attempt's counts, flagged: the client's tally stays exact
    assert second.accepted == 10 and second.duplicate
    m = scrape(exporter.http_port)
    assert m.total("gen_ai_server_request_duration_seconds_count") == 10
    assert m.value("phasewatch_ingest_batches_total", outcome="duplicate") == 1
