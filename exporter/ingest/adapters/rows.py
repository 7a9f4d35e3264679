"""The row every adapter builds: ``record.ROW_FIELDS`` with integer Unix ns times, the
times that servers round apart by a few ns put back in order, and how far two clocks of
one server may disagree before the times contradict each other."""

from __future__ import annotations

from phasewatch.ingest.adapters.attributes import NS

# Servers derive each latency attribute from the same few timestamps, but each float
# is rounded on its own: e2e and prefill + decode may disagree by a few nanoseconds.
# Within this much, a later time that lands before an earlier one is the same instant.
ROUNDING_NS = 1000
# vLLM's TTFT and e2e are its API server's wall-clock figures, its queue, prefill and
# decode engine-core monotonic differences (vllm/v1/metrics/stats.py): rebuilt as times,
# the last token can land after the finish (measured -3.6 .. +4.8 ms on an idle CPU
# server; a busy frontend that handles the first output late makes it more). Up to this
# much the request is kept with every duration vLLM's own, and the disagreement is
# counted (phasewatch_clock_skew_seconds); past it the times contradict each other.
TWO_CLOCK_TOLERANCE_NS = 10 * NS


def row(model: str, engine: str, finish_reason: str, request_id: str, arrival, scheduled,
        first_token, last_token, finish, prompt, cached, output, *, queued=None,
        token_times=None) -> tuple:
    """A ``record.ROW_FIELDS`` tuple (times in integer ns, None = unknown)."""
    times = [arrival, queued, scheduled, first_token, last_token, finish]
    latest = None
    for i, t in enumerate(times):
        if t is None:
            continue
        if latest is None or t >= latest:
            latest = t
        elif latest - ROUNDING_NS <= t:
            times[i] = latest
    return (model, engine, finish_reason, request_id, *times, prompt, cached, output,
            token_times)
