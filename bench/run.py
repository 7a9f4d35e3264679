"""Ingest benchmark: gRPC Export end to end vs the raw protobuf decode of the same batches.

The exporter runs as `phasewatch serve` in its own process pinned to one core; this
process (the client) is pinned to the other. A run sends pre-encoded columnar
batches of 1,000 finished requests (with ~200 token gaps each, then without token
times) over loopback with a few calls in flight, and stops the clock when
/metrics shows every request counted. The reference, measured in the same run on
the same batches, is the raw decode: protobuf parse plus every column to numpy.
Prints a table and writes bench/results.json. Compare ratios, not absolute times.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np

from exporter import wire
from exporter.protocol import phasewatch_pb2 as pb
from exporter.record import RequestBatch

ROOT = Path(__file__).resolve().parents[1]
REQUESTS_PER_BATCH = 1000
GAPS_PER_REQUEST = 200


def synthetic_batch(rng: np.random.Generator, with_gaps: bool) -> RequestBatch:
    n = REQUESTS_PER_BATCH
    t0 = 1_700_000_000 * 10**9 + rng.integers(0, 10**9, n)
    queue = rng.integers(10**5, 10**7, n)
    prefill = rng.integers(10**7, 3 * 10**8, n)
    out = rng.integers(150, 250, n) if with_gaps else rng.integers(2, 400, n)
    counts = (np.minimum(out - 1, GAPS_PER_REQUEST) if with_gaps
              else np.zeros(n, dtype=np.int64))
    gaps = rng.gamma(4.0, 0.002, int(counts.sum())).astype(np.float32).astype(np.float64)
    ends = np.cumsum(counts)
    sums = np.add.reduceat(gaps, ends - counts) if with_gaps else np.zeros(n)
    decode = (sums * 1e9).astype(np.int64) if with_gaps else out * 8 * 10**6
    first = t0 + queue + prefill
    strings = ["", "Llama-3.1-8B", "stop", *[f"req-{i}" for i in range(n)]]
    return RequestBatch(
        strings=strings, model=np.ones(n, np.int32), engine=np.zeros(n, np.int32),
        finish_reason=np.full(n, 2, np.int32), request_id=np.arange(3, n + 3, dtype=np.int32),
        arrival=t0, scheduled=t0 + queue, first_token=first, last_token=first + decode,
        finish=first + decode + 10**5, prompt_tokens=rng.integers(100, 4000, n),
        cached_prompt_tokens=np.zeros(n, np.int64), output_tokens=out,
        token_gaps=gaps, gap_counts=counts.astype(np.int64))


def raw_decode_rate(payloads: list[bytes], seconds: float = 3.0) -> float:
    """Requests/s of protobuf parse + every column to numpy (the floor any consumer pays)."""
    fields = [f.name for f in pb.ExportRequest.DESCRIPTOR.fields if f.is_repeated
              and f.name != "strings"]
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for p in payloads:
            msg = pb.ExportRequest.FromString(p)
            for f in fields:
                np.asarray(getattr(msg, f))
            list(msg.strings)
            done += msg.request_count
    return done / (time.perf_counter() - t0)


def counted(http_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("phasewatch_ingest_accepted_total{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def start_exporter(core: int) -> tuple[subprocess.Popen, int, int]:
    cmd = [sys.executable, "-m", "exporter.cli", "serve", "--grpc-port", "0", "--http-port",
           "0", "--otlp-grpc-port", "0", "--otlp-http-port", "0", "--http-host", "127.0.0.1",
           "--log-level", "info"]
    proc = subprocess.Popen(["taskset", "-c", str(core), *cmd], stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    ports = {}
    patterns = {"grpc": r"phasewatch gRPC receiver on [^:]+:(\d+)",
                "http": r"metrics on https?://[^:]+:(\d+)/metrics"}  # as tests/serve.py
    for line in proc.stderr:
        for name, pattern in patterns.items():
            m = re.search(pattern, line)
            if m:
                ports[name] = int(m[1])
        if len(ports) == 2:
            break
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
    return proc, ports["grpc"], ports["http"]


def end_to_end_rate(payloads: list[bytes], seconds: float, in_flight: int = 3) -> float:
    proc, grpc_port, http_port = start_exporter(core=0)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=[
            ("grpc.max_send_message_length", 64 << 20)])
        export = channel.unary_unary("/phasewatch.v1.Phasewatch/Export")
        export(payloads[0], timeout=30)  # warm up; counted below as part of the baseline
        base = counted(http_port)
        stop = time.perf_counter() + seconds
        sent = [0] * in_flight

        def sender(k: int) -> None:
            i = k
            while time.perf_counter() < stop:
                export(payloads[i % len(payloads)], timeout=30)
                sent[k] += REQUESTS_PER_BATCH
                i += in_flight

        t0 = time.perf_counter()
        with ThreadPoolExecutor(in_flight) as pool:
            list(pool.map(sender, range(in_flight)))
        total = sum(sent)
        while counted(http_port) - base < total:
            time.sleep(0.001)
        elapsed = time.perf_counter() - t0
        assert counted(http_port) - base == total, "requests lost or double counted"
        channel.close()
        return total / elapsed
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> int:
    if hasattr(os, "sched_setaffinity") and os.cpu_count() and os.cpu_count() > 1:
        os.sched_setaffinity(0, {1})
    rng = np.random.default_rng(0)
    rows = []
    for label, with_gaps in (("Export, 1,000 requests x ~200 token gaps", True),
                             ("Export, 1,000 requests, no token times", False)):
        payloads = [wire.encode_export(synthetic_batch(rng, with_gaps), "bench")
                    for _ in range(8)]
        gaps = sum(len(pb.ExportRequest.FromString(p).token_gap_seconds) for p in payloads)
        gaps_per_request = gaps / (len(payloads) * REQUESTS_PER_BATCH)
        raw = raw_decode_rate(payloads)
        e2e = end_to_end_rate(payloads, seconds=8.0)
        rows.append({"path": label, "requests_per_s": e2e,
                     "token_gaps_per_s": e2e * gaps_per_request,
                     "raw_decode_requests_per_s": raw, "ratio_to_raw_decode": e2e / raw,
                     "batch_bytes": len(payloads[0])})
    print(f"{'path':44s} {'req/s':>11s} {'gaps/s':>12s} {'raw decode req/s':>17s} "
          f"{'ratio':>6s}")
    for r in rows:
        print(f"{r['path']:44s} {r['requests_per_s']:11,.0f} {r['token_gaps_per_s']:12,.0f} "
              f"{r['raw_decode_requests_per_s']:17,.0f} {r['ratio_to_raw_decode']:6.2f}")
    out = ROOT / "bench" / "results.json"
    out.write_text(json.dumps({"machine_cores": os.cpu_count(), "ingest": rows}, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
