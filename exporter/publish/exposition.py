"""/metrics in Prometheus's protobuf format, the one that carries native histograms.

Prometheus asks for ``application/vnd.google.protobuf;
proto=io.prometheus.client.MetricFamily; encoding=delimited`` when native histograms
are on (2.40+ with ``--enable-feature=native-histograms``). The page holds every
family the text page holds, with the same samples, plus one native family per
latency histogram (``phasewatch.requests.native``), named ``<histogram>_native``::

    gen_ai_server_time_to_first_token_seconds          classic buckets, as in text
    gen_ai_server_time_to_first_token_seconds_native   schema 4, ~4.4% buckets

Separate names because a Prometheus reading native histograms ingests a family that
carries both kinds as native only, and every ``_bucket``/``_count``/``_sum`` query
(rules, Grafana, the dashboard) would go empty; with two families the classic
series stay as they are and quantile queries prefer the native one where it exists
(``phasewatch.dashboard.queries.quantile``).

The body is a stream of ``MetricFamily`` messages, each preceded by its length as
a varint.
"""

from __future__ import annotations

from prometheus_client.registry import Collector

from phasewatch.aggregation.aggregate import Aggregator
from phasewatch.catalog import NATIVE_SUFFIX
from phasewatch.ingest.wire import varint
from phasewatch.protocol import exposition_pb2 as pb
from phasewatch.publish.families import CounterCells, Exposure, HistogramRows, walk
from phasewatch.requests import native

CONTENT_TYPE = ("application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; "
                "encoding=delimited")


def native_name(name: str) -> str:
    return name + NATIVE_SUFFIX


def wants_protobuf(accept: str) -> bool:
    """Whether ``accept`` ranks the delimited MetricFamily protobuf above every text
    format (ties go to the earlier entry, as Prometheus lists its preference)."""
    best_q, best_proto = -1.0, False
    for entry in (accept or "").split(","):
        media, *params = [p.strip() for p in entry.split(";")]
        opts = dict(p.split("=", 1) for p in params if "=" in p)
        try:
            q = float(opts.get("q", 1.0))
        except ValueError:
            q = 0.0
        proto = (media == "application/vnd.google.protobuf"
                 and opts.get("proto") == "io.prometheus.client.MetricFamily"
                 and opts.get("encoding") == "delimited")
        if not proto and media not in ("text/plain", "application/openmetrics-text", "*/*"):
            continue
        if q > best_q:
            best_q, best_proto = q, proto
    return best_proto and best_q > 0


def delimited(families) -> bytes:
    parts = []
    for fam in families:
        body = fam.SerializeToString()
        parts.append(varint(len(body)))
        parts.append(body)
    return b"".join(parts)


def read_delimited(body: bytes) -> list:
    """The MetricFamily messages of a delimited protobuf page (for tests and tools)."""
    out, i = [], 0
    while i < len(body):
        n, shift = 0, 0
        while True:
            b = body[i]
            i += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        out.append(pb.MetricFamily.FromString(body[i:i + n]))
        i += n
    return out


# Accept headers Prometheus 2.42 sends (captured): with native histograms on, and off.
PROMETHEUS_NATIVE_ACCEPT = (
    "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
    "encoding=delimited,application/openmetrics-text;version=1.0.0;q=0.8,"
    "application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,"
    "*/*;q=0.1")
PROMETHEUS_CLASSIC_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def _labels(metric, names, values) -> None:
    for n, v in zip(names, values, strict=True):
        pair = metric.label.add()
        pair.name, pair.value = n, v


class HotProto:
    """The aggregator's histograms (classic and native) and counters as MetricFamily
    messages, from one snapshot."""

    def __init__(self, aggregator: Aggregator, exposure: Exposure | None = None):
        self._agg = aggregator
        self._exposure = exposure or Exposure()
        # (histogram, native?, label values) -> a serialized Metric holding the labels
        # and what never changes (bucket bounds; schema and zero threshold), merged in
        # with one call per series and scrape
        self._templates: dict[tuple, bytes] = {}

    def _template(self, spec, is_native: bool, names: list[str], values: list[str]) -> bytes:
        key = (spec.key, is_native, *values)
        got = self._templates.get(key)
        if got is None:
            if len(self._templates) > 100_000:  # label sets churned: start again
                self._templates.clear()
            m = pb.Metric(label=[pb.LabelPair(name=n, value=v)
                                 for n, v in zip(names, values, strict=True)])
            if is_native:
                m.histogram.schema = native.SCHEMA
                m.histogram.zero_threshold = spec.native.zero_threshold
            else:
                m.histogram.bucket.extend(pb.Bucket(upper_bound=b) for b in spec.buckets.bounds)
            got = self._templates[key] = m.SerializeToString()
        return got

    def families(self) -> list:
        out = []
        for f in walk(self._exposure.apply(self._agg.snapshot())):
            if isinstance(f, CounterCells):
                fam = pb.MetricFamily(name=f.family.name, help=f.family.help, type=pb.COUNTER)
                for values, v in f.cells:
                    m = fam.metric.add()
                    _labels(m, f.names, values)
                    m.counter.value = v
                out.append(fam)
                continue
            out.append(self._classic(f))
            if f.native is not None:
                out.append(self._native(f))
        return out

    def _classic(self, f: HistogramRows):
        fam = pb.MetricFamily(name=f.family.name, help=f.family.help, type=pb.HISTOGRAM)
        for row, values in zip(f.rows, f.labels, strict=True):
            m = fam.metric.add()
            m.MergeFromString(self._template(f.spec, False, f.names, values))
            h = m.histogram
            h.sample_count, h.sample_sum = int(f.cum[row, -1]), float(f.sums[row])
            for b, c in zip(h.bucket, f.cum[row, :-1].tolist(), strict=True):
                b.cumulative_count = c
        return fam

    def _native(self, f: HistogramRows):
        lo, ncounts = f.native
        encoded = native.encode(f.spec.native, ncounts, lo)
        fam = pb.MetricFamily(name=native_name(f.family.name), help=f.family.help
                              + f" Native histogram (schema {native.SCHEMA}).",
                              type=pb.HISTOGRAM)
        for row, values in zip(f.rows, f.labels, strict=True):
            m = fam.metric.add()
            m.MergeFromString(self._template(f.spec, True, f.names, values))
            h = m.histogram
            h.sample_count, h.sample_sum = int(f.cum[row, -1]), float(f.sums[row])
            zero, spans, deltas = encoded[row] if row < len(encoded) else (0, [], [])
            h.zero_count = zero
            h.positive_span.extend(pb.BucketSpan(offset=o, length=n) for o, n in spans)
            h.positive_delta.extend(deltas)
        return fam


_TYPES = {"counter": pb.COUNTER, "gauge": pb.GAUGE, "summary": pb.SUMMARY,
          "histogram": pb.HISTOGRAM, "info": pb.GAUGE, "stateset": pb.GAUGE,
          "gaugehistogram": pb.HISTOGRAM}


def registry_families(collector: Collector) -> list:
    """A prometheus_client collector's families (counters, gauges, info, summaries,
    histograms; anything else untyped) as MetricFamily messages."""
    out = []
    for family in collector.collect():
        kind = _TYPES.get(family.type, pb.UNTYPED)
        if kind in (pb.HISTOGRAM, pb.SUMMARY):
            out.append(_grouped(family, kind))
            continue
        name = {"counter": family.name + "_total",
                "info": family.name + "_info"}.get(family.type, family.name)
        fam = pb.MetricFamily(name=name, help=family.documentation, type=kind)
        for s in family.samples:
            if s.name != name and family.type in ("counter", "info"):
                continue  # _created
            m = fam.metric.add()
            _labels(m, list(s.labels), list(s.labels.values()))
            field = {pb.COUNTER: m.counter, pb.GAUGE: m.gauge}.get(kind, m.untyped)
            field.value = float(s.value)
        out.append(fam)
    return out


def _grouped(family, kind) -> object:
    """Histogram or summary samples (_bucket/quantile, _count, _sum) per label set."""
    fam = pb.MetricFamily(name=family.name, help=family.documentation, type=kind)
    series: dict[tuple, object] = {}
    for s in family.samples:
        own = {k: v for k, v in s.labels.items() if k not in ("le", "quantile")}
        key = tuple(sorted(own.items()))
        m = series.get(key)
        if m is None:
            m = series[key] = fam.metric.add()
            _labels(m, list(own), list(own.values()))
        body = m.histogram if kind == pb.HISTOGRAM else m.summary
        suffix = s.name[len(family.name):]
        if suffix == "_count":
            body.sample_count = int(s.value)
        elif suffix == "_sum":
            body.sample_sum = float(s.value)
        elif suffix == "_bucket" and s.labels["le"] != "+Inf":
            b = body.bucket.add()
            b.upper_bound, b.cumulative_count = float(s.labels["le"]), int(s.value)
        elif suffix == "" and "quantile" in s.labels:
            qv = body.quantile.add()
            qv.quantile, qv.value = float(s.labels["quantile"]), float(s.value)
    return fam
