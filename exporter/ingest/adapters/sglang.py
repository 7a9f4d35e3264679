"""SGLang request traces, as SGLang 0.5.23's own tracing code builds them.

Read from SGLang's code and replayed from what it exports
(``tests/fixtures/otlp/engines/sglang-0.5.23``, whose README names file and line):

* The root span ``"{role} Req {rid[:8]}"`` (role ``""`` when unified, so the name may
  start with a space; ``prefill`` / ``decode`` when prefill and decode are
  disaggregated) is made by the tokenizer process, starts at the request's creation
  and carries ``gen_ai.latency.*`` in seconds on that process's clock:
  ``time_to_first_token``, ``e2e``, ``time_in_model_decode`` (finish - first token) and
  ``time_in_model_prefill``, which runs from the API server's dispatch and so holds the
  scheduler's wait: it is not read. No queue attribute is sent. An aborted request's
  root has no usage and no ``gen_ai.request.id`` (its ``rid`` attribute is there).
* Under the root, one thread span per process that handled the request (its
  attributes ``thread_label``, ``pid``; the scheduler's named ``... Scheduler [TP 0]
  [PP 0] (host:... | pid:...)``), and under those the stage spans, on the scheduler's
  own clock: ``prefill_waiting`` (the scheduler's queue), ``prefill_forward`` (the
  prefill, over every chunk of a chunked prefill), ``prefill_transfer_kv_cache`` (a
  disaggregated prefill server sending the KV cache), and at ``SGLANG_TRACE_LEVEL`` 3
  one ``decode_loop`` per decode step (from the previous step's end). Level 1 (the
  recommended one: 6 spans per request unified, against ~8 + one per output token)
  keeps the first three.
* Disaggregated, each role has a root (same ``rid``) in a trace of its own (one trace
  when the client sent a ``traceparent``). The client's stream comes from the decode
  server: its root gives TTFT, e2e and decode; the prefill server's stage spans give
  queue, prefill and the KV transfer. The request is counted once.

The tokenizer and each scheduler are separate processes with their own exporters, so a
root's stage spans may reach phasewatch before or after it. Roots wait in
``PendingRoots`` until their trace has shown the scheduler's thread span (a process's
spans are exported in the order they end, and that span ends after its stages) and,
disaggregated, until both roles have; or until ``hold`` seconds have passed, when the
request is counted with what came (what is missing is counted unavailable, never
guessed).

Timeline (``row``): as vLLM's, anchored at the client-facing first token so that each
duration is SGLang's own: first token = creation + TTFT and finish = creation + e2e
(tokenizer clock); last token = first token + decode; prefill = ``prefill_forward``
and the KV transfer = ``prefill_transfer_kv_cache`` before the first token; queue =
``prefill_waiting`` before them (scheduler clock); what TTFT holds beyond them is
preprocess (tokenisation, dispatch, disaggregated bootstrap, the decode server's
admission, the output's trip back). Token times: one ``decode_loop`` end per step after
the first token, so the pooled ITL is SGLang's per-step time.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from phasewatch.aggregation.waiting_room import CAPACITY, Room
from phasewatch.ingest.adapters.attributes import NS, count, first_reason, seconds, text
from phasewatch.ingest.adapters.contract import Capabilities, Rejected
from phasewatch.ingest.adapters.latency import COUNT_KEYS
from phasewatch.ingest.adapters.rows import row

ENGINE = "sglang"
_NAME = re.compile(r"(^|\s)Req [0-9A-Za-z_-]{1,64}$")
ROLES = ("", "prefill", "decode")
LATENCY = ("gen_ai.latency.time_to_first_token", "gen_ai.latency.e2e",
           "gen_ai.latency.time_in_model_decode")
# child spans remembered for the root (``TraceParts`` kinds)
CHILD_SPANS = {"prefill_waiting": "sgl_waiting", "prefill_forward": "sgl_forward",
               "prefill_transfer_kv_cache": "sgl_kv", "decode_loop": "sgl_step",
               "decode_forward": "sgl_decode"}  # the last only to place decode_loop
SCHEDULER = "sgl_scheduler"  # a scheduler process's thread span
HOLD_S = 10.0  # > the OTel SDK's 5 s batch delay (OTEL_BSP_SCHEDULE_DELAY)
MAX_PENDING = 100_000
# stage and scheduler spans remembered (``remember``); roots wait for them and for their
# other role (``waiting_room``)
CAPABILITIES = Capabilities(remembers=True, pairs_roots=True)


def matches(span) -> bool:
    return _NAME.search(span.name) is not None and any(
        k.startswith("gen_ai.latency.") for k in span.attributes)


def role_of(span) -> str:
    role = span.name.rsplit("Req ", 1)[0].strip().lower()
    return role if role in ROLES else ""


def is_scheduler_thread(span) -> bool:
    return "Scheduler" in span.name and "thread_label" in span.attributes


def remember(span, parts) -> bool:
    """Keep (parent span id, start, end) of an SGLang stage or scheduler thread span."""
    kind = CHILD_SPANS.get(span.name)
    if kind is None:
        if not is_scheduler_thread(span):
            return False
        kind = SCHEDULER
    parts.add(span.trace_id, kind, span.span_id, (span.parent_span_id, span.start_ns,
                                                   span.end_ns))
    return True


def rid_of(span) -> str:
    a = span.attributes
    return text(a, "rid", "gen_ai.request.id") or span.span_id.hex()


def check(span) -> None:
    """Raise ``Rejected`` for a root whose attributes cannot be used (``row``'s reasons,
    given when the root arrives rather than when its request is counted)."""
    a = span.attributes
    ttft, e2e = (seconds(a, k) for k in LATENCY[:2])
    seconds(a, LATENCY[2])
    for keys in COUNT_KEYS:
        count(a, *keys)
    if ttft is None and e2e is None:
        raise Rejected("no_latency_attributes", f"{span.name!r} without time_to_first_token "
                       "or e2e")


def _own(parts: dict, root_id: bytes) -> dict[str, dict]:
    """The parts (kind -> span id -> value) under root ``root_id``: its scheduler thread
    spans and the stage spans whose parent chain (stage -> thread span, or stage ->
    stage -> thread span) reaches one. A trace may hold both roles' roots (a client's
    ``traceparent``)."""
    threads = {sid: v for sid, v in parts.get(SCHEDULER, {}).items() if v[0] == root_id}
    if len(threads) > 1:  # several scheduler ranks traced one request: one rank's stages
        sid = min(threads, key=lambda k: (threads[k][1], k))
        threads = {sid: threads[sid]}
    parent_of = {sid: v[0] for k in CHILD_SPANS.values() for sid, v in parts.get(k, {}).items()}
    out: dict[str, dict] = {SCHEDULER: threads}
    for kind in CHILD_SPANS.values():
        # a decode_loop under decode_forward (disaggregated): one stage further up
        out[kind] = {sid: v for sid, v in parts.get(kind, {}).items()
                     if parent_of.get(v[0], v[0]) in threads}
    return out


def _total(parts: dict) -> int | None:
    """Nanoseconds in the stage spans of one kind (a requeued request has several)."""
    return sum(end - start for _, start, end in parts.values()) if parts else None


def _client(roles: dict):
    """The root the client's stream came from: unified, else the decode server's."""
    return roles.get("") or roles.get("decode") or roles.get("prefill")


def row_of(roles: dict, ctx) -> tuple[tuple, float]:
    """A ``record.ROW_FIELDS`` row for one request from its roots (role -> ``Root``), and
    its KV transfer in seconds (NaN = none or unknown)."""
    client = _client(roles)
    pre = roles.get("") or roles.get("prefill")
    s, a = client.span, client.span.attributes
    ttft, e2e, decode = (seconds(a, k) for k in LATENCY)
    arrival = s.start_ns or None
    first = arrival + round(ttft * NS) if arrival and ttft is not None else None
    finish = arrival + round(e2e * NS) if arrival and e2e is not None else s.end_ns or None
    last = first + round(decode * NS) if first and decode is not None else None
    forward = _total(pre.parts.get("sgl_forward", {})) if pre else None
    waiting = _total(pre.parts.get("sgl_waiting", {})) if pre else None
    kv = _total(pre.parts.get("sgl_kv", {})) if pre and "decode" in roles else None
    scheduled = queued = None
    if first is not None and forward is not None:
        scheduled = first - forward - (kv or 0)
        queued = scheduled - waiting if waiting is not None else None
    tokens = None
    steps = sorted(client.parts.get("sgl_step", {}).values(), key=lambda v: v[1])
    if first is not None and steps:
        t0 = steps[0][1]
        tokens = [first] + [first + end - t0 for _, _, end in steps]
    pa = pre.span.attributes if pre else a  # the prompt: the server that read it
    prompt_keys, cached_keys, output_keys = COUNT_KEYS
    out = row(ctx.model_for(s, text(a, "gen_ai.response.model", "gen_ai.request.model")),
              ENGINE, first_reason(a.get("gen_ai.response.finish_reasons")),
              text(a, "gen_ai.request.id", "rid"), arrival, scheduled, first, last, finish,
              count(pa, *prompt_keys), count(pa, *cached_keys), count(a, *output_keys),
              queued=queued, token_times=tokens)
    return out, (kv / NS if kv is not None else float("nan"))


def convert(span, ctx) -> tuple:
    """A root alone (its stage spans, if remembered, are taken from ``ctx.trace_parts``)."""
    check(span)
    root = Root(span, "")
    root.claim(ctx.trace_parts)
    return row_of({role_of(span): root}, ctx)[0]


def waiting_room(hold: float = HOLD_S) -> PendingRoots:
    """Where roots wait for their stage spans and other role (``PendingRoots``)."""
    return PendingRoots(hold=hold)


@dataclass
class Root:
    span: object
    protocol: str
    parts: dict = field(default_factory=dict)
    complete: bool = False  # its scheduler's thread span (so all its stages) has come

    def look(self, trace_parts) -> bool:
        if not self.complete and trace_parts is not None:
            own = _own(trace_parts.peek_raw(self.span.trace_id), self.span.span_id)
            self.complete = bool(own[SCHEDULER])
        return self.complete

    def claim(self, trace_parts) -> None:
        """Take this root's parts out of ``trace_parts`` (leaving another root's)."""
        if trace_parts is None:
            return
        raw = trace_parts.take_raw(self.span.trace_id)
        self.parts = _own(raw, self.span.span_id)
        for kind, vs in raw.items():
            mine = self.parts.get(kind, {})
            for sid, v in vs.items():
                if sid not in mine:  # another root's (both roles in one trace)
                    trace_parts.add(self.span.trace_id, kind, sid, v)


@dataclass
class Released:
    """One request ready to count: its row, KV transfer (s), root spans and protocol."""

    row: tuple
    kv_transfer: float
    spans: list  # the request's root spans, the client-facing one first
    protocol: str
    outcome: str  # complete, waited (past the hold, parts missing), capacity


class PendingRoots:
    """Roots waiting for their stage spans and their other role (module docstring).
    Bounded: past ``max_pending`` requests the oldest is counted with what it has."""

    def __init__(self, hold: float = HOLD_S, max_pending: int = MAX_PENDING,
                 clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        # a request's roots by role, by rid: each waits ``hold`` seconds from its first
        self._by_rid: Room[dict[str, Root]] = Room(hold, max_pending, clock)
        self._by_trace: dict[bytes, set[str]] = {}
        # disaggregated requests counted with one role missing: the late role is refused
        # (``late_role``) rather than counted as a second request
        self._one_role: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_rid)

    @property
    def hold(self) -> float:
        """Seconds a request waits for its parts at most."""
        return self._by_rid.hold

    @property
    def max_pending(self) -> int:
        """Requests waiting at most: past it the oldest is counted (capacity)."""
        return self._by_rid.max_size

    @max_pending.setter
    def max_pending(self, value: int) -> None:
        self._by_rid.max_size = value

    def park(self, spans: list, protocol: str) -> list[str]:
        """Check and hold root spans; the reason each was refused ("" = held)."""
        reasons = []
        now = self._clock()
        with self._lock:
            for s in spans:
                try:
                    check(s)
                except Rejected as e:
                    reasons.append(e.reason)
                    continue
                rid, role = rid_of(s), role_of(s)
                if role and rid in self._one_role:
                    reasons.append("late_role")
                    continue
                reasons.append("")
                roles = self._roles(rid, now)
                if role in roles:  # the same request's root again, as a new span
                    rid = f"{rid}#{s.span_id.hex()}"
                    roles = self._roles(rid, now)
                roles[role] = Root(s, protocol)
                self._by_trace.setdefault(s.trace_id, set()).add(rid)
        return reasons

    def _roles(self, rid: str, now: float) -> dict[str, Root]:
        roles = self._by_rid.get(rid)
        return self._by_rid.put(rid, {}, now) if roles is None else roles

    def ready(self, ctx, traces=(), force: bool = False) -> list[Released]:
        """Requests complete now (checking those in ``traces``, the traces that gained
        parts or roots), those past ``hold`` seconds (all with ``force``), and the
        oldest past capacity."""
        now = float("inf") if force else self._clock()
        out = []
        with self._lock:
            for t in traces:
                for rid in list(self._by_trace.get(t, ())):
                    roles = self._by_rid.get(rid)
                    if roles is not None and self._complete(roles, ctx.trace_parts):
                        out.append(self._release(rid, self._by_rid.take(rid), ctx, "complete"))
            for rid, roles, reason in self._by_rid.sweep(now):
                outcome = "capacity" if reason == CAPACITY else (
                    "complete" if self._complete(roles, ctx.trace_parts) else "waited")
                out.append(self._release(rid, roles, ctx, outcome))
        return out

    @staticmethod
    def _complete(roles: dict, trace_parts) -> bool:
        if "" not in roles and not ("prefill" in roles and "decode" in roles):
            return False  # one role of a disaggregated request: wait for the other
        return all(r.look(trace_parts) for r in roles.values())

    def _release(self, rid: str, roles: dict[str, Root], ctx, outcome: str) -> Released:
        for r in roles.values():
            rids = self._by_trace.get(r.span.trace_id)
            if rids is not None:
                rids.discard(rid)
                if not rids:
                    del self._by_trace[r.span.trace_id]
            r.claim(ctx.trace_parts)
        client = _client(roles)
        if "" not in roles and len(roles) == 1:
            self._one_role[rid] = None
            if len(self._one_role) > self.max_pending:
                self._one_role.popitem(last=False)
        row_, kv = row_of(roles, ctx)
        spans = [client.span, *(r.span for r in roles.values() if r is not client)]
        return Released(row_, kv, spans, client.protocol, outcome)
