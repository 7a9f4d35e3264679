"""Each cause's sentence, written once: the exporter's verdict (``cause``, ``bottleneck``)
and the dashboard's Prometheus source (``dashboard.prometheus_verdicts``) call these with
the figures they have, so a cause reads the same whichever page shows it.

A figure a source does not have is None and its part of the sentence is left out
(through Prometheus the share of the time running sat at its maximum is not at hand).
"""

from __future__ import annotations

FRONTEND = "API server: the time goes before the engine's queue"


def pct(x: float) -> str:
    return f"{x:.0%}"


def seconds(window: float) -> str:
    """A window's length as the sentences write it: "30 s"."""
    return f"{window:.0f} s"


def kv_cache(preemptions: float, window: str, usage: float | None,
             mean_waiting: float | None = None, records: bool = False) -> str:
    """"KV cache full: 32 preemptions in 30 s at 100% usage"; without preemptions, the
    usage (from the records: the KV footprint estimated against the memory left after the
    weights) and the requests waiting."""
    if preemptions > 0:
        at = f" at {pct(usage)} usage" if usage is not None else ""
        return f"KV cache full: {preemptions:.0f} preemptions in {window}{at}"
    wait = f", {mean_waiting:.1f} requests waiting on average" if mean_waiting else ""
    if not records:
        what = f"usage up to {pct(usage)}"
    elif usage >= 1:  # an estimate: over 100 % says its memory figure is short
        what = "the KV footprint of the requests in flight reaches the memory left after " \
               "the weights"
    else:
        what = (f"the KV footprint of the requests in flight reaches {pct(usage)} of the "
                "memory left after the weights")
    return f"KV cache full: {what}{wait}"


def preemption_recompute(preemptions: float, window: str, usage: float | None) -> str:
    """Preemptions with the KV cache not seen full."""
    top = f" with the KV cache at most {pct(usage)} full" if usage is not None else ""
    return f"{preemptions:.0f} preemptions in {window}{top}: preempted requests are recomputed"


def slot_limit(running: float, usage: float | None, pinned: float | None = None,
               over_waiting: bool = False, configured: float | None = None,
               from_records: bool = False, mean_waiting: float | None = None) -> str:
    """"Slot limit: 64 requests running (95% of the time at that maximum), the KV cache at
    most 29% full"."""
    how = ", by the requests' own times" if from_records else ""
    when = "of the time requests waited" if over_waiting else "of the time"
    limit = f", the configured {configured:.0f}" if configured else ""
    held = f" ({pct(pinned)} {when} at that maximum{limit}{how})" if pinned is not None else ""
    wait = f", {mean_waiting:.1f} waiting on average" if mean_waiting else ""
    room = f"the KV cache at most {pct(usage)} full" if usage is not None else "KV usage unknown"
    return f"Slot limit: {running:.0f} requests running{held}{wait}, {room}"


def imbalance(queueing: str, queueing_share: float, calm: str, calm_share: float) -> str:
    """One pod queueing while another barely does (``bottleneck.imbalance``)."""
    return (f"Load imbalance: queue {queueing_share:.0%} of request time on {queueing} "
            f"while {calm} queues {calm_share:.0%}")
