"""The client library against a real exporter that is down, then comes up."""

import time

from phasewatch.app import Exporter
from phasewatch.client import PhasewatchClient
from phasewatch.config import ServeConfig
from tests.conftest import scrape
from tests.support.prom import free_port

T = 1_700_000_000.0


def record(client, i):
    return client.record("m", arrival=T, scheduled=T + 0.01, first_token=T + 0.1,
                         last_token=T + 0.2, finish=T + 0.21, prompt_tokens=10,
                         output_tokens=3, token_times=[T + 0.1, T + 0.15, T + 0.2],
                         request_id=f"r{i}")


def test_exporter_down_then_up_nothing_lost_drops_counted():
    port = free_port()
    client = PhasewatchClient(f"127.0.0.1:{port}", engine="e", max_buffer=5,
                              flush_interval=0.05, initial_backoff=0.05, max_backoff=0.2)
    try:
        # The first flush takes the buffer and starts retrying; then the buffer refills.
        assert all(record(client, i) for i in range(5))
        deadline = time.monotonic() + 5
        while client.stats["retries"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.stats["retries"] > 0  # it is retrying UNAVAILABLE, not giving up
        results = [record(client, i) for i in range(5, 13)]
        assert results == [True] * 5 + [False] * 3  # bounded buffer: three dropped
        assert client.stats["dropped_buffer_full"] == 3

        exporter = Exporter(ServeConfig(grpc_port=port, http_port=0,
                                        http_host="127.0.0.1")).start()
        try:
            assert client.flush(15)
            m = scrape(exporter.http_port)
            assert m.total("gen_ai_server_request_duration_seconds_count") == 10
            assert m.value("phasewatch_ingest_dropped_total", reason="sender_buffer_full") == 3
        finally:
            exporter.stop(1)
    finally:
        client.close(timeout=1)


def test_close_flushes_and_is_idempotent(exporter):
    client = PhasewatchClient(f"127.0.0.1:{exporter.grpc_port}", engine="e",
                              flush_interval=10.0)  # only close() will flush
    for i in range(50):
        record(client, i)
    client.close()
    client.close()
    assert client.stats["accepted"] == 50
    assert not record(client, 99)  # closed: refused and counted, not silently lost
    assert client.stats["dropped_closed"] == 1


def test_a_full_batch_is_sent_without_waiting_for_the_flush_interval(exporter):
    """``flush_rows`` requests waiting wake the sender at once: at a high rate rows
    leave before the serving process's garbage collector has to walk them again."""
    client = PhasewatchClient(f"127.0.0.1:{exporter.grpc_port}", engine="e",
                              flush_interval=60.0, flush_rows=8)
    try:
        for i in range(7):
            record(client, i)
        time.sleep(0.3)
        assert client.pending() == 7  # below flush_rows: they wait for the interval
        record(client, 7)
        deadline = time.monotonic() + 5
        while client.stats["accepted"] < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.stats["accepted"] == 8 and client.pending() == 0
        assert scrape(exporter.http_port).total(
            "gen_ai_server_request_duration_seconds_count") == 8
    finally:
        client.close()


def test_close_gives_up_at_its_deadline_when_the_exporter_never_comes():
    client = PhasewatchClient(f"127.0.0.1:{free_port()}", flush_interval=0.05,
                              initial_backoff=0.05, max_backoff=0.1)
    for i in range(3):
        record(client, i)
    t0 = time.monotonic()
    client.close(timeout=0.5)
    assert time.monotonic() - t0 < 3
    assert client.stats["dropped_shutdown"] == 3


def test_buffered_token_times_are_bounded_too(exporter):
    """Requests carrying token times fill the buffer by tokens (max_buffer_tokens) before
    they fill it by count; past that record() drops and counts, and what was kept all
    arrives."""
    client = PhasewatchClient(f"127.0.0.1:{exporter.grpc_port}", engine="e",
                              flush_interval=10.0, max_buffer_tokens=3 * 40)
    kept = [record(client, i) for i in range(45)]  # 3 token times each
    assert kept == [True] * 40 + [False] * 5
    assert client.stats["dropped_buffer_full"] == 5
    client.close()
    assert client.stats["accepted"] == 40
    m = scrape(exporter.http_port)
    assert m.total("phasewatch_inter_token_latency_seconds_count") == 80
    assert m.value("phasewatch_ingest_dropped_total", reason="sender_buffer_full") == 5
