"""Plotly figures (as plain dicts, which Dash sends as they are) from the source frames.

Every function takes frames from ``phasewatch.dashboard.frames`` and returns a figure
(``phasewatch.dashboard.layout.figure``: title, legend and margins); an empty frame gives a figure
that says so. ``uirevision`` is the title, so a live refresh keeps the user's zoom and
hidden traces.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from phasewatch.dashboard.frames import KEYS, who
from phasewatch.dashboard.layout import (
    PLOT_PX,
    empty_figure,
    figure,
    log_seconds_ticks,
    log_tokens_ticks,
    note,
)
from phasewatch.dashboard.theme import CEILING_STYLES, PHASE_COLORS, PHASES

DASHES = ("solid", "dot", "dash", "longdash", "dashdot", "longdashdot")
SECONDS_AXIS = {"tickformat": "~s", "ticksuffix": "s", "rangemode": "tozero"}


def si(x: float) -> str:
    """3.35e12 -> "3.35 T": SI prefixes for bytes/s and FLOP/s."""
    if not math.isfinite(x) or x == 0:
        return f"{x:g} "
    k = min(max(math.floor(math.log10(abs(x)) / 3), -4), 6)
    return f"{x / 10 ** (3 * k):.3g} {'pnum kMGTPE'[k + 4].strip()}"


def _label(key: tuple, several: bool) -> str:
    """Name a label set (a ``KEYS`` tuple) in legends only when there are several on the
    chart: `` · model/engine[/pod][ (source)]``."""
    return " · " + who(dict(zip(KEYS, key, strict=True))) if several else ""


def _label_sets(df: pd.DataFrame) -> list[tuple[str, ...]]:
    """Every (model, engine, pod, source) in ``df``, sorted."""
    return sorted(set(zip(*(df[k] for k in KEYS), strict=True)))


def _of(df: pd.DataFrame, key: tuple) -> pd.DataFrame:
    """The rows of one label set."""
    keep = pd.Series(True, index=df.index)
    for k, v in zip(KEYS, key, strict=True):
        keep &= df[k] == v
    return df[keep]


def _time_axis() -> dict:
    return {"type": "date", "title": {"text": "time"}}


def _dates(at: pd.Series) -> list:
    return pd.to_datetime(at, unit="s", utc=True).dt.tz_convert(None).tolist()


# ---- roofline ---------------------------------------------------------------------
NO_ROOFLINE = ("No roofline yet: the exporter needs --model and --hardware, and finished "
               "requests in the window")
# Ceilings, so the exporter was given the deployment, but no operating point yet.
NO_POINTS = "No operating point yet: estimated every few seconds from the window's requests"


def ceiling_name(kind: str, hardware: str) -> str:
    """A roofline line's name: "datasheet ceiling (H100-SXM x1)", "achievable ceiling",
    "measured ceiling (calibrate, AMD EPYC 7B13 (2 cores) x1)"."""
    where = ", ".join(w for w in ("calibrate" if kind == "measured" else "", hardware) if w)
    return f"{kind} ceiling" + (f" ({where})" if where else "")


def roofline_figure(points: pd.DataFrame, ceilings: pd.DataFrame,
                    idle_text: str | None = None) -> dict:
    """Log-log roofline: per hardware, min(bandwidth x intensity, peak FLOP/s) for each
    ceiling, and each phase's operating point now (large) and its recent trail.
    ``idle_text``: what a figure without operating points says when the workload has
    stopped (the ceilings stay); else it says why there are none."""
    title = "Roofline: achieved FLOP/s against arithmetic intensity"
    if ceilings.empty and points.empty:
        return empty_figure(title, idle_text or NO_ROOFLINE)
    ok = points[np.isfinite(points["intensity"].astype(float))
                & np.isfinite(points["flops"].astype(float))
                & (points["intensity"].astype(float) > 0) & (points["flops"].astype(float) > 0)]
    ridges = [r for r in (ceilings["flops"] / ceilings["bandwidth"]).astype(float).tolist()
              if math.isfinite(r) and r > 0]  # a ceiling Prometheus lacks a figure for: NaN
    xs = ok["intensity"].astype(float).tolist() + ridges
    lo = 10 ** math.floor(math.log10(max(min([*xs, 1.0]) / 3, 1e-3)))
    hi = 10 ** math.ceil(math.log10(max([*xs, 10.0]) * 10))
    sets = _label_sets(ok)
    points_data, spans = _phase_traces(ok, sets)
    data = _ceiling_traces(ceilings, lo, hi) + points_data + _gpu_traces(ok, sets)
    ys = [y for t in data for y in t["y"] if y > 0 and math.isfinite(y)]
    return figure(data, title,
                  {"type": "log", "title": {"text": "arithmetic intensity (FLOPs/byte)"},
                   "range": [math.log10(lo), math.log10(hi)], "dtick": 1},
                  {"type": "log", "title": {"text": "achieved FLOP/s"}, "tickformat": "~s",
                   "dtick": 1, "range": flops_range(ys)},
                  annotations=([trail_note(max(spans))] if spans else
                               [] if sets else [note(idle_text or NO_POINTS)]))


def _ceiling_traces(ceilings: pd.DataFrame, lo: float, hi: float) -> list[dict]:
    """One line per distinct ceiling, min(bandwidth x intensity, peak) from ``lo`` to
    ``hi`` FLOPs/byte (a ceiling with no bandwidth or no peak is left out)."""
    data, seen = [], set()
    for row in ceilings.itertuples(index=False):
        key = (row.hardware, row.ceiling, row.bandwidth, row.flops)
        if key in seen or not (row.bandwidth > 0 and row.flops > 0):
            continue
        seen.add(key)
        ridge = row.flops / row.bandwidth
        style = CEILING_STYLES.get(row.ceiling, CEILING_STYLES["datasheet"])
        name = ceiling_name(row.ceiling, row.hardware)
        data.append({"type": "scatter", "mode": "lines", "name": name,
                     "x": [lo, ridge, hi], "y": [row.bandwidth * lo, row.flops, row.flops],
                     "line": {"color": style["color"], "dash": style["dash"], "width": 2},
                     "hovertemplate": (f"{name}<br>bandwidth {si(row.bandwidth)}B/s, peak "
                                       f"{si(row.flops)}FLOP/s<br>ridge {ridge:.0f} "
                                       "FLOPs/byte<extra></extra>")})
    return data


def _phase_traces(ok: pd.DataFrame, sets: list) -> tuple[list[dict], list[float]]:
    """Each label set's phases: the operating point now (large) and its recent trail;
    with how far back each trail goes, in seconds."""
    data: list[dict] = []
    spans: list[float] = []
    for key, phase in [(s, p) for s in sets for p in ("prefill", "decode")]:
        mine = _of(ok, key)
        mine = mine[mine["phase"] == phase].sort_values("at")
        if mine.empty:
            continue
        suffix = _label(key, len(sets) > 1)
        trail = mine[~mine["latest"].astype(bool)]
        now = mine[mine["latest"].astype(bool)].tail(1)
        if now.empty:
            now = mine.tail(1)
        if not trail.empty:
            data.append(_trail(trail, phase, suffix, float(now["at"].iloc[-1])))
            spans.append(float(now["at"].iloc[-1]) - float(trail["at"].astype(float).min()))
        data.append({"type": "scatter", "mode": "markers", "name": f"{phase}{suffix}",
                     "legendgroup": phase + suffix, "meta": phase,
                     "x": now["intensity"].tolist(), "y": now["flops"].tolist(),
                     "marker": {"color": PHASE_COLORS[phase], "size": 16,
                                "line": {"color": "#222", "width": 1.5}},
                     "hovertemplate": f"<b>{phase} now{suffix}</b><br>%{{x:.3g}} FLOPs/byte,"
                                      " %{y:.3s}FLOP/s<extra></extra>"})
    return data, spans


def _gpu_traces(ok: pd.DataFrame, sets: list) -> list[dict]:
    """Each label set's work over the estimate's range beside the DRAM traffic its GPUs
    counted, at the same intensity (``frames.POINT_COLUMNS``): two markers joined, the
    GPU's above the estimate's (the estimate is the least the work moves)."""
    data = []
    for key in sets:
        mine = _of(ok, key)
        est, gpu = (mine[mine["phase"] == p].tail(1) for p in ("estimate", "gpu"))
        if est.empty or gpu.empty:
            continue
        suffix = _label(key, len(sets) > 1)
        x = [float(est["intensity"].iloc[0]), float(gpu["intensity"].iloc[0])]
        y = [float(est["flops"].iloc[0]), float(gpu["flops"].iloc[0])]
        data.append({"type": "scatter", "mode": "lines+markers",
                     "name": f"estimate vs GPU counters{suffix}", "meta": "gpu",
                     "x": x, "y": y, "customdata": ["estimated", "the GPU counted"],
                     "marker": {"symbol": ["circle-open", "diamond"], "size": 13,
                                "color": "#222", "line": {"width": 2}},
                     "line": {"color": "#222", "width": 1, "dash": "dot"},
                     "hovertemplate": f"<b>%{{customdata}}{suffix}</b><br>the range's work at "
                                      "%{x:.3g} FLOPs/byte: %{y:.3s}FLOP/s<extra></extra>"})
    return data


def flops_range(ys: list[float]) -> list[float] | None:
    """The FLOP/s axis (log10): every line and point, and a strip above the roof about
    a line of text tall, where the trail's note sits clear of the ceilings."""
    if not ys:
        return None
    bottom, top = math.log10(min(ys)) - 0.05, math.log10(max(ys))
    return [bottom, top + max(0.3, 0.15 * (top - bottom))]


TRAIL_SIZES = (4.0, 10.0)  # the oldest and the newest earlier point; "now" is 16


def trail_note(span: float) -> dict:
    """The key to the trails, along the top of the roofline, in the strip above the roof
    (``flops_range``) that no operating point reaches."""
    return {"text": f"Small dots: each phase over the last {span_text(span)}, newest "
                    "largest; big dots: now",
            "showarrow": False, "xref": "paper", "yref": "paper", "x": 0.01, "y": 0.99,
            "xanchor": "left", "yanchor": "top", "align": "left",
            "font": {"size": 11, "color": "#555"}, "bgcolor": "rgba(255,255,255,0.8)"}


def span_text(seconds: float) -> str:
    """A trail's span as the legend says it: ``40 s`` under 90 s, else ``5 min``."""
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _trail(trail: pd.DataFrame, phase: str, suffix: str, now_at: float) -> dict:
    """A phase's earlier operating points, oldest first, joined by a line and growing
    toward the newest (``trail_note`` says so); shown and hidden with the phase's point
    now (one legend group)."""
    at = trail["at"].astype(float).to_numpy()
    age = now_at - at
    span = float(max(age.max(), 0.0))
    lo, hi = TRAIL_SIZES
    sizes = hi - (hi - lo) * (age / span if span > 0 else np.zeros_like(age))
    color = PHASE_COLORS[phase]
    return {"type": "scatter", "mode": "lines+markers", "showlegend": False,
            "name": f"{phase} earlier{suffix}",
            "legendgroup": phase + suffix, "x": trail["intensity"].tolist(),
            "y": trail["flops"].tolist(), "customdata": np.round(age).tolist(),
            "marker": {"color": color, "size": np.round(sizes, 1).tolist(), "opacity": 0.45},
            "line": {"color": color, "width": 1}, "opacity": 0.6,
            "hovertemplate": f"{phase} %{{customdata:.0f}} s before now{suffix}<br>"
                             "%{x:.3g} FLOPs/byte, %{y:.3s}FLOP/s<extra></extra>"}


# ---- time series --------------------------------------------------------------------
def _series_figure(series: pd.DataFrame, title: str, metrics: dict[str, tuple[str, str]],
                   yaxis: dict, empty: str) -> dict:
    """One line per (label set, metric); ``metrics`` maps metric -> (name, colour)."""
    df = series[series["metric"].isin(list(metrics))]
    if df.empty:
        return empty_figure(title, empty)
    sets = _label_sets(df)
    data = []
    for i, key in enumerate(sets):
        mine = _of(df, key)
        suffix = _label(key, len(sets) > 1)
        for metric, (name, color) in metrics.items():
            m = mine[mine["metric"] == metric].sort_values("at")
            if m.empty:
                continue
            dash = "dot" if metric.endswith("p95") else DASHES[i % len(DASHES)]
            data.append({"type": "scatter", "mode": "lines", "name": name + suffix,
                         "x": _dates(m["at"]), "y": m["value"].tolist(),
                         "line": {"color": color, "dash": dash, "width": 2}})
    return figure(data, title, _time_axis(), yaxis)


def ttft_figure(series: pd.DataFrame) -> dict:
    return _series_figure(series, "TTFT percentiles", {
        "ttft_p50": ("TTFT p50", "#0072B2"), "ttft_p95": ("TTFT p95", "#56B4E9")},
        {**SECONDS_AXIS, "title": {"text": "TTFT"}}, "No TTFT samples yet")


def token_latency_figure(series: pd.DataFrame) -> dict:
    return _series_figure(series, "ITL and TPOT percentiles", {
        "itl_p50": ("ITL p50", "#009E73"), "itl_p95": ("ITL p95", "#7FCDB4"),
        "tpot_p50": ("TPOT p50", "#CC79A7"), "tpot_p95": ("TPOT p95", "#E5B3D2")},
        {**SECONDS_AXIS, "title": {"text": "time per token"}},
        "No ITL/TPOT samples yet")


def throughput_figure(series: pd.DataFrame) -> dict:
    return _series_figure(series, "Tokens per second", {
        "prompt_tokens_per_second": ("prompt tokens in", PHASE_COLORS["prefill"]),
        "output_tokens_per_second": ("output tokens out", PHASE_COLORS["decode"])},
        {"title": {"text": "tokens/s"}, "tickformat": "~s", "rangemode": "tozero"},
        "No tokens yet")


SLO_LINES = {"good_ratio": ("every objective met", "#222222"),
             "ttft_attainment": ("TTFT met", "#0072B2"),
             "tpot_attainment": ("TPOT met", "#CC79A7"),
             "itl_attainment": ("ITL met", "#009E73"),
             "e2el_attainment": ("e2e met", "#E69F00")}


def slo_figure(series: pd.DataFrame) -> dict:
    """Each objective's attainment, and the share of requests that met all of them, over
    the rolling window, as time goes by."""
    return _series_figure(series, "Objectives met (share of requests in the window)",
                          SLO_LINES, {"title": {"text": "requests met"}, "tickformat": ".0%",
                                      "rangemode": "tozero"},
                          "No requests judged against the objectives yet")


def shares_figure(series: pd.DataFrame) -> dict:
    """Stacked phase time shares; with several label sets, the first one is stacked and
    the selector narrows it (shares of different services do not add)."""
    title = "Share of request time by phase"
    df = series[series["metric"].isin([f"{p}_share" for p in PHASES])]
    if df.empty:
        return empty_figure(title, "No complete requests yet")
    sets = _label_sets(df)
    mine = _of(df, sets[0])
    suffix = _label(sets[0], len(sets) > 1)
    data = []
    for p in PHASES:
        m = mine[mine["metric"] == f"{p}_share"].sort_values("at")
        if m.empty:  # preprocess or kv_transfer, from a server that does not report it
            continue
        data.append({"type": "scatter", "mode": "lines", "stackgroup": "shares",
                     "name": p + suffix, "x": _dates(m["at"]), "y": m["value"].tolist(),
                     "line": {"color": PHASE_COLORS[p], "width": 0.5},
                     "fillcolor": PHASE_COLORS[p],
                     "hovertemplate": f"{p}: %{{y:.0%}}<extra></extra>"})
    shown = (f" ({who(dict(zip(KEYS, sets[0], strict=True)))}; pick one to change)"
             if len(sets) > 1 else "")
    return figure(data, title + shown, _time_axis(),
                  {"title": {"text": "share of request time"}, "tickformat": ".0%",
                   "range": [0, 1]})


# ---- requests -----------------------------------------------------------------------
def waterfall_figure(waterfall: pd.DataFrame, idle_text: str | None = None) -> dict:
    """Recent requests as horizontal bars split into their phases; the title names the
    phases drawn (preprocess and the KV transfer only where the server reports them)."""
    if waterfall.empty:
        return empty_figure("Recent requests by phase", idle_text or
                            "No finished requests with their phases yet")
    df = waterfall.sort_values("start").reset_index(drop=True)
    # "joined: <request>" where the exporter labels sources (a tap's request, the
    # engine's, or both joined), so a client-visible bar is never taken for an engine's
    labels = [(f"{src}: {x}" if src else str(x))[:28]
              for x, src in zip(df["label"], df["source"], strict=True)]
    base = df["start"].astype(float).to_numpy()
    data = []
    for p in PHASES:
        width = np.nan_to_num(df[p].astype(float).to_numpy())
        if not width.any():  # a server that does not report it (preprocess: inside the
            continue  # queue), or the client's view (ttft undivided: no queue or prefill)
        data.append({"type": "bar", "orientation": "h", "name": p, "y": labels,
                     "x": width.tolist(), "base": base.tolist(),
                     "marker": {"color": PHASE_COLORS[p]},
                     "customdata": np.stack([df["prompt_tokens"].astype(float).fillna(-1),
                                             df["output_tokens"].astype(float).fillna(-1)],
                                            axis=1).tolist(),
                     "hovertemplate": f"%{{y}}<br>{p} %{{x:.3s}}s<br>prompt "
                                      "%{customdata[0]:.0f} tokens, output "
                                      "%{customdata[1]:.0f}<extra></extra>"})
        base = base + width
    which = ("Mean request per pod" if (df["kind"] == "mean").all() else "Recent requests")
    title = f"{which}: {', '.join(t['name'] for t in data)}"
    return figure(data, title, {"title": {"text": "seconds (0 = the newest request's end)"}},
                  {"title": {"text": "request"}, "type": "category", "automargin": True,
                   "tickfont": {"size": 9}}, plot_px=max(PLOT_PX, 14 * len(labels)),
                  barmode="overlay")


def prompt_ttft_figure(prompt_points: pd.DataFrame, prompt_classes: pd.DataFrame,
                       idle_text: str | None = None) -> dict:
    """TTFT against prompt length: each request (where the source has them) and the p50
    and p95 of each prompt-length class, with prefill seconds per token on hover."""
    title = "TTFT against prompt length"
    if prompt_points.empty and prompt_classes.empty:
        return empty_figure(title, idle_text or
                            "No requests with a prompt length and a TTFT yet")
    data = []
    sets = _label_sets(pd.concat([prompt_points[list(KEYS)], prompt_classes[list(KEYS)]]))
    for i, key in enumerate(sets):
        suffix = _label(key, len(sets) > 1)
        pts = _of(prompt_points, key)
        pts = pts[(pts["prompt_tokens"] > 0) & (pts["ttft"] > 0)]
        if not pts.empty:
            data.append({"type": "scatter", "mode": "markers", "name": "request" + suffix,
                         "x": pts["prompt_tokens"].tolist(), "y": pts["ttft"].tolist(),
                         "marker": {"color": PHASE_COLORS["prefill"], "size": 5,
                                    "opacity": 0.35, "symbol": i % 10},
                         "hovertemplate": "%{x} prompt tokens<br>TTFT %{y:.3s}s"
                                          "<extra></extra>"})
        cls = _of(prompt_classes, key).sort_values("min_tokens")
        if cls.empty:
            continue
        x = class_midpoints(cls["min_tokens"], cls["max_tokens"])
        per_token = cls["prefill_per_token_p50"].astype(float).fillna(-1).tolist()
        for q, dash in (("p50", "solid"), ("p95", "dot")):
            data.append({"type": "scatter", "mode": "lines+markers",
                         "name": f"class TTFT {q}{suffix}", "x": x,
                         "y": cls[f"ttft_{q}"].tolist(),
                         "line": {"color": "#222", "dash": dash, "width": 2},
                         "marker": {"size": 8},
                         "customdata": list(zip(cls["prompt_class"], per_token,
                                                cls["count"], strict=True)),
                         "hovertemplate": f"prompt class %{{customdata[0]}} tokens<br>TTFT {q} "
                                          "%{y:.3s}s<br>prefill %{customdata[1]:.3s}s per "
                                          "token (p50; -1: unknown)<br>%{customdata[2]} "
                                          "requests<extra></extra>"})
    ys = [y for t in data for y in t["y"]]
    xs = [x for t in data for x in t["x"]]
    return figure(data, title, {"type": "log", "title": {"text": "prompt length (tokens)"},
                                **log_tokens_ticks(xs)},
                  {"type": "log", "title": {"text": "TTFT"}, **log_seconds_ticks(ys)})


def class_midpoints(min_tokens: pd.Series, max_tokens: pd.Series) -> list[float]:
    """A prompt class's x: the middle of its token range (0-256 at 128), the open top
    class (no finite max) as if it ended at twice its min."""
    lo = min_tokens.astype(float)
    hi = max_tokens.astype(float)
    hi = hi.where(np.isfinite(hi), lo * 2)
    return ((lo + hi) / 2).clip(lower=1).tolist()
