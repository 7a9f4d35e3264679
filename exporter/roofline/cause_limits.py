"""The thresholds the verdict (``Thresholds``: its rules 2 and 3) and the causes
(``Limits``) are found by, and how far each of the latter moves for the cause the verdict
already holds (hysteresis on the cause, as the phase and the resource have it).

A cause is decided again on every refresh from a window that slides. Near a threshold,
a records-only figure (the share of the time running sat at the slot limit, read from
the requests' own times) wanders by ten or twenty points between refreshes: the demo's
``overload`` read 74-100 % "at the maximum" in one minute, and where it dipped under
``pinned`` the banner said "no slot limit seen" for 4-12 s at a time while the batch
card read 63.4 of 64. So, as ``verdict.HYSTERESIS`` does for the phase, the cause in
place keeps its place until the evidence falls clearly past its threshold: each of its
thresholds moves by the amount here in its favour (``Limits.holding``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Limits:
    # vLLM preempts when it cannot allocate a block; its usage gauge reads 1.0 then.
    # Scraped every couple of seconds, a cache that fills and frees between scrapes
    # reads a little under: 0.95 is "full".
    kv_full: float = 0.95
    kv_room: float = 0.8  # under this the KV cache has room for more sequences
    # preemptions with the cache seen at least this full are kv_cache (a scrape every
    # couple of seconds misses the moment it was full); below it, preemption_recompute
    kv_preempt_full: float = 0.8
    pinned: float = 0.6  # share of scrapes (or moments) with running at its maximum
    waiting: float = 0.5  # share of scrapes with a request waiting: requests queue
    busy: float = 0.5  # share of the window the engine had a request in prefill or decode
    interference_flops: float = 0.5  # share of decode steps' FLOPs that are prefill chunks
    interference_slowdown: float = 1.25  # TPOT sharing every step with prefill / none
    interference_lost: float = 0.2  # share of decode time lost: shared x (1 - 1/slowdown)
    interference_shared: float = 0.3  # share of decode time shared with prefill (FLOPs rule)

    def holding(self, cause: str | None) -> Limits:
        """These limits with ``cause``'s thresholds moved in its favour (``HOLD``)."""
        moves = HOLD.get(cause or "", {})
        return replace(self, **{k: getattr(self, k) + v for k, v in moves.items()})


# How far each threshold moves for the cause in place (signed: toward keeping it).
HOLD: dict[str, dict[str, float]] = {
    "kv_cache": {"kv_full": -0.05, "kv_preempt_full": -0.05},
    "concurrency_limit": {"pinned": -0.15, "waiting": -0.15, "kv_room": 0.05},
    "prefill_interference": {"interference_slowdown": -0.1, "interference_lost": -0.05,
                             "interference_flops": -0.1, "interference_shared": -0.05},
    "compute_saturated": {"busy": -0.1},
}

LIMITS = Limits()


@dataclass(frozen=True)
class Thresholds:
    """The verdict's rules as numbers (``verdict``'s rules 2 and 3), used there only."""
    bound: float = 0.6  # of the achievable ceiling: under it, the resource is overhead
    # a phase's own rate past the peak is impossible (``PhaseEstimate.ceiling_exceeded``);
    # with the other phase's FLOPs in its steps (spread evenly, an estimate) this far past
    peak_tolerance: float = 0.05
    hysteresis: float = 0.05  # a share or a bound moves this far for the current verdict
    full_confidence_requests: int = 20  # the sample size that no longer costs confidence
    margin_scale: float = 0.2  # a margin (share over the runner-up, use off the bound) this
    # wide is full: the 0.6 bound +- 0.2 spans "clearly overhead" to "clearly bound"
    tpot_inputs: float = 0.85  # confidence kept on TPOT alone, without emission times
    floor: float = 0.5  # a zero margin halves the confidence, it does not zero it
    unknown: float = 0.5  # confidence kept when the resource is unknown
    high: float = 0.7  # confidence levels: "high" from here, "medium" from ``medium``
    medium: float = 0.4


RULES = Thresholds()
