"""The rolling window's requests as columns (``RollingWindow.columns()``): one array per
field, one row per request, for the roofline (its estimate, the cause, the objectives'
figures). The fields are the ring's (``window_rows.RING_*``), named in one place here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np

from phasewatch.aggregation.window_rows import RING_FLOAT, RING_INT, RING_SLO


@dataclass(frozen=True)
class WindowColumns:
    """Requests in the window, by column. Times are the sender's Unix seconds (NaN
    unknown), phases seconds, token counts -1 where unknown (``window_rows``)."""

    t: np.ndarray  # when the exporter ingested it (its own clock)
    arrival: np.ndarray
    preprocess: np.ndarray
    queue: np.ndarray
    prefill: np.ndarray
    kv_transfer: np.ndarray
    ttft: np.ndarray
    decode: np.ndarray
    tpot: np.ndarray
    e2e: np.ndarray
    scheduled_at: np.ndarray
    first_token_at: np.ndarray
    last_token_at: np.ndarray
    end_at: np.ndarray
    done_at: np.ndarray
    weight: np.ndarray  # the requests each stands for (1/p of a sampled trace)
    ls: np.ndarray  # label set
    prompt: np.ndarray
    cached: np.ndarray
    uncached: np.ndarray
    output: np.ndarray
    finish_reason: np.ndarray
    steps: np.ndarray  # decode steps it took (token gaps, else output - 1)
    timed: np.ndarray  # 1 where steps came from emission times
    slo_outcome: np.ndarray  # [request, objective]
    slo_phase: np.ndarray

    @classmethod
    def of(cls, columns: Mapping[str, np.ndarray]) -> WindowColumns:
        """From arrays by name; a column not given is unknown in every row (NaN, -1):
        a test's few columns, or the ring's whole set."""
        n = len(next(iter(columns.values()))) if columns else 0
        missing = {f.name: _unknown(f.name, n) for f in fields(cls) if f.name not in columns}
        return cls(**columns, **missing)

    def __len__(self) -> int:
        return len(self.end_at)

    def where(self, rows: np.ndarray) -> WindowColumns:
        """The rows ``rows`` selects (a mask or indices)."""
        return WindowColumns(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    def memo(self, key: object, make):
        """``make()``, made once for this columns object and kept with it: what the
        roofline's passes over one update share (a sort, the decodes' intervals). The
        columns are read, never written, once taken."""
        kept = self.__dict__.setdefault("_memo", {})  # (frozen: no attribute is set)
        if key not in kept:
            kept[key] = make()
        return kept[key]

    def order(self, name: str) -> np.ndarray:
        """The rows sorted by column ``name`` (NaN last), sorted once (``memo``)."""
        return self.memo(("order", name), lambda: argsort_nan_last(getattr(self, name)))

    def order_within(self, name: str, rows: np.ndarray) -> np.ndarray:
        """``np.argsort(column[rows])`` for the mask ``rows``, from ``order``: a pass over
        the column, not a sort (ties may fall in another order, as argsort's may)."""
        by = self.order(name)
        place = np.cumsum(rows) - 1  # each selected row's place among them
        return place[by[rows[by]]]

    def phases(self) -> dict[str, np.ndarray]:
        """The phase columns, for ``window.phase_time_shares``."""
        return {k: getattr(self, k) for k in ("preprocess", "queue", "prefill",
                                               "kv_transfer", "ttft", "decode")}


def argsort_nan_last(x: np.ndarray) -> np.ndarray:
    """``np.argsort(x)`` (NaN last; ties in either order), with the NaNs set aside
    first: numpy sorts floats with SIMD (x86-simd-sort) only where none is NaN, and a
    window's column of 100,000 times with 1 % unknown sorted 3-4x slower whole than its
    known values alone (bench/PROFILE.md, the roofline update)."""
    if x.dtype.kind != "f":
        return np.argsort(x)
    bad = np.isnan(x)
    if not bad.any():
        return _argsort(x)
    good = np.flatnonzero(~bad)
    return np.concatenate([good[_argsort(x[good])], np.flatnonzero(bad)])


def _argsort(x: np.ndarray) -> np.ndarray:
    order = time_order(x)
    return np.argsort(x) if order is None else order


def time_order(x: np.ndarray) -> np.ndarray | None:
    """``np.argsort(x, kind="stable")`` for positive floats that share one binary
    exponent (Unix times in seconds: every one since 2004 is in [2**30, 2**31)), as one
    sort of 64-bit integers; None for any other ``x``. Such floats are all whole
    multiples of one spacing, so each one's offset from the least, in those spacings, is
    an exact integer kept in order; shifted up, it holds the value's index in its low
    bits (ties then fall in index order, as a stable sort's). numpy sorts 64-bit integers
    with SIMD on AVX2 where it argsorts floats without: on the 2-core AMD host about half
    the time of ``np.argsort`` at 100,000 times (2.4 against 4.5 ms), and 6.1 ms at the
    decode-step timeline's 364,000 events against 9.1 for merging them from the requests'
    orders (``intervals.sorted_near``)."""
    n = len(x)
    if n < 2:
        return np.arange(n)
    if x.dtype != np.float64:
        return None
    lo, hi = float(x.min()), float(x.max())  # (NaN in x: NaN, and no order here)
    if not (lo > 0.0 and hi < math.inf) or math.frexp(lo)[1] != math.frexp(hi)[1]:
        return None
    bits = (n - 1).bit_length()
    spacing = math.ulp(lo)  # (one binade: the spacing of every value in it)
    if (hi - lo) / spacing >= 2.0 ** (64 - bits):
        return None
    key = np.subtract(x, lo)  # (exact: both multiples of the spacing, and the difference
    key *= 1.0 / spacing  # under 2**53 of them; the scaling a power of two)
    packed = key.astype(np.uint64)
    packed <<= np.uint64(bits)
    packed |= np.arange(n, dtype=np.uint64)
    packed.sort()
    packed &= np.uint64((1 << bits) - 1)
    return packed.view(np.int64)


def _unknown(name: str, n: int) -> np.ndarray:
    if name in RING_SLO:
        return np.full((n, 0), -1, np.int8)
    if name in RING_FLOAT:
        return np.full(n, np.nan)
    return np.zeros(n, np.int64) if name == "timed" else np.full(n, -1, np.int64)


assert {f.name for f in fields(WindowColumns)} == {*RING_FLOAT, *RING_INT, *RING_SLO}
