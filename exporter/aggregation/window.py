"""Rolling window over recently ingested requests, for the JSON API (and the dashboard).

``summarize`` returns a ``WindowSummary`` (``phasewatch.aggregation.summary``): figures,
which the JSON API lays out.

Two bounded structures, both indexed by label set (model, engine):

* a ring of the most recent ``capacity`` accepted requests with their phases, for
  window quantiles of TTFT/TPOT/e2e, phase time shares and the request waterfall;
* one-second slices of exact counts (requests, prompt and output tokens) and of a
  fine log-linear histogram of pooled ITL gaps, so rates are exact whatever the
  load and ITL quantiles need no per-gap storage. Counts are weighted as the counters
  are (a request whose trace was sampled counts 1/p, ``RequestBatch.weight``), so rates
  agree with ``/metrics``; the requests as received are counted beside them.

Membership is by the requests' own clock: each request counts in the second it finished
(its finish, else its last token; its ingest time when it has neither or when that is
more than ``window_rows.FUTURE_TOLERANCE_S`` past the exporter's clock), in rates and
quantiles alike, and a label set's window ends at its newest finish plus the wall time
since that label set's last ingest. Live, that is now; a replay or a burst that delivers
a minute of requests in a few seconds is rated over the minute its requests span (rates
follow the requests' finish times, not their arrival at phasewatch); when traffic stops
the window keeps moving and the rates fall to 0. A label set's rates divide by the
window, or by the time its requests' clock covers (from their earliest arrival to the
window's end) when that is shorter. Slices are kept per label set, so senders whose
clocks disagree do not mix.
Memory is fixed by ``capacity``, ``seconds`` and the label-set cap.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import astuple, dataclass, fields

import numpy as np

from phasewatch.aggregation.columns import WindowColumns
from phasewatch.aggregation.slo import N_OBJ, WINDOW_COLUMNS
from phasewatch.aggregation.summary import (
    Quantiles,
    SeriesSummary,
    SloFigures,
    WindowSummary,
    by_prompt_class,
    whole,
)
from phasewatch.aggregation.window_rows import (
    RING_FLOAT,
    RING_INT,
    RING_SLO,
    SLICE_COLUMNS,
    BatchRows,
    batch_rows,
    rows_of,
)
from phasewatch.requests.buckets import WINDOW_INDEX
from phasewatch.requests.gaps import GapCounts
from phasewatch.requests.record import FINISH_REASONS

# engine decode steps (TGI's per-step spans): ingest time, label set, the forward's
# start and end (Unix s) and the requests in it
STEP_CAPACITY = 65536
DEFAULT_NAMES = ("model", "engine", "pod")  # label-set names: LabelSets.names


@dataclass(frozen=True)
class ReportedSteps:
    """Decode steps an engine reported (TGI), one row each: when it was ingested (``t``),
    its label set (``ls``), start and end (Unix seconds) and the requests in it."""

    t: np.ndarray
    ls: np.ndarray
    start: np.ndarray
    end: np.ndarray
    size: np.ndarray

    def where(self, rows: np.ndarray) -> ReportedSteps:
        return ReportedSteps(*(column[rows] for column in astuple(self)))


_STEP_COLUMNS = tuple(f.name for f in fields(ReportedSteps))


@dataclass
class _SliceSums:
    """The window's slices summed per label set: counts (SLICE_COLUMNS), the ITL
    histogram and its sum, and the objectives' flags (None without objectives)."""

    counts: np.ndarray
    itl: np.ndarray
    itl_sum: np.ndarray
    slo: np.ndarray | None


class RollingWindow:
    def __init__(self, seconds: float = 30.0, capacity: int = 65536, clock=time.time):
        if seconds <= 0 or seconds > 3600:
            raise ValueError(f"window seconds must be in (0, 3600], got {seconds}")
        if capacity < 1:
            raise ValueError(f"window capacity must be positive, got {capacity}")
        self.seconds = float(seconds)
        self.capacity = capacity
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()
        self._ring = {c: np.full(capacity, np.nan) for c in RING_FLOAT}
        self._ring.update({c: np.zeros(capacity, dtype=np.int64) for c in RING_INT})
        self._ring.update({c: np.full((capacity, N_OBJ), -1, np.int8) for c in RING_SLO})
        self._ids = np.empty(capacity, dtype=object)
        self._head = 0  # next write position
        self._size = 0
        self._slots = math.ceil(self.seconds) + 2
        # per (slot, label set): the requests' second it holds (-1: none)
        self._slot_second = np.full((self._slots, 0), -1, dtype=np.int64)
        # per label set: newest done_at, earliest arrival (else done_at), wall time of
        # its last ingest
        self._newest = np.zeros(0)
        self._first = np.zeros(0)
        self._last_ingest = np.zeros(0)
        # requests, prompt tokens, output tokens, and ITL per token: tokens, seconds
        self._slice_counts = np.zeros((self._slots, 0, SLICE_COLUMNS))
        self._slice_itl = np.zeros((self._slots, 0, WINDOW_INDEX.size), dtype=np.int32)
        self._slice_itl_sum = np.zeros((self._slots, 0))  # exact seconds, for the mean
        self._steps = {c: np.full(STEP_CAPACITY, np.nan) for c in _STEP_COLUMNS}
        self._step_head = 0
        # with objectives (``Aggregator(objectives=...)`` sets it): label-set tuple ->
        # its ``Objectives``, and per slice the good requests and (objective, outcome)
        # counts (``aggregation.slo.window_columns``)
        self.objectives = None
        self._slice_slo = np.zeros((self._slots, 0, WINDOW_COLUMNS))  # weighted

    # ---- writing -------------------------------------------------------------
    def add(self, batch, ph, ls: np.ndarray, n_ls: int, reasons: np.ndarray,
            gaps: GapCounts, judged=None) -> None:
        """Add a batch's kept requests; ``gaps`` holds its token gaps binned by
        ``WINDOW_INDEX`` (``phasewatch.requests.gaps``), ``judged`` its rows against their
        objectives (``requests.objectives.Judged``) when objectives are set."""
        now = self._clock()
        b = batch_rows(batch, ph, ls, reasons, judged, now)
        with self._lock:
            self._write_ring(b.rows, b.ids)
            self._grow(n_ls)
            for i in np.unique(b.ls).tolist():
                mine = b.ls == i
                self._newest[i] = max(self._newest[i], float(b.rows["done_at"][mine].max()))
                first = float(b.began[mine].min())
                self._first[i] = first if self._first[i] == 0 else min(self._first[i], first)
                self._last_ingest[i] = now
            self._add_to_slices(b, n_ls)
            self._add_gaps(b, gaps)

    def _add_to_slices(self, b: BatchRows, n_ls: int) -> None:
        """Each request in the slot of the second it finished, per label set."""
        key = b.second * n_ls + b.ls
        uniq, inverse = np.unique(key, return_inverse=True)
        inverse = inverse.reshape(-1)
        sums = np.stack([np.bincount(inverse, weights=b.values[:, j], minlength=len(uniq))
                         for j in range(SLICE_COLUMNS)], axis=1)
        w = b.rows["weight"]
        flags = None if b.slo is None else np.stack([
            np.bincount(inverse, weights=col * w, minlength=len(uniq))
            for col in b.slo.T], axis=1)
        for j, (k, row) in enumerate(zip(uniq.tolist(), sums, strict=True)):
            sec, i = divmod(k, n_ls)
            slot = self._slot_for(sec, i)
            if slot is not None:
                self._slice_counts[slot, i] += row
                if flags is not None:
                    self._slice_slo[slot, i] += flags[j]

    def _add_gaps(self, b: BatchRows, gaps: GapCounts) -> None:
        """A batch's gaps go to each label set's newest second in it."""
        for j, i in enumerate(gaps.series.tolist()):
            mine = b.ls == i
            if not mine.any():
                continue
            slot = self._slot_for(int(b.second[mine].max()), i)
            if slot is not None:
                self._slice_itl[slot, i] += gaps.window[j].astype(np.int32)
                self._slice_itl_sum[slot, i] += gaps.sums[j]

    def _grow(self, n_ls: int) -> None:
        extra = n_ls - self._slice_counts.shape[1]
        if extra <= 0:
            return
        self._slice_counts = np.pad(self._slice_counts, ((0, 0), (0, extra), (0, 0)))
        self._slice_itl = np.pad(self._slice_itl, ((0, 0), (0, extra), (0, 0)))
        self._slice_itl_sum = np.pad(self._slice_itl_sum, ((0, 0), (0, extra)))
        if self.objectives is not None:
            self._slice_slo = np.pad(self._slice_slo, ((0, 0), (0, extra), (0, 0)))
        self._slot_second = np.pad(self._slot_second, ((0, 0), (0, extra)),
                                   constant_values=-1)
        for name in ("_newest", "_first", "_last_ingest"):
            setattr(self, name, np.pad(getattr(self, name), (0, extra)))

    def _slot_for(self, second: int, i: int) -> int | None:
        """Label set ``i``'s slot for ``second``, emptied if it held an older second;
        None when ``second`` is older than the slots still hold (counted in no rate)."""
        slot = second % self._slots
        held = self._slot_second[slot, i]
        if held == second:
            return slot
        if held > second:
            return None
        self._slot_second[slot, i] = second
        self._slice_counts[slot, i] = 0
        self._slice_itl[slot, i] = 0
        self._slice_itl_sum[slot, i] = 0
        if self.objectives is not None:
            self._slice_slo[slot, i] = 0
        return slot

    def add_steps(self, ls: np.ndarray, start: np.ndarray, end: np.ndarray,
                  size: np.ndarray) -> None:
        """Decode steps an engine reported (label set, start and end in Unix seconds,
        requests in the step), for the roofline's decode batch."""
        n = min(len(ls), STEP_CAPACITY)
        now = self._clock()
        with self._lock:
            pos = (self._step_head + np.arange(n)) % STEP_CAPACITY
            for k, v in (("t", np.full(n, now)), ("ls", ls), ("start", start), ("end", end),
                         ("size", size)):
                self._steps[k][pos] = np.asarray(v, dtype=float)[-n:]
            self._step_head = (self._step_head + n) % STEP_CAPACITY

    def steps(self, seconds: float | None = None) -> ReportedSteps:
        """The reported decode steps ingested in the last ``seconds`` (default: the
        window), as ``columns`` does for requests; ``ls`` as integers."""
        now = self._clock()
        span = seconds or self.seconds
        with self._lock:
            sel = ~np.isnan(self._steps["t"]) & (self._steps["t"] >= now - span)
            out = rows_of(self._steps, sel)
        out["ls"] = out["ls"].astype(np.int64)
        return ReportedSteps(**out)

    def _write_ring(self, rows: dict, ids: np.ndarray) -> None:
        n = len(ids)
        if n > self.capacity:  # keep only the newest rows of an oversized batch
            rows = {k: v[-self.capacity:] for k, v in rows.items()}
            ids, n = ids[-self.capacity:], self.capacity
        pos = (self._head + np.arange(n)) % self.capacity
        for k, v in rows.items():
            self._ring[k][pos] = v
        self._ids[pos] = ids
        self._head = (self._head + n) % self.capacity
        self._size = min(self.capacity, self._size + n)

    # ---- reading -------------------------------------------------------------
    def summary(self, label_sets: list[tuple], seconds: float | None = None,
                names: tuple[str, ...] = DEFAULT_NAMES) -> dict:
        """``summarize``'s figures in their JSON form (``/api/v1/summary``)."""
        return self.summarize(label_sets, seconds, names).as_dict()

    def summarize(self, label_sets: list[tuple], seconds: float | None = None,
                  names: tuple[str, ...] = DEFAULT_NAMES) -> WindowSummary:
        """Per label set: rates, TTFT/ITL/TPOT/e2e quantiles, phase time shares, over the
        ``seconds`` (at most the window) ending at its requests' clock's now (module
        docstring)."""
        now = self._clock()
        length = min(seconds or self.seconds, self.seconds)
        uptime = now - self._started
        with self._lock:
            # each label set's window end on its requests' clock
            end = self._newest + (now - self._last_ingest)
            sums = self._slice_sums(end, length)
            covered = np.minimum(length, np.maximum(end - self._first, min(length, uptime)))
            ring = self._ring_within(end, length)
        series = [self._series(i, key, names, sums, covered, ring)
                  for i, key in enumerate(label_sets)]
        series = [s for s in series if s is not None]
        shown = [s.covered_seconds for s in series]
        return WindowSummary(length, max(shown) if shown else max(min(length, uptime), 1e-9),
                             now, self.capacity, series)

    def _slice_sums(self, end: np.ndarray, length: float) -> _SliceSums:
        """The per-second slices of the last ``length`` seconds before each label set's
        ``end``, summed per label set (under the lock). Summed slot by slot: no temporary
        the size of all slots (a few MB at the label cap, which the allocator would keep)."""
        n = self._slice_counts.shape[1]
        live = ((self._slot_second > np.floor(end - length)) & (self._slot_second <= end)
                & (self._slot_second >= 0))
        sums = _SliceSums(np.zeros((n, SLICE_COLUMNS)),
                          np.zeros((n, WINDOW_INDEX.size), dtype=np.int64), np.zeros(n),
                          np.zeros((n, WINDOW_COLUMNS)) if self.objectives is not None
                          else None)
        for slot in np.flatnonzero(live.any(axis=1)).tolist():
            m = live[slot]
            sums.counts[m] += self._slice_counts[slot, m]
            if sums.slo is not None:
                sums.slo[m] += self._slice_slo[slot, m]
            sums.itl[m] += self._slice_itl[slot, m]
            sums.itl_sum[m] += self._slice_itl_sum[slot, m]
        return sums

    def _ring_within(self, end: np.ndarray, length: float) -> dict[str, np.ndarray]:
        """The sampled requests done within the last ``length`` seconds before their
        label set's ``end`` (whole seconds, as the slices), under the lock."""
        ring_ls = self._ring["ls"]
        known = ~np.isnan(self._ring["t"]) & (ring_ls < self._slice_counts.shape[1])
        lo = np.full(len(ring_ls), np.inf)
        lo[known] = np.floor(end[ring_ls[known]] - length)
        in_window = known & (np.floor(self._ring["done_at"]) > lo)
        return {k: v[in_window] for k, v in self._ring.items()}

    def _series(self, i: int, key: tuple, names: tuple[str, ...], sums: _SliceSums,
                covered: np.ndarray, ring: dict[str, np.ndarray]) -> SeriesSummary | None:
        """Label set ``i``'s figures, or None where the window holds none of its requests
        (a label set made after the window last grew: ``i`` past its arrays)."""
        sel = ring["ls"] == i
        if i >= len(sums.itl_sum) or (sums.counts[i, 0] == 0 and not sel.any()):
            return None
        model, engine = key[:2]
        c, covered_i = sums.counts[i], float(covered[i])
        return SeriesSummary(
            model, engine, dict(zip(names[2:], key[2:], strict=False)),
            covered_seconds=max(covered_i, 1e-9), requests=whole(c[0]),
            prompt_tokens=whole(c[1]), output_tokens=whole(c[2]),
            received_requests=int(c[5]),
            ttft=Quantiles.of(ring["ttft"][sel]), tpot=Quantiles.of(ring["tpot"][sel]),
            e2e=Quantiles.of(ring["e2e"][sel]),
            e2e_to_last_token=Quantiles.of(ring["last_token_at"][sel] - ring["arrival"][sel]),
            itl=Quantiles.binned(sums.itl[i], sums.itl_sum[i]),
            itl_per_token_mean=float(c[4] / c[3]) if c[3] else None,
            itl_per_token_count=int(c[3]),
            phase_time_share=phase_time_shares(ring, sel),
            ttft_by_prompt_class=by_prompt_class(ring, sel),
            sampled_requests=int(sel.sum()),
            slo=SloFigures.of(self.objectives(key), sums.slo[i], covered_i, c[0])
            if sums.slo is not None else None)

    def columns(self, seconds: float | None = None) -> WindowColumns:
        """Copies of the ring's columns for requests ingested in the last ``seconds``
        (default: the window; may reach further back, as far as the ring holds), all
        label sets; for the roofline estimator."""
        now = self._clock()
        span = seconds or self.seconds
        with self._lock:
            sel = ~np.isnan(self._ring["t"]) & (self._ring["t"] >= now - span)
            return WindowColumns(**rows_of(self._ring, sel))

    def recent(self, label_sets: list[tuple], limit: int = 200,
               model: str | None = None, names: tuple[str, ...] = DEFAULT_NAMES) -> list[dict]:
        """The newest accepted requests with their phases, newest first."""
        with self._lock:
            order = (self._head - 1 - np.arange(self._size)) % self.capacity
            if model is not None:
                wanted = [i for i, key in enumerate(label_sets) if key[0] == model]
                order = order[np.isin(self._ring["ls"][order], wanted)]
            order = order[:limit]
            ring = {k: v[order] for k, v in self._ring.items()}
            ids = self._ids[order]
        out = []
        for j in range(len(ids)):
            key = label_sets[ring["ls"][j]]
            row = {"request_id": ids[j], "model": key[0], "engine": key[1],
                   **dict(zip(names[2:], key[2:], strict=False)),
                   "finish_reason": FINISH_REASONS[ring["finish_reason"][j]]}
            for k in ("arrival", "preprocess", "queue", "prefill", "kv_transfer", "ttft",
                      "decode", "tpot", "e2e"):
                v = float(ring[k][j])
                row[k] = None if math.isnan(v) else v
            for k, name in (("prompt", "prompt_tokens"), ("cached", "cached_prompt_tokens"),
                            ("output", "output_tokens")):
                v = int(ring[k][j])
                row[name] = None if v < 0 else v
            out.append(row)
        return out


SHARE_PHASES = ("preprocess", "queue", "prefill", "kv_transfer", "decode")
OPTIONAL_PHASES = ("preprocess", "kv_transfer")  # not every server reports them
# The client's view (a tap's records, no engine span): time to first token, undivided
# (preprocess + queue + prefill: named so that no one reads it as prefill), and decode.
CLIENT_PHASES = ("ttft", "decode")


def phase_time_shares(cols: dict, sel: np.ndarray | None = None) -> dict[str, float | None]:
    """Each phase's share of the time requests spent in all of them, over the requests
    (``sel``) whose queue, prefill and decode are known. A request that does not report
    preprocess has it inside its queue (measured from arrival), so it adds 0 there; one
    without a KV transfer (not disaggregated) had none. An optional phase no request
    reports is None, and so is ``ttft``.

    Where no request has its queue and prefill known but some have their time to first
    token and decode (the client's view: a stream tap's records, no engine span), the
    shares are those two (``CLIENT_PHASES``) and every engine phase is None. All None
    without such requests either."""
    sel = np.ones(len(cols["queue"]), dtype=bool) if sel is None else sel
    q, p, d = cols["queue"][sel], cols["prefill"][sel], cols["decode"][sel]
    full = ~(np.isnan(q) | np.isnan(p) | np.isnan(d))
    none = dict.fromkeys((*SHARE_PHASES, "ttft"))
    if not full.any():
        t = cols["ttft"][sel]
        seen = ~(np.isnan(t) | np.isnan(d))
        total = float(t[seen].sum() + d[seen].sum())
        if not seen.any() or total <= 0:
            return none
        return {**none, "ttft": float(t[seen].sum() / total),
                "decode": float(d[seen].sum() / total)}
    optional = {k: cols[k][sel][full] for k in OPTIONAL_PHASES}
    parts = {"preprocess": np.nan_to_num(optional["preprocess"]).sum(), "queue": q[full].sum(),
             "prefill": p[full].sum(), "kv_transfer": np.nan_to_num(optional["kv_transfer"]).sum(),
             "decode": d[full].sum()}
    total = sum(parts.values())
    if total <= 0:
        return none
    shares = {**none, **{k: float(parts[k] / total) for k in SHARE_PHASES}}
    for k, v in optional.items():
        if np.isnan(v).all():
            shares[k] = None
    return shares
