"""Rolling window over recently ingested requests, for the JSON API (and the dashboard).

Two bounded structures, both indexed by label set (model, engine):

* a ring of the most recent ``capacity`` accepted requests with their phases, for
  window quantiles of TTFT/TPOT/e2e, phase time shares and the request waterfall;
* one-second slices of exact counts (requests, prompt and output tokens) and of a
  fine log-linear histogram of pooled ITL gaps, so rates are exact whatever the
  load and ITL quantiles need no per-gap storage.

Membership is by ingest time (the exporter's clock), like Prometheus's rate():
senders' clocks may be skewed or simulated. Memory is fixed by ``capacity``,
``seconds`` and the label-set cap, never by load.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np

from exporter.buckets import (
    PROMPT_CLASS_RANGES,
    PROMPT_CLASSES,
    WINDOW_INDEX,
    prompt_class_codes,
)
from exporter.gaps import GapCounts
from exporter.record import FINISH_REASONS, NS

_RING_FLOAT = ("t", "arrival", "preprocess", "queue", "prefill", "kv_transfer", "ttft", "decode",
               "tpot", "e2e", "scheduled_at", "first_token_at", "last_token_at", "end_at")
# steps: decode steps a request took (token-gap count when emission times were sent,
# else output_tokens - 1; -1 unknown); timed: 1 when steps came from emission times.
_RING_INT = ("ls", "prompt", "cached", "uncached", "output", "finish_reason", "steps", "timed")
QUANTILES = (0.5, 0.9, 0.95, 0.99)
# engine decode steps (TGI's per-step spans): ingest time, label set, the forward's
# start and end (Unix s) and the requests in it
_STEP_COLUMNS = ("t", "ls", "start", "end", "size")
STEP_CAPACITY = 65536


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
        self._ring = {c: np.full(capacity, np.nan) for c in _RING_FLOAT}
        self._ring.update({c: np.zeros(capacity, dtype=np.int64) for c in _RING_INT})
        self._ids = np.empty(capacity, dtype=object)
        self._head = 0  # next write position
        self._size = 0
        self._slots = math.ceil(self.seconds) + 2
        self._slot_second = np.full(self._slots, -1, dtype=np.int64)
        self._slice_counts = np.zeros((self._slots, 0, 3))  # requests, prompt, output
        self._slice_itl = np.zeros((self._slots, 0, WINDOW_INDEX.size), dtype=np.int32)
        self._slice_itl_sum = np.zeros((self._slots, 0))  # exact seconds, for the mean
        self._steps = {c: np.full(STEP_CAPACITY, np.nan) for c in _STEP_COLUMNS}
        self._step_head = 0

    # ---- writing -------------------------------------------------------------
    def add(self, batch, ph, ls: np.ndarray, n_ls: int, reasons: np.ndarray,
            gaps: GapCounts) -> None:
        """Add a batch's kept requests; ``gaps`` holds its token gaps binned by
        ``WINDOW_INDEX`` (``exporter.gaps``)."""
        now = self._clock()
        kept = ph.kept

        def at(col: np.ndarray) -> np.ndarray:
            c = col[kept]
            return np.where(c != 0, c / NS, np.nan)

        out = batch.output_tokens[kept]
        steps = batch.gap_counts[kept]
        end = at(batch.finish)
        rows = {
            "t": np.full(int(kept.sum()), now),
            "arrival": np.where(batch.arrival[kept] != 0, batch.arrival[kept] / NS, np.nan),
            "preprocess": ph.preprocess[kept], "queue": ph.queue[kept],
            "prefill": ph.prefill[kept], "kv_transfer": ph.kv_transfer[kept],
            "ttft": ph.ttft[kept],
            "decode": ph.decode[kept], "tpot": ph.tpot[kept], "e2e": ph.e2e[kept],
            "scheduled_at": at(batch.scheduled), "first_token_at": at(batch.first_token),
            "last_token_at": at(batch.last_token),
            "end_at": np.where(np.isnan(end), at(batch.last_token), end),
            "ls": ls[kept], "prompt": batch.prompt_tokens[kept],
            "cached": batch.cached_prompt_tokens[kept],
            "uncached": ph.uncached_prompt_tokens[kept], "output": out,
            "finish_reason": reasons[kept],
            "steps": np.where(steps > 0, steps, np.where(out > 1, out - 1, -1)),
            "timed": (steps > 0).astype(np.int64),
        }
        ids = np.asarray(batch.strings, dtype=object)[batch.request_id[kept]]
        counts = np.zeros((n_ls, 3))
        k_ls = ls[kept]
        counts[:, 0] = np.bincount(k_ls, minlength=n_ls)
        once = ~batch.prompt_shared[kept]  # a shared prompt counts with its first sequence
        for j, col in ((1, batch.prompt_tokens), (2, batch.output_tokens)):
            c = col[kept]
            counted = (c >= 0) & once if j == 1 else c >= 0
            counts[:, j] = np.bincount(k_ls[counted], weights=c[counted], minlength=n_ls)
        with self._lock:
            self._write_ring(rows, ids)
            slot = self._slot_for(int(now), n_ls)
            self._slice_counts[slot, :n_ls] += counts
            self._slice_itl[slot, gaps.series] += gaps.window.astype(np.int32)
            self._slice_itl_sum[slot, gaps.series] += gaps.sums

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

    def steps(self, seconds: float | None = None) -> dict[str, np.ndarray]:
        """The reported decode steps ingested in the last ``seconds`` (default: the
        window), as ``columns`` does for requests; ``ls`` as integers."""
        now = self._clock()
        span = seconds or self.seconds
        with self._lock:
            sel = ~np.isnan(self._steps["t"]) & (self._steps["t"] >= now - span)
            out = {k: v[sel] for k, v in self._steps.items()}
        out["ls"] = out["ls"].astype(np.int64)
        return out

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

    def _slot_for(self, second: int, n_ls: int) -> int:
        if n_ls > self._slice_counts.shape[1]:
            extra = n_ls - self._slice_counts.shape[1]
            self._slice_counts = np.pad(self._slice_counts, ((0, 0), (0, extra), (0, 0)))
            self._slice_itl = np.pad(self._slice_itl, ((0, 0), (0, extra), (0, 0)))
            self._slice_itl_sum = np.pad(self._slice_itl_sum, ((0, 0), (0, extra)))
        slot = second % self._slots
        if self._slot_second[slot] != second:
            self._slot_second[slot] = second
            self._slice_counts[slot] = 0
            self._slice_itl[slot] = 0
            self._slice_itl_sum[slot] = 0
        return slot

    # ---- reading -------------------------------------------------------------
    def summary(self, label_sets: list[tuple], seconds: float | None = None) -> dict:
        """Per label set: rates, TTFT/ITL/TPOT/e2e quantiles, phase time shares."""
        now = self._clock()
        span = min(seconds or self.seconds, self.seconds)
        with self._lock:
            live = self._slot_second > int(now) - math.ceil(span)
            counts = self._slice_counts[live].sum(axis=0)
            itl = self._slice_itl[live].sum(axis=0, dtype=np.int64)
            itl_sum = self._slice_itl_sum[live].sum(axis=0)
            in_window = ~np.isnan(self._ring["t"]) & (self._ring["t"] >= now - span)
            ring = {k: v[in_window] for k, v in self._ring.items()}
        elapsed = max(min(span, now - self._started), 1e-9)
        models = []
        for i, key in enumerate(label_sets):
            model, engine = key[:2]
            sel = ring["ls"] == i
            if i >= counts.shape[0] or (counts[i, 0] == 0 and not sel.any()):
                continue
            models.append({
                "model": model, "engine": engine, **({"pod": key[2]} if len(key) > 2 else {}),
                "requests_in_window": int(counts[i, 0]),
                "prompt_tokens_in_window": int(counts[i, 1]),
                "output_tokens_in_window": int(counts[i, 2]),
                "request_rate": counts[i, 0] / elapsed,
                "prompt_tokens_per_second": counts[i, 1] / elapsed,
                "output_tokens_per_second": counts[i, 2] / elapsed,
                "ttft_seconds": _quantiles(ring["ttft"][sel]),
                "tpot_seconds": _quantiles(ring["tpot"][sel]),
                "e2e_seconds": _quantiles(ring["e2e"][sel]),
                # vLLM's e2e: arrival to the last token (e2e above runs to the finish)
                "e2e_to_last_token_seconds": _quantiles(
                    ring["last_token_at"][sel] - ring["arrival"][sel]),
                "itl_seconds": _binned_quantiles(itl[i], itl_sum[i]),
                "phase_time_share": phase_time_shares(ring, sel),
                "ttft_by_prompt_class": _by_prompt_class(ring, sel),
                "sampled_requests": int(sel.sum()),
            })
        return {"window_seconds": span, "covered_seconds": elapsed, "generated_at": now,
                "ring_capacity": self.capacity, "models": models}

    def columns(self, seconds: float | None = None) -> dict[str, np.ndarray]:
        """Copies of the ring's columns for requests ingested in the last ``seconds``
        (default: the window; may reach further back, as far as the ring holds), all
        label sets; for the roofline estimator."""
        now = self._clock()
        span = seconds or self.seconds
        with self._lock:
            sel = ~np.isnan(self._ring["t"]) & (self._ring["t"] >= now - span)
            return {k: v[sel] for k, v in self._ring.items()}

    def recent(self, label_sets: list[tuple], limit: int = 200,
               model: str | None = None) -> list[dict]:
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
                   **({"pod": key[2]} if len(key) > 2 else {}),
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


def _quantiles(values: np.ndarray) -> dict:
    """Mean, p50/p90/p95/p99 (numpy's linear interpolation, as ``vllm bench serve``'s
    ``np.percentile``) and count of the known values."""
    v = values[~np.isnan(values)]
    if v.size == 0:
        return {"mean": None} | {f"p{round(q * 100)}": None for q in QUANTILES} | {"count": 0}
    qs = np.quantile(v, QUANTILES)
    return {"mean": float(v.mean())} | {
        f"p{round(q * 100)}": float(x) for q, x in zip(QUANTILES, qs, strict=True)} | {
        "count": int(v.size)}


def _binned_quantiles(counts: np.ndarray, total_seconds: float) -> dict:
    """Quantiles from the window's log-linear bins (each the bin's geometric middle)
    and the exact mean from the gaps' summed seconds."""
    total = int(counts.sum())
    if total == 0:
        return {"mean": None} | {f"p{round(q * 100)}": None for q in QUANTILES} | {"count": 0}
    cum = np.cumsum(counts)
    lo, hi = WINDOW_INDEX.bounds()
    out = {"mean": float(total_seconds / total)}
    for q in QUANTILES:
        b = int(np.searchsorted(cum, q * total, side="left"))
        b = min(max(b, 1), len(lo)) - 1  # under/overflow bins read as the range's ends
        out[f"p{round(q * 100)}"] = float(math.sqrt(lo[b] * hi[b]))  # geometric middle
    return out | {"count": total}


def _by_prompt_class(ring: dict, sel: np.ndarray) -> list[dict]:
    """TTFT and prefill seconds per uncached prompt token per prompt-length class, so a
    TTFT rise from longer prompts is told apart from a slower prefill."""
    codes = prompt_class_codes(ring["prompt"][sel])
    ttft, prefill, uncached = ring["ttft"][sel], ring["prefill"][sel], ring["uncached"][sel]
    with np.errstate(divide="ignore", invalid="ignore"):
        per_token = np.where(uncached > 0, prefill / uncached, np.nan)
    out = []
    for code, (_, label) in enumerate(PROMPT_CLASSES):
        mine = codes == code
        if mine.any():
            lo, hi = PROMPT_CLASS_RANGES[label]
            out.append({"prompt_class": label, "min_tokens": lo, "max_tokens": hi,
                        "ttft_seconds": _quantiles(ttft[mine]),
                        "prefill_seconds_per_token": _quantiles(per_token[mine])})
    return out


SHARE_PHASES = ("preprocess", "queue", "prefill", "kv_transfer", "decode")
OPTIONAL_PHASES = ("preprocess", "kv_transfer")  # not every server reports them


def phase_time_shares(cols: dict, sel: np.ndarray | None = None) -> dict[str, float | None]:
    """Each phase's share of the time requests spent in all of them, over the requests
    (``sel``) whose queue, prefill and decode are known. A request that does not report
    preprocess has it inside its queue (measured from arrival), so it adds 0 there; one
    without a KV transfer (not disaggregated) had none. An optional phase no request
    reports is None. All None without such requests."""
    sel = np.ones(len(cols["queue"]), dtype=bool) if sel is None else sel
    q, p, d = cols["queue"][sel], cols["prefill"][sel], cols["decode"][sel]
    full = ~(np.isnan(q) | np.isnan(p) | np.isnan(d))
    optional = {k: cols[k][sel][full] for k in OPTIONAL_PHASES}
    parts = {"preprocess": np.nan_to_num(optional["preprocess"]).sum(), "queue": q[full].sum(),
             "prefill": p[full].sum(), "kv_transfer": np.nan_to_num(optional["kv_transfer"]).sum(),
             "decode": d[full].sum()}
    total = sum(parts.values())
    if not full.any() or total <= 0:
        return dict.fromkeys(SHARE_PHASES)
    shares = {k: float(parts[k] / total) for k in SHARE_PHASES}
    for k, v in optional.items():
        if np.isnan(v).all():
            shares[k] = None
    return shares
