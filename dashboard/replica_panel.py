"""The Replicas panel: one table per label set served by two pods or more, each pod a
row, the ones that differ from the rest marked and said why. A plain function of the
``replicas`` frame (``phasewatch.dashboard.replicas``), unit-tested without a browser."""

from __future__ import annotations

import pandas as pd
from dash import html

from phasewatch.dashboard.frames import who
from phasewatch.dashboard.panels import percent_text, rate_text, seconds_text, term
from phasewatch.dashboard.replicas import MIN_REQUESTS, OUTLIER_RULES, figure_text

# (header, column, formatter, glossary term or None)
COLUMNS = (
    ("Requests/s", "request_rate", lambda x: rate_text(x, "req/s"), None),
    ("TTFT p50", "ttft_p50", seconds_text, "TTFT"),
    ("TTFT p95", "ttft_p95", seconds_text, "TTFT"),
    ("Queue share", "queue_share", percent_text, "queue"),
    ("KV cache", "kv_usage", percent_text, None),
)


def rule_text() -> str:
    """The outlier rule in words, from ``OUTLIER_RULES`` (so the page says what the code
    does): "A replica is marked where its TTFT p95 is at least 2x the median of the other
    replicas' and 50 ms above it, ..."."""
    def margin(r) -> str:
        return figure_text(r.margin, r.unit).replace("%", " points")

    first, *rest = OUTLIER_RULES
    parts = [f"its {first.words} is at least {first.ratio:g}x the median of the other "
             f"replicas' and {margin(first)} above it",
             *[f"its {r.words} {r.ratio:g}x and {margin(r)} above" for r in rest]]
    return (f"A replica is marked where {', '.join(parts[:-1])}, or {parts[-1]} (latency "
            f"and queue share judged only with {MIN_REQUESTS} requests or more in the "
            "range); or where its verdict differs from the one every other replica reports.")


def _cell(row, column: str, fmt) -> html.Td:
    flagged = column in (row["flagged"] or ())
    return html.Td(fmt(row[column]), className="pw-flagged" if flagged else None)


def _verdict(row) -> str:
    return row["headline"] if isinstance(row["headline"], str) and row["headline"] else "–"


def _why_row(row) -> html.Tr:
    """Under an outlier's row, across the table: each reason it stands out, one a line."""
    reasons = [r[:1].upper() + r[1:] for r in row["why"].split("; ") if r]
    return html.Tr(html.Td(html.Ul([html.Li(r) for r in reasons]), colSpan=len(COLUMNS) + 2),
                   className="pw-why", **{"data-pod": row["pod"]})


def replica_table(rows: pd.DataFrame) -> html.Div:
    """One label set's replicas (``rows``, two or more) as a table: a row per pod, and
    under each outlier's row why it stands out."""
    outliers = int(rows["outlier"].fillna(False).astype(bool).sum())
    first = rows.iloc[0]
    name = who({**first.to_dict(), "pod": ""})
    summary = (f"{outliers} of {len(rows)} replicas stand{'s' if outliers == 1 else ''} out"
               if outliers else f"{len(rows)} replicas, none stands out")
    head = html.Tr([html.Th("Pod"),
                    *[html.Th(term(t, h) if t else h) for h, _, _, t in COLUMNS],
                    html.Th("Verdict")])
    body = []
    for _, row in rows.iterrows():
        marked = bool(row["outlier"]) if not pd.isna(row["outlier"]) else False
        body.append(html.Tr(
            [html.Td(row["pod"], className="pw-pod"),
             *[_cell(row, c, fmt) for _, c, fmt, _ in COLUMNS],
             html.Td(_verdict(row), className="pw-flagged" if "headline" in (
                 row["flagged"] or ()) else None)],
            className="pw-outlier" if marked else None, **{"data-pod": row["pod"]}))
        if marked and row["why"]:
            body.append(_why_row(row))
    return html.Div([html.H3([f"Replicas of {name}: ", html.Span(summary)]),
                     html.Table([html.Thead(head), html.Tbody(body)],
                                className="pw-replica-table")],
                    className="pw-replica-set", **{"data-model": first["model"]})


def replica_tables(replicas: pd.DataFrame) -> list:
    """A table per label set with two replicas or more; [] where there is none (one pod,
    or a source that does not split by pod)."""
    if replicas.empty:
        return []
    out = []
    for _, rows in replicas.groupby(["model", "engine", "source"], sort=True):
        if rows["pod"].nunique() >= 2:
            out.append(replica_table(rows.sort_values("pod")))
    return out
