"""HTML panels from the frames: the verdict banner (or the empty/error state) and the
KPI cards. Plain functions of a ``Snapshot``, unit-tested without a browser."""

from __future__ import annotations

import math
import re
import time

import pandas as pd
from dash import html

from phasewatch.dashboard.frames import LATENCIES, LATENCY_STATS, Snapshot, who
from phasewatch.dashboard.theme import (
    CLIENT_PHASES,
    GLOSSARY,
    OPTIONAL_PHASES,
    PHASES,
    text_color,
    verdict_color,
)
from phasewatch.publish import benchtext
from phasewatch.requests.objectives import OBJECTIVES
from phasewatch.roofline.verdict_text import headline

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
    if snap.idle and snap.empty:
        return html.Div(className="pw-state", id="state-idle", children=[
            html.H3(idle_text(snap.window_seconds)), html.P(_idle_detail(snap))])
    if snap.empty:
        return html.Div(className="pw-state", id="state-empty", children=[
            html.H3("No data yet"), html.P(_empty_detail(snap))])
    return None


def _idle_detail(snap: Snapshot) -> str:
    if snap.source == "prometheus":
        return (f"Prometheus at {snap.target} holds phasewatch series, but no request "
                f"finished in the last {snap.window_seconds:g} s (--range): the workload "
                "has stopped or its traces no longer reach the exporters. The figures "
                "fill in again with the next requests.")
    return (f"{snap.target} has received requests, but none finished in its "
            f"{snap.window_seconds:g} s window: the workload has stopped or its traces no "
            "longer arrive. The figures fill in again with the next requests.")


def _empty_detail(snap: Snapshot) -> str:
    if snap.source == "prometheus":
        return (f"Prometheus at {snap.target} has no phasewatch series yet: have it scrape "
                "each exporter's /metrics (:9464), and point the inference servers' OTLP "
                "traces at the exporters; figures fill in as requests finish.")
    return (f"No requests finished in the last {snap.window_seconds:g} s at {snap.target}. "
            "Point the inference server's OTLP traces (or the phasewatch client) at the "
            "exporter; figures fill in as requests finish.")


def idle_text(window_seconds: float) -> str:
    return f"No requests in the last {window_seconds:g} s"


def utilization_text(x) -> str:
    """A utilization as a percentage, never one over 100 %: a rate over its ceiling means
    the ceiling is wrong, not that the GPU did the impossible."""
    if x is not None and not pd.isna(x) and x > 1:
        return "over its ceiling"
    return percent_text(x)


# Where the cause came from, in the banner's words.
CAUSE_SOURCES = {"engine_metrics": "from the engine's /metrics",
                 "records": "from the records"}
UNSCRAPED = "from the records: engine metrics not scraped"


def cause_source_text(v) -> str:
    if v["cause_source"] != "engine_metrics" and not v["engine_scraped"]:
        return UNSCRAPED
    return CAUSE_SOURCES.get(v["cause_source"], "")


def text_after_cause(text: str, cause_text: str) -> str:
    """The verdict's text without its cause sentence (the banner shows that one first)."""
    if not cause_text:
        return text
    return " ".join(text.replace(f"{cause_text}.", "").split())


def _chips(v) -> list:
    over = {(phase, what) for phase, what, _ in (v["ceiling_exceeded"] or ())}
    mbu = "over its ceiling" if ("decode", "bandwidth") in over else utilization_text(v["mbu"])
    mfu = "over its ceiling" if ("prefill", "flops") in over else utilization_text(v["mfu"])
    client = not pd.isna(v["ttft_share"])  # the client's view: ttft and decode alone
    chips = [html.Span([term(p), f" {percent_text(v[f'{p}_share'])}"], className="pw-chip")
             for p in (CLIENT_PHASES if client else PHASES)
             if not pd.isna(v[f"{p}_share"]) or p not in OPTIONAL_PHASES]
    if client:
        chips.append(html.Span("from the client's view (no engine spans)",
                               className="pw-chip", title=GLOSSARY["ttft"]))
    chips += [html.Span([term("MBU", "decode MBU"), f" {mbu}"], className="pw-chip"),
              html.Span([term("MFU", "prefill MFU"), f" {mfu}"], className="pw-chip"),
              html.Span([term("confidence"), f" {percent_text(v['confidence'])}"],
                        className="pw-chip")]
    if v["reporting"] and v["reporting"] > 1:
        chips.append(html.Span(f"{v['agreeing']} of {v['reporting']} pods agree",
                               className="pw-chip"))
    return chips + gpu_chips(v)


def gpu_chips(v) -> list:
    """The GPU's own counters beside the estimate: "GPU DRAM active 4.2% (estimate 3.0%)",
    the tensor pipes the same, and where they were read; [] without counters."""
    if not isinstance(v.get("gpu_outcome"), str) or not v["gpu_outcome"]:
        return []
    chips = []
    for name, what in (("dram", "GPU DRAM active"), ("tensor", "GPU tensor pipes active")):
        measured, estimated = v.get(f"gpu_{name}"), v.get(f"gpu_{name}_estimated")
        if _known(measured) is not None:
            est = (f" (estimate {_fine_percent(estimated)})" if _known(estimated) is not None
                   else "")
            chips.append(html.Span([term("GPU counters", what), f" {_fine_percent(measured)}"
                                    f"{est}"], className="pw-chip pw-gpu",
                                   **{"data-counter": name}))
    gpus = int(v["gpu_gpus"]) if _known(v.get("gpu_gpus")) is not None else 0
    source = v["gpu_source"] if isinstance(v.get("gpu_source"), str) else "GPU counters"
    chips.append(html.Span(f"{GPU_OUTCOMES.get(v['gpu_outcome'], v['gpu_outcome'])} "
                           f"({source}, {gpus} GPU{'s' if gpus != 1 else ''})",
                           className="pw-chip pw-gpu", **{"data-outcome": v["gpu_outcome"]}))
    return chips


def _fine_percent(x) -> str:
    """A share as a percent, with a decimal under 10 % (an idle GPU's 0.3 %)."""
    return f"{x:.1%}" if float(x) < 0.1 else f"{x:.0%}"


# what the GPU's counters say of the verdict, in the banner's words
GPU_OUTCOMES = {"overstated": "the estimate exceeds the GPU's counters",
                "idle": "the GPU idle while the engine had work",
                "confirmed": "the GPU's counters confirm it",
                "not_confirmed": "the GPU's counters do not confirm it",
                "unchecked": "GPU counters read"}


def banner(v) -> html.Div:
    """One verdict: the headline (phase and cause), the cause in words with numbers and
    where it came from, the rest of the verdict, its figures, and the levers."""
    title = v["headline"] or headline(v["phase"], v["resource"], v["cause"] or None)
    body = []
    if v["cause_text"]:
        body.append(html.P([html.Strong(f"{v['cause_text']}."), " ",
                            html.Span(f"({cause_source_text(v)})", className="pw-cause-source")],
                           className="pw-cause"))
    rest = text_after_cause(v["text"], v["cause_text"])
    if rest:
        body.append(html.P(rest))
    levers = list(v["levers"]) if isinstance(v["levers"], (tuple, list)) else []
    return html.Div(
        className="pw-banner verdict",
        style={"background": verdict_color(v["phase"], v["resource"]),
               "color": text_color(v["phase"], v["resource"])},
        **{"data-phase": v["phase"], "data-resource": v["resource"],
           "data-cause": v["cause"], "data-model": v["model"], "data-source": v["source"]},
        children=[html.H2(f"{title} — {who(v)}"), *body,
                  html.Div(_chips(v), className="pw-chips"),
                  _levers(levers, _flag(v.get("idle"))), *_predictions(v.get("predictions"))])


def _predictions(texts) -> list:
    """What pulling each lever would change, each marked predicted; none where there is
    no basis (or from Prometheus, which has no fit)."""
    if not isinstance(texts, (tuple, list)) or not texts:
        return []
    return [html.Div([html.Span("If pulled (predicted from this window's fit):"),
                      html.Ul([html.Li(lever_parts(t)) for t in texts])],
                     className="pw-levers pw-predictions")]


FLAG = re.compile(r"(--[A-Za-z0-9][A-Za-z0-9-]*)")


def lever_parts(lever: str) -> list:
    """A lever's words with each command-line flag as code that does not break at its
    hyphens (``--max-model-len`` split over two lines reads as two flags)."""
    return [html.Code(part, className="pw-flag") if FLAG.fullmatch(part) else part
            for part in FLAG.split(lever) if part]


def _flag(x) -> bool:
    """A frame's yes/no that may be unknown (None, NaN): True only for a known yes."""
    return x is not None and not pd.isna(x) and bool(x)


def _levers(levers: list[str], idle: bool = False) -> html.Div:
    if not levers:
        why = ("the engine is idle most of the window, so nothing needs fixing" if idle
               else "not enough evidence yet")
        return html.Div(f"No lever: {why}.", className="pw-levers")
    return html.Div([html.Span("Levers that fit:"),
                     html.Ul([html.Li(lever_parts(lever)) for lever in levers])],
                    className="pw-levers")


def banners(snap: Snapshot) -> list:
    """One banner per selected label set with a verdict."""
    out = [banner(v) for _, v in snap.verdicts.iterrows()]
    if not out and not snap.kpis.empty:
        out.append(html.Div(className="pw-state", id="state-no-verdict", children=[
            html.H3("No verdict yet"), html.P(_no_verdict_detail(snap))]))
    return out


def _no_verdict_detail(snap: Snapshot) -> str:
    """Requests finished in the window, and no verdict: the exporter has not estimated
    one yet, or (through Prometheus, whose range may outlast an exporter's window) the
    exporters have dropped theirs with a workload that just stopped."""
    done = f"Requests finished in the last {snap.window_seconds:g} s"
    if snap.source == "prometheus":
        return (f"{done} (--range), but no exporter publishes a verdict for them: each "
                "estimates one every few seconds once its own window holds enough "
                "requests, and drops it once that window has none (a workload that has "
                "just stopped reads so until the range is empty too).")
    return (f"{done}; the roofline and the verdict are estimated every few seconds once "
            "the window holds enough of them.")


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


# Shown only where traces were sampled upstream (issue 29): the counts are weighted.
SAMPLED_CARD = (("sampled", " traces"), "sampled_share", percent_text)


def _known(v):
    """A frame value as a number, or None (NaN, None)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def bench_blocks(kpis: pd.DataFrame, source: str) -> list[html.Pre]:
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
    return blocks


def bench_compare(blocks: list | None = None) -> html.Details:
    """The fold around ``bench_blocks``. It is built once, in the layout, and a refresh
    replaces only its blocks: a fold rebuilt every refresh closes under the user's click."""
    return html.Details(
        [html.Summary("Compare with vllm bench serve: the same rows, names and units "
                      "(requests that finished in the range, as the server saw them)"),
         html.Div(blocks or [], id="bench-blocks", className="pw-bench-blocks")],
        id="bench-compare", className="pw-bench", style={"display": "none"})


def kpi_cards(kpis: pd.DataFrame) -> list:
    several = len(kpis) > 1
    cards = []
    sampled = kpis["sampled_share"].notna().any() and (kpis["sampled_share"] < 1).any()
    for (word, rest), column, fmt in (*CARDS, SAMPLED_CARD) if sampled else CARDS:
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


# ---- objectives (--slo) -------------------------------------------------------------
OBJECTIVE_WORDS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "e2e"}


def has_objectives(kpis: pd.DataFrame) -> bool:
    """Some selected label set has objectives set (its exporter runs with --slo), plainly
    or only for some prompt-length classes."""
    return any(kpis[f"{o}_attainment"].notna().any() for o in OBJECTIVES)


def attainment_text(x) -> str:
    """A share met, rounded down to 0.1 % (99.96 % met is "99.9%", never "100.0%")."""
    if x is None or pd.isna(x):
        return "–"
    return f"{math.floor(x * 1000 + 1e-9) / 10:.1f}%"


def _limit(seconds, classes="") -> str:
    """"≤ 500 ms", "≤ 500 ms (3000 ms for 4k-16k)", "3000 ms for 4k-16k"."""
    classes = classes if isinstance(classes, str) else ""
    if seconds is None or pd.isna(seconds):
        return f"{classes} prompts" if classes else ""
    return f"≤ {seconds * 1000:g} ms" + (f" ({classes})" if classes else "")


def slo_cards(kpis: pd.DataFrame) -> list:
    """Goodput, then each objective set: the share of requests that met it over the
    window and how many missed; [] without objectives."""
    if kpis.empty or not has_objectives(kpis):
        return []
    rows = [r for _, r in kpis.iterrows()
            if any(not pd.isna(r[f"{o}_attainment"]) for o in OBJECTIVES)]
    several = len(rows) > 1
    cards = [_slo_card([term("goodput"), " (met every objective)"], "kpi-goodput", [
        (rate_text(r["goodput"], "req/s"),
         f"{percent_text(r['good_ratio'])} of requests" + (f" {who(r)}" if several else ""))
        for r in rows])]
    for o in OBJECTIVES:
        mine = [r for r in rows if not pd.isna(r[f"{o}_attainment"])]
        if not mine:
            continue
        limits = {_limit(r[f"{o}_objective"], r[f"{o}_classes"]) for r in mine}
        word = OBJECTIVE_WORDS[o]
        title = ([term(word), f" {next(iter(limits))} met"] if len(limits) == 1
                 else [term(word), " objective met"])
        cards.append(_slo_card(title, f"kpi-{o}-attainment", [
            (attainment_text(r[f"{o}_attainment"]),
             " ".join(filter(None, (
                 "" if len(limits) == 1 else
                 f"({_limit(r[f'{o}_objective'], r[f'{o}_classes'])})",
                 f"{_count(r[f'{o}_missed'])} missed",
                 who(r) if several else ""))))
            for r in mine]))
    return cards


def _count(x) -> str:
    return "–" if x is None or pd.isna(x) else f"{x:.0f}"


def _slo_card(title: list, id_: str, values: list[tuple[str, str]]) -> html.Div:
    body = [html.Div([html.Span(value, className="pw-card-value"),
                      html.Div(sub, className="pw-card-sub")]) for value, sub in values]
    return html.Div([html.Div(title, className="pw-card-title"), *body],
                    className="pw-card pw-slo-card", id=id_)
