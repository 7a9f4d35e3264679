"""The one internal request record, in columnar form.

Every receiver converts what it gets into a ``RequestBatch``: one row per finished
request, one numpy column per field, strings interned in a per-batch table. The
single-request ``RequestRecord`` (or its row tuple) is for code that builds records
one at a time (the client library, adapters, tests); ``RequestBatch.from_rows`` /
``from_records`` turn them into columns.

Conventions (the same as the wire protocol's):
* times are int64 Unix nanoseconds, 0 = absent;
* token counts are int64, -1 = unknown;
* ``token_gaps`` holds, request after request, the seconds between consecutive
  token emissions (emission 0 = first token); ``gap_counts[i]`` of them belong
  to request i, and 0 means no emission times are known for it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
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
    """Finished requests, one row each. See the module docstring for conventions."""

    strings: list[str]  # strings[0] == ""
    model: np.ndarray  # int32 refs into strings
    engine: np.ndarray  # int32 refs
    finish_reason: np.ndarray  # int32 refs
    request_id: np.ndarray  # int32 refs
    arrival: np.ndarray  # int64 ns
    scheduled: np.ndarray
    first_token: np.ndarray
    last_token: np.ndarray
    finish: np.ndarray
    prompt_tokens: np.ndarray  # int64, -1 unknown
    cached_prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    token_gaps: np.ndarray  # seconds, flattened; float64 (float32 as decoded off the wire)
    gap_counts: np.ndarray  # int64 per request
    # int64 ns: the engine took the request in (vLLM's QUEUED event). Last, with a default
    # (all absent), so receivers that never know it build batches as before.
    queued: np.ndarray | None = None
    # How far (ns) a time of the frontend's clock and one of the engine's may disagree in
    # these rows (``phases``' "Two clocks"): 0 = one clock, strict order.
    clock_skew_tolerance_ns: int = 0
    # bool per row: a further sequence of a parallel-sampling request (vLLM n > 1 sends
    # one span per sequence, each with the whole prompt): its prompt was read once, by
    # the request's first sequence, so it is not counted again (tokens, prompt rates,
    # prefill work); its prompt_tokens still say how long the prompt was (prompt class).
    prompt_shared: np.ndarray | None = None
    # float64 seconds per row, NaN = none or unknown: a disaggregated request's KV-cache
    # transfer from its prefill server, between the prefill and the first token (SGLang's
    # ``prefill_transfer_kv_cache``). ``scheduled`` is then first token - transfer -
    # prefill, so the prefill phase is ``first_token - scheduled - kv_transfer``.
    kv_transfer: np.ndarray | None = None
    # int64, one per token_gaps entry: tokens carried by the emission that ends the gap;
    # 0 = unknown (all of a request's, or none), -1 = the sender's counts did not fit
    # its emissions (the request is rejected). None: unknown for the whole batch.
    gap_tokens: np.ndarray | None = None
    # int32 refs into strings: ``RequestRecord.trace_parent`` (0 = none)
    trace_parent: np.ndarray | None = None
    # int8 per row: index into SOURCES
    source: np.ndarray | None = None
    # int64 per row: ``RequestRecord.choice`` (rows with choice > 0 are prompt_shared)
    choice: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.arrival)
        if self.queued is None:
            self.queued = np.zeros(n, dtype=np.int64)
        if self.trace_parent is None:
            self.trace_parent = np.zeros(n, dtype=np.int32)
        if self.source is None:
            self.source = np.zeros(n, dtype=np.int8)
        if self.choice is None:
            self.choice = np.zeros(n, dtype=np.int64)
        if self.prompt_shared is None:
            self.prompt_shared = np.zeros(len(self.arrival), dtype=bool)
        if self.kv_transfer is None:
            self.kv_transfer = np.full(len(self.arrival), np.nan)

    def __len__(self) -> int:
        return len(self.arrival)

    @classmethod
    def from_rows(cls, rows: Sequence[tuple], times_in_ns: bool = False,
                  pause: Callable[[], None] | None = None) -> RequestBatch:
        """Columns from ``ROW_FIELDS`` tuples; None or 0 = absent.

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
        pause()
        table: dict[str, int] = {"": 0}
        refs = []
        for i in (0, 1, 2, 3, 15):
            refs.append(np.fromiter((table.setdefault(v or "", len(table)) for v in cols[i]),
                                    dtype=np.int32, count=n))
            pause()

        def times(i: int) -> np.ndarray:
            if times_in_ns:
                return np.array([v or 0 for v in cols[i]], dtype=np.int64).reshape(n)
            s = np.array(cols[i], dtype=float).reshape(n)  # None -> NaN
            # NaN, infinities and times past the int64 ns range (year 2262) are absent
            ok = np.abs(s) < MAX_SECONDS
            return np.where(ok, np.round(np.where(ok, s, 0) * NS), 0).astype(np.int64)

        def counts(i: int) -> np.ndarray:
            return np.array([UNKNOWN_COUNT if v is None else v for v in cols[i]],
                            dtype=np.int64).reshape(n)

        scalars = []
        for i in range(4, 13):
            scalars.append(times(i) if i < 10 else counts(i))
            pause()
        tt = [() if v is None else v for v in cols[13]]
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
        gap_tokens = _gap_tokens(cols[14], lens, gap_counts)
        choice = np.array([v or 0 for v in cols[16]], dtype=np.int64).reshape(n)
        return cls(
            strings=list(table), model=refs[0], engine=refs[1], finish_reason=refs[2],
            request_id=refs[3], arrival=scalars[0], queued=scalars[1], scheduled=scalars[2],
            first_token=scalars[3], last_token=scalars[4], finish=scalars[5],
            prompt_tokens=scalars[6], cached_prompt_tokens=scalars[7],
            output_tokens=scalars[8], token_gaps=gaps, gap_counts=gap_counts,
            gap_tokens=gap_tokens, trace_parent=refs[4], prompt_shared=choice > 0,
            choice=choice,
        )

    @classmethod
    def from_records(cls, records: Sequence[RequestRecord], engine: str = "") -> RequestBatch:
        """Columns from single records (``engine`` fills records that name none)."""
        return cls.from_rows([r.row(engine) for r in records])

    def strings_of(self, refs: np.ndarray) -> list[str]:
        lut = np.asarray(self.strings, dtype=object)
        return list(lut[refs])


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
