"""The tap's counts by family, as Prometheus counters (``phasewatch_tap_*``) on a port of
its own, and as the one line logged when the tap stops."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from aiohttp import web

from phasewatch import catalog
from phasewatch.tap.observed import TOKEN_TIMES_DROPPED

if TYPE_CHECKING:
    from phasewatch.tap.proxy import Tap

# What ``Tap.counts`` holds, by family: the outcome of every request (one each);
# streams cut short, by why; records lost, by why (with the client's own drops);
# answers or requests passed on without being read.
OUTCOMES = ("completed", "aborted", "unanswered", "untimed", "body_too_large_untimed",
            "upstream_unreachable", "upstream_timeout", "bad_request",
            "tap_error")  # and upstream_status_<N>xx
ABORTS = ("client_disconnected", "upstream_broke_off", "upstream_stalled", "tap_stopped")
TAP_DROPS = ("no_model", "record_failed", "body_too_large_untimed")
UNREAD = ("unreadable_request", "compressed_answer", "event_too_large", "unreadable_event",
          "unreadable_body")
TOKEN_TIMES = TOKEN_TIMES_DROPPED  # requests kept without their per-token times
# the gRPC client's, and the OTLP recorder's export_failed (tap.otlp_out)
CLIENT_DROPS = ("buffer_full", "refused", "shutdown", "invalid", "closed", "export_failed")


def tallies(counts: Mapping[str, int], client_stats: Mapping[str, int] | None = None
            ) -> dict[str, dict[str, int]]:
    """The counts by family: requests (by outcome), aborts, records_dropped (the tap's
    and the client's, ``rejected`` by the exporter among them), unread and
    token_times_dropped (requests recorded without their per-token times); and, with
    the client's stats, records_accepted."""
    stats = client_stats or {}
    outcomes = {k: counts.get(k, 0) for k in OUTCOMES}
    outcomes.update({k: v for k, v in counts.items() if k.startswith("upstream_status_")})
    dropped = {k: counts.get(k, 0) for k in TAP_DROPS}
    if client_stats is not None:
        dropped.update({k: stats.get(f"dropped_{k}", 0) for k in CLIENT_DROPS})
        dropped["rejected"] = stats.get("rejected", 0)
    out = {"requests": outcomes, "aborts": {k: counts.get(k, 0) for k in ABORTS},
           "records_dropped": dropped, "unread": {k: counts.get(k, 0) for k in UNREAD},
           "token_times_dropped": {k: counts.get(k, 0) for k in TOKEN_TIMES}}
    if client_stats is not None:
        out["records_accepted"] = {"": stats.get("accepted", 0)}
    return out


class TapCollector:
    """The tap's counts as Prometheus counters (``phasewatch_tap_*``), read at scrape."""

    def __init__(self, tap: Tap, client=None):
        self._tap, self._client = tap, client

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        stats = dict(self._client.stats) if self._client is not None else None
        for family, values in tallies(self._tap.counts, stats).items():
            f = catalog.TAP[family]  # name, help and label (values in docs/metrics.md)
            m = CounterMetricFamily(f.family, f.help, labels=list(f.labels) or None)
            for value, n in sorted(values.items()):
                m.add_metric([value] if f.labels else [], n)
            yield m


def metrics_app(tap: Tap, client=None) -> web.Application:
    """``GET /metrics``: the tap's counts in Prometheus text, on a port of its own (the
    tap's port passes every path to the upstream)."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(TapCollector(tap, client))

    async def metrics(_request):
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


def summary(counts: Mapping[str, int], client_stats: Mapping[str, int] | None = None) -> str:
    """One line: each family's counts that are not zero."""
    parts = []
    for family, values in tallies(counts, client_stats).items():
        if family == "records_accepted":
            parts.append(f"records_accepted {values['']}")
            continue
        shown = ", ".join(f"{k} {v}" for k, v in sorted(values.items()) if v)
        parts.append(f"{family}: {shown or 'none'}")
    return "; ".join(parts)
