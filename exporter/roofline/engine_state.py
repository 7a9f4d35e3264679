"""The engine's state over the window as the cause's rules read it (``cause``): from the
engine's own /metrics (``EngineState.of`` an ``engine_metrics.EngineRates``) or, where no
scrape is fresh, from the records (``cause.in_engine``). A figure not known is None.
"""

from __future__ import annotations

from dataclasses import dataclass

from phasewatch.roofline.engine_metrics import EngineRates


@dataclass(frozen=True)
class EngineState:
    max_running: float | None = None
    running_at_max_share: float | None = None  # of the time (or of the moments waited)
    configured_max_running: float | None = None
    mean_waiting: float | None = None
    waiting_share: float | None = None  # share of scrapes with a request waiting
    waiting_by_reason: dict[str, float] | None = None  # mean per reason (vLLM)
    mean_kv_usage: float | None = None
    max_kv_usage: float | None = None  # from the records: the footprint over the room
    kv_capacity_tokens: float | None = None
    preemptions: float | None = None  # over the window
    # how the records read running: "waiting" (over the moments a request waited) and
    # the share of those moments; "records" where the records' share at the engine's own
    # maximum replaced its gauge's (``cause._running_from_records``), and the gauge's
    running_read_over: str | None = None
    waiting_moment_share: float | None = None
    running_read_from: str | None = None
    engine_running_at_max_share: float | None = None
    running_at_level_share: float | None = None  # at or above a level read elsewhere

    @classmethod
    def of(cls, rates: EngineRates) -> EngineState:
        return cls(rates.max_running, rates.running_at_max_share,
                   rates.configured_max_running, rates.mean_waiting, rates.waiting_share,
                   dict(rates.waiting_by_reason) or None, rates.mean_kv_usage,
                   rates.max_kv_usage, rates.kv_capacity_tokens, rates.preemptions)

    def evidence(self, *names: str) -> dict:
        """The figures ``names`` that are known, in that order: a cause's evidence."""
        return {k: v for k in names if (v := getattr(self, k)) is not None}
