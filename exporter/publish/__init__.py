"""Publishing: what leaves the exporter.

In: the aggregation's snapshot and window, the roofline's results, ``selfstats``.

Out: ``/metrics``, every family as ``phasewatch.catalog`` lists it (``families``: what a
scrape shows of the aggregation and the one walk over it; ``metrics``: the text and
OpenMetrics writers, the registry's collectors and the page; ``exposition``: the
protobuf page with native histograms; ``roofline_metrics``: the roofline's gauges), the
JSON API (``api``) and probes over ``transport.http_server``, and ``benchtext`` (the window printed
as ``vllm bench serve`` does).
"""
