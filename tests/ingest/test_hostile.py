"""Hostile values through the real clients: each is accepted sanely, or rejected and
counted with a reason; the exporter stays up, and no NaN, infinite or negative
value reaches /metrics."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from phasewatch.client import PhasewatchClient
from phasewatch.requests.record import RequestRecord
from phasewatch.sim import otlp_shapes
from tests.conftest import scrape
from tests.ingest.test_otlp import _grpc

BIG_NAME = "m" * (1 << 20)  # a 1 MB model name


def hostile(t0: float) -> list[tuple[str, dict]]:
    ok = dict(arrival=t0, scheduled=t0 + 0.01, first_token=t0 + 0.1, last_token=t0 + 1.0,
              finish=t0 + 1.0, prompt_tokens=100, output_tokens=10)
    nan = float("nan")
    return [
        ("nan durations", ok | dict(scheduled=nan, first_token=nan)),
        ("infinite times", ok | dict(arrival=-math.inf, finish=math.inf)),
        ("negative durations", ok | dict(last_token=t0 + 0.05, finish=t0 + 0.05)),
        ("first token before arrival", ok | dict(first_token=t0 - 3.0)),
        ("everything reversed", dict(arrival=t0 + 9, scheduled=t0 + 5, first_token=t0 + 2,
                                     last_token=t0 + 1, finish=t0, prompt_tokens=1,
                                     output_tokens=1)),
        ("a billion tokens", ok | dict(prompt_tokens=10**9, output_tokens=10**9,
                                       cached_prompt_tokens=10**9)),
        ("negative tokens", ok | dict(prompt_tokens=-7, output_tokens=-1)),
        ("tokens past the wire", ok | dict(prompt_tokens=10**12)),
        ("tokens not a number", ok | dict(output_tokens="many")),
        ("time not a number", ok | dict(arrival="yesterday")),
        ("empty everything", dict()),
        ("far future", ok | dict(arrival=1e12, finish=1e12 + 1)),
    ]


def _no_poison(m) -> None:
    for s in m.samples:
        assert math.isfinite(s.value), (s.name, s.labels, s.value)
        assert s.value >= 0, (s.name, s.labels, s.value)
    assert not any(len(v) > 200 for s in m.samples for v in s.labels.values())


def test_hostile_values_through_the_phasewatch_client(exporter):
    t0 = time.time() - 30
    cases = hostile(t0)
    # room for the ten-million-gap request below (the default bound, 2M, would drop it
    # and count it dropped_buffer_full, as test_client checks)
    client = PhasewatchClient(f"127.0.0.1:{exporter.grpc_port}", engine="vllm",
                              max_buffer_tokens=2 * 10**7)
    for name, kw in cases:
        assert client.record(name if name != "empty everything" else "", **kw)
    ok = dict(arrival=t0, scheduled=t0 + 0.01, first_token=t0 + 0.1, last_token=t0 + 1.0,
              finish=t0 + 1.0, prompt_tokens=100, output_tokens=10)
    client.record(BIG_NAME, **ok)  # a 1 MB model name
    client.record(123, **ok)  # a name that is not a string
    # ten million token gaps in one request
    times = t0 + 0.1 + np.arange(10**7 + 1) * 1e-7
    client.record("long", **ok | dict(last_token=float(times[-1]),
                                      finish=float(times[-1]), output_tokens=10**7 + 1),
                  token_times=times)
    assert client.flush(timeout=120)
    client.close()
    sent = len(cases) + 3
    st = client.stats
    assert st["accepted"] + st["rejected"] + st["dropped_invalid"] == sent, st
    assert st["dropped_invalid"] == 4  # 10^12 tokens, "many", "yesterday", name 123
    m = scrape(exporter.http_port)
    _no_poison(m)
    accepted = m.value("phasewatch_ingest_accepted_total", protocol="phasewatch")
    rejected = m.total("phasewatch_ingest_rejected_total", protocol="phasewatch")
    assert accepted == st["accepted"] and rejected == st["rejected"] + st["dropped_invalid"]
    assert m.value("phasewatch_ingest_rejected_total", protocol="phasewatch",
                   reason="sender_invalid_value") == 4
    assert m.value("phasewatch_ingest_label_overflow_total", label="model",
                   reason="too_long") == 1
    # the ten million gaps were all observed
    assert m.total("phasewatch_inter_token_latency_seconds_count", model="long") >= 10**7 - 1 \
        or m.total("gen_ai_server_time_per_output_token_seconds_count", model="long") >= 1
    assert scrape(exporter.http_port)  # still serving


@pytest.mark.parametrize("shape", ["vllm", "sglang", "tgi"])
def test_hostile_values_through_the_otel_sdk(exporter, shape):
    t0 = time.time() - 30
    recs = [RequestRecord(model=BIG_NAME if i == 0 else name, request_id=f"r{i}",
                          **{k: v for k, v in kw.items()
                             if not isinstance(v, str) and not (isinstance(v, int) and
                                                                v > 10**10)})
            for i, (name, kw) in enumerate(hostile(t0))
            if name != "far future"]  # OTLP times are uint64 ns: past 2554 cannot be sent
    mem = InMemorySpanExporter()
    tp = otlp_shapes.provider(shape, mem)
    tracer = otlp_shapes.tracer_for(tp, shape)
    emitted = 0
    for r in recs:
        try:
            otlp_shapes.EMIT[shape](tracer, r)
            emitted += 1
        except (TypeError, ValueError, OverflowError):
            pass  # the SDK side could not even express it
    tp.force_flush()
    spans = mem.get_finished_spans()
    assert _grpc(exporter).export(spans).name == "SUCCESS"
    m = scrape(exporter.http_port)
    _no_poison(m)
    proto = "otlp_grpc"
    requests = m.value("phasewatch_otlp_spans_total", protocol=proto, outcome="request") or 0
    rejected = m.value("phasewatch_otlp_spans_total", protocol=proto, outcome="rejected") or 0
    assert requests + rejected == emitted, (requests, rejected, emitted)
