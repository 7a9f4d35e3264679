"""Transport: the listeners' plumbing, shared by every receiver and the HTTP port.

In: connections and calls on the exporter's ports, before any protocol reads them:
gRPC (``grpc``: servers with the message size limits, the ``gated`` path every ingest
call passes, the ``UNAVAILABLE``/``RetryInfo``, ``INVALID_ARGUMENT`` and ``INTERNAL``
answers, the identity (de)serializer), HTTP (``http_server``: /metrics, /healthz,
/readyz and the JSON API's routing, with a bound on connections), and what guards them
all: ``admission`` (the overload gate: calls and bytes in flight, resident memory),
``auth`` (bearer tokens, as a gRPC interceptor and an HTTP check), ``tls`` (TLS and
mutual TLS from PEM files reloaded when they change, the gRPC ports behind a TLS
front; ``ClientTls`` for the clients' side); ``listen``: a bind failure as the one line
every command prints (``ListenError``, naming the flag).

Out: started servers that hand each admitted call's bytes to its handler (the
receivers in ``ingest``, the pages in ``publish``); every refusal counted in
``selfstats`` (``phasewatch_ingest_refused_total``, ``phasewatch_auth_refused_total``).
Nothing here imports ``ingest``, ``publish`` or ``aggregation``.
"""
