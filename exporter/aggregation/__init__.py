"""Aggregation: counting the phases of many requests, and the rolling window.

In: a ``requests.record.RequestBatch``, handed by a receiver to a ``sink.RequestSink``:
``tracejoin`` (a stream tap's record and the engine's span of one request, joined) in
front of ``aggregate.Aggregator``, which counts it with its ``requests.phases.Phases``
per label set (``labels``: model, engine, and pod and source where configured, capped),
and, with latency objectives (``--slo``), judges each request against them (``slo``).

Out: ``aggregate.Aggregator.snapshot()`` (histograms, native histograms and counters
for /metrics), ``slo.SloCounts.snapshot()`` (the objectives' counts),
``window.RollingWindow`` (recent requests and per-second slices: the JSON API's summary,
goodput among it, and requests, the roofline's inputs) and ``history`` (the summary
sampled over time for the dashboard).
"""
