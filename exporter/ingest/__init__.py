"""Receivers: what comes in, and the one request record it becomes.

In: the phasewatch gRPC protocol (``grpc_server`` + ``wire``: finished requests, or the
lifecycle stream joined per request in ``lifecycle``), OTLP traces over gRPC and HTTP
(``otlp/``) read by one adapter per server's span shape (``adapters/``), and the
stream tap's records (from the ``tap`` stage: a proxy in front of an OpenAI-compatible
server, timing what the client sees). Guarding them, from ``transport``:
``admission`` (the overload gate), ``auth`` (bearer tokens), ``tls``, the gRPC servers
and their limits; ``dedupe`` remembers recent batch and span ids so a retry is counted
once.

Out: ``requests.record.RequestBatch`` columns, every column a receiver knows filled as it
builds them, handed to an ``aggregation.sink.RequestSink`` (the exporter's: the trace
join in front of the aggregator); every refusal and rejection counted in ``selfstats``.
"""
