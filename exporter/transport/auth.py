"""Optional bearer-token authentication for ingest (phasewatch gRPC, OTLP/gRPC,
OTLP/HTTP) and the JSON API.

With ``--auth-token`` (better: ``PHASEWATCH_AUTH_TOKEN`` from a Secret) every ingest
call and every ``/api/v1/`` request must carry ``authorization: Bearer <token>``
(gRPC metadata or the HTTP header, as the OpenTelemetry SDK exporters send it with
``headers={"authorization": "Bearer …"}``). ``/metrics``, ``/healthz`` and ``/readyz``
stay open for Prometheus and the kubelet. A refusal is answered with gRPC
``UNAUTHENTICATED`` or HTTP 401 (never retried by the clients) and counted in
``phasewatch_auth_refused_total{receiver,reason}``. Tokens are compared in constant
time.
"""

from __future__ import annotations

import hmac

import grpc

from phasewatch.selfstats import SelfStats
from phasewatch.transport.grpc import identity

HEADER = "authorization"


def bearer(token: str) -> str:
    """The Authorization header (or gRPC metadata) value that carries ``token``."""
    return f"Bearer {token}"


class BearerAuth:
    def __init__(self, token: str, stats: SelfStats):
        self._expected = bearer(token).encode() if token else b""
        self._stats = stats

    @property
    def enabled(self) -> bool:
        return bool(self._expected)

    def allows(self, receiver: str, value: str | None) -> bool:
        """True if ``value`` (the authorization header or metadata) carries the token;
        a refusal is counted with why."""
        if not self._expected:
            return True
        if value and hmac.compare_digest(value.strip().encode(), self._expected):
            return True
        reason = "missing_token" if not value else "bad_token"
        self._stats.inc("phasewatch_auth_refused_total", receiver=receiver, reason=reason)
        return False

    def interceptors(self, receiver: str) -> tuple[grpc.ServerInterceptor, ...]:
        """The gRPC server interceptors for ``receiver``: none when auth is off."""
        return (_Interceptor(self, receiver),) if self.enabled else ()


def _abort(request_or_iterator, context: grpc.ServicerContext):
    context.abort(grpc.StatusCode.UNAUTHENTICATED,
                  "phasewatch: missing or wrong bearer token (authorization metadata)")


class _Interceptor(grpc.ServerInterceptor):
    def __init__(self, auth: BearerAuth, receiver: str):
        self._auth, self._receiver = auth, receiver

    def intercept_service(self, continuation, handler_call_details):
        metadata = dict(handler_call_details.invocation_metadata or ())
        handler = continuation(handler_call_details)
        if handler is None or self._auth.allows(self._receiver, metadata.get(HEADER)):
            return handler
        # The refusal must have the method's own shape (unary or client-streaming),
        # and never decodes the payload.
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(
                _abort, request_deserializer=identity, response_serializer=identity)
        return grpc.unary_unary_rpc_method_handler(
            _abort, request_deserializer=identity, response_serializer=identity)
