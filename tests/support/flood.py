"""A flood of finished requests from real clients, as a separate process.

    python -m tests.support.flood PROTOCOL TARGET SECONDS THREADS OUT.json

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
    from phasewatch.client import PhasewatchClient

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
    from phasewatch.sim.otlp_load import grpc_exporter

    return grpc_exporter(target, _Statuses(seen, lock))


def _http_exporter(target: str, seen: Counter, lock: threading.Lock):
    import requests

    from phasewatch.sim.otlp_load import http_exporter

    def hook(response, *args, **kwargs):
        with lock:
            seen[str(response.status_code)] += 1

    session = requests.Session()
    session.hooks["response"].append(hook)
    return http_exporter(target, session)


def flood_otlp(protocol: str, target: str, seconds: float, threads: int,
               rate: float = 150_000) -> dict:
    """Open loop, as an SDK batch processor is: a generator makes ``rate`` spans/s into
    a bounded queue whatever the exporter does; THREADS exporters drain it. A batch
    that finds the queue full is dropped and counted (the SDK would drop it too)."""
    import queue

    from opentelemetry.sdk.trace.export import SpanExportResult

    from phasewatch.sim.otlp_load import FreshBatches, template_spans

    fresh = FreshBatches(template_spans(BATCH_SPANS), seed=os.getpid())
    seen: Counter = Counter()
    lock = threading.Lock()
    make = _grpc_exporter if protocol == "otlp-grpc" else _http_exporter
    tally = Counter()
    backlog: queue.Queue = queue.Queue(maxsize=4 * threads)
    end = time.monotonic() + seconds

    def generate() -> None:
        start, made = time.monotonic(), 0
        while time.monotonic() < end:
            due = (time.monotonic() - start) * rate - made * BATCH_SPANS
            if due < BATCH_SPANS:
                time.sleep(0.001)
                continue
            batch = fresh.next()
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
