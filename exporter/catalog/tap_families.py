"""The stream tap's families (``TAP``, by ``tap.tallies()`` key): on serve's /metrics with
--tap-upstream, or on ``phasewatch tap --metrics-port``'s."""

from __future__ import annotations

from phasewatch.catalog.family import Family

# ---- the stream tap (``phasewatch tap --metrics-port``, or serve --tap-upstream) --------
TAP_NEEDS = "--tap-upstream (or on the /metrics of `phasewatch tap --metrics-port`)"


def _tap(name: str, doc: str, *labels: str) -> Family:
    return Family(name, "counter", doc, labels, needs=TAP_NEEDS)


TAP_REQUESTS = _tap("phasewatch_tap_requests_total",
                    "Requests through the tap, one outcome each.", "outcome")
TAP_ABORTS = _tap("phasewatch_tap_aborts_total",
                  "Requests cut short on any path, by reason.", "reason")
TAP_RECORDS_DROPPED = _tap("phasewatch_tap_records_dropped_total",
                           "Records of timed requests lost, by reason.", "reason")
TAP_UNREAD = _tap("phasewatch_tap_unread_total",
                  "Requests or answers passed on without being read, by reason.", "reason")
TAP_RECORDS_ACCEPTED = _tap("phasewatch_tap_records_accepted_total",
                            "Records the exporter accepted.")
TAP_TOKEN_TIMES_DROPPED = _tap(
    "phasewatch_tap_token_times_dropped_total",
    "Requests whose per-token times the token count contradicts, recorded without them, "
    "by reason.", "reason")
# tap.tallies() family key -> family
TAP: dict[str, Family] = {"requests": TAP_REQUESTS, "aborts": TAP_ABORTS,
                          "records_dropped": TAP_RECORDS_DROPPED, "unread": TAP_UNREAD,
                          "records_accepted": TAP_RECORDS_ACCEPTED,
                          "token_times_dropped": TAP_TOKEN_TIMES_DROPPED}
