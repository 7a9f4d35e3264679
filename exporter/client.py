"""Client library: what an inference server (or a test) uses to send finished requests.

``record()`` only appends a tuple to a list under a lock, so it never blocks the
serving thread on the network; when the buffer is full the request is dropped
and counted, and the count travels to the exporter (``sender_dropped``) so the
loss shows on ``/metrics``. A background thread flushes about every 250 ms in
columnar ``Export`` batches, retrying retryable failures with exponential
backoff and full jitter, each batch keeping its id so the exporter counts a
retried batch once. ``close()`` flushes what is left within a deadline.

    client = PhasewatchClient("localhost:50051", engine="vllm")
    client.record("Llama-3.1-8B", arrival=t0, scheduled=t1, first_token=t2,
                  last_token=t3, finish=t4, prompt_tokens=812, output_tokens=128,
                  token_times=emission_times, token_counts=tokens_per_emission,
                  finish_reason="stop")
    client.close()
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Sequence

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2

from phasewatch.ingest import wire
from phasewatch.requests.record import SOURCES, RequestBatch, RequestRecord
from phasewatch.transport import auth
from phasewatch.transport.grpc import MAX_MESSAGE_BYTES
from phasewatch.transport.tls import ClientTls

log = logging.getLogger(__name__)
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}


def _retry_delay(e: grpc.RpcError) -> float | None:
    """The ``google.rpc.RetryInfo`` delay the exporter attached to an error, if any."""
    try:
        raw = dict(e.trailing_metadata() or ()).get("google.rpc.retryinfo-bin")
    except Exception:  # not a call error (e.g. a channel that never connected)
        return None
    if raw is None:
        return None
    try:
        d = error_details_pb2.RetryInfo.FromString(raw).retry_delay
    except DecodeError:
        return None
    return max(0.0, d.seconds + d.nanos / 1e9)


def _hand_over() -> None:
    """Let a thread waiting for the GIL (the serving thread's ``record()``) in.
    ``sched_yield`` releases the GIL for a syscall of ~0.5 us; ``time.sleep(0)`` would
    too, but sleeps out the kernel's timer slack (~70 us here) every time."""
    os.sched_yield()


def _columns(rows: list[tuple]) -> tuple[RequestBatch, int]:
    """The rows as columns, leaving out (and counting) rows that cannot be encoded: a
    name that is not a string, a count that is not an integer or overflows the wire, a
    time that is not a number.
    The fast path converts all rows at once, handing the GIL over between pieces (a
    batch's token times in one piece would stall ``record()`` for milliseconds); only
    a failing batch is sorted row by row."""
    def fits(rows) -> RequestBatch | None:
        try:
            batch = RequestBatch.from_rows(rows, pause=_hand_over)
        except (TypeError, ValueError, OverflowError):
            return None
        if wire.encodable(batch).all() and all(isinstance(x, str) for x in batch.strings):
            return batch
        return None

    batch = fits(rows)
    if batch is not None:
        return batch, 0
    good = [row for row in rows if fits([row]) is not None]
    return RequestBatch.from_rows(good), len(rows) - len(good)


class PhasewatchClient:
    def __init__(self, target: str, engine: str = "", *, flush_interval: float = 0.25,
                 flush_rows: int = 512, max_buffer: int = 100_000,
                 max_buffer_tokens: int = 2_000_000, max_batch: int = 2000,
                 timeout: float = 5.0,
                 initial_backoff: float = 0.1, max_backoff: float = 5.0,
                 channel: grpc.Channel | None = None, token: str = "", tls_ca: str = "",
                 tls_cert: str = "", tls_key: str = "", source: str = "engine"):
        """``token``: the exporter's ``--auth-token``, sent as ``authorization: Bearer``
        metadata (a wrong one is refused with UNAUTHENTICATED and not retried).
        ``tls_ca``: PEM file of the CA that signed the exporter's certificate (TLS);
        ``tls_cert`` / ``tls_key``: this client's certificate and key (mutual TLS).
        ``max_buffer`` requests and ``max_buffer_tokens`` token emission times may wait
        to be sent (a Python float in a list takes 32 bytes: 2M is ~64 MB; a batch being
        retried holds as much again); past either, ``record()`` drops and counts.
        The sender sends every ``flush_interval`` seconds, and as soon as ``flush_rows``
        requests wait: at a high rate rows then leave before the serving process's
        garbage collector promotes them (held 0.25 s at 10k req/s, their token lists
        cost ~60 ms of collections a second on the serving thread; sent every 512 rows,
        almost none).
        ``source``: "engine" (the server's own instrumentation) or "tap" (a proxy in
        front of it timing what the client sees; ``phasewatch tap`` sets it)."""
        if (flush_interval <= 0 or flush_rows < 1 or max_buffer < 1 or max_batch < 1
                or max_buffer_tokens < 1):
            raise ValueError("flush_interval, flush_rows, max_buffer, max_buffer_tokens and "
                             "max_batch must be positive")
        if source not in ("engine", "tap"):
            raise ValueError(f"source must be 'engine' or 'tap', got {source!r}")
        self.target, self.engine = target, engine
        self._source = SOURCES.index(source)
        self._flush_interval, self._max_buffer, self._max_batch = (
            flush_interval, max_buffer, max_batch)
        self._max_tokens, self._buffered_tokens = max_buffer_tokens, 0
        self._flush_rows = flush_rows
        self._timeout, self._backoff0, self._backoff_max = timeout, initial_backoff, max_backoff
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        if channel is None and (tls_ca or tls_cert):
            channel = grpc.secure_channel(
                target, ClientTls(tls_ca, tls_cert, tls_key).grpc_credentials(),
                options=options)
        self._channel = channel or grpc.insecure_channel(target, options=options)
        self._export = self._channel.unary_unary(f"/{wire.SERVICE}/Export")
        self._metadata = ((auth.HEADER, auth.bearer(token)),) if token else None
        self._lock = threading.Lock()
        self._buffer: list[tuple] = []
        self._dropped_unreported = self._invalid_unreported = 0
        self._in_flight = 0
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._closed = False  # _closing as a plain attribute, for record()'s fast path
        self._deadline = float("inf")
        self._abandoned = False
        self._interrupt = threading.Event()
        # sent, accepted, rejected, retries (and retries_<grpc code>), dropped_<reason>
        self.stats: Counter = Counter()
        self._thread = threading.Thread(target=self._run, name="phasewatch-client",
                                        daemon=True)
        self._thread.start()

    # ---- serving thread ------------------------------------------------------
    def record(self, model: str, *, arrival: float | None = None,
               queued: float | None = None, scheduled: float | None = None,
               first_token: float | None = None,
               last_token: float | None = None, finish: float | None = None,
               prompt_tokens: int | None = None, cached_prompt_tokens: int | None = None,
               output_tokens: int | None = None, finish_reason: str = "",
               request_id: str = "", token_times: Sequence[float] | None = None,
               token_counts: Sequence[int] | None = None, trace_parent: str = "",
               choice: int = 0) -> bool:
        """Queue one finished request (times in Unix seconds). False if it was dropped.

        ``arrival``: the request reached the server; ``queued`` (optional): the engine
        took it in after templating and tokenisation (preprocess = queued - arrival);
        ``scheduled``: it left the engine's queue.

        ``token_times``: one time per **emission**, the first token's first: each
        streamed chunk (SSE event) as the client saw it, or each token where tokens are
        sent one by one. ITL is the gaps between emissions, pooled (vLLM's benchmark
        ``itl``). ``token_counts`` (optional, one per emission): the tokens each carried
        (multi-token chunks, speculative decoding); with them ITL is also reported per
        token (each gap spread over the tokens of the emission it ends). Counts that do
        not fit the emissions or the output tokens reject the request (counted).

        ``trace_parent`` ("<trace id>-<span id>", hex): the W3C traceparent sent to the
        engine with the request, so the exporter can join this record with the engine's
        span. ``choice``: the sequence of a request with n > 1 (> 0 shares the prompt)."""
        row = (model, "", finish_reason, request_id, arrival, queued, scheduled, first_token,
               last_token, finish, prompt_tokens, cached_prompt_tokens, output_tokens,
               token_times, token_counts, trace_parent, choice)  # record.ROW_FIELDS order
        try:
            tokens = len(token_times) if token_times is not None else 0
        except TypeError:  # not a sequence: the sender counts the row as invalid
            tokens = 0
        with self._lock:
            if (len(self._buffer) >= self._max_buffer or self._closed
                    or self._buffered_tokens + tokens > self._max_tokens):
                self._dropped_unreported += 1
                self.stats["dropped_closed" if self._closed else "dropped_buffer_full"] += 1
                return False
            self._buffer.append(row)
            self._buffered_tokens += tokens
            if len(self._buffer) == self._flush_rows:
                self._wake.set()
        return True

    def record_request(self, r: RequestRecord) -> bool:
        """Queue a ``RequestRecord`` (its engine is ignored: the client's engine applies)."""
        return self.record(r.model, arrival=r.arrival, queued=r.queued, scheduled=r.scheduled,
                           first_token=r.first_token, last_token=r.last_token,
                           finish=r.finish, prompt_tokens=r.prompt_tokens,
                           cached_prompt_tokens=r.cached_prompt_tokens,
                           output_tokens=r.output_tokens, finish_reason=r.finish_reason,
                           request_id=r.request_id, token_times=r.token_times,
                           token_counts=r.token_counts, trace_parent=r.trace_parent,
                           choice=r.choice)

    # ---- background ----------------------------------------------------------
    def _run(self) -> None:
        while True:
            closing = self._closing.is_set()
            self._wake.wait(self._flush_interval)
            self._wake.clear()
            with self._lock:
                rows, self._buffer = self._buffer, []
                self._in_flight = len(rows)
                self._buffered_tokens = 0
            for start in range(0, len(rows), self._max_batch):
                chunk = rows[start:start + self._max_batch]
                self._send(chunk)  # settles every row of the chunk
                if self._abandoned:
                    return
            if closing and not rows:
                with self._lock:
                    unreported = self._dropped_unreported + self._invalid_unreported
                if unreported and time.monotonic() < self._deadline:
                    self._send([])  # an empty batch carries the last drop count
                return

    def _send(self, rows: list[tuple]) -> None:
        batch, invalid = _columns(rows)
        if invalid:
            self._settle(invalid, dropped_invalid=invalid)
            log.warning("dropped %d requests whose names, times or counts cannot be "
                        "encoded", invalid)
        with self._lock:
            dropped, self._dropped_unreported = self._dropped_unreported, 0
            invalid += self._invalid_unreported
            self._invalid_unreported = 0
        batch_id = wire.new_batch_id()
        payload = wire.encode_export(batch, self.engine, batch_id, dropped, invalid,
                                     self._source)
        attempt = 0
        while True:
            if self._abandoned:  # close() gave up waiting and counted these itself
                return
            try:
                reply = wire.decode_export_response(
                    self._export(payload, timeout=self._timeout, metadata=self._metadata))
                self._settle(len(batch), sent=len(batch), accepted=reply.accepted,
                             rejected=reply.rejected)
                return
            except ValueError:  # "Cannot invoke RPC on closed channel": close() raced us
                if not self._abandoned:
                    raise
                return
            except grpc.RpcError as e:
                code = e.code()
                if code not in RETRYABLE:
                    self._settle(len(batch), dropped_refused=len(batch))
                    log.warning("exporter refused a batch of %d requests: %s %s",
                                len(rows), code, e.details())
                    return
                hint = _retry_delay(e)
                self.stats[f"retries_{code.name.lower()}"] += 1
            delay = random.uniform(0, min(self._backoff_max, self._backoff0 * 2 ** attempt))
            if hint is not None:  # the exporter said when (RetryInfo): at least that long
                delay = hint * random.uniform(1.0, 1.5)
            attempt += 1
            self.stats["retries"] += 1
            if time.monotonic() + delay > self._deadline:
                if self._settle(len(batch), dropped_shutdown=len(batch)):
                    with self._lock:  # still unreported: the exporter never saw these
                        self._dropped_unreported += dropped
                        self._invalid_unreported += invalid
                return
            if self._interrupt.wait(delay):  # close() began: look at its deadline now
                self._interrupt.clear()

    def _settle(self, rows: int, **counts: int) -> bool:
        """Account for ``rows`` taken from the buffer; False if close() already did."""
        with self._lock:
            if self._abandoned:
                return False
            self.stats.update(counts)
            self._in_flight -= rows
            return True

    # ---- control ---------------------------------------------------------------
    def pending(self) -> int:
        with self._lock:
            return len(self._buffer) + self._in_flight

    def flush(self, timeout: float = 10.0) -> bool:
        """Send everything buffered now; True once all of it has been answered."""
        end = time.monotonic() + timeout
        self._wake.set()
        while self.pending():
            if time.monotonic() > end:
                return False
            self._wake.set()
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is buffered (retrying until ``timeout``), then stop. Idempotent."""
        if not self._thread.is_alive():
            return
        self._deadline = time.monotonic() + timeout
        with self._lock:
            self._closed = True
        self._closing.set()
        self._wake.set()
        self._interrupt.set()
        self._thread.join(timeout + 1.0)
        with self._lock:  # when close() returns, every record is accounted for
            self._abandoned = True
            lost = len(self._buffer) + self._in_flight
            self._buffer, self._in_flight, self._buffered_tokens = [], 0, 0
            if lost:
                self.stats["dropped_shutdown"] += lost
        self._channel.close()

    def __enter__(self) -> PhasewatchClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
