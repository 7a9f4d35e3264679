"""The admission gate: in-flight calls and bytes, the memory limit, the connection cap,
and a resent batch while its first attempt is still being ingested."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from dataclasses import replace

import grpc
import pytest
from google.rpc import error_details_pb2

from phasewatch.app import Exporter
from phasewatch.client import PhasewatchClient
from phasewatch.config import ServeConfig
from phasewatch.ingest import wire
from phasewatch.requests.record import RequestBatch, RequestRecord
from phasewatch.selfstats import SelfStats
from phasewatch.transport.admission import Admission, Refused
from tests.conftest import TEST_PORTS, scrape
from tests.ingest.test_otlp import _request_bytes
from tests.transport.test_otlp_overload import _post

EXPORT = "/phasewatch.v1.Phasewatch/Export"


def _refused(stats: SelfStats, reason: str, protocol: str = "p") -> float:
    return stats.get("phasewatch_ingest_refused_total", protocol=protocol, reason=reason)


def test_in_flight_calls_and_bytes_are_capped_and_counted():
    stats = SelfStats()
    gate = Admission(stats, max_in_flight=2, max_in_flight_bytes=100)
    gate.admit("p", 60)
    with pytest.raises(Refused) as e:
        gate.admit("p", 50)  # 110 bytes would be in flight
    assert e.value.reason == "in_flight_bytes"
    gate.admit("p", 40)
    with pytest.raises(Refused) as e:
        gate.admit("p", 1)
    assert e.value.reason == "in_flight" and "retry" in str(e.value)
    assert (gate.in_flight(), gate.in_flight_bytes()) == (2, 100)
    gate.release(60)
    gate.release(40)
    gate.admit("p", 10_000)  # alone, a call larger than the byte budget still passes
    gate.release(10_000)
    assert (gate.in_flight(), gate.in_flight_bytes()) == (0, 0)
    assert _refused(stats, "in_flight") == 1 and _refused(stats, "in_flight_bytes") == 1


def test_the_oldest_call_in_flight_is_timed_on_each_thread():
    """``oldest_call_seconds`` (--stall-dump's watch on held ingest calls): each admitted
    call timed from its admission on its own thread, until its release there."""
    clock = [100.0]
    gate = Admission(SelfStats(), clock=lambda: clock[0])
    assert gate.oldest_call_seconds() == 0.0
    admitted, release = threading.Event(), threading.Event()

    def call():
        gate.admit("p", 10)
        admitted.set()
        release.wait(10)
        gate.release(10)

    other = threading.Thread(target=call)
    other.start()
    assert admitted.wait(10)
    clock[0] = 103.0
    gate.admit("p", 5)  # this thread's call, admitted later
    clock[0] = 110.0
    assert gate.oldest_call_seconds() == 10.0
    release.set()
    other.join(10)
    assert gate.oldest_call_seconds() == 7.0
    gate.release(5)
    assert gate.oldest_call_seconds() == 0.0


def test_memory_over_the_soft_limit_refuses_until_it_drops():
    stats, rss = SelfStats(), [500 << 20]
    clock = [0.0]
    gate = Admission(stats, memory_limit=600 << 20, rss=lambda: rss[0], clock=lambda: clock[0])
    assert gate.soft_limit == 480 << 20  # 0.8 x the limit
    with pytest.raises(Refused) as e:
        gate.admit("p", 1)
    assert e.value.reason == "memory" and "480 MiB of 600 MiB" in str(e.value)
    with pytest.raises(Refused):
        gate.check_memory("lifecycle")
    rss[0] = 400 << 20
    clock[0] += 0.01  # the sample is reused for 50 ms
    with pytest.raises(Refused):
        gate.admit("p", 1)
    clock[0] += 0.1
    gate.admit("p", 1)
    assert _refused(stats, "memory") == 2 and _refused(stats, "memory", "lifecycle") == 1


@pytest.fixture
def tiny_memory():
    """An exporter whose memory limit (1 MiB) is always exceeded: every call is refused."""
    ex = Exporter(replace(ServeConfig(**TEST_PORTS), memory_limit_mib=1)).start()
    yield ex
    ex.stop(grace=1)


def _record(t0: float) -> RequestRecord:
    return RequestRecord("m", arrival=t0, scheduled=t0 + 0.01, first_token=t0 + 0.1,
                         last_token=t0 + 0.5, finish=t0 + 0.5, prompt_tokens=10,
                         output_tokens=5)


def test_over_the_memory_limit_every_receiver_answers_retry_later(tiny_memory):
    ex = tiny_memory
    client = PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine="vllm", timeout=2.0)
    client.record_request(_record(time.time() - 5))
    client.flush(timeout=1.5)
    client.close(timeout=1.0)
    assert client.stats["retries_unavailable"] >= 1 and client.stats["accepted"] == 0
    assert client.stats["dropped_shutdown"] == 1  # the client gave up at close, and says so
    code, headers, _ = _post(ex, _request_bytes("vllm", []))
    assert code == 503 and headers["Retry-After"] == "1"
    m = scrape(ex.http_port)
    assert m.value("phasewatch_ingest_refused_total", protocol="phasewatch",
                   reason="memory") == client.stats["retries_unavailable"]
    assert m.value("phasewatch_ingest_refused_total", protocol="otlp_http",
                   reason="memory") == 1
    assert m.value("phasewatch_memory_limit_bytes") == 1 << 20
    assert not m.total("gen_ai_server_request_duration_seconds_count")


def test_connections_past_the_cap_get_503_and_are_counted():
    ex = Exporter(replace(ServeConfig(**TEST_PORTS), max_connections=1)).start()
    try:
        idle = socket.create_connection(("127.0.0.1", ex.otlp_http_port))  # holds the slot
        time.sleep(0.2)
        second = socket.create_connection(("127.0.0.1", ex.otlp_http_port))
        second.settimeout(5)
        reply = second.recv(4096)
        assert reply.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in reply
        second.close()
        idle.close()
        time.sleep(0.2)  # the slot is free again
        assert _post(ex, _request_bytes("vllm", []))[0] == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{ex.http_port}/metrics") as r:
            text = r.read().decode()
        assert ('phasewatch_ingest_refused_total{protocol="otlp_http",reason="connections"} 1.0'
                in text)
    finally:
        ex.stop(grace=1)


class Parked:
    """An exporter whose first phasewatch ingest waits inside until ``release`` is set."""

    def __init__(self, max_in_flight: int):
        self.ex = Exporter(replace(ServeConfig(**TEST_PORTS), max_in_flight=max_in_flight))
        self.inside, self.release = threading.Event(), threading.Event()
        real = self.ex.aggregator.ingest

        def ingest(*args, **kwargs):
            if not self.inside.is_set():
                self.inside.set()
                self.release.wait(10)
            return real(*args, **kwargs)

        self.ex.aggregator.ingest = ingest
        self.ex.start()
        self.t0 = time.time() - 5
        self.payload = wire.encode_export(RequestBatch.from_records([_record(self.t0)]),
                                          "vllm", batch_id=7)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.ex.grpc_port}")
        self.export = self.channel.unary_unary(EXPORT)
        self.first = self.export.future(self.payload, timeout=10)
        assert self.inside.wait(5)

    def close(self) -> None:
        self.release.set()
        self.channel.close()
        self.ex.stop(grace=1)


@pytest.fixture
def parked(request):
    p = Parked(request.param)
    yield p
    p.close()


def _retry_delay(e: grpc.RpcError) -> int:
    return error_details_pb2.RetryInfo.FromString(
        dict(e.trailing_metadata())["google.rpc.retryinfo-bin"]).retry_delay.seconds


@pytest.mark.parametrize("parked", [1], indirect=True)
def test_phasewatch_export_unavailable_with_retry_info_then_the_client_gets_through(parked):
    p = parked
    client = PhasewatchClient(f"127.0.0.1:{p.ex.grpc_port}", engine="vllm")
    for _ in range(3):
        client.record_request(_record(p.t0))
    deadline = time.monotonic() + 5
    while not client.stats["retries_unavailable"] and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(grpc.RpcError) as e:
        p.export(p.payload, timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and _retry_delay(e.value) == 1
    p.release.set()
    assert wire.decode_export_response(p.first.result(10)).accepted == 1
    client.close(timeout=10)
    assert client.stats["accepted"] == 3 and client.stats["retries_unavailable"] >= 1
    m = scrape(p.ex.http_port)
    assert m.total("gen_ai_server_request_duration_seconds_count") == 4
    assert m.value("phasewatch_ingest_refused_total", protocol="phasewatch",
                   reason="in_flight") == client.stats["retries_unavailable"] + 1


@pytest.mark.parametrize("parked", [2], indirect=True)
def test_a_batch_resent_while_its_first_attempt_runs_is_told_to_retry(parked):
    p = parked
    with pytest.raises(grpc.RpcError) as e:  # admitted, but its id is still being ingested
        p.export(p.payload, timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and _retry_delay(e.value) == 1
    p.release.set()
    assert wire.decode_export_response(p.first.result(10)).accepted == 1
    again = wire.decode_export_response(p.export(p.payload, timeout=5))
    assert again.duplicate and again.accepted == 1  # the first attempt's counts
    m = scrape(p.ex.http_port)
    assert m.total("gen_ai_server_request_duration_seconds_count") == 1
    assert m.value("phasewatch_ingest_refused_total", protocol="phasewatch",
                   reason="in_progress") == 1
    assert m.value("phasewatch_ingest_batches_total", protocol="phasewatch",
                   outcome="duplicate") == 1
