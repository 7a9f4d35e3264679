"""gRPC plumbing shared by the gRPC receivers (phasewatch's ``Export`` and
``StreamLifecycle``, OTLP's ``TraceService``) and the bearer-token check.

The message size limits (``MAX_MESSAGE_BYTES``, and grpc's own a little higher), the
gate every ingest call passes (``gated``: size, then the admission gate), the answers
it gives (``too_large``, ``refuse`` with ``RetryInfo``, ``internal_error``), the
identity (de)serializer that leaves decoding to the handler, and ``serve_grpc``: a
started server with those limits, its port probed first so a taken port fails with
the OS's reason.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections.abc import Sequence
from concurrent import futures

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from phasewatch.transport.admission import RETRY_AFTER_SECONDS, Admission, Refused

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # OTLP's recommended limit; the same here
# grpc's own limit sits a little higher, so that a payload just past ours reaches the
# handler and is refused there with a count; past this one grpc refuses it itself
# (RESOURCE_EXHAUSTED, before any phasewatch code runs).
GRPC_HARD_LIMIT = MAX_MESSAGE_BYTES + 4 * 1024 * 1024


def too_large(stats, protocol: str, size: int, context) -> None:
    """Refuse a payload over MAX_MESSAGE_BYTES: counted, INVALID_ARGUMENT (a resend of
    the same bytes cannot succeed, so it must not be retried)."""
    stats.inc("phasewatch_ingest_batches_total", protocol=protocol, outcome="too_large")
    stats.inc("phasewatch_ingest_rejected_total", protocol=protocol,
              reason="payload_too_large")
    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                  f"payload of {size} bytes exceeds {MAX_MESSAGE_BYTES}; send smaller batches")


def retry_trailers(message: str) -> tuple:
    """``UNAVAILABLE`` details telling the client when to retry: a ``google.rpc.RetryInfo``
    in ``grpc-status-details-bin`` and in the ``google.rpc.retryinfo-bin`` trailer the
    OpenTelemetry SDK's exporter reads."""
    retry = error_details_pb2.RetryInfo(
        retry_delay=duration_pb2.Duration(seconds=RETRY_AFTER_SECONDS))
    detail = any_pb2.Any()
    detail.Pack(retry)
    status = status_pb2.Status(code=code_pb2.UNAVAILABLE, message=message, details=[detail])
    return (("google.rpc.retryinfo-bin", retry.SerializeToString()),
            ("grpc-status-details-bin", status.SerializeToString()))


def refuse(stats, protocol: str, e: Refused, context) -> None:
    """Answer a call the admission gate refused: ``UNAVAILABLE`` with ``RetryInfo``."""
    stats.inc("phasewatch_ingest_batches_total", protocol=protocol, outcome="overloaded")
    context.set_trailing_metadata(retry_trailers(str(e)))
    context.abort(grpc.StatusCode.UNAVAILABLE, str(e))


def gated(stats, admission: Admission, protocol: str, request: bytes, context,
          handle) -> bytes:
    """What every gRPC ingest call passes before ``handle(request, context)``: the size
    limit, then the admission gate (its slot released when ``handle`` returns)."""
    if len(request) > MAX_MESSAGE_BYTES:
        return too_large(stats, protocol, len(request), context)
    try:
        admission.admit(protocol, len(request))
    except Refused as e:
        return refuse(stats, protocol, e, context)
    try:
        return handle(request, context)
    except Exception:
        if context.code() is not None:  # the handler's own answer (context.abort)
            raise
        internal_error(stats, protocol, f"a {len(request)}-byte batch", context)
    finally:
        admission.release(len(request))


def internal_error(stats, protocol: str, what: str, context) -> None:
    """From an ``except`` block: a bug, not bad input. Logged with its traceback, counted
    as batches_total{outcome="error"} and answered INTERNAL, never a silent UNKNOWN."""
    log.exception("%s: ingest failed on %s", protocol, what)
    stats.inc("phasewatch_ingest_batches_total", protocol=protocol, outcome="error")
    context.abort(grpc.StatusCode.INTERNAL, f"phasewatch could not ingest {what}; its log "
                  "has the cause")


def identity(b: bytes) -> bytes:
    """Request/response (de)serializer that leaves the bytes to the handler."""
    return b


def _probe(host: str, port: int | None) -> None:
    """gRPC's bind failure says only "Failed to bind" (after a C-core log line), and
    with SO_REUSEPORT it shares a port another gRPC server holds: bind the address with
    a plain socket first, so a taken port fails here, with the OS's reason."""
    if not port:
        return
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    try:
        socket.create_server((host.strip("[]"), port), family=family).close()
    except OSError as e:
        if e.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
            raise OSError(e.errno, os.strerror(e.errno)) from None
        # anything else (a name this probe cannot resolve): gRPC has the last word


def serve_grpc(handlers, host: str, port: int | None, max_workers: int, what: str,
               interceptors: Sequence[grpc.ServerInterceptor] = ()) -> tuple[grpc.Server, int]:
    """A started grpc server for ``handlers`` with the message size limit; returns it
    and the port actually bound. ``what`` names it in thread names and errors."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"pw-{what}"),
        handlers=[handlers], interceptors=list(interceptors),
        options=[("grpc.max_receive_message_length", GRPC_HARD_LIMIT),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
    )
    address = host if port is None else f"{host}:{port}"  # port None: host is unix:PATH
    _probe(host, port)
    bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind the {what} gRPC port on {address}")
    server.start()
    return server, bound
