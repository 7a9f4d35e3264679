"""The one internal request record, in columnar form.

Every receiver converts what it gets into a ``RequestBatch``: one row per finished
request, one numpy column per field, strings interned in a per-batch table. The
single-request ``RequestRecord`` (or its row tuple) is for code that builds records
one at a time (the client library, adapters, tests); ``RequestBatch.from_rows`` /
``from_records`` turn them into columns. Every batch is made by a ``BatchBuilder``
(columns by name, the rest absent); ``take`` and ``concat`` select and join rows.

Conventions (the same as the wire protocol's):
* times are int64 Unix nanoseconds, 0 = absent;
* token counts are int64, -1 = unknown;
* ``token_gaps`` holds, request after request, the seconds between consecutive
  token emissions (emission 0 = first token); ``gap_counts[i]`` of them belong
  to request i, and 0 means no emission times are known for it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# Engines' finish reasons mapped onto a bounded set (vLLM: stop/length/abort;
# TGI: eos_token/length/stop_sequence; OpenAI-style: stop/length/content_filter).
FINISH_REASONS = ("stop", "length", "abort", "error", "other", "unknown")
_FINISH_ALIASES = {
    "stop": "stop", "eos": "stop", "eos_token": "stop", "stop_sequence": "stop",
    "length": "length", "max_tokens": "length", "abort": "abort", "cancelled": "abort",
    "canceled": "abort", "error": "error", "": "unknown",
}

UNKNOWN_COUNT = -1
TOKEN_PIECE = 4096  # token times converted between two pauses (~75 us)
NS = 1_000_000_000
MAX_SECONDS = 9.2e9  # |Unix seconds| that fit int64 nanoseconds


@dataclass
class RequestRecord:
    """One finished request. Times are Unix seconds (floats) or None when unknown."""

    model: str
    arrival: float | None = None
    queued: float | None = None  # the engine took it in (after templating, tokenisation)
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finish: float | None = None
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str = ""
    request_id: str = ""
    engine: str = ""
    # one time per emission (a streamed chunk, or one token when each is sent alone),
    # the first token's first
    token_times: Sequence[float] | None = None
    # optional, aligned with token_times: the tokens each emission carried (a
    # multi-token chunk, speculative decoding); None = unknown
    token_counts: Sequence[int] | None = None
    # "<W3C trace id>-<span id>" (lower-case hex) of the span the engine's request span is
    # a child of: what the stream tap injected as ``traceparent``, or an engine span's
    # trace and parent. Rows of both sides with the same one are one request
    # (aggregation.tracejoin).
    trace_parent: str = ""
    # which choice (sequence) of a request with n > 1 this is: a further one (> 0) shares
    # the first's prompt (``RequestBatch.prompt_shared``)
    choice: int = 0

    def row(self, engine: str = "") -> tuple:
        """This record as a ``ROW_FIELDS`` tuple."""
        return (self.model, self.engine or engine, self.finish_reason, self.request_id,
                self.arrival, self.queued, self.scheduled, self.first_token, self.last_token,
                self.finish,
                self.prompt_tokens, self.cached_prompt_tokens, self.output_tokens,
                self.token_times, self.token_counts, self.trace_parent, self.choice)


# Order of the fields in a row tuple (the client buffers rows, not objects). Rows may
# stop after token_times (the span adapters' rows) or token_counts.
ROW_FIELDS = ("model", "engine", "finish_reason", "request_id", "arrival", "queued",
              "scheduled", "first_token", "last_token", "finish", "prompt_tokens",
              "cached_prompt_tokens", "output_tokens", "token_times", "token_counts",
              "trace_parent", "choice")

# Who saw a row's request (``RequestBatch.source``, the ``source`` label): the engine
# (its spans, events or own client), the stream tap in front of it, or both (joined).
SOURCES = ("engine", "tap", "joined")
SOURCE_ENGINE, SOURCE_TAP, SOURCE_JOINED = range(3)
# the stream tap's W3C tracestate member key (``phasewatch=tap``): an engine span that
# inherited it came through a tap, whose record of the request follows
TAP_TRACESTATE_KEY = "phasewatch"


@dataclass
class RequestBatch:
    """Finished requests, one row each (module docstring), made by ``BatchBuilder``."""

    strings: list[str]  # strings[0] == ""
    model: np.ndarray  # int32 refs into strings
    engine: np.ndarray  # int32 refs
    finish_reason: np.ndarray  # int32 refs
    request_id: np.ndarray  # int32 refs
    arrival: np.ndarray  # int64 ns
    # int64 ns: the engine took the request in (vLLM's QUEUED event); 0 = unknown
    queued: np.ndarray
    scheduled: np.ndarray
    first_token: np.ndarray
    last_token: np.ndarray
    finish: np.ndarray
    prompt_tokens: np.ndarray  # int64, -1 unknown
    cached_prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    token_gaps: np.ndarray  # seconds, flattened; float64 (float32 as decoded off the wire)
    gap_counts: np.ndarray  # int64 per request
    # int64, one per token_gaps entry: tokens carried by the emission that ends the gap;
    # 0 = unknown (all of a request's, or none), -1 = the sender's counts did not fit
    # its emissions (the request is rejected). None: unknown for the whole batch.
    gap_tokens: np.ndarray | None
    # How far (ns) a time of the frontend's clock and one of the engine's may disagree in
    # these rows (``phases``' "Two clocks"): 0 = one clock, strict order.
    clock_skew_tolerance_ns: int
    # bool per row: a further sequence of a parallel-sampling request (vLLM n > 1 sends
    # one span per sequence, each with the whole prompt): its prompt was read once, by
    # the request's first sequence, so it is not counted again (tokens, prompt rates,
    # prefill work); its prompt_tokens still say how long the prompt was (prompt class).
    prompt_shared: np.ndarray
    # float64 seconds per row, NaN = none or unknown: a disaggregated request's KV-cache
    # transfer from its prefill server, between the prefill and the first token (SGLang's
    # ``prefill_transfer_kv_cache``). ``scheduled`` is then first token - transfer -
    # prefill, so the prefill phase is ``first_token - scheduled - kv_transfer``.
    kv_transfer: np.ndarray
    # int32 refs into strings: ``RequestRecord.trace_parent`` (0 = none)
    trace_parent: np.ndarray
    # int8 per row: index into SOURCES
    source: np.ndarray
    # int64 per row: ``RequestRecord.choice`` (rows with choice > 0 are prompt_shared)
    choice: np.ndarray
    # int32 refs into strings: the pod the request came from (OTLP's resource), for a
    # central exporter's ``pod`` label (0 = none)
    pod: np.ndarray
    # bool per row: an engine span that carries the stream tap's tracestate member
    # (TAP_TRACESTATE_KEY): it came through a tap, whose record of it is coming
    tapped: np.ndarray
    # float64 per row: the requests this row stands for, 1 / the probability its trace was
    # sampled with (``requests.sampling``); 1 = not sampled or unknown. Counters add it,
    # latency histograms do not.
    weight: np.ndarray

    def __len__(self) -> int:
        return len(self.arrival)

    @classmethod
    def from_rows(cls, rows: Sequence[tuple], times_in_ns: bool = False,
                  pause: Callable[[], None] | None = None,
                  source: int = SOURCE_ENGINE) -> RequestBatch:
        """Columns from ``ROW_FIELDS`` tuples (``BatchBuilder.from_rows``), every row seen
        by ``source``."""
        builder = BatchBuilder.from_rows(rows, times_in_ns, pause)
        if source != SOURCE_ENGINE:
            builder.columns(source=np.full(len(rows), source))
        return builder.build()

    @classmethod
    def from_records(cls, records: Sequence[RequestRecord], engine: str = "") -> RequestBatch:
        """Columns from single records (``engine`` fills records that name none)."""
        return cls.from_rows([r.row(engine) for r in records])

    def strings_of(self, refs: np.ndarray) -> list[str]:
        lut = np.asarray(self.strings, dtype=object)
        return list(lut[refs])

    def take(self, rows: np.ndarray) -> RequestBatch:
        """The rows ``rows`` (a bool mask, or indexes in any order), with their token gaps;
        the string table is shared."""
        rows = np.asarray(rows)
        if rows.dtype == bool:
            if rows.all():
                return self
            rows = np.flatnonzero(rows)
        counts = self.gap_counts[rows]
        starts = (np.cumsum(self.gap_counts) - self.gap_counts)[rows]
        # each taken row's gaps: its start, start + 1, ..., in the order of ``rows``
        gap = np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
        builder = BatchBuilder(len(rows), strings=self.strings)
        builder.columns(**{k: getattr(self, k)[rows] for k in PER_ROW})
        return builder.gaps(self.token_gaps[gap], counts, None if self.gap_tokens is None
                            else self.gap_tokens[gap]).tolerance(
            self.clock_skew_tolerance_ns).build()


def concat(batches: Sequence[RequestBatch]) -> RequestBatch:
    """The rows of ``batches``, in order, as one batch: a table of the strings they use
    (none other), token gaps as float64, gap tokens (0 = unknown) where any has them, the
    widest clock tolerance of them."""
    builder = BatchBuilder(sum(len(b) for b in batches))
    cols: dict[str, list] = {k: [] for k in PER_ROW}
    for b in batches:
        for k in PER_ROW:
            col = getattr(b, k)
            if k in TEXT_COLUMNS:  # refs into this batch's table -> into the new one
                used, inverse = np.unique(col, return_inverse=True)
                lut = np.fromiter((builder.ref(b.strings[u]) for u in used.tolist()),
                                  dtype=np.int32, count=len(used))
                col = lut[inverse.reshape(-1)]
            cols[k].append(col)
    if not batches:
        return builder.build()
    tokens = None if all(b.gap_tokens is None for b in batches) else np.concatenate([
        np.zeros(len(b.token_gaps), np.int64) if b.gap_tokens is None else b.gap_tokens
        for b in batches])
    return builder.columns(**{k: np.concatenate(v) for k, v in cols.items()}).gaps(
        np.concatenate([b.token_gaps.astype(np.float64) for b in batches]),
        np.concatenate([b.gap_counts for b in batches]), tokens).tolerance(
        max(b.clock_skew_tolerance_ns for b in batches)).build()


# Every per-row column of a batch, its dtype and its value when absent (prompt_shared's:
# choice > 0). TEXT_COLUMNS hold refs into the batch's string table.
COLUMNS = {
    **dict.fromkeys(("model", "engine", "finish_reason", "request_id", "trace_parent",
                     "pod"), (np.int32, 0)),
    **dict.fromkeys(("arrival", "queued", "scheduled", "first_token", "last_token",
                     "finish"), (np.int64, 0)),
    **dict.fromkeys(("prompt_tokens", "cached_prompt_tokens", "output_tokens"),
                    (np.int64, UNKNOWN_COUNT)),
    "choice": (np.int64, 0), "prompt_shared": (bool, None), "kv_transfer": (np.float64, np.nan),
    "source": (np.int8, SOURCE_ENGINE), "tapped": (bool, False), "weight": (np.float64, 1.0),
    "gap_counts": (np.int64, 0),
}
PER_ROW = tuple(COLUMNS)
TEXT_COLUMNS = PER_ROW[:6]


class BatchBuilder:
    """One ``RequestBatch`` of ``n`` rows from columns given by name; a column not given
    is absent (``COLUMNS``' values), token gaps none. Text goes in as strings (``text``,
    interned), or as refs (``columns``) into a table the builder adopts
    (``BatchBuilder(n, strings=...)``) or interned with ``ref``::

        BatchBuilder(n).text(model=names).columns(arrival=ns, output_tokens=c).build()
    """

    def __init__(self, n: int, strings: list[str] | None = None):
        self.n = n
        self.strings = [""] if strings is None else strings
        self._index: dict[str, int] | None = {"": 0} if strings is None else None
        self._cols: dict[str, np.ndarray] = {}
        self._gaps: tuple = (np.empty(0), np.zeros(n, dtype=np.int64), None)
        self._tolerance = 0

    def ref(self, s: str) -> int:
        """``s``'s index in the table (added if new)."""
        if self._index is None:  # an adopted table, indexed on first use
            self._index = {}
            for i, v in enumerate(self.strings):
                self._index.setdefault(v, i)
        r = self._index.get(s)
        if r is None:
            r = self._index[s] = len(self.strings)
            self.strings.append(s)
        return r

    def text(self, **columns: Iterable[str | None]) -> BatchBuilder:
        """Text columns as strings, one per row (None = "")."""
        for name, values in columns.items():
            self.ref("")
            index, strings = self._index, self.strings
            if len(index) == len(strings):  # no repeats in the table: intern inline
                refs = np.fromiter((index.setdefault(v or "", len(index)) for v in values),
                                   dtype=np.int32, count=self.n)
                strings.extend(itertools.islice(index, len(strings), None))
            else:
                refs = np.fromiter((self.ref(v or "") for v in values), dtype=np.int32,
                                   count=self.n)
            self.columns(**{name: refs})
        return self

    def columns(self, **columns) -> BatchBuilder:
        """Per-row columns by name (``COLUMNS``), converted to the column's dtype."""
        for name, values in columns.items():
            if name not in COLUMNS:
                raise TypeError(f"a RequestBatch has no column {name!r}")
            self._cols[name] = np.asarray(values, dtype=COLUMNS[name][0]).reshape(self.n)
        return self

    def gaps(self, token_gaps: np.ndarray, gap_counts: np.ndarray,
             gap_tokens: np.ndarray | None = None) -> BatchBuilder:
        """Token gaps (seconds, flattened, kept in their dtype), how many of them each row
        has, and the tokens of each gap's emission (None = unknown)."""
        self._gaps = (token_gaps, gap_counts, gap_tokens)
        return self

    def tolerance(self, clock_skew_ns: int) -> BatchBuilder:
        """``RequestBatch.clock_skew_tolerance_ns`` (0: one clock)."""
        self._tolerance = clock_skew_ns
        return self

    def build(self) -> RequestBatch:
        cols = dict(self._cols)
        token_gaps, gap_counts, gap_tokens = self._gaps
        cols.setdefault("gap_counts", gap_counts)
        for name, (dtype, absent) in COLUMNS.items():
            if name not in cols and absent is not None:
                cols[name] = np.full(self.n, absent, dtype=dtype)
        cols.setdefault("prompt_shared", cols["choice"] > 0)
        return RequestBatch(strings=self.strings, token_gaps=token_gaps,
                            gap_counts=np.asarray(cols.pop("gap_counts"), dtype=np.int64),
                            gap_tokens=gap_tokens, clock_skew_tolerance_ns=self._tolerance,
                            **cols)

    @classmethod
    def from_rows(cls, rows: Sequence[tuple], times_in_ns: bool = False,
                  pause: Callable[[], None] | None = None) -> BatchBuilder:
        """A builder with the columns of ``ROW_FIELDS`` tuples; None or 0 = absent.

        Times (and token times) are Unix seconds as floats, or with ``times_in_ns``
        integer Unix ns, kept exact (the lifecycle join has them so). Rows are
        transposed once (``zip``) and each column converted by numpy in C; token
        emission times become gaps with one ``np.diff`` over all of them, not a loop
        per token. ``pause`` is called between columns and between pieces of about
        TOKEN_PIECE token times: the client's sender passes ``os.sched_yield`` so a
        large batch never holds the GIL for long.
        """
        pause = pause or _nothing
        n = len(rows)
        cols = list(zip(*rows, strict=True)) if n else [()] * len(ROW_FIELDS)
        cols += [(None,) * n] * (len(ROW_FIELDS) - len(cols))  # rows without the last fields
        field = dict(zip(ROW_FIELDS, cols, strict=True))
        pause()
        b = cls(n)
        for name in ("model", "engine", "finish_reason", "request_id", "trace_parent"):
            b.text(**{name: field[name]})
            pause()

        def times(values) -> np.ndarray:
            if times_in_ns:
                return np.array([v or 0 for v in values], dtype=np.int64).reshape(n)
            s = np.array(values, dtype=float).reshape(n)  # None -> NaN
            # NaN, infinities and times past the int64 ns range (year 2262) are absent
            ok = np.abs(s) < MAX_SECONDS
            return np.where(ok, np.round(np.where(ok, s, 0) * NS), 0).astype(np.int64)

        def counts(values) -> np.ndarray:
            return np.array([UNKNOWN_COUNT if v is None else v for v in values],
                            dtype=np.int64).reshape(n)

        for name in ("arrival", "queued", "scheduled", "first_token", "last_token", "finish"):
            b.columns(**{name: times(field[name])})
            pause()
        for name in ("prompt_tokens", "cached_prompt_tokens", "output_tokens"):
            b.columns(**{name: counts(field[name])})
            pause()
        tt = [() if v is None else v for v in field["token_times"]]
        lens = np.fromiter(map(len, tt), dtype=np.int64, count=n)
        pieces, start, ends = [], 0, np.cumsum(lens)
        while start < n:  # about TOKEN_PIECE token times per piece
            stop = max(start + 1, int(np.searchsorted(ends, ends[start] + TOKEN_PIECE)))
            pieces.append(np.fromiter(itertools.chain.from_iterable(tt[start:stop]),
                                      dtype=np.int64 if times_in_ns else float,
                                      count=int(lens[start:stop].sum())))
            start = stop
            pause()
        flat = np.concatenate(pieces) if pieces else np.empty(0)
        owner = np.repeat(np.arange(n), lens)
        gaps = np.diff(flat)[owner[1:] == owner[:-1]] if flat.size > 1 else np.empty(0)
        if times_in_ns:
            gaps = gaps / NS  # differences of exact integers: no epoch-scale rounding
        gap_counts = np.maximum(lens - 1, 0)
        b.gaps(gaps, gap_counts, _gap_tokens(field["token_counts"], lens, gap_counts))
        return b.columns(choice=[v or 0 for v in field["choice"]])


def _nothing() -> None:
    pass


def _gap_tokens(counts: Sequence, emissions: np.ndarray,
                gap_counts: np.ndarray) -> np.ndarray | None:
    """Per gap: the tokens of the emission ending it, from per-emission counts (None =
    unknown: 0s; not one per emission: -1s, so the request is rejected); None when no
    request has counts."""
    if all(c is None for c in counts):
        return None
    out = np.zeros(int(gap_counts.sum()), dtype=np.int64)
    at = 0
    for c, n, g in zip(counts, emissions.tolist(), gap_counts.tolist(), strict=True):
        if c is not None and g:
            arr = np.asarray(list(c))
            ok = len(arr) == n and arr.dtype.kind in "iu"
            out[at:at + g] = arr[1:] if ok else -1
        at += g
    return out


def finish_reason_codes(batch: RequestBatch) -> np.ndarray:
    """Index into FINISH_REASONS for every row: one lookup per distinct reason used
    (the string table also holds every request id, which must not be walked)."""
    used, inverse = np.unique(batch.finish_reason, return_inverse=True)
    codes = np.array([FINISH_REASONS.index(_FINISH_ALIASES.get(
        batch.strings[i].lower(), "other")) for i in used.tolist()], dtype=np.int64)
    return codes[inverse].reshape(-1) if len(used) else np.zeros(0, dtype=np.int64)
