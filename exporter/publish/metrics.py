"""Prometheus exposition: one collector that renders the aggregation snapshot at scrape.

Names, HELP texts and labels are the catalog's (``phasewatch.catalog``); the OTel GenAI
semconv names where one exists
(``gen_ai.server.time_to_first_token`` -> ``gen_ai_server_time_to_first_token_seconds``).
Sample exposition::

    gen_ai_server_time_to_first_token_seconds_bucket{model="Llama-3.1-8B",engine="vllm",prompt_class="1k-4k",le="0.25"} 812.0
    phasewatch_phase_duration_seconds_sum{model="Llama-3.1-8B",engine="vllm",phase="decode"} 1534.2
    phasewatch_tokens_total{model="Llama-3.1-8B",engine="vllm",kind="output"} 201533.0
    phasewatch_ingest_rejected_total{protocol="phasewatch",reason="clock_order"} 3.0
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from typing import TypeVar

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from phasewatch import catalog
from phasewatch.aggregation.aggregate import Aggregator
from phasewatch.publish import exposition
from phasewatch.publish.families import CounterCells, Exposure, walk

T = TypeVar("T")
# a gauge's reading at scrape: its value, or (a family with labels) label values -> value
GaugeReading = Callable[[], float | Mapping[tuple[str, ...], float]]


class HotCollector(Collector):
    """The aggregator's histograms and counters as prometheus_client families, built from
    ``Aggregator.snapshot()`` at every scrape. ``HotText`` renders the same samples
    straight to text (what /metrics serves in the two standard formats); this is the
    path for any other format, and the reference it is tested against."""

    def __init__(self, aggregator: Aggregator, exposure: Exposure | None = None):
        self._agg = aggregator
        self._exposure = exposure or Exposure()

    def collect(self) -> Iterator[Metric]:
        for f in walk(self._exposure.apply(self._agg.snapshot())):
            if isinstance(f, CounterCells):
                fam = CounterMetricFamily(f.family.family, f.family.help, labels=f.names)
                for values, v in f.cells:
                    fam.add_metric(values, v)
                yield fam
                continue
            fam = HistogramMetricFamily(f.family.name, f.family.help, labels=f.names)
            les = [floatToGoString(b) for b in f.spec.buckets.bounds] + ["+Inf"]
            for row, values in zip(f.rows, f.labels, strict=True):
                fam.add_metric(values, list(zip(les, f.cum[row].tolist(), strict=True)),
                               float(f.sums[row]))
            yield fam


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    return str(int(v)) if v.is_integer() and abs(v) < 2**53 else floatToGoString(v)


class HotText:
    """``HotCollector``'s samples rendered straight to the text format (0.0.4) or
    OpenMetrics 1.0.0. A scrape of 20 models x 3 engines is ~20,000 samples; through
    metric family objects that takes ~5 us a sample, here the label part of each line
    is built once per label set and cached, and a sample costs one string join.
    Counts are written as integers (valid floats in both formats). Label names are in
    alphabetical order, ``le`` among them, as prometheus_client writes every other
    family on the page."""

    def __init__(self, aggregator: Aggregator, exposure: Exposure | None = None):
        self._agg = aggregator
        self._exposure = exposure or Exposure()
        self._prefixes: dict[tuple, list[str]] = {}

    def _lines(self, key: tuple, name: str, pairs: list[tuple[str, str]],
               les: list[str]) -> list[str]:
        got = self._prefixes.get(key)
        if got is None:
            if len(self._prefixes) > 100_000:  # label sets churned: start again
                self._prefixes.clear()
            pairs = sorted(pairs)
            before = "".join(f'{n}="{_escape(v)}",' for n, v in pairs if n < "le")
            after = "".join(f',{n}="{_escape(v)}"' for n, v in pairs if n > "le")
            plain = ",".join(f'{n}="{_escape(v)}"' for n, v in pairs)
            got = self._prefixes[key] = [
                *(f'{name}_bucket{{{before}le="{le}"{after}}} ' for le in les),
                f"{name}_count{{{plain}}} ", f"{name}_sum{{{plain}}} "]
        return got

    def render(self, openmetrics: bool) -> bytes:
        out = []
        for f in walk(self._exposure.apply(self._agg.snapshot())):
            if isinstance(f, CounterCells):
                out.append(self._counter(f, openmetrics))
                continue
            name = f.family.name
            out.append(f"# HELP {name} {_help(f.family.help, openmetrics)}\n"
                       f"# TYPE {name} histogram\n")
            les = [floatToGoString(b) for b in f.spec.buckets.bounds] + ["+Inf"]
            for row, values in zip(f.rows, f.labels, strict=True):
                prefixes = self._lines((f.spec.key, *values), name,
                                       list(zip(f.names, values, strict=True)), les)
                counts = f.cum[row].tolist()
                out.append("".join([f"{p}{v}\n" for p, v in
                                    zip(prefixes[:-2], counts, strict=True)]))
                out.append(f"{prefixes[-2]}{counts[-1]}\n{prefixes[-1]}"
                           f"{floatToGoString(f.sums[row])}\n")
        return "".join(out).encode()

    @staticmethod
    def _counter(f: CounterCells, openmetrics: bool) -> str:
        name = f.family.name
        family = f.family.family if openmetrics else name
        out = [f"# HELP {family} {_help(f.family.help, openmetrics)}\n"
               f"# TYPE {family} counter\n"]
        for values, v in f.cells:
            pairs = sorted(zip(f.names, values, strict=True))
            text = ",".join(f'{n}="{_escape(lv)}"' for n, lv in pairs)
            out.append(f"{name}{{{text}}} {_number(v)}\n")
        return "".join(out)


def _help(doc: str, openmetrics: bool) -> str:
    """HELP text escaped: OpenMetrics as label values, the text format without quotes."""
    return _escape(doc) if openmetrics else doc.replace("\\", "\\\\").replace("\n", "\\n")


def package_version() -> str:
    """The installed phasewatch's version (a source tree run without installing: unknown)."""
    try:
        return metadata.version("phasewatch")
    except metadata.PackageNotFoundError:
        return "unknown"


class SelfCollector(Collector):
    """The exporter's own counters (``SelfStats``; one with a catalog ``needs`` only once
    it has counted something), the gauges it is given (catalog family -> its reading: a
    number, or for a family with labels its label values -> number) and the build's
    version."""

    def __init__(self, aggregator: Aggregator,
                 gauges: dict[catalog.Family, GaugeReading] | None = None):
        self._agg = aggregator
        self._gauges = gauges or {}

    def collect(self) -> Iterator[Metric]:
        values = self._agg.stats.snapshot()
        for f in catalog.SELF_COUNTERS:
            fam = CounterMetricFamily(f.family, f.help, labels=list(f.labels))
            for (n, label_values), v in sorted(values.items()):
                if n == f.name:
                    fam.add_metric(list(label_values), float(v))
            if fam.samples or not f.needs:  # one that needs a feature: once it counted
                yield fam
        for f, read in self._gauges.items():
            if not f.labels:
                yield GaugeMetricFamily(f.name, f.help, value=float(read()))
                continue
            fam = GaugeMetricFamily(f.name, f.help, labels=list(f.labels))
            for label_values, v in sorted(read().items()):  # label values -> its value
                fam.add_metric(list(label_values), float(v))
            yield fam
        b = catalog.BUILD_INFO
        info = GaugeMetricFamily(b.name, b.help, labels=list(b.labels))
        info.add_metric([package_version()], 1.0)
        yield info


class MetricsPage:
    """The /metrics body for an ``Accept`` header: text 0.0.4 and OpenMetrics 1.0.0 (what
    Prometheus asks for) are ``HotText`` followed by ``rest``; the protobuf format
    (what Prometheus asks for with native histograms on) is ``phasewatch.publish.exposition``'s,
    the hot families with their native histograms followed by ``rest``; any other
    format goes through prometheus_client's own encoder over ``full``."""

    def __init__(self, hot: HotText, rest, full, proto=None):
        self._hot, self._rest, self._full, self._proto = hot, rest, full, proto
        # the hot families run guarded as ``requests`` where ``rest`` is a GuardedRegistry
        self._board = getattr(rest, "board", None)

    def _guarded(self, fn: Callable[[], T], fallback: T) -> T:
        return fn() if self._board is None else self._board.run("requests", fn, fallback)

    def render(self, accept: str) -> tuple[bytes, str]:
        if self._proto is not None and exposition.wants_protobuf(accept):
            families = (self._guarded(self._proto.families, [])
                        + exposition.registry_families(self._rest))
            return exposition.delimited(families), exposition.CONTENT_TYPE
        encoder, ctype = choose_encoder(accept)
        if ctype == CONTENT_TYPE_PLAIN_0_0_4:
            return (self._guarded(lambda: self._hot.render(False), b"")
                    + generate_latest(self._rest)), ctype
        if ctype in (openmetrics.CONTENT_TYPE_LATEST,
                     f"{openmetrics.CONTENT_TYPE_LATEST}; escaping=underscores"):
            return (self._guarded(lambda: self._hot.render(True), b"")
                    + openmetrics.generate_latest(self._rest)), ctype
        return encoder(self._full), ctype
