"""``make profile``: where each ingest path spends its time, by pyinstrument.

Each path runs in this process as its receiver runs it (payload bytes in, counted
requests out), on the benchmark's own batches, under pyinstrument's statistical
profiler; the top of each call tree is printed with each frame's share of the
path's time, and the per-request (per-span) cost measured without the profiler.
bench/PROFILE.md is the summary of a run of this, with what was done about it.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from bench.common import CLIENT_CORE, pin


def _export_payloads(with_gaps: bool) -> list[bytes]:
    from bench.ingest import synthetic_batch
    from phasewatch.ingest import wire

    rng = np.random.default_rng(0)
    # batch id 0: not deduplicated, so the 8 batches can be sent again and again
    return [wire.encode_export(synthetic_batch(rng, with_gaps), "bench") for _ in range(8)] * 100


def _otlp_payloads() -> list[bytes]:
    from phasewatch.sim.otlp_load import FreshBatches, template_spans

    fresh = FreshBatches(template_spans(), seed=1)
    return [fresh.next().request.SerializeToString() for _ in range(400)]


def _lifecycle_payloads() -> list[bytes]:
    from phasewatch.ingest import wire
    from phasewatch.ingest.lifecycle import EventKind, LifecycleEvent

    out = []
    t0 = time.time_ns() - 10**9
    for b in range(200):
        events = []
        for r in range(50):
            rid, t = f"b{b}-r{r}", t0 + r * 10**6
            events += [
                LifecycleEvent(rid, EventKind.ARRIVED, t, model="m", prompt_tokens=900),
                LifecycleEvent(rid, EventKind.SCHEDULED, t + 10**6),
                LifecycleEvent(rid, EventKind.FIRST_TOKEN, t + 5 * 10**7),
                LifecycleEvent(rid, EventKind.TOKENS, 0, first_emission_index=1,
                               token_times_unix_nano=tuple(t + 5 * 10**7 + k * 8 * 10**6
                                                           for k in range(1, 100))),
                LifecycleEvent(rid, EventKind.FINISHED, t + 10**9, output_tokens=100,
                               finish_reason="stop", emission_count=100,
                               last_token_unix_nano=t + 5 * 10**7 + 99 * 8 * 10**6)]
        out.append(wire.encode_lifecycle("vllm", events))
    return out


def paths():
    """(name, payloads, units per payload, unit, make) per ingest path; ``make()`` gives
    a handler(payload) with fresh state (OTLP spans are deduplicated by id)."""
    from phasewatch.aggregation.aggregate import Aggregator
    from phasewatch.ingest import wire
    from phasewatch.ingest.lifecycle import LifecycleJoiner
    from phasewatch.ingest.otlp.ingest import EXTRACT, OtlpIngest
    from phasewatch.ingest.otlp.jsonform import json_spans, request_json
    from phasewatch.ingest.otlp.spans import parse_request

    def export():
        agg = Aggregator()

        def handle(p: bytes) -> None:
            batch, _ = wire.decode_export(p)
            agg.ingest(batch, "phasewatch")
        return handle

    def otlp():
        ingest = OtlpIngest(Aggregator())
        return lambda p: ingest.export(parse_request(p), "otlp_grpc")

    def otlp_json():
        ingest = OtlpIngest(Aggregator())
        return lambda p: ingest.export_spans(json_spans(p, EXTRACT), "otlp_http")

    def lifecycle():
        agg = Aggregator()
        joiner = LifecycleJoiner(agg)
        return lambda p: joiner.add(*wire.decode_lifecycle(p)[:2])

    spans = _otlp_payloads()
    as_json = [json.dumps(request_json(parse_request(p))).encode() for p in spans[:100]]
    return [
        ("phasewatch Export, 1,000 requests x ~200 token gaps", _export_payloads(True), 1000,
         "request", export),
        ("phasewatch Export, no token times", _export_payloads(False), 1000, "request", export),
        ("OTLP protobuf (gRPC and HTTP), vLLM spans", spans, 512, "span", otlp),
        ("OTLP JSON (HTTP), vLLM spans", as_json, 512, "span", otlp_json),
        ("phasewatch StreamLifecycle, 50 requests x 5 events", _lifecycle_payloads(), 50,
         "request", lifecycle),
    ]


def main() -> int:
    import pyinstrument

    pin(CLIENT_CORE)
    for name, payloads, units, unit, make in paths():
        handle = make()
        for p in payloads[-4:]:  # warm up
            handle(p)
        t0 = time.perf_counter()
        runs = 0  # each payload once at most: a repeat could be a duplicate
        while time.perf_counter() - t0 < 2.0 and runs < len(payloads) - 4:
            handle(payloads[runs])
            runs += 1
        per_unit = (time.perf_counter() - t0) / (runs * units) * 1e6
        handle = make()
        profiler = pyinstrument.Profiler(interval=0.0002)
        profiler.start()
        for p in payloads[:max(runs // 2, 8)]:
            handle(p)
        profiler.stop()
        print(f"=== {name}: {per_unit:.2f} us per {unit} ({1e6 / per_unit:,.0f} {unit}s/s, "
              "no profiler)")
        print(profiler.output_text(unicode=False, color=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
