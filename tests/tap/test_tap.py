"""``phasewatch tap`` between a client and an OpenAI-compatible server.

The server here streams as vLLM's OpenAI server does (``data: {json}`` events, a
final usage chunk with ``stream_options.include_usage``, running usage on every chunk
with ``continuous_usage_stats``, ``data: [DONE]``), with chosen delays, so every
figure the tap reports has a known value; the real vLLM is driven through the tap in
the real-engines tests.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
import ssl
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import replace

import pytest
from aiohttp import web
from multidict import CIMultiDict

from phasewatch import tap as tapmod
from phasewatch.app import Exporter
from phasewatch.client import PhasewatchClient
from phasewatch.config import ServeConfig
from tests.conftest import TEST_PORTS, scrape, wait_for
from tests.support.certs import make_certs
from tests.support.prom import free_port

MODEL = "tiny-llama"
FIRST_DELAY, GAP = 0.30, 0.05


class FakeServer:
    """An OpenAI-style server on its own loop: streams ``tokens`` chunks, the first
    after FIRST_DELAY (or the request's ``first_delay``), then one every GAP
    (``per_chunk`` tokens each); ``stall_after`` chunks it goes silent for ``stall``
    seconds, ``break_after`` chunks it drops the connection. Over HTTPS with
    ``ssl_context``."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None):
        self.ssl_context = ssl_context
        self.seen_headers: list[CIMultiDict] = []  # every header as it came
        self.body_sizes: list[int] = []
        self.asked: list[dict] = []
        self.cancelled = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self) -> FakeServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._up(), self._loop).result(10)
        return self

    async def _up(self):
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/broken", self._broken)
        app.router.add_post("/v1/echo", self._echo)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.ssl_context)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def stop(self):
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _models(self, request):
        self.seen_headers.append(CIMultiDict(request.headers))
        resp = web.json_response({"object": "list", "data": [{"id": MODEL}]})
        resp.set_cookie("session", "of-whoever-asked")
        return resp

    async def _echo(self, request):
        body = await request.read()
        return web.json_response({"size": len(body),
                                  "sha256": hashlib.sha256(body).hexdigest()})

    async def _broken(self, request):
        return web.Response(status=500, text="engine error\n")

    async def _chat(self, request):
        self.seen_headers.append(CIMultiDict(request.headers))
        raw = await request.read()
        self.body_sizes.append(len(raw))
        ask = json.loads(raw)
        self.asked.append(ask)
        first_delay = ask.get("first_delay", FIRST_DELAY)
        tokens, per_chunk = ask.get("max_tokens", 6), ask.get("per_chunk", 1)
        eos_only = ask.get("eos_only", False)  # one token, the end of sequence: no text
        opts = ask.get("stream_options") or {}
        usage = {"prompt_tokens": 12, "completion_tokens": tokens, "total_tokens": 12 + tokens,
                 "prompt_tokens_details": {"cached_tokens": 8}}
        model = ask.get("model") or MODEL  # the served name asked for, as vLLM answers
        if not ask.get("stream"):
            await asyncio.sleep(first_delay)
            return web.json_response({
                "id": "c1", "object": "chat.completion", "model": model, "usage": usage,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                             "finish_reason": "length"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            await asyncio.sleep(first_delay)
            sent = 0
            while sent < tokens:
                if sent == ask.get("stall_after"):
                    await asyncio.sleep(ask["stall"])
                if sent == ask.get("break_after"):  # the server dies mid-answer
                    request.transport.close()
                    return resp
                n = min(per_chunk, tokens - sent)
                sent += n
                chunk = {"id": "c1", "object": "chat.completion.chunk", "model": model,
                         "choices": [{"index": 0,
                                      "delta": {"content": "" if eos_only else "x" * n},
                                      "finish_reason": "length" if sent == tokens else None}]}
                if opts.get("continuous_usage_stats"):
                    chunk["usage"] = {"prompt_tokens": 12, "completion_tokens": sent}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(GAP)
            if ask.get("eos_after"):  # vLLM's stop: the end-of-sequence token, no text
                await resp.write(("data: " + json.dumps({
                    "id": "c1", "object": "chat.completion.chunk", "model": model,
                    "choices": [{"index": 0, "delta": {"content": ""},
                                 "finish_reason": "stop"}]}) + "\n\n").encode())
                usage = {**usage, "completion_tokens": tokens + 1}
            if opts.get("include_usage"):
                final = {"id": "c1", "object": "chat.completion.chunk", "model": model,
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


@pytest.fixture
def make_tap(fake, exporter):
    """Taps over ``fake`` recording to ``exporter``, each with its own client, made with
    Tap's (and TapServer's) keywords and stopped at the end."""
    made = []

    def make(upstream: str | None = None, client: PhasewatchClient | None = None,
             server_kw: dict | None = None, **kw):
        client = client or PhasewatchClient(f"127.0.0.1:{exporter.grpc_port}",
                                            engine="tap", flush_interval=0.05)
        tap = tapmod.Tap(upstream or f"http://127.0.0.1:{fake.port}",
                         tapmod.client_recorder(client), **kw)
        server = tapmod.TapServer(tap, client=client, **(server_kw or {})).start()
        made.append((server, client))
        return tap, server, client

    yield make
    for server, client in made:
        server.stop()
        client.close(timeout=1)


class Got:
    """What a client read of one answer: ``complete`` is False when the answer was cut
    off (a chunked answer without its last chunk)."""

    def __init__(self, status: int, data: bytes, complete: bool, times: list[float]):
        self.status, self.data, self.complete, self.times = status, data, complete, times


def fetch(port: int, body: dict | bytes | None, path="/v1/chat/completions",
          headers: dict | None = None, method="POST", context: ssl.SSLContext | None = None,
          chunked=False) -> Got:
    conn = (http.client.HTTPSConnection("127.0.0.1", port, timeout=30, context=context)
            if context is not None else http.client.HTTPConnection("127.0.0.1", port,
                                                                  timeout=30))
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    if chunked:  # no Content-Length: the body in pieces of 64 KiB
        body = iter([body[i:i + 65536] for i in range(0, len(body), 65536)])
    conn.request(method, path, body=body, encode_chunked=chunked,
                 headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    data, times, complete = b"", [], True
    while True:
        try:
            piece = resp.read1(65536)
        except http.client.IncompleteRead as e:
            data += e.partial
            complete = False
            break
        if not piece:
            break
        data += piece
        times.append(time.time())
    conn.close()
    return Got(resp.status, data, complete, times)


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
    assert wait_for(lambda: tap.counts["completed"] == 1)


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
    got = [h.get("traceparent") for h in fake.seen_headers]
    version, trace, span, flags = got[0].split("-")
    assert (version, trace, flags) == ("00", "0af7651916cd43dd8448eb211c80319c", "01")
    assert span != "b7ad6b7169203331" and len(span) == 16
    fresh = got[1].split("-")
    assert len(fresh[1]) == 32 and fresh[1] != trace
    # the tap's tracestate member, which the engine's span inherits
    assert [h.getall("tracestate") for h in fake.seen_headers] == [["phasewatch=tap"]] * 2


def post_lines(port: int, lines: list[tuple[str, str]]) -> int:
    """A one-token request with these header lines as given (a name may repeat); the
    answer's status, its body read."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = json.dumps({"model": MODEL, "max_tokens": 1}).encode()
    conn.putrequest("POST", "/v1/chat/completions", skip_accept_encoding=True)
    for k, v in (("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                 *lines):
        conn.putheader(k, v)
    conn.endheaders(body)
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status


def test_tracestate_puts_the_taps_member_first_and_keeps_the_callers(fake, tapped):
    """W3C trace context: a vendor's member goes to the left, an older one of its own
    is removed, at most 32 members; the caller's tracestate split over two header lines
    is one list; with a traceparent that does not parse, its tracestate goes too."""
    _, server, _ = tapped
    caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    many = ",".join(f"v{i}=x" for i in range(40))
    for parent, states in ((caller, ["congo=t61rcWkgMzE, phasewatch=old", "rojo=00f067aa"]),
                           (caller, [many]), ("not-a-traceparent", ["congo=t61rcWkgMzE"])):
        assert post_lines(server.port, [("traceparent", parent),
                                        *(("tracestate", s) for s in states)]) == 200
    got = [h.getall("tracestate") for h in fake.seen_headers]
    assert got[0] == ["phasewatch=tap,congo=t61rcWkgMzE,rojo=00f067aa"]
    assert got[1] == [",".join(["phasewatch=tap", *(f"v{i}=x" for i in range(31))])]
    assert got[2] == ["phasewatch=tap"] and fake.seen_headers[2]["traceparent"][3:35] != (
        "0af7651916cd43dd8448eb211c80319c")


def test_a_header_sent_twice_goes_upstream_twice(fake, tapped):
    _, server, _ = tapped
    assert post_lines(server.port, [("X-Tenant", "a"), ("X-Tenant", "b")]) == 200
    assert fake.seen_headers[-1].getall("X-Tenant") == ["a", "b"]


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
            [sys.executable, "-m", "phasewatch.cli", "tap", "--upstream",
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
    # SIGTERM: the tap stops cleanly and logs what it counted
    assert proc.returncode == 0, log.read_text()
    assert ("phasewatch tap stopped: requests: completed 1; aborts: none; records_dropped: "
            "none; unread: none; token_times_dropped: none; records_accepted 1"
            ) in log.read_text(), log.read_text()


@pytest.mark.parametrize("spelling", ["exporter-tls", "tls"])
def test_the_command_with_tls_and_a_token_everywhere(certs, tmp_path, spelling):
    """An exporter requiring mutual TLS and a token, an https upstream with a private
    CA, the tap's own listener and counts over HTTPS: every option through the command
    line (the token from $PHASEWATCH_AUTH_TOKEN). Each TLS flag reaches its side: the
    exporter refuses the tap without the client certificate, clients fail without the
    listener's. Issue 26: the old spellings of TLS to the exporter (--tls-ca, --tls-cert,
    --tls-key: one suffix from the listener's --tls-cert-file) still work, with one
    deprecation line."""
    import os
    import re
    import subprocess
    import sys

    from tests.conftest import terminate

    up_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    up_tls.load_cert_chain(certs.server_cert, certs.server_key)
    upstream = FakeServer(ssl_context=up_tls).start()
    ex = Exporter(replace(ServeConfig(**TEST_PORTS), auth_token=TOKEN,
                          tls_cert_file=certs.server_cert, tls_key_file=certs.server_key,
                          tls_client_ca_file=certs.ca)).start()
    log = tmp_path / "tap.log"
    proc = None
    try:
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "phasewatch.cli", "tap", "--upstream",
                 f"https://127.0.0.1:{upstream.port}", "--upstream-ca", certs.ca,
                 "--port", "0", "--metrics-port", "0", "--target",
                 f"127.0.0.1:{ex.grpc_port}", f"--{spelling}-ca", certs.ca,
                 f"--{spelling}-cert", certs.client_cert, f"--{spelling}-key",
                 certs.client_key,
                 "--tls-cert-file", certs.server_cert, "--tls-key-file", certs.server_key,
                 "--timeout", "30", "--max-body-mib", "1"],
                stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "PHASEWATCH_AUTH_TOKEN": TOKEN})
        found = wait_for(lambda: re.search(
            r"tap on https://127.0.0.1:(\d+).*\n.*counts on https://127.0.0.1:(\d+)/metrics",
            log.read_text()), timeout=30)
        assert found, log.read_text()
        trusting = ssl.create_default_context(cafile=certs.ca)
        got = fetch(int(found[1]), STREAM, context=trusting)
        assert got.status == 200 and got.complete and b"[DONE]" in got.data

        def accepted():
            with urllib.request.urlopen(f"https://127.0.0.1:{found[2]}/metrics",
                                        context=trusting, timeout=10) as r:
                text = r.read().decode()
            return "phasewatch_tap_records_accepted_total 1.0" in text

        assert wait_for(accepted, timeout=15), log.read_text()
        warned = [line for line in log.read_text().splitlines() if "deprecated" in line]
        assert warned == ([] if spelling == "exporter-tls" else [
            "phasewatch tap: warning: --tls-ca, --tls-cert, --tls-key deprecated: use "
            "--exporter-tls-ca, --exporter-tls-cert, --exporter-tls-key (TLS to the "
            "exporter; --tls-cert-file/--tls-key-file are a listener's own)"])
    finally:
        terminate(proc)
        ex.stop(grace=1)
        upstream.stop()


# ---- faults: the client gets what the server gave, and every loss is counted ----------

STREAM = {"model": MODEL, "stream": True, "max_tokens": 6,
          "stream_options": {"include_usage": True}}


def test_a_slow_upstream_is_waited_for_and_its_delay_is_the_ttft(fake, make_tap, exporter):
    """The first byte after 1.2 s, then 30 chunks 50 ms apart: 2.7 s in all, longer than
    the tap's --timeout (1.5 s), which bounds silence, not a stream."""
    tap, server, _ = make_tap(timeout_s=1.5)
    ask = {**STREAM, "max_tokens": 30, "first_delay": 1.2}
    direct = fetch(fake.port, ask)
    through = fetch(server.port, ask)
    assert (through.status, through.data, through.complete) == (200, direct.data, True)
    (row,) = wait_for(lambda: requests_of(exporter))
    assert 1.2 <= row["ttft"] < 1.4 and row["output_tokens"] == 30, row
    assert row["e2e"] > 1.5
    assert wait_for(lambda: tap.counts["completed"] == 1)
    assert not tap.counts["upstream_stalled"]


def test_an_upstream_silent_past_the_timeout_cuts_the_answer_off_and_is_counted(
        fake, make_tap, exporter):
    tap, server, _ = make_tap(timeout_s=0.5)
    ask = {**STREAM, "stall_after": 2, "stall": 3}
    got = fetch(server.port, ask)
    # the two chunks sent, then the answer ends without its last chunk: cut off, as
    # the client can tell, never a clean end the server did not send
    assert got.status == 200 and not got.complete
    assert got.data.count(b"data: ") == 2 and b"[DONE]" not in got.data
    assert wait_for(lambda: tap.counts["upstream_stalled"] == 1 and tap.counts["aborted"] == 1)
    assert fake.cancelled.wait(5), "the upstream request was left open"
    (row,) = wait_for(lambda: requests_of(exporter))
    assert row["finish_reason"] == "abort" and row["ttft"] >= FIRST_DELAY


def test_an_upstream_silent_before_answering_is_a_504_and_counted(fake, make_tap):
    tap, server, _ = make_tap(timeout_s=0.5)
    got = fetch(server.port, {"model": MODEL, "first_delay": 2})
    assert got.status == 504 and b"no answer within 0.5s" in got.data
    assert wait_for(lambda: tap.counts["upstream_timeout"] == 1)
    assert not tap.counts["completed"]


def test_an_upstream_breaking_off_mid_stream_reaches_the_client_as_it_broke(
        fake, make_tap, exporter):
    tap, server, _ = make_tap()
    ask = {**STREAM, "break_after": 2}
    direct = fetch(fake.port, ask)
    through = fetch(server.port, ask)
    assert not direct.complete and direct.data.count(b"data: ") == 2
    assert (through.status, through.data, through.complete) == (200, direct.data, False)
    assert wait_for(lambda: tap.counts["upstream_broke_off"] == 1 and tap.counts["aborted"] == 1)
    (row,) = wait_for(lambda: requests_of(exporter))
    assert row["finish_reason"] == "abort"


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_streamed_through_untimed_and_counted(
        fake, make_tap, exporter, chunked):
    tap, server, client = make_tap(max_body_bytes=4096)
    big = {**STREAM, "max_tokens": 3, "pad": "x" * 300_000}  # > 4 KiB, several pieces
    direct = fetch(fake.port, big)
    through = fetch(server.port, big, chunked=chunked)
    assert (through.status, through.data, through.complete) == (200, direct.data, True)
    assert fake.body_sizes[-1] == fake.body_sizes[-2] == len(json.dumps(big))
    assert wait_for(lambda: tap.counts["body_too_large_untimed"] == 1)
    assert not tap.counts["completed"]
    # one under the limit, in either framing, is timed as ever
    assert fetch(server.port, {**STREAM, "max_tokens": 3}, chunked=chunked).status == 200
    assert wait_for(lambda: len(requests_of(exporter)) == 1)
    assert client.flush(5) and client.stats["accepted"] == 1
    assert tapmod.tallies(tap.counts)["records_dropped"]["body_too_large_untimed"] == 1


def test_other_paths_stream_bodies_of_any_size(fake, make_tap):
    """No 413 from the tap: an upload to an untimed path is never read into memory."""
    tap, server, _ = make_tap(max_body_bytes=1024)
    body = bytes(range(256)) * (3 << 12)  # 3 MiB
    for chunked in (False, True):
        got = fetch(server.port, body, path="/v1/echo", chunked=chunked)
        assert got.status == 200 and json.loads(got.data) == {
            "size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    assert wait_for(lambda: tap.counts["untimed"] == 2) and not tap.counts["body_too_large_untimed"]


def test_the_tap_stopping_mid_stream_records_the_request_as_aborted(fake, make_tap,
                                                                   exporter):
    tap, server, client = make_tap(server_kw={"grace": 0.3})
    got: list[Got] = []
    reader = threading.Thread(target=lambda: got.append(
        fetch(server.port, {**STREAM, "max_tokens": 200})))
    reader.start()
    assert wait_for(lambda: fake.seen_headers)
    time.sleep(FIRST_DELAY + 0.1)  # streaming now
    server.stop()
    reader.join(10)
    assert got and not got[0].complete and got[0].data.count(b"data: ") >= 1
    assert tap.counts["tap_stopped"] == 1 and tap.counts["aborted"] == 1
    assert client.flush(5) and client.stats["accepted"] == 1


# ---- what passes through untouched ------------------------------------------------

def test_the_clients_authorization_and_headers_reach_the_upstream_untouched(fake, make_tap):
    _, server, _ = make_tap()
    key = {"Authorization": "Bearer users-vllm-api-key"}
    assert fetch(server.port, {**STREAM, "max_tokens": 1}, headers=key).status == 200
    assert fetch(server.port, None, path="/v1/models", method="GET", headers=key).status == 200
    assert fetch(server.port, None, path="/v1/models", method="GET").status == 200
    timed, models, anonymous = fake.seen_headers
    for seen in (timed, models):
        assert seen["Authorization"] == "Bearer users-vllm-api-key"
    # nothing added: no User-Agent, Accept or Accept-Encoding of aiohttp's, and the
    # cookie the server set for one client is not replayed for the next
    assert "User-Agent" not in timed and "Accept" not in timed
    assert timed["Accept-Encoding"] == "identity"  # http.client's own
    assert "Authorization" not in anonymous and "Cookie" not in anonymous


def test_the_tap_passes_metrics_and_every_other_path_to_the_upstream(fake, make_tap):
    """The tap's own counts are on --metrics-port, never on a path of the engine's."""
    _, server, _ = make_tap(server_kw={"metrics_port": 0})
    got = fetch(server.port, None, path="/metrics", method="GET")
    assert got.status == 404  # the fake engine has no /metrics: its answer, passed on


# ---- TLS and bearer tokens ----------------------------------------------------------

@pytest.fixture
def certs(tmp_path):
    return make_certs(tmp_path / "certs")


def test_the_tap_serves_https_and_reloads_its_certificate(fake, make_tap, exporter, certs,
                                                          tmp_path, monkeypatch):
    from phasewatch.transport import tls

    monkeypatch.setattr(tls, "CHECK_SECONDS", 0.0)
    listener = tapmod.server_ssl(certs.server_cert, certs.server_key)
    _, server, _ = make_tap(server_kw={"ssl_context": listener})
    trusting = ssl.create_default_context(cafile=certs.ca)
    direct = fetch(fake.port, STREAM)
    through = fetch(server.port, STREAM, context=trusting)
    assert (through.status, through.data) == (200, direct.data)
    assert wait_for(lambda: requests_of(exporter))
    with pytest.raises(ssl.SSLError):  # a client that does not trust the CA
        fetch(server.port, STREAM, context=ssl.create_default_context())
    # renewed certificate files (another CA): new connections get them
    renewed = make_certs(tmp_path / "renewed")
    for name in ("server_cert", "server_key"):
        with open(getattr(certs, name), "wb") as f:
            f.write(renewed.read(name))
    got = fetch(server.port, STREAM, context=ssl.create_default_context(cafile=renewed.ca))
    assert got.status == 200


def test_an_https_upstream_with_a_private_ca(make_tap, certs, exporter):
    up_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    up_tls.load_cert_chain(certs.server_cert, certs.server_key)
    upstream = FakeServer(ssl_context=up_tls).start()
    try:
        url = f"https://127.0.0.1:{upstream.port}"
        direct = fetch(upstream.port, STREAM, context=ssl.create_default_context(
            cafile=certs.ca))
        _, server, _ = make_tap(url, upstream_ca=certs.ca)
        through = fetch(server.port, STREAM)
        assert (through.status, through.data) == (200, direct.data)
        (row,) = wait_for(lambda: requests_of(exporter))
        assert row["ttft"] >= FIRST_DELAY
        # without the CA the upstream's certificate is not trusted: 502, counted
        untrusting, server2, _ = make_tap(url)
        got = fetch(server2.port, STREAM)
        assert got.status == 502 and b"certificate" in got.data.lower()
        assert untrusting.counts["upstream_unreachable"] == 1
    finally:
        upstream.stop()
    with pytest.raises(ValueError, match="upstream-ca"):
        tapmod.Tap(url, None, upstream_ca=str(certs.ca) + ".missing")


TOKEN = "exporter-s3cret"


@pytest.fixture
def exporter_with_token():
    with Exporter(ServeConfig(**TEST_PORTS, auth_token=TOKEN)) as ex:
        yield ex


@pytest.mark.parametrize("token", [TOKEN, "wrong"])
def test_records_to_an_exporter_that_requires_a_token(fake, make_tap, exporter_with_token,
                                                      token):
    client = PhasewatchClient(f"127.0.0.1:{exporter_with_token.grpc_port}", engine="tap",
                              flush_interval=0.05, token=token, source="tap")
    tap, server, _ = make_tap(client=client, server_kw={"metrics_port": 0})
    direct = fetch(fake.port, STREAM)
    for _ in range(2):  # the user's traffic is the same either way
        through = fetch(server.port, STREAM)
        assert (through.status, through.data) == (200, direct.data)
    # recorded as each answer ended, which the client may see a moment before
    assert wait_for(lambda: tap.counts["completed"] == 2)
    client.flush(10)
    m = scrape(server.metrics_port)
    assert m.value("phasewatch_tap_requests_total", outcome="completed") == 2
    if token == TOKEN:
        assert client.stats["accepted"] == 2
        assert m.value("phasewatch_tap_records_accepted_total") == 2
        assert m.value("phasewatch_tap_records_dropped_total", reason="refused") == 0
    else:  # refused (UNAUTHENTICATED, not retried), every record counted as lost
        assert client.stats["dropped_refused"] == 2 and client.stats["accepted"] == 0
        assert m.value("phasewatch_tap_records_dropped_total", reason="refused") == 2
        assert "refused 2" in tapmod.summary(tap.counts, client.stats)


def test_the_metrics_port_counts_every_outcome(fake, make_tap):
    tap, server, client = make_tap(server_kw={"metrics_port": 0})
    assert fetch(server.port, STREAM).status == 200
    assert fetch(server.port, {**STREAM, "model": ""}).status == 200  # named by the answer
    assert fetch(server.port, None, path="/v1/models", method="GET").status == 200
    assert fetch(server.port, {"model": MODEL}, path="/v1/broken").status == 500
    assert fetch(server.port, {**STREAM, "break_after": 1}).status == 200
    assert wait_for(lambda: tap.counts["completed"] + tap.counts["aborted"] == 3)
    assert client.flush(5)
    m = scrape(server.metrics_port)
    # /v1/models and /v1/broken's 500 are untimed paths
    want = {"completed": 2, "aborted": 1, "untimed": 2, "upstream_unreachable": 0}
    for outcome, n in want.items():
        assert m.value("phasewatch_tap_requests_total", outcome=outcome) == n, outcome
    assert m.value("phasewatch_tap_aborts_total", reason="upstream_broke_off") == 1
    assert m.value("phasewatch_tap_records_accepted_total") == 3  # the aborted one too
    assert not any(s.value for s in m.samples
                   if s.name == "phasewatch_tap_records_dropped_total"), m.text


def test_the_tap_inside_phasewatch_serve_records_straight_into_the_join(fake):
    """``phasewatch serve --tap-upstream URL``: the tap in the exporter's process, its
    records handed to the trace join in batches (no gRPC), its counts on /metrics."""
    tap = tapmod.TapConfig(upstream=f"http://127.0.0.1:{fake.port}", port=0, engine="vllm")
    config = replace(ServeConfig(**TEST_PORTS), tap=tap, source_label=True,
                     trace_join_wait=0.5)
    with Exporter(config) as ex:
        body = json.dumps({"model": MODEL, "stream": True, "max_tokens": 4,
                           "stream_options": {"include_usage": True}}).encode()
        for _ in range(3):
            with urllib.request.urlopen(urllib.request.Request(
                    f"http://127.0.0.1:{ex.tap_port}/v1/chat/completions", data=body,
                    headers={"Content-Type": "application/json"}), timeout=10) as r:
                assert b"[DONE]" in r.read()
        s = wait_for(lambda: (lambda sc: sc if sc.total("phasewatch_requests_total") == 3
                              else None)(scrape(ex.http_port)), 10)
        # no engine traces: each counted alone at once, as the tap saw it
        assert s.total("phasewatch_requests_total", engine="vllm", source="tap") == 3
        assert s.value("phasewatch_trace_join_requests_total",
                       outcome="tap_only_no_engine") == 3
        assert s.value("phasewatch_tap_requests_total", outcome="completed") == 3
        assert s.value("phasewatch_tap_records_accepted_total") == 3
        assert s.total("gen_ai_server_time_to_first_token_seconds_sum") >= 3 * FIRST_DELAY
        status = json.loads(urllib.request.urlopen(
            f"http://127.0.0.1:{ex.http_port}/api/v1/status", timeout=5).read())
        assert status["tap_port"] == ex.tap_port


def test_serve_with_its_tap_alone_shows_a_request_at_once_not_after_the_join_wait(
        fake, tmp_path):
    """Issue 26: with no engine tracing behind it, the in-process tap's request reached
    /metrics only after --trace-join-wait (10 s, the default here), waiting for an
    engine span that never came. The real command, its default wait."""
    import re

    from tests.support.serve import ServeProcess

    with ServeProcess(tmp_path, "--tap-upstream", f"http://127.0.0.1:{fake.port}",
                      "--tap-port", "0") as serve:
        tap_port = int(re.search(r"stream tap on http://[^:]+:(\d+)",
                                 serve.log_path.read_text())[1])
        assert fetch(tap_port, STREAM).complete
        answered = time.monotonic()
        s = wait_for(lambda: (lambda sc: sc if sc.total("phasewatch_requests_total")
                              else None)(scrape(serve.http_port)), 12)
        shown = time.monotonic() - answered
        assert s.total("phasewatch_requests_total", model=MODEL) == 1, serve.log_path
        assert shown < 2.0, f"on /metrics {shown:.1f} s after the answer"
        assert s.value("phasewatch_trace_join_requests_total",
                       outcome="tap_only_no_engine") == 1


LLAMA_HF = "meta-llama/Llama-3.1-8B-Instruct"


@pytest.mark.parametrize(("flags", "label"), [
    ({"model": "Llama-3.1-8B", "served_model_name": LLAMA_HF}, LLAMA_HF),
    ({"model": "Llama-3.1-8B"}, "Llama-3.1-8B"),  # vLLM serves the HF id all the same
])
def test_one_model_is_one_label_set_from_the_tap_otlp_and_grpc(fake, flags, label):
    """Issue 26: the tap's series carried the served name, the same model's vLLM spans
    (no model attribute) the configured --model: one model, two label sets, the
    roofline on one of them. Every name of the configured model is now its served name
    (--served-model-name, else --model), from every receiver."""
    from phasewatch.requests.record import RequestRecord
    from phasewatch.roofline.deployments import ModelOptions
    from phasewatch.sim.otlp_shapes import OtlpSink

    now = time.time()
    times = dict(arrival=now - 1.0, queued=now - 0.98, scheduled=now - 0.9,
                 first_token=now - 0.7, last_token=now - 0.1, finish=now - 0.099,
                 prompt_tokens=12, output_tokens=8)

    tap = tapmod.TapConfig(upstream=f"http://127.0.0.1:{fake.port}", port=0, engine="vllm")
    config = replace(ServeConfig(**TEST_PORTS), tap=tap, source_label=True,
                     model_flags=ModelOptions(hardware="H100-SXM", **flags))
    with Exporter(config) as ex:
        # a client of vLLM asks for the name vLLM serves; no engine traces yet, so its
        # record is counted at once (before the span below: a tracing engine would
        # make it wait for its own span)
        assert fetch(ex.tap_port, {**STREAM, "model": LLAMA_HF}).complete
        assert wait_for(lambda: scrape(ex.http_port).total("phasewatch_requests_total"), 5)
        sink = OtlpSink("otlp-grpc", f"127.0.0.1:{ex.otlp_grpc_port}", "vllm")
        sink.record_request(RequestRecord("", **times))  # vLLM V1's span: no model
        assert sink.close()
        client = PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine="vllm",
                                  flush_interval=0.05)
        client.record("llama-3.1-8b", **times)  # one of the catalog's names for it
        client.close()
        s = wait_for(lambda: (lambda sc: sc if sc.total("phasewatch_requests_total") == 3
                              else None)(scrape(ex.http_port)), 10)
        models = {x.labels["model"] for x in s.samples
                  if x.name == "phasewatch_requests_total" and x.value}
        sources = {x.labels["source"] for x in s.samples
                   if x.name == "phasewatch_requests_total" and x.value}
        assert (models, sources) == ({label}, {"tap", "engine"})

        def roofline():
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{ex.http_port}/api/v1/roofline", timeout=5) as r:
                return [m for m in json.load(r)["models"] if m["configured"]]
        rows = wait_for(roofline, 10)
        assert {m["model"] for m in rows} == {label}
        assert {m["deployment"]["model"] for m in rows} == {"Llama-3.1-8B"}
        # the JSON API answers a query by any of the model's names, as it labels requests
        for alias in ("llama-3.1-8b", LLAMA_HF):
            q = urllib.parse.quote(alias)
            with urllib.request.urlopen(f"http://127.0.0.1:{ex.http_port}/api/v1/roofline"
                                        f"?model={q}", timeout=5) as r:
                assert {m["model"] for m in json.load(r)["models"]} == {label}, alias
            with urllib.request.urlopen(f"http://127.0.0.1:{ex.http_port}/api/v1/requests"
                                        f"?model={q}", timeout=5) as r:
                assert len(json.load(r)["requests"]) == 3, alias


def test_ask_usage_gets_the_token_counts_and_keeps_the_clients_stream_as_it_asked(
        fake, make_tap, exporter):
    _, server, _ = make_tap(ask_usage=True)
    ask = {"model": MODEL, "stream": True, "max_tokens": 5}  # no stream_options
    _, direct, _ = post(fake.port, ask)
    status, through, _ = post(server.port, ask)
    assert status == 200 and through == direct and b'"usage"' not in through
    (row,) = wait_for(lambda: requests_of(exporter))
    assert (row["prompt_tokens"], row["cached_prompt_tokens"], row["output_tokens"]) == (
        12, 8, 5)
    assert fake.asked[-1]["stream_options"] == {"include_usage": True}  # the tap asked
    # a client that asked for the usage itself gets it, as before
    with_usage = {**ask, "stream_options": {"include_usage": True}}
    assert post(server.port, with_usage)[1] == post(fake.port, with_usage)[1]


def test_usage_filter_passes_every_other_event_whole_and_in_order():
    f = tapmod.UsageFilter()
    events = [b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n',
              b'data: {"choices": [], "usage": {"prompt_tokens": 3}}\n\n',
              b": a comment\n\n", b"data: [DONE]\n\n"]
    stream = b"".join(events)
    out = b"".join(f.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)) + f.rest()
    assert out == events[0] + events[2] + events[3]


def test_a_request_the_http_parser_refuses_is_counted_and_logged_in_one_line(fake, make_tap,
                                                                             caplog):
    """2,000 headers: aiohttp answers 400 before the tap's handler runs; the tap counts
    it (outcome bad_request) and logs one line, no traceback (issue 30)."""
    import logging
    import socket

    tap, server, _ = make_tap()
    with caplog.at_level(logging.INFO):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            headers = "".join(f"X-H{i}: v\r\n" for i in range(2000))
            s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n{headers}"
                      "Content-Length: 2\r\n\r\n{}".encode())
            assert s.recv(64).split(b" ")[1] == b"400"
        assert wait_for(lambda: tap.counts.get("bad_request") == 1, timeout=10)
    records = [r for r in caplog.records if "could not be read as HTTP" in r.getMessage()]
    assert len(records) == 1 and records[0].exc_info is None
    assert "Too many headers" in records[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    status, _, _ = post(server.port, {"model": MODEL, "stream": True, "max_tokens": 2})
    assert status == 200  # the next client is served


def test_aiohttps_own_debug_lines_are_no_outcome():
    """Only a request the parser refused is counted; aiohttp's debug lines (its loop in
    debug mode: "Ignored premature client disconnection") are passed on, not counted."""
    from collections import Counter

    from aiohttp.http_exceptions import BadHttpMethod

    from phasewatch.tap.server import ServerLog

    counts = Counter()
    log = ServerLog(counts)
    log.debug("Ignored premature client disconnection")
    log.debug("Error handling request from %s", "192.0.2.1", exc_info=BadHttpMethod("\x16"))
    assert dict(counts) == {"bad_request": 1}
