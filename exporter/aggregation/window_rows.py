"""A batch's kept requests as the rolling window stores them (``RollingWindow.add``):
the ring's columns per request, and the per-second slice counts they add up to; and the
ring's rows read back (``rows_of``).

Pure: numpy over the batch's columns, no lock and no window state; the window writes
what this returns under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from phasewatch.aggregation.slo import N_OBJ, window_columns
from phasewatch.requests.record import NS

# done_at: the second the request counts in (window.py's docstring); weight: the
# requests it stands for (``RequestBatch.weight``), for the roofline's work
RING_FLOAT = ("t", "arrival", "preprocess", "queue", "prefill", "kv_transfer", "ttft",
              "decode", "tpot", "e2e", "scheduled_at", "first_token_at", "last_token_at",
              "end_at", "done_at", "weight")
# steps: decode steps a request took (token-gap count when emission times were sent,
# else output_tokens - 1; -1 unknown); timed: 1 when steps came from emission times.
RING_INT = ("ls", "prompt", "cached", "uncached", "output", "finish_reason", "steps", "timed")
# with objectives, per request and objective (``requests.objectives.judge``): the outcome
# (MET, MISSED, UNKNOWN; -1 not set) and the phase that broke a miss (-1: not missed)
RING_SLO = ("slo_outcome", "slo_phase")
# per slice: requests, prompt, output tokens (weighted), per-token ITL tokens, seconds, and
# the requests as received (each once)
SLICE_COLUMNS = 6
FUTURE_TOLERANCE_S = 5.0  # a finish this far past the exporter's clock counts at ingest


@dataclass(frozen=True)
class BatchRows:
    """One batch's kept requests, ready for the window."""

    rows: dict[str, np.ndarray]  # ring column -> one value (or row) per request
    ids: np.ndarray  # request ids (object)
    ls: np.ndarray  # label set per request
    began: np.ndarray  # when each one's covered time began (Unix s)
    second: np.ndarray  # the second each one counts in (int)
    values: np.ndarray  # (requests, SLICE_COLUMNS): what each adds to its slice
    slo: np.ndarray | None  # (requests, slo.WINDOW_COLUMNS) flags, with objectives


def batch_rows(batch, ph, ls: np.ndarray, reasons: np.ndarray, judged, now: float) -> BatchRows:
    """``batch``'s kept requests (``ph.kept``) as ``BatchRows`` at ingest time ``now``."""
    kept = ph.kept
    rows = _ring_rows(batch, ph, ls, reasons, kept, now)
    for c, j in zip(RING_SLO, ("outcome", "phase"), strict=True):
        rows[c] = (np.full((len(rows["output"]), N_OBJ), -1, np.int8) if judged is None
                   else getattr(judged, j)[kept])
    done = rows["end_at"]
    # unknown, or later than the exporter's clock allows (a sender clock ahead, a
    # simulated or bogus time): counted at ingest, so it cannot move its label set's
    # window into the future and empty it
    done = np.where(np.isnan(done) | (done > now + FUTURE_TOLERANCE_S), now, done)
    rows["done_at"] = done
    # when the label set's covered time began: its earliest arrival (a benchmark's run,
    # as aiperf times it, from the first request), else its earliest finish
    arrival = rows["arrival"]
    began = np.where(np.isnan(arrival), done, np.minimum(arrival, done))
    ids = np.asarray(batch.strings, dtype=object)[batch.request_id[kept]]
    return BatchRows(rows=rows, ids=ids, ls=ls[kept], began=began,
                     second=np.floor(done).astype(np.int64),
                     values=_slice_values(batch, ph, kept, rows["weight"]),
                     slo=None if judged is None else window_columns(judged)[kept])


def _ring_rows(batch, ph, ls, reasons, kept, now: float) -> dict[str, np.ndarray]:
    def at(col: np.ndarray) -> np.ndarray:
        c = col[kept]
        return np.where(c != 0, c / NS, np.nan)

    out = batch.output_tokens[kept]
    steps = batch.gap_counts[kept]
    end = at(batch.finish)
    return {
        "t": np.full(int(kept.sum()), now),
        "arrival": at(batch.arrival),
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
        "timed": (steps > 0).astype(np.int64), "weight": batch.weight[kept],
    }


def _slice_values(batch, ph, kept, w: np.ndarray) -> np.ndarray:
    once = ~batch.prompt_shared[kept]  # a shared prompt counts with its first sequence
    prompt, output = batch.prompt_tokens[kept], batch.output_tokens[kept]
    per_token = (ph.itl_counts if ph.token_itl_counts is None
                 else ph.token_itl_counts)[kept]
    return np.stack([w, np.where((prompt >= 0) & once, prompt, 0) * w,
                     np.where(output >= 0, output, 0) * w,
                     per_token, np.where(per_token > 0, ph.gap_sums[kept], 0.0),
                     np.ones(len(w))], axis=1)


def rows_of(columns: dict[str, np.ndarray], sel: np.ndarray) -> dict[str, np.ndarray]:
    """``{k: v[sel]}``, the same rows in the same order; where ``sel`` is at most two
    runs (the ring's rows ingested since a time: one run, or two where it wrapped), by
    slices, which copy a whole column at once (half the time of the mask at 131,072
    rows)."""
    idx = np.flatnonzero(sel)
    gaps = np.flatnonzero(np.diff(idx) != 1)
    if len(idx) == 0 or len(gaps) > 1:
        return {k: v[sel] for k, v in columns.items()}
    if not len(gaps):
        run = slice(idx[0], idx[-1] + 1)
        return {k: v[run].copy() for k, v in columns.items()}
    a, b = slice(idx[0], idx[gaps[0]] + 1), slice(idx[gaps[0] + 1], idx[-1] + 1)
    return {k: np.concatenate([v[a], v[b]]) for k, v in columns.items()}
