"""Client rows: ``record()`` on the serving thread, and finished -> visible in /metrics.

``record()`` is timed call by call on a thread that paces itself like a server
(bursts every millisecond, 10,000 requests/s, each with 200 token emission
times) while the client's own sender thread encodes and sends in the
background, the process free to use every core as a server's is: once with the
exporter up, once with it down (a closed port: the
sender retries with backoff, the buffer fills and records are dropped and
counted). The reference is ``deque.append`` of the same row on the same thread,
timed the same way: the least any in-process buffer costs. The mean comes from
bursts timed whole (a timer per call would add its own cost), the p99 from calls
timed one by one.

Finished -> visible: the same paced load with default client settings; /metrics
is scraped every 20 ms, and a request counts as visible at the first scrape whose
accepted total covers it (the client sends in order), so the delay of each is
known to within a scrape.
"""

from __future__ import annotations

import collections
import socket
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.common import CLIENT_CORE, Row, pin, scrape, serve, total, unpin
from phasewatch.client import PhasewatchClient

RATE = 10_000  # requests/s
BURST_EVERY = 0.001
TOKENS = 200


def _rows(n: int) -> list[dict]:
    now = time.time()
    out = []
    for i in range(n):
        t0 = now - 2 + (i % 1000) * 1e-3
        first = t0 + 0.05
        times = [first + 0.008 * k for k in range(TOKENS)]
        out.append(dict(arrival=t0, scheduled=t0 + 0.01, first_token=first,
                        last_token=times[-1], finish=times[-1] + 0.001, prompt_tokens=900,
                        output_tokens=TOKENS, finish_reason="stop", request_id=f"r{i}",
                        token_times=times))
    return out


def paced(call, seconds: float, rows: list[dict], per_call: bool = True) -> np.ndarray:
    """Call ``call(kwargs)`` at RATE in bursts. ``per_call``: the duration of every call
    in ns; else of every burst divided by its calls (no timer inside: for the mean)."""
    per_burst = int(RATE * BURST_EVERY)
    durations = []
    clock = time.perf_counter_ns
    start = time.perf_counter()
    i = 0
    while (now := time.perf_counter()) - start < seconds:
        due = int((now - start) * RATE)
        while i < due:
            # each request brings its own list of emission times, as a server's would
            burst = [{**kw, "token_times": list(kw["token_times"])} for kw in
                     (rows[(i + k) % len(rows)] for k in range(per_burst))]
            if per_call:
                for kw in burst:
                    t = clock()
                    call(kw)
                    durations.append(clock() - t)
            else:
                t = clock()
                for kw in burst:
                    call(kw)
                durations.append((clock() - t) / per_burst)
            i += per_burst
        time.sleep(BURST_EVERY / 2)
    return np.array(durations)


def _closed_port() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


def record_rows(seconds: float = 6.0) -> list[Row]:
    """The serving process may use every core here, as an inference server's does: its
    sender thread's C work (encoding, gRPC) runs beside the serving thread, not on it.
    The exporter stays on its own core."""
    unpin()
    try:
        return _record_rows(seconds)
    finally:
        pin(CLIENT_CORE)


def _record_rows(seconds: float) -> list[Row]:
    rows = _rows(2000)
    buf = collections.deque(maxlen=512)  # at most what the client holds at this rate (flush_rows)

    def reference(kw: dict) -> None:
        buf.append(tuple(kw.values()))

    ref = paced(reference, seconds / 4, rows)
    ref_mean = paced(reference, seconds / 4, rows, per_call=False)
    buf.clear()  # what it held must not weigh on the collections measured next
    out, means = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        ex = serve(Path(tmp))
        try:
            client = PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine="vllm")
            out["up"] = paced(lambda kw: client.record("m", **kw), seconds / 2, rows)
            means["up"] = paced(lambda kw: client.record("m", **kw), seconds / 2, rows,
                                per_call=False)
            client.close(10)
            up_stats = dict(client.stats)
        finally:
            ex.stop()
    client = PhasewatchClient(_closed_port(), engine="vllm")
    out["down"] = paced(lambda kw: client.record("m", **kw), seconds / 2, rows)
    means["down"] = paced(lambda kw: client.record("m", **kw), seconds / 2, rows,
                          per_call=False)
    client.close(0.5)
    down_stats = dict(client.stats)
    result = []
    for state, d in out.items():
        stats = up_stats if state == "up" else down_stats
        extra = {"p99_us": float(np.percentile(d, 99)) / 1e3,
                 "p999_us": float(np.percentile(d, 99.9)) / 1e3,
                 "max_us": float(d.max()) / 1e3, "calls": int(d.size),
                 "reference_p99_us": float(np.percentile(ref, 99)) / 1e3,
                 "client_stats": stats}
        result.append(Row(f"record_{state}", f"client record(), exporter {state}: mean",
                          float(means[state].mean()) / 1e3, "us", 2.0, "lower",
                          float(ref_mean.mean()) / 1e3, "deque.append of the same row",
                          extra=extra))
        result.append(Row(f"record_{state}_p99", f"client record(), exporter {state}: p99",
                          extra["p99_us"], "us", 20.0, "lower", extra["reference_p99_us"],
                          "deque.append of the same row"))
    return result


def visibility_row(seconds: float = 20.0, scrape_every: float = 0.02) -> Row:
    """p99 of (first scrape showing a request) - (its record() call), default client."""
    rows = _rows(2000)
    with tempfile.TemporaryDirectory() as tmp:
        ex = serve(Path(tmp))
        try:
            client = PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine="vllm")
            recorded: list[float] = []  # time of the i-th record(), in order
            seen: list[tuple[float, float]] = []  # (scrape time, accepted total)
            stop = threading.Event()

            def scraper() -> None:
                while not stop.is_set():
                    text = scrape(ex.http_port)
                    seen.append((time.perf_counter(),
                                 total(text, "phasewatch_ingest_accepted_total")))
                    time.sleep(scrape_every)

            watcher = threading.Thread(target=scraper)
            watcher.start()
            paced(lambda kw: (client.record("m", **kw), recorded.append(time.perf_counter())),
                  seconds, rows, per_call=False)
            client.flush(10)
            time.sleep(0.5)
            stop.set()
            watcher.join()
            client.close(5)
        finally:
            ex.stop()
    scrape_t = np.array([t for t, _ in seen])
    counts = np.array([c for _, c in seen])
    recorded_t = np.array(recorded)
    # the request numbered k (1-based) is visible at the first scrape with count >= k
    first = np.searchsorted(counts, np.arange(1, recorded_t.size + 1), side="left")
    visible = first < len(counts)
    delay = scrape_t[first[visible]] - recorded_t[visible]
    return Row("finish_to_visible", "request finished -> visible in /metrics, p99",
               float(np.percentile(delay, 99)), "s", 1.0, "lower", 0.25,
               "the client's flush interval (default 0.25 s)",
               extra={"p50_s": float(np.percentile(delay, 50)), "max_s": float(delay.max()),
                      "requests": int(recorded_t.size), "never_seen": int((~visible).sum()),
                      "scrape_every_s": scrape_every})
