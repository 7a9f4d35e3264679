"""Overload without silent loss: a 30 s flood through each protocol with real clients.

The exporter runs as its own process (``phasewatch serve --max-in-flight 2
--memory-limit-mib 300``) so its memory is its own; two client processes
(``tests/support/flood.py``) offer it many times what it can ingest, open loop. Afterwards:

* every request a client reports delivered is counted exactly once in /metrics;
* everything else was dropped by the client with a reason it reports (its buffer or
  queue full while the exporter pushed back), and for the phasewatch client that
  drop count reached /metrics too;
* every retryable refusal a client received is counted by the exporter, one for one;
* peak resident memory stayed under the limit, and /metrics answered quickly all along.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections import Counter

import pytest

from tests.conftest import Scrape
from tests.support.serve import ServeProcess

SECONDS = 30
PROCESSES, THREADS = 2, 3
MEMORY_LIMIT_MIB = 300
SDK_MAX_ATTEMPTS = 6  # the OTel SDK exporters give up after this many refused attempts


def _scrape(port: int) -> tuple[Scrape, float]:
    start = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return Scrape(text), time.monotonic() - start


def _flood(sp: ServeProcess, protocol: str, tmp_path) -> tuple[list[dict], list[float], int]:
    target = {"phasewatch": f"127.0.0.1:{sp.grpc_port}",
              "otlp-grpc": f"127.0.0.1:{sp.otlp_grpc_port}",
              "otlp-http": f"http://127.0.0.1:{sp.otlp_http_port}/v1/traces"}[protocol]
    outs = [tmp_path / f"flood-{i}.json" for i in range(PROCESSES)]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.support.flood", protocol, target,
                               str(SECONDS), str(THREADS), str(o)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for o in outs]
    latencies, peak = [], 0
    try:
        deadline = time.monotonic() + SECONDS + 150
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            latencies.append(_scrape(sp.http_port)[1])
            peak = max(peak, sp.status()["VmRSS"])
            time.sleep(0.25)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.wait() == 0 for p in procs)
    return [json.loads(o.read_text()) for o in outs], latencies, peak


@pytest.mark.parametrize("protocol", ["phasewatch", "otlp-grpc", "otlp-http"])
def test_flood_is_refused_retried_and_counted_exactly(protocol, tmp_path):
    with ServeProcess(tmp_path, "--max-in-flight", "2",
                      "--memory-limit-mib", str(MEMORY_LIMIT_MIB)) as sp:
        results, latencies, peak = _flood(sp, protocol, tmp_path)
        m, _ = _scrape(sp.http_port)
        hwm = sp.status()["VmHWM"]
    client = sum((Counter(r["client"]) for r in results), Counter())
    offered = sum(r["offered"] for r in results)
    proto = protocol.replace("-", "_")
    accepted = m.value("phasewatch_ingest_accepted_total", protocol=proto)
    refused = m.total("phasewatch_ingest_refused_total", protocol=proto)
    counted = m.total("gen_ai_server_request_duration_seconds_count")
    print(f"\n{protocol}: offered {offered / SECONDS:,.0f}/s, accepted {accepted / SECONDS:,.0f}/s"
          f" ({offered / accepted:.1f}x capacity); refused {refused:.0f} times; client {client};"
          f" peak RSS {hwm / 2**20:.0f} MiB; /metrics max {max(latencies) * 1000:.0f} ms over "
          f"{len(latencies)} scrapes")
    assert offered >= 3 * accepted, "the flood must be several times what it can ingest"
    assert refused > 0, "the exporter never pushed back"
    if protocol == "phasewatch":
        # client side: every record() is accepted, or dropped with a reason it counts
        drops = sum(v for k, v in client.items() if k.startswith("dropped_"))
        assert offered == client["accepted"] + client["rejected"] + drops
        assert client["rejected"] == 0 and drops == client["dropped_buffer_full"]
        # exporter side: the same numbers, the drops reported by the client included
        assert accepted == counted == client["accepted"]
        assert m.value("phasewatch_ingest_dropped_total",
                       reason="sender_buffer_full") == client["dropped_buffer_full"]
        assert refused == client["retries_unavailable"]
    else:
        statuses = sum((Counter(r["statuses"]) for r in results), Counter())
        refusal = "UNAVAILABLE" if protocol == "otlp-grpc" else "503"
        assert offered == client["exported"] + client["failed"] + client["dropped_queue_full"]
        assert accepted == counted == client["exported"]
        assert m.value("phasewatch_otlp_spans_total", protocol=proto,
                       outcome="duplicate") in (None, 0)
        assert refused == statuses[refusal]  # each refusal a client got was counted
        assert set(statuses) <= {refusal, "OK", "200"}, statuses
        # an export the SDK gave up on was refused on every attempt: never half-counted
        assert client["exports_failed"] * SDK_MAX_ATTEMPTS <= refused
    assert hwm < MEMORY_LIMIT_MIB * 2**20 and peak < MEMORY_LIMIT_MIB * 2**20
    latencies.sort()
    assert latencies[int(len(latencies) * 0.99)] < 0.5 and latencies[-1] < 2.0, latencies[-5:]
