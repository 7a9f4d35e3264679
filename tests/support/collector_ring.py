"""The OpenTelemetry Collector's load-balancing exporter, as far as routing goes: which
backend each trace goes to (``Ring``), and the split of one batch of spans by it
(``CollectorRoute``, an OpenTelemetry SDK span exporter in front of one SDK OTLP exporter
per backend).

``Ring`` is the exporter's consistent hash ring, written here from its description in
opentelemetry-collector-contrib, exporter/loadbalancingexporter/consistent_hashing.go
(none of its code is copied):

* a backend ("endpoint", the resolver's string: ``10.1.2.3:4317`` from the k8s resolver,
  the configured ``host:port`` from the static one) gets ``WEIGHT`` points, point ``i``
  at ``crc32_ieee(endpoint + i as 4 little-endian bytes) % POSITIONS``;
* all points are generated first and placed in one global order, so the ring does not
  depend on the order the resolver lists the backends in; a point whose position is
  taken moves to the next free one, at most ``PROBE_LIMIT`` ahead, else it is dropped;
* a trace goes to the first point at or after ``crc32_ieee(trace id's 16 bytes) %
  POSITIONS``, wrapping to the first point of the ring.

Versions read: the file at commit 9d1b9151d5b56ec9555e8672b37868140ae466c0 (one byte of
index, 36,000 positions, 100 points, a taken position's point dropped, a recursive
search for the next point); the version of PR #41271 (2025: a 4-byte little-endian index
and linear probing up to 10 ahead; the stored copy carries no commit id); PR #49585
(opened 2026-07-09, merged: points ordered globally before collisions are resolved,
200 points per endpoint on 131,071 = 2^17 - 1 positions). #49585's source was not among
the stored copies; its consistent_hashing_test.go was, and ``UPSTREAM_VECTORS`` are that
file's expectations (TestPositionsForEndpoints, TestEndpointFor,
TestPositionsForEndpointsDropsWhenProbeLimitIsExhausted), which this ring meets. The
order in which colliding points claim a position (here: position, endpoint, index) is
this file's reading of "globally ordered"; it decides only the traces whose hash lands
exactly on a collided position.
"""

from __future__ import annotations

import bisect
import struct
import zlib
from collections.abc import Sequence

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

POSITIONS = 131_071  # maxPositions
WEIGHT = 200  # defaultWeight: points per endpoint
PROBE_LIMIT = 10  # linearProbeLimit

# consistent_hashing_test.go after #49585: (endpoints, weight) -> ring positions (hex, as
# the Go test writes them), and endpointFor on a ring of the default weight.
UPSTREAM_VECTORS = {
    "positions": [
        (["endpoint-1"], 5, [(0x4be4, "endpoint-1"), (0x666a, "endpoint-1"),
                             (0xad6f, "endpoint-1"), (0x1a4c1, "endpoint-1"),
                             (0x1bae2, "endpoint-1")]),
        (["endpoint-1", "endpoint-1"], 5, [
            (p + d, "endpoint-1") for p in (0x4be4, 0x666a, 0xad6f, 0x1a4c1, 0x1bae2)
            for d in (0, 1)]),
        (["endpoint-A", "endpoint-B"], 5, [
            (0x61a4, "endpoint-B"), (0xca91, "endpoint-A"), (0x10b72, "endpoint-A"),
            (0x11372, "endpoint-B"), (0x116b1, "endpoint-B"), (0x11801, "endpoint-A"),
            (0x18a36, "endpoint-B"), (0x1af01, "endpoint-B"), (0x1af16, "endpoint-A"),
            (0x1e723, "endpoint-A")]),
    ],
    "endpoint_for": (["endpoint-1", "endpoint-2"], [
        (bytes([1, 2, 0, 0]), "endpoint-2"), (bytes([128, 128, 0, 0]), "endpoint-1"),
        (b"ad-service-7", "endpoint-2"), (b"get-recommendations-1", "endpoint-2")]),
}


class Ring:
    def __init__(self, endpoints: Sequence[str], weight: int = WEIGHT,
                 positions: int = POSITIONS, probe_limit: int = PROBE_LIMIT):
        self.size = positions
        points = sorted((zlib.crc32(e.encode() + struct.pack("<I", i)) % positions, e, i)
                        for e in endpoints for i in range(weight))
        taken: dict[int, str] = {}
        for pos, endpoint, _ in points:
            probed = 0
            while pos in taken and probed < probe_limit:
                pos, probed = (pos + 1) % positions, probed + 1
            if probed < probe_limit:  # the Go loop gives up at the limit, free or not
                taken[pos] = endpoint
        self.items = sorted(taken.items())
        self._positions = [p for p, _ in self.items]

    def shares(self) -> dict[str, float]:
        """The share of all positions (of uniformly hashed trace ids) each endpoint gets:
        a point owns the positions after the previous point, up to and with its own."""
        out: dict[str, float] = {}
        previous = self.items[-1][0] - self.size
        for pos, endpoint in self.items:
            out[endpoint] = out.get(endpoint, 0.0) + (pos - previous) / self.size
            previous = pos
        return out

    def endpoint_for(self, identifier: bytes) -> str:
        at = bisect.bisect_left(self._positions, zlib.crc32(identifier) % self.size)
        return self.items[at if at < len(self.items) else 0][1]


class CollectorRoute(SpanExporter):
    """What the Collector does with one export: each span to the backend its trace id's
    ring position names (``backends``: endpoint -> SDK exporter), and, for comparison,
    every span to ``whole`` as well. ``sent`` counts the traces each backend got."""

    def __init__(self, backends: dict, whole: SpanExporter):
        self.ring, self.backends, self.whole = Ring(list(backends)), backends, whole
        self.sent: dict[str, set[int]] = {e: set() for e in backends}

    def endpoint_of(self, trace_id: int) -> str:
        return self.ring.endpoint_for(trace_id.to_bytes(16, "big"))

    def export(self, spans) -> SpanExportResult:
        shards: dict[str, list] = {}
        for s in spans:
            endpoint = self.endpoint_of(s.context.trace_id)
            shards.setdefault(endpoint, []).append(s)
            self.sent[endpoint].add(s.context.trace_id)
        results = [self.backends[e].export(group) for e, group in shards.items()]
        results.append(self.whole.export(list(spans)))
        ok = all(r is SpanExportResult.SUCCESS for r in results)
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        for exporter in [*self.backends.values(), self.whole]:
            exporter.shutdown()
