"""The one internal request record, in columnar form.

Every receiver converts what it gets into a ``RequestBatch``: one row per finished
request, one numpy column per field, strings interned in a per-batch table. The
single-request ``RequestRecord`` is a convenience for code that builds records one
at a time (the client library, adapters, tests); ``RequestBatch.from_records``
turns a list of them into columns.

Conventions (the same as the wire protocol's):
* times are int64 Unix nanoseconds, 0 = absent;
* token counts are int64, -1 = unknown;
* ``token_gaps`` holds, request after request, the seconds between consecutive
  token emissions (emission 0 = first token); ``gap_counts[i]`` of them belong
  to request i, and 0 means no emission times are known for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# Engines' finish reasons mapped onto a bounded set (vLLM: stop/length/abort;
# TGI: eos_token/length/stop_sequence; OpenAI-style: stop/length/content_filter).
FINISH_REASONS = ("stop", "length", "abort", "error", "other", "unknown")
_FINISH_ALIASES = {
    "stop": "stop", "eos": "stop", "eos_token": "stop", "stop_sequence": "stop",
    "length": "length", "max_tokens": "length", "abort": "abort", "cancelled": "abort",
    "canceled": "abort", "error": "error", "": "unknown",
}

ABSENT_TIME = 0
UNKNOWN_COUNT = -1
NS = 1_000_000_000


def to_unix_nano(seconds: float | None) -> int:
    """Unix seconds (float, as ``time.time()`` gives) to ns; None -> absent (0)."""
    return ABSENT_TIME if seconds is None else round(seconds * NS)


@dataclass
class RequestRecord:
    """One finished request. Times are Unix seconds (floats) or None when unknown."""

    model: str
    arrival: float | None = None
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
    token_times: Sequence[float] | None = None  # emission times, first token first


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
    token_gaps: np.ndarray  # float64 seconds, flattened
    gap_counts: np.ndarray  # int64 per request
    extra: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.arrival)

    @classmethod
    def empty(cls) -> RequestBatch:
        return cls.from_records([])

    @classmethod
    def from_records(cls, records: Sequence[RequestRecord], engine: str = "") -> RequestBatch:
        """Build columns from single records (a Python loop: not for hot paths)."""
        table: dict[str, int] = {"": 0}

        def ref(s: str | None) -> int:
            return table.setdefault(s or "", len(table))

        def count(v: int | None) -> int:
            return UNKNOWN_COUNT if v is None else int(v)

        gaps: list[np.ndarray] = []
        counts = []
        rows = []
        for r in records:
            rows.append((
                ref(r.model), ref(r.engine or engine), ref(r.finish_reason), ref(r.request_id),
                to_unix_nano(r.arrival), to_unix_nano(r.scheduled), to_unix_nano(r.first_token),
                to_unix_nano(r.last_token), to_unix_nano(r.finish),
                count(r.prompt_tokens), count(r.cached_prompt_tokens), count(r.output_tokens),
            ))
            times = np.asarray(r.token_times if r.token_times is not None else (), dtype=float)
            g = np.diff(times) if times.size > 1 else np.empty(0)
            gaps.append(g)
            counts.append(g.size)
        cols = np.array(rows, dtype=np.int64).reshape(len(rows), 12).T
        return cls(
            strings=list(table),
            model=cols[0].astype(np.int32),
            engine=cols[1].astype(np.int32),
            finish_reason=cols[2].astype(np.int32),
            request_id=cols[3].astype(np.int32),
            arrival=cols[4].copy(),
            scheduled=cols[5].copy(),
            first_token=cols[6].copy(),
            last_token=cols[7].copy(),
            finish=cols[8].copy(),
            prompt_tokens=cols[9].copy(),
            cached_prompt_tokens=cols[10].copy(),
            output_tokens=cols[11].copy(),
            token_gaps=np.concatenate(gaps) if gaps else np.empty(0),
            gap_counts=np.asarray(counts, dtype=np.int64),
        )

    @staticmethod
    def concat(batches: Sequence[RequestBatch]) -> RequestBatch:
        """Concatenate batches, merging their string tables."""
        batches = [b for b in batches if len(b)]
        if not batches:
            return RequestBatch.empty()
        table: dict[str, int] = {"": 0}
        remapped: dict[str, list[np.ndarray]] = {k: [] for k in _REF_COLUMNS}
        for b in batches:
            lut = np.fromiter((table.setdefault(s, len(table)) for s in b.strings),
                              dtype=np.int32, count=len(b.strings))
            for k in _REF_COLUMNS:
                remapped[k].append(lut[getattr(b, k)])
        cols = {k: np.concatenate([getattr(b, k) for b in batches]) for k in _VALUE_COLUMNS}
        cols.update({k: np.concatenate(v) for k, v in remapped.items()})
        return RequestBatch(strings=list(table), **cols)

    def strings_of(self, refs: np.ndarray) -> list[str]:
        lut = np.asarray(self.strings, dtype=object)
        return list(lut[refs])


_REF_COLUMNS = ("model", "engine", "finish_reason", "request_id")
_VALUE_COLUMNS = (
    "arrival", "scheduled", "first_token", "last_token", "finish",
    "prompt_tokens", "cached_prompt_tokens", "output_tokens", "token_gaps", "gap_counts",
)


def finish_reason_codes(batch: RequestBatch) -> np.ndarray:
    """Index into FINISH_REASONS for every row (a dict lookup per distinct string)."""
    lut = np.fromiter(
        (FINISH_REASONS.index(_FINISH_ALIASES.get(s.lower(), "other")) for s in batch.strings),
        dtype=np.int64, count=len(batch.strings))
    return lut[batch.finish_reason]
