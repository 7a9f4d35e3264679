"""Publishing: what leaves the exporter.

In: the aggregation's snapshot and window, the roofline's results, ``selfstats``.

Out: ``/metrics`` (``metrics``: the hot families rendered directly, and the registry's
collectors; ``exposition``: the protobuf page with native histograms;
``roofline_metrics``: the roofline's gauges), the JSON API and probes over
``transport.http_server``, and ``benchtext`` (the window printed as ``vllm bench
serve`` does).
"""
