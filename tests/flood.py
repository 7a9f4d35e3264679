"""A flood of finished requests from real clients, as a separate process.

    python -m tests.flood PROTOCOL TARGET SECONDS THREADS OUT.json

PROTOCOL ``phasewatch``: THREADS ``PhasewatchClient`` instances, each fed by its own
thread calling ``record()`` as fast as it can. ``otlp-grpc`` / ``otlp-http``: THREADS
OpenTelemetry SDK ``OTLPSpanExporter`` instances, each exporting batches of
vLLM-shaped spans (fresh ids every batch) back to back. The SDK exporters are used
as they ship; only the transport is watched (a channel interceptor, a requests
response hook) to count every status the exporter received, so a refusal seen by a
client can be matched with a refusal counted by the exporter.

OUT.json gets what the clients report: requests/spans offered, delivered,
rejected and dropped, and every reply status seen.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections import Counter

import grpc

BATCH_SPANS = 256
TOKENS = 16


def _rows(n: int) -> list[dict]:
    rng = random.Random(7)
    now = time.time()
    rows = []
    for i in range(n):
        t0 = now - 5 + rng.random()
        first = t0 + 0.02 + 0.1 * rng.random()
        times = [first + 0.02 * k for k in range(TOKENS)]
        rows.append(dict(arrival=t0, scheduled=t0 + 0.01, first_token=first,
                         last_token=times[-1], finish=times[-1] + 0.001,
                         prompt_tokens=200 + i % 800, output_tokens=TOKENS,
                         finish_reason="stop", token_times=times))
    return rows


def flood_phasewatch(target: str, seconds: float, threads: int) -> dict:
    from exporter.client import PhasewatchClient

    rows = _rows(1000)
    clients = [PhasewatchClient(target, engine="vllm", max_buffer=20_000, timeout=30.0,
                                max_backoff=2.0) for _ in range(threads)]
    recorded = [0] * threads
    end = time.monotonic() + seconds

    def drive(i: int) -> None:
        c, n = clients[i], 0
        while time.monotonic() < end:
            for kw in rows:
                c.record("flood-model", **kw)
            n += len(rows)
        recorded[i] = n

    workers = [threading.Thread(target=drive, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for c in clients:
        c.close(timeout=90.0)
    stats = sum((c.stats for c in clients), Counter())
    return {"offered": sum(recorded), "seconds": seconds, "client": dict(stats)}


def _template_spans():
    """One batch of vLLM-shaped spans from the simulator's emitter, as templates."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from exporter.record import RequestRecord
    from exporter.sim import otlp_shapes

    mem = InMemorySpanExporter()
    tp = otlp_shapes.provider("vllm", mem, max_export_batch_size=BATCH_SPANS)
    tracer = otlp_shapes.tracer_for(tp, "vllm")
    for i, kw in enumerate(_rows(BATCH_SPANS)):
        otlp_shapes.emit_vllm(tracer, RequestRecord(
            model="", engine="vllm", request_id=f"req-{i}", cached_prompt_tokens=0,
            **{k: v for k, v in kw.items() if k != "token_times"}))
    tp.force_flush()
    tp.shutdown()
    return mem.get_finished_spans()


class Batch(list):
    """A batch of spans whose OTLP request was built ahead: ``request`` is the
    ``ExportTraceServiceRequest`` the SDK's own encoder made from the templates, with
    fresh trace and span ids (distinct requests every batch). The SDK exporters take
    it in place of encoding again (``_translate_data`` / ``encode_spans``), so the
    load generator is not bounded by the SDK's per-span Python encoding and can offer
    the exporter several times what it can ingest; their transport, retries and
    ``RetryInfo`` / ``Retry-After`` handling are the SDK's, unchanged."""

    request = None


def _fresh(templates, template_request, rng: random.Random) -> Batch:
    request = type(template_request)()
    request.CopyFrom(template_request)
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                span.trace_id = rng.randbytes(16)
                span.span_id = rng.randbytes(8)
    batch = Batch(templates)
    batch.request = request
    return batch


def _prebuilt(encode):
    return lambda spans: spans.request if isinstance(spans, Batch) else encode(spans)


class _Statuses(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, seen: Counter, lock: threading.Lock):
        self._seen, self._lock = seen, lock

    def intercept_unary_unary(self, continuation, details, request):
        call = continuation(details, request)
        code = call.code()
        with self._lock:
            self._seen[code.name] += 1
        return call


def _grpc_exporter(target: str, seen: Counter, lock: threading.Lock):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    class Watched(OTLPSpanExporter):
        def _translate_data(self, data):
            return data.request if isinstance(data, Batch) else super()._translate_data(data)

        def _initialize_channel_and_stub(self):
            super()._initialize_channel_and_stub()
            self._client = self._stub(grpc.intercept_channel(self._channel,
                                                             _Statuses(seen, lock)))

    return Watched(endpoint=target, insecure=True, timeout=30)


def _http_exporter(target: str, seen: Counter, lock: threading.Lock):
    import requests
    from opentelemetry.exporter.otlp.proto.http import trace_exporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    if not hasattr(trace_exporter.encode_spans, "prebuilt"):
        trace_exporter.encode_spans = _prebuilt(trace_exporter.encode_spans)
        trace_exporter.encode_spans.prebuilt = True

    def hook(response, *args, **kwargs):
        with lock:
            seen[str(response.status_code)] += 1

    session = requests.Session()
    session.hooks["response"].append(hook)
    return OTLPSpanExporter(endpoint=target, session=session, timeout=30)


def flood_otlp(protocol: str, target: str, seconds: float, threads: int,
               rate: float = 150_000) -> dict:
    """Open loop, as an SDK batch processor is: a generator makes ``rate`` spans/s into
    a bounded queue whatever the exporter does; THREADS exporters drain it. A batch
    that finds the queue full is dropped and counted (the SDK would drop it too)."""
    import queue

    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace.export import SpanExportResult

    templates = _template_spans()
    template_request = encode_spans(templates)
    seen: Counter = Counter()
    lock = threading.Lock()
    make = _grpc_exporter if protocol == "otlp-grpc" else _http_exporter
    tally = Counter()
    backlog: queue.Queue = queue.Queue(maxsize=4 * threads)
    end = time.monotonic() + seconds

    def generate() -> None:
        rng, start, made = random.Random(os.getpid()), time.monotonic(), 0
        while time.monotonic() < end:
            due = (time.monotonic() - start) * rate - made * BATCH_SPANS
            if due < BATCH_SPANS:
                time.sleep(0.001)
                continue
            batch = _fresh(templates, template_request, rng)
            made += 1
            try:
                backlog.put_nowait(batch)
            except queue.Full:
                with lock:
                    tally["dropped_queue_full"] += len(batch)
        for _ in range(threads):
            backlog.put(None)
        with lock:
            tally["generated"] += made * BATCH_SPANS

    def drain() -> None:
        exporter, mine = make(target, seen, lock), Counter()
        while (batch := backlog.get()) is not None:
            ok = exporter.export(batch) == SpanExportResult.SUCCESS
            mine["exported" if ok else "failed"] += len(batch)
            mine["exports_ok" if ok else "exports_failed"] += 1
        exporter.shutdown()
        with lock:
            tally.update(mine)

    workers = [threading.Thread(target=drain) for _ in range(threads)]
    for w in [*workers, gen := threading.Thread(target=generate)]:
        w.start()
    for w in [gen, *workers]:
        w.join()
    return {"offered": tally["generated"], "seconds": seconds, "client": dict(tally),
            "statuses": dict(seen)}


def main(argv: list[str]) -> int:
    protocol, target, seconds, threads, out = argv
    if protocol == "phasewatch":
        result = flood_phasewatch(target, float(seconds), int(threads))
    else:
        result = flood_otlp(protocol, target, float(seconds), int(threads))
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
