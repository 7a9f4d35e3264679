"""``phasewatch tap`` between a client and an OpenAI-compatible server.

The server here streams as vLLM's OpenAI server does (``data: {json}`` events, a
final usage chunk with ``stream_options.include_usage``, running usage on every chunk
with ``continuous_usage_stats``, ``data: [DONE]``), with chosen delays, so every
figure the tap reports has a known value; the real vLLM is driven through the tap in
the real-engines tests.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
import urllib.request

import pytest
from aiohttp import web

from exporter import tap as tapmod
from exporter.client import PhasewatchClient
from tests.conftest import scrape, wait_for
from tests.prom import free_port

MODEL = "tiny-llama"
FIRST_DELAY, GAP = 0.30, 0.05


class FakeServer:
    """An OpenAI-style server on its own loop: streams ``tokens`` chunks, the first
    after FIRST_DELAY, then one every GAP (``per_chunk`` tokens each)."""

    def __init__(self):
        self.seen_headers: list[dict] = []
        self.cancelled = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self) -> FakeServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._up(), self._loop).result(10)
        return self

    async def _up(self):
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/broken", self._broken)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def stop(self):
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    async def _broken(self, request):
        return web.Response(status=500, text="engine error\n")

    async def _chat(self, request):
        self.seen_headers.append(dict(request.headers))
        ask = await request.json()
        tokens, per_chunk = ask.get("max_tokens", 6), ask.get("per_chunk", 1)
        eos_only = ask.get("eos_only", False)  # one token, the end of sequence: no text
        opts = ask.get("stream_options") or {}
        usage = {"prompt_tokens": 12, "completion_tokens": tokens, "total_tokens": 12 + tokens,
                 "prompt_tokens_details": {"cached_tokens": 8}}
        if not ask.get("stream"):
            await asyncio.sleep(FIRST_DELAY)
            return web.json_response({
                "id": "c1", "object": "chat.completion", "model": MODEL, "usage": usage,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                             "finish_reason": "length"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            await asyncio.sleep(FIRST_DELAY)
            sent = 0
            while sent < tokens:
                n = min(per_chunk, tokens - sent)
                sent += n
                chunk = {"id": "c1", "object": "chat.completion.chunk", "model": MODEL,
                         "choices": [{"index": 0,
                                      "delta": {"content": "" if eos_only else "x" * n},
                                      "finish_reason": "length" if sent == tokens else None}]}
                if opts.get("continuous_usage_stats"):
                    chunk["usage"] = {"prompt_tokens": 12, "completion_tokens": sent}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(GAP)
            if ask.get("eos_after"):  # vLLM's stop: the end-of-sequence token, no text
                await resp.write(("data: " + json.dumps({
                    "id": "c1", "object": "chat.completion.chunk", "model": MODEL,
                    "choices": [{"index": 0, "delta": {"content": ""},
                                 "finish_reason": "stop"}]}) + "\n\n").encode())
                usage = {**usage, "completion_tokens": tokens + 1}
            if opts.get("include_usage"):
                final = {"id": "c1", "object": "chat.completion.chunk", "model": MODEL,
                         "choices": [], "usage": usage}
                await resp.write(f"data: {json.dumps(final)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled.set()
            raise
        return resp


@pytest.fixture
def fake():
    server = FakeServer().start()
    yield server
    server.stop()


@pytest.fixture
def tapped(fake, exporter):
    client = PhasewatchClient(f"127.0.0.1:{exporter.grpc_port}", engine="tap",
                              flush_interval=0.05)
    tap = tapmod.Tap(f"http://127.0.0.1:{fake.port}", tapmod.client_recorder(client))
    server = tapmod.TapServer(tap).start()
    yield tap, server, client
    server.stop()
    client.close()


def post(port: int, body: dict, headers: dict | None = None, path="/v1/chat/completions",
         read_bytes: int | None = None) -> tuple[int, bytes, list[float]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, body=json.dumps(body),
                 headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    data, times = b"", []
    while True:
        piece = resp.read1(65536) if read_bytes is None else resp.read1(read_bytes)
        if not piece:
            break
        data += piece
        times.append(time.time())
        if read_bytes is not None:
            break
    conn.close()
    return resp.status, data, times


def requests_of(exporter) -> list[dict]:
    with urllib.request.urlopen(
            f"http://127.0.0.1:{exporter.http_port}/api/v1/requests?limit=50") as r:
        return json.load(r)["requests"]


def test_a_stream_passes_byte_for_byte_and_is_timed_as_the_client_sees_it(fake, tapped,
                                                                          exporter):
    tap, server, _ = tapped
    ask = {"model": MODEL, "stream": True, "max_tokens": 6,
           "stream_options": {"include_usage": True}}
    _, direct, _ = post(fake.port, ask)
    t0 = time.time()
    status, through, _ = post(server.port, ask)
    assert status == 200 and through == direct
    rows = wait_for(lambda: requests_of(exporter))
    (row,) = rows
    assert row["model"] == MODEL and row["finish_reason"] == "length"
    assert row["prompt_tokens"] == 12 and row["output_tokens"] == 6
    assert row["cached_prompt_tokens"] == 8
    assert FIRST_DELAY <= row["ttft"] < FIRST_DELAY + 0.2, row
    assert row["arrival"] >= t0
    # six emissions, five gaps of ~GAP: TPOT over them
    assert row["tpot"] == pytest.approx(GAP, abs=0.03)
    m = scrape(exporter.http_port)
    assert m.total("phasewatch_inter_token_latency_seconds_count", model=MODEL) == 5
    assert tap.counts["completed"] == 1


def test_tokens_per_emission_from_the_servers_running_usage(fake, tapped, exporter):
    _, server, _ = tapped
    ask = {"model": MODEL, "stream": True, "max_tokens": 9, "per_chunk": 3,
           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert post(server.port, ask)[0] == 200
    assert wait_for(lambda: requests_of(exporter))
    m = scrape(exporter.http_port)
    assert m.total("phasewatch_inter_token_latency_seconds_count", model=MODEL) == 2
    # two gaps, each ending a 3-token chunk: 6 per-token values of ~GAP/3
    assert m.total("phasewatch_inter_token_latency_per_token_seconds_count",
                   model=MODEL) == 6
    mean = (m.total("phasewatch_inter_token_latency_per_token_seconds_sum", model=MODEL)
            / 6)
    assert mean == pytest.approx(GAP / 3, abs=0.01)


def test_an_output_of_only_the_end_of_sequence_token_has_a_first_token(fake, tapped,
                                                                       exporter):
    _, server, _ = tapped
    ask = {"model": MODEL, "stream": True, "max_tokens": 1, "eos_only": True,
           "stream_options": {"include_usage": True}}
    assert post(server.port, ask)[0] == 200
    (row,) = wait_for(lambda: requests_of(exporter))
    assert row["output_tokens"] == 1 and row["ttft"] >= FIRST_DELAY


def test_a_text_less_stop_chunk_is_the_end_of_sequence_tokens_emission(fake, tapped,
                                                                        exporter):
    """As vLLM streams a stop: 4 tokens of text, then the end-of-sequence token in a
    chunk with no text; usage says 5 tokens. 5 emissions, 4 gaps (vLLM's ITL count)."""
    _, server, _ = tapped
    ask = {"model": MODEL, "stream": True, "max_tokens": 4, "eos_after": True,
           "stream_options": {"include_usage": True}}
    assert post(server.port, ask)[0] == 200
    (row,) = wait_for(lambda: requests_of(exporter))
    assert (row["output_tokens"], row["finish_reason"]) == (5, "stop")
    m = scrape(exporter.http_port)
    assert m.total("phasewatch_inter_token_latency_seconds_count", model=MODEL) == 4
    # one token per emission, so per token is per emission
    assert m.total("phasewatch_inter_token_latency_per_token_seconds_count", model=MODEL) == 4


def test_traceparent_is_injected_keeping_the_callers_trace(fake, tapped):
    _, server, _ = tapped
    caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    post(server.port, {"model": MODEL, "max_tokens": 1}, {"traceparent": caller})
    post(server.port, {"model": MODEL, "max_tokens": 1})
    got = [h.get("Traceparent") or h.get("traceparent") for h in fake.seen_headers]
    version, trace, span, flags = got[0].split("-")
    assert (version, trace, flags) == ("00", "0af7651916cd43dd8448eb211c80319c", "01")
    assert span != "b7ad6b7169203331" and len(span) == 16
    fresh = got[1].split("-")
    assert len(fresh[1]) == 32 and fresh[1] != trace


def test_a_non_streamed_answer_is_one_emission(fake, tapped, exporter):
    _, server, _ = tapped
    status, body, _ = post(server.port, {"model": MODEL, "max_tokens": 4})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4
    (row,) = wait_for(lambda: requests_of(exporter))
    assert row["output_tokens"] == 4 and row["ttft"] >= FIRST_DELAY
    assert row["e2e"] >= row["ttft"]


def test_other_paths_and_error_answers_pass_through_untimed(fake, tapped, exporter):
    tap, server, _ = tapped
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/v1/models")
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())["data"][0]["id"] == MODEL
    conn.close()
    status, body, _ = post(server.port, {"model": MODEL}, path="/v1/broken")
    assert (status, body) == (500, b"engine error\n")
    time.sleep(0.3)
    assert requests_of(exporter) == []
    assert tap.counts["completed"] == 0


def test_a_client_hanging_up_mid_stream_stops_the_upstream_and_is_counted(fake, tapped,
                                                                           exporter):
    tap, server, _ = tapped
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(
        {"model": MODEL, "stream": True, "max_tokens": 200}),
        headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.read1(100)  # the first chunk arrived
    conn.sock.close()  # the client goes away
    conn.close()
    assert fake.cancelled.wait(10), "the upstream kept generating"
    assert wait_for(lambda: tap.counts["client_disconnected"] == 1)
    (row,) = wait_for(lambda: requests_of(exporter))
    assert row["finish_reason"] == "abort"


def test_upstream_down_is_a_502_and_counted(exporter):
    tap = tapmod.Tap(f"http://127.0.0.1:{free_port()}", lambda *a: None)
    server = tapmod.TapServer(tap).start()
    try:
        status, body, _ = post(server.port, {"model": MODEL, "stream": True})
        assert status == 502 and b"phasewatch tap: upstream" in body
        assert tap.counts["upstream_unreachable"] == 1
    finally:
        server.stop()


def test_exporter_down_never_touches_the_users_traffic(fake):
    client = PhasewatchClient(f"127.0.0.1:{free_port()}", engine="tap", flush_interval=0.05)
    tap = tapmod.Tap(f"http://127.0.0.1:{fake.port}", tapmod.client_recorder(client))
    server = tapmod.TapServer(tap).start()
    try:
        ask = {"model": MODEL, "stream": True, "max_tokens": 3}
        _, direct, _ = post(fake.port, ask)
        for _ in range(3):
            status, through, _ = post(server.port, ask)
            assert status == 200 and through == direct
        # recorded as each response ended, held by the client for an exporter that is away
        assert wait_for(lambda: tap.counts["completed"] == 3)
        assert wait_for(lambda: client.pending() == 3), client.stats
    finally:
        server.stop()
        client.close(timeout=0.5)
    assert client.stats["dropped_shutdown"] == 3  # never silently lost: counted


def test_the_command_serves_and_records(fake, exporter, tmp_path):
    import re
    import subprocess
    import sys

    from tests.conftest import terminate

    log = tmp_path / "tap.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "exporter.cli", "tap", "--upstream",
             f"http://127.0.0.1:{fake.port}", "--port", "0", "--target",
             f"127.0.0.1:{exporter.grpc_port}"], stdout=out, stderr=subprocess.STDOUT)
    try:
        found = wait_for(lambda: re.search(r"tap on http://127.0.0.1:(\d+)", log.read_text()),
                         timeout=30)
        assert found, log.read_text()
        status, _, _ = post(int(found[1]), {"model": MODEL, "stream": True, "max_tokens": 3})
        assert status == 200
        (row,) = wait_for(lambda: requests_of(exporter), timeout=15)
        assert row["engine"] == "tap" and row["ttft"] >= FIRST_DELAY
    finally:
        terminate(proc)
