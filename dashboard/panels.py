"""HTML panels from the frames: the verdict banner (or the empty/error state) and the
KPI cards. Plain functions of a ``Snapshot``, unit-tested without a browser."""

from __future__ import annotations

import math
import time

import pandas as pd
from dash import html

from dashboard.frames import LATENCIES, LATENCY_STATS, Snapshot, who
from dashboard.theme import GLOSSARY, PHASES, verdict_color
from exporter.publish import benchtext
from exporter.roofline.verdict import headline

SOURCE_NAMES = {"exporter": "Exporter", "prometheus": "Prometheus"}


def term(word: str, shown: str | None = None) -> html.Span:
    """A word with its glossary entry as a tooltip."""
    return html.Span(shown or word, title=GLOSSARY[word], className="pw-term")


def seconds_text(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x * 1000:.1f} ms" if x < 0.1 else f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def percent_text(x) -> str:
    return "–" if x is None or pd.isna(x) else f"{x:.0%}"


def rate_text(x, unit: str) -> str:
    if x is None or pd.isna(x):
        return "–"
    if x >= 10_000:
        return f"{x / 1000:.1f}k {unit}"
    return f"{x:.1f} {unit}" if x < 100 else f"{x:.0f} {unit}"


def number_text(x) -> str:
    return "–" if x is None or pd.isna(x) else f"{x:.1f}"


# ---- the state line and the verdict banner ----------------------------------------
def state_panel(snap: Snapshot, last_ok: float | None = None) -> html.Div | None:
    """The error or empty state, or None when there is data to show."""
    name = SOURCE_NAMES.get(snap.source, snap.source)
    e = snap.error
    if e is not None:
        stale = (f" The figures below show the data of "
                 f"{time.strftime('%H:%M:%S', time.localtime(last_ok))}."
                 if last_ok else "")
        if e.kind == "unreachable":
            return html.Div(className="pw-state error", id="state-unreachable", children=[
                html.H3(f"{name} unreachable"),
                html.P(["Tried ", html.Code(e.target), f": {e.message}. Retrying every "
                        f"refresh.{stale}"])])
        if e.kind == "query":
            return html.Div(className="pw-state error", id="state-query-error", children=[
                html.H3("Prometheus query failing"),
                html.P(e.message), html.Pre(e.target, style={"whiteSpace": "pre-wrap"}),
                html.P(f"Prometheus at {snap.target}.{stale}")])
        return html.Div(className="pw-state error", id="state-http-error", children=[
            html.H3(f"{name} answered with an error"),
            html.P(["From ", html.Code(e.target), f": {e.message}.{stale}"])])
    if snap.empty:
        return html.Div(className="pw-state", id="state-empty", children=[
            html.H3("No data yet"),
            html.P(f"No requests finished in the last {snap.window_seconds:g} s at "
                   f"{snap.target}. Point the inference server's OTLP traces (or the "
                   "phasewatch client) at the exporter; figures fill in as requests "
                   "finish.")])
    return None


def banners(snap: Snapshot) -> list:
    """One banner per selected label set with a verdict."""
    out = []
    for _, v in snap.verdicts.iterrows():
        color = verdict_color(v["phase"], v["resource"])
        chips = [html.Span([term(p), f" {percent_text(v[f'{p}_share'])}"], className="pw-chip")
                 for p in PHASES]
        chips += [html.Span([term("MBU", "decode MBU"), f" {percent_text(v['mbu'])}"],
                            className="pw-chip"),
                  html.Span([term("MFU", "prefill MFU"), f" {percent_text(v['mfu'])}"],
                            className="pw-chip"),
                  html.Span([term("confidence"), f" {percent_text(v['confidence'])}"],
                            className="pw-chip")]
        if v["reporting"] and v["reporting"] > 1:
            chips.append(html.Span(f"{v['agreeing']} of {v['reporting']} pods agree",
                                   className="pw-chip"))
        levers = list(v["levers"]) if isinstance(v["levers"], (tuple, list)) else []
        out.append(html.Div(
            className="pw-banner verdict", style={"background": color},
            **{"data-phase": v["phase"], "data-resource": v["resource"],
               "data-model": v["model"], "data-source": v["source"]},
            children=[html.H2(f"{headline(v['phase'], v['resource'])} — {who(v)}"),
                      html.P(v["text"]),
                      html.Div(chips, className="pw-chips"),
                      html.Div(("Levers that fit: " + " · ".join(levers)) if levers else
                               "No lever: not enough evidence yet.", className="pw-levers")]))
    if not out and not snap.kpis.empty:
        out.append(html.Div(className="pw-state", id="state-no-verdict", children=[
            html.H3("Waiting for the first verdict"),
            html.P("Requests are arriving; the roofline and the verdict are estimated every "
                   "few seconds once the window holds enough of them.")]))
    return out


# ---- KPI cards --------------------------------------------------------------------
# (title parts, column, formatter)
CARDS = (
    (("TTFT", " p50"), "ttft_p50", seconds_text),
    (("TTFT", " p95"), "ttft_p95", seconds_text),
    (("ITL", " p50"), "itl_p50", seconds_text),
    (("ITL", " p95"), "itl_p95", seconds_text),
    (("TPOT", " p50"), "tpot_p50", seconds_text),
    (("e2e", " p50"), "e2e_p50", seconds_text),
    ((None, "Requests/s"), "request_rate", lambda x: rate_text(x, "req/s")),
    ((None, "Output tokens/s"), "output_tokens_per_second", lambda x: rate_text(x, "tok/s")),
    (("MBU", " (decode)"), "mbu", percent_text),
    (("MFU", " (prefill)"), "mfu", percent_text),
    (("decode batch", ""), "decode_batch_size", number_text),
)


def _known(v):
    """A frame value as a number, or None (NaN, None)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def bench_compare(kpis: pd.DataFrame, source: str) -> html.Details:
    """Each label set's figures as ``vllm bench serve`` prints a run (mean, median,
    P50/P90/P99 of TTFT, TPOT, ITL and E2EL in ms), to set beside a benchmark's."""
    blocks = []
    for _, r in kpis.iterrows():
        figures = {"requests": _known(r["requests_in_range"]),
                   "duration_s": _known(r["range_seconds"]),
                   "prompt_tokens": _known(r["prompt_tokens_in_range"]),
                   "output_tokens": _known(r["output_tokens_in_range"]),
                   **{k: {s: _known(r[f"{k}_{s}"]) for s in LATENCY_STATS} for k in LATENCIES}}
        span = figures["duration_s"]
        title = f"phasewatch {who(r)} ({source}" + (
            f", last {span:.0f} s)" if span else ")")
        blocks.append(html.Pre(benchtext.render(title, figures)))
    return html.Details(
        [html.Summary("Compare with vllm bench serve: the same rows, names and units "
                      "(requests that finished in the range, as the server saw them)"),
         html.Div(blocks, className="pw-bench-blocks")],
        id="bench-compare", className="pw-bench")


def kpi_cards(kpis: pd.DataFrame) -> list:
    several = len(kpis) > 1
    cards = []
    for (word, rest), column, fmt in CARDS:
        title = [term(word), rest] if word else [rest]
        if several:
            body = [html.Div([html.Span(fmt(r[column]), style={"fontWeight": 600}),
                              html.Span(f" {who(r)}", className="pw-card-sub")])
                    for _, r in kpis.iterrows()]
        else:
            value = kpis[column].iloc[0] if len(kpis) else None
            body = [html.Div(fmt(value), className="pw-card-value")]
        cards.append(html.Div([html.Div(title, className="pw-card-title"), *body],
                              className="pw-card", id=f"kpi-{column}"))
    return cards
