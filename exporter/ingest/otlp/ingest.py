"""The path every OTLP receiver shares: spans -> adapters -> one batch -> the sink.

Per export: each span is classified by the adapter registry (``adapters.ADAPTERS``,
or the one given); child spans a request needs are remembered by trace (``TraceParts``)
by the adapters that declare it; engines' decode steps are read likewise; other spans
that are not requests are ignored; request spans are deduplicated by (trace id, span id)
over a bounded window, so a retried export counts once; an adapter's ``Rejected`` is
counted with its reason; the rest become one ``RequestBatch`` per adapter (converted
column by column over the whole export where the adapter can). The request spans of an
adapter that pairs roots wait in its waiting room (``pending``) for the spans of its
other processes; they are counted by the export that completes them or by ``sweep``
once ``join_wait`` seconds have passed (None: the adapter's own wait). The outcome
feeds OTLP's ``partial_success``: rejected spans and a message naming the reasons (a
waiting root's later rejection is in the counters only).

The ingest names no engine: what it knows of one, the adapter declares
(``adapters.contract``), and ``tests/repository/test_structure.py`` keeps it so.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from phasewatch.aggregation.sink import RequestSink
from phasewatch.ingest.adapters import ADAPTERS, AdapterContext, AdapterRegistry, Rejected
from phasewatch.ingest.adapters.origin import pod_of, span_columns
from phasewatch.ingest.adapters.rows import TWO_CLOCK_TOLERANCE_NS
from phasewatch.ingest.adapters.traces import TraceParts
from phasewatch.ingest.dedupe import BatchIds
from phasewatch.ingest.otlp.spans import walk
from phasewatch.requests.record import BatchBuilder, RequestBatch

# Spans known by name to go to a vectorised adapter: walk reads just the keys it needs
# (the default registry's; an ingest with its own registry has its own ``extract``).
EXTRACT = ADAPTERS.extract
DEDUPE_CAPACITY = 1 << 18  # (trace id, span id) pairs remembered: ~30 MB at most
# OTLP times are uint64 ns; past this (year 2223) a span plus its latencies could leave
# the int64 ns columns, so it is rejected (``timestamp_out_of_range``) instead.
MAX_TIME_NS = 8 * 10**18


@dataclass
class ExportOutcome:
    spans: int = 0
    accepted: int = 0
    ignored: int = 0
    duplicates: int = 0
    rejected: Counter = field(default_factory=Counter)

    @property
    def rejected_spans(self) -> int:
        return sum(self.rejected.values())

    def message(self) -> str:
        if not self.rejected:
            return ""
        reasons = ", ".join(f"{r} ({n})" for r, n in self.rejected.most_common())
        return f"{self.rejected_spans} of {self.spans} spans rejected: {reasons}"


class OtlpIngest:
    def __init__(self, sink: RequestSink, context: AdapterContext | None = None,
                 dedupe_capacity: int = DEDUPE_CAPACITY, emitter=None,
                 join_wait: float | None = None, adapters: AdapterRegistry = ADAPTERS):
        self._sink = sink
        self.stats = sink.stats
        self.adapters = adapters
        self.extract = adapters.extract  # ``walk``'s keys for this ingest's adapters
        self.context = context or AdapterContext()
        self.context.trace_parts = TraceParts()
        self.context.pods = "pod" in sink.label_names  # the rows' pod column is filled
        self.pending = adapters.waiting_room(join_wait)  # roots waiting for their parts
        self._seen = BatchIds(dedupe_capacity)
        self.emitter = emitter  # otlp.reemit.PhaseSpanEmitter, or None

    def export(self, request, protocol: str) -> ExportOutcome:
        """Ingest one decoded ExportTraceServiceRequest. Never raises on bad spans."""
        return self.export_spans(walk(request, self.extract), protocol)

    def export_spans(self, spans: list, protocol: str) -> ExportOutcome:
        """Ingest one request's spans, walked with ``self.extract`` (``walk``,
        ``json_spans``)."""
        out = ExportOutcome(spans=len(spans))
        refused: Counter = Counter()  # by the adapters (the aggregator counts its own)
        requests, touched, steps = self._sort(spans, out, refused)
        # spans besides another side's rows (the tap's): an engine traces, so a join
        # waits for its spans
        if len(spans) > sum(a.CAPABILITIES.source is not None for a, _ in requests):
            self._sink.engine_exported()
        groups = self._claim(requests, out, refused)
        if steps:
            self._sink.add_steps(steps)
        batches = []
        for adapter, group in groups.items():
            if adapter.CAPABILITIES.pairs_roots:  # waits for its other processes' spans
                reasons = self.pending.park(group, protocol)
                refused.update(r for r in reasons if r)
                touched.update(s.trace_id for s, r in zip(group, reasons, strict=True) if not r)
            else:
                batches.append(self._convert(adapter, group, refused))
        out.rejected.update(refused)
        for batch, kept in batches:
            if not kept:
                continue
            result = self._ingest(batch, kept, protocol, [[s] for s in kept])
            out.accepted += result.accepted
            out.rejected.update(result.rejected)
        for proto, (batch, roots) in self._joined(self.pending.ready(self.context,
                                                                     touched)).items():
            result = self._ingest(batch, [r[0] for r in roots], proto, roots)
            if proto == protocol:
                out.accepted += sum(len(r) for r, k in zip(roots, result.kept, strict=True)
                                    if k)
                out.rejected.update(result.rejected)
            else:  # roots that came over another receiver: counted there
                self._count_joined(proto, roots, result)
        self._count(out, refused, protocol)
        return out

    def _sort(self, spans: list, out: ExportOutcome, refused: Counter) -> tuple:
        """All child spans first (their request span may be in this export): remembered,
        engine decode steps read, other spans that are no request ignored. Returns the
        request spans with their adapters, the traces that gained parts, the steps."""
        adapters, parts = self.adapters, self.context.trace_parts
        requests, touched, steps = [], set(), []
        for s in spans:
            adapter = adapters.classify(s)
            if adapter is None:
                if adapters.remember(s, parts):
                    touched.add(s.trace_id)
                elif (step := adapters.decode_step(s)) is not None:
                    engine, *times = step
                    steps.append((self.context.model_for(s), engine,
                                  pod_of(s.resource) if self.context.pods else "", *times))
                out.ignored += 1
            elif len(s.trace_id) != 16 or len(s.span_id) != 8:
                refused["bad_span_id"] += 1
            else:
                requests.append((adapter, s))
        return requests, touched, steps

    def _claim(self, requests: list, out: ExportOutcome, refused: Counter) -> dict:
        """adapter -> its request spans not seen before and with usable times, in order."""
        fresh = self._seen.claim_many([s.trace_id + s.span_id for _, s in requests])
        groups: dict = {}
        for (adapter, s), new in zip(requests, fresh, strict=True):
            if not new:
                out.duplicates += 1
                continue
            # a rejected span stays claimed: a retry is rejected once only
            if s.end_ns < s.start_ns:
                refused["negative_span_duration"] += 1
            elif s.end_ns > MAX_TIME_NS:
                refused["timestamp_out_of_range"] += 1
            else:
                groups.setdefault(adapter, []).append(s)
        return groups

    def _count_joined(self, protocol: str, roots: list, result) -> None:
        """spans_total for joined requests counted outside the export they came in."""
        for outcome, want in (("request", True), ("rejected", False)):
            n = sum(len(r) for r, k in zip(roots, result.kept, strict=True) if bool(k) == want)
            if n:
                self.stats.inc("phasewatch_otlp_spans_total", n, protocol=protocol,
                               outcome=outcome)

    def _ingest(self, batch: RequestBatch, kept: list, protocol: str, roots: list):
        """``kept[i]`` is the span that row ``i`` came from (its re-emitted phases);
        ``roots[i]`` every request span of the row (released for a retry)."""
        try:
            result = self._sink.ingest(batch, protocol)
        except Exception:
            for rs in roots:  # let the client's retry through
                for s in rs:
                    self._seen.release(s.trace_id + s.span_id)
            raise
        if result.kept is None:
            result.kept = np.zeros(len(batch), dtype=bool)
        if self.emitter is not None:
            self.emitter.emit([(s.trace_id, s.span_id) for s in kept], batch)
        return result

    def _joined(self, released: list) -> dict:
        """Requests released by the waiting room as one batch per protocol: protocol ->
        (batch, the root spans of each row, client-facing first)."""
        by_proto: dict[str, list] = {}
        for r in released:
            by_proto.setdefault(r.protocol, []).append(r)
        if released:
            outcomes = Counter(r.outcome for r in released)
            for outcome, n in outcomes.items():
                self.stats.inc("phasewatch_otlp_joined_requests_total", n, outcome=outcome)
        out = {}
        for proto, rs in by_proto.items():
            builder = BatchBuilder.from_rows([r.row for r in rs], times_in_ns=True)
            builder.columns(kv_transfer=[r.kv_transfer for r in rs])
            span_columns(builder, [r.spans[0] for r in rs], self.context.pods,
                         self.context.sampling)
            out[proto] = (builder.tolerance(TWO_CLOCK_TOLERANCE_NS).build(),
                          [r.spans for r in rs])
        return out

    def sweep(self) -> int:
        """Count the waiting requests whose wait is over; how many."""
        released = self.pending.ready(self.context)
        for proto, (batch, roots) in self._joined(released).items():
            self._count_joined(proto, roots, self._ingest(batch, [r[0] for r in roots], proto,
                                                          roots))
        return len(released)

    def _convert(self, adapter, spans: list, refused: Counter):
        """One adapter's spans as a batch of the ones it accepts, and those spans."""
        if adapter.CAPABILITIES.converts_many:  # vectorised over the export
            batch, reasons = adapter.convert_many(spans, self.context)
            refused.update(r for r in reasons if r)
            return batch, [s for s, r in zip(spans, reasons, strict=True) if not r]
        rows, kept = [], []
        for s in spans:
            try:
                rows.append(adapter.convert(s, self.context))
                kept.append(s)
            except Rejected as e:
                refused[e.reason] += 1
        builder = BatchBuilder.from_rows(rows, times_in_ns=True)
        return span_columns(builder, kept, self.context.pods, self.context.sampling,
                            adapter).build(), kept

    def _count(self, out: ExportOutcome, refused: Counter, protocol: str) -> None:
        inc = self.stats.inc
        _, child_spans = self.context.trace_parts.drain_evictions()
        if child_spans:  # held for a request span that never came (an aborted request)
            inc("phasewatch_ingest_dropped_total", child_spans, reason="child_spans_unclaimed")
        for outcome, n in (("request", out.accepted), ("ignored", out.ignored),
                           ("duplicate", out.duplicates), ("rejected", out.rejected_spans)):
            if n:
                inc("phasewatch_otlp_spans_total", n, protocol=protocol, outcome=outcome)
        for reason, n in refused.items():
            inc("phasewatch_ingest_rejected_total", n, protocol=protocol, reason=reason)
        for reason, n in self.context.sampling.take_ignored().items():
            inc("phasewatch_trace_sampling_ignored_total", n, reason=reason)

