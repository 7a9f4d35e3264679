"""Plotly figures (as plain dicts, which Dash sends as they are) from the source frames.

Every function takes frames from ``dashboard.frames`` and returns a figure; an empty
frame gives a figure that says so. ``uirevision`` is constant, so a live refresh
keeps the user's zoom and hidden traces.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from dashboard.frames import KEYS, who
from dashboard.theme import CEILING_STYLES, OPTIONAL_PHASES, PHASE_COLORS, PHASES

DASHES = ("solid", "dot", "dash", "longdash", "dashdot", "longdashdot")
SECONDS_AXIS = {"tickformat": "~s", "ticksuffix": "s", "rangemode": "tozero"}


def _layout(title: str, xaxis: dict, yaxis: dict, **extra) -> dict:
    # Title on the left (the mode bar sits on the right); legend below the x-axis title.
    return {"title": {"text": title, "font": {"size": 14}, "x": 0.01, "xanchor": "left"},
            "uirevision": title, "margin": {"l": 60, "r": 10, "t": 36, "b": 90},
            "height": 360, "legend": {"orientation": "h", "yanchor": "top", "y": -0.28,
                                      "font": {"size": 11}},
            "xaxis": xaxis, "yaxis": yaxis, "hovermode": "closest",
            "paper_bgcolor": "#fff", "plot_bgcolor": "#fff", **extra}


def si(x: float) -> str:
    """3.35e12 -> "3.35 T": SI prefixes for bytes/s and FLOP/s."""
    if not math.isfinite(x) or x == 0:
        return f"{x:g} "
    k = min(max(math.floor(math.log10(abs(x)) / 3), -4), 6)
    return f"{x / 10 ** (3 * k):.3g} {'pnum kMGTPE'[k + 4].strip()}"


def empty_figure(title: str, message: str) -> dict:
    return {"data": [], "layout": _layout(
        title, {"visible": False}, {"visible": False},
        annotations=[{"text": message, "showarrow": False, "xref": "paper", "yref": "paper",
                      "x": 0.5, "y": 0.5, "font": {"size": 14, "color": "#777"}}])}


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


def roofline_figure(points: pd.DataFrame, ceilings: pd.DataFrame,
                    empty_text: str = NO_ROOFLINE) -> dict:
    """Log-log roofline: per hardware, min(bandwidth x intensity, peak FLOP/s) for each
    ceiling, and each phase's operating point now (large) and its recent trail.
    ``empty_text``: what the figure says with neither (a stopped workload says so)."""
    title = "Roofline: achieved FLOP/s against arithmetic intensity"
    if ceilings.empty and points.empty:
        return empty_figure(title, empty_text)
    ok = points[np.isfinite(points["intensity"].astype(float))
                & np.isfinite(points["flops"].astype(float))
                & (points["intensity"].astype(float) > 0) & (points["flops"].astype(float) > 0)]
    ridges = [r for r in (ceilings["flops"] / ceilings["bandwidth"]).astype(float).tolist()
              if math.isfinite(r) and r > 0]  # a ceiling Prometheus lacks a figure for: NaN
    xs = ok["intensity"].astype(float).tolist() + ridges
    lo = 10 ** math.floor(math.log10(max(min([*xs, 1.0]) / 3, 1e-3)))
    hi = 10 ** math.ceil(math.log10(max([*xs, 10.0]) * 10))
    data = []
    seen = set()
    for row in ceilings.itertuples(index=False):
        key = (row.hardware, row.ceiling, row.bandwidth, row.flops)
        if key in seen or not (row.bandwidth > 0 and row.flops > 0):
            continue
        seen.add(key)
        ridge = row.flops / row.bandwidth
        style = CEILING_STYLES.get(row.ceiling, CEILING_STYLES["datasheet"])
        name = f"{row.ceiling} ceiling" + (f" ({row.hardware})" if row.hardware else "")
        data.append({"type": "scatter", "mode": "lines", "name": name,
                     "x": [lo, ridge, hi], "y": [row.bandwidth * lo, row.flops, row.flops],
                     "line": {"color": style["color"], "dash": style["dash"], "width": 2},
                     "hovertemplate": (f"{name}<br>bandwidth {si(row.bandwidth)}B/s, peak "
                                       f"{si(row.flops)}FLOP/s<br>ridge {ridge:.0f} "
                                       "FLOPs/byte<extra></extra>")})
    sets = _label_sets(ok)
    for key, phase in [(s, p) for s in sets for p in ("prefill", "decode")]:
        mine = _of(ok, key)
        mine = mine[mine["phase"] == phase].sort_values("at")
        if mine.empty:
            continue
        suffix = _label(key, len(sets) > 1)
        color = PHASE_COLORS[phase]
        trail = mine[~mine["latest"].astype(bool)]
        if not trail.empty:
            data.append({"type": "scatter", "mode": "lines+markers", "showlegend": False,
                         "name": f"{phase} trail{suffix}", "legendgroup": phase + suffix,
                         "x": trail["intensity"].tolist(), "y": trail["flops"].tolist(),
                         "marker": {"color": color, "size": 5, "opacity": 0.35},
                         "line": {"color": color, "width": 1}, "opacity": 0.5,
                         "hovertemplate": f"{phase} earlier{suffix}<br>%{{x:.3g}} FLOPs/byte,"
                                          " %{y:.3s}FLOP/s<extra></extra>"})
        now = mine[mine["latest"].astype(bool)].tail(1)
        if now.empty:
            now = mine.tail(1)
        data.append({"type": "scatter", "mode": "markers", "name": f"{phase}{suffix}",
                     "legendgroup": phase + suffix, "meta": phase,
                     "x": now["intensity"].tolist(), "y": now["flops"].tolist(),
                     "marker": {"color": color, "size": 16, "line": {"color": "#222",
                                                                     "width": 1.5}},
                     "hovertemplate": f"<b>{phase} now{suffix}</b><br>%{{x:.3g}} FLOPs/byte,"
                                      " %{y:.3s}FLOP/s<extra></extra>"})
    return {"data": data, "layout": _layout(
        title,
        {"type": "log", "title": {"text": "arithmetic intensity (FLOPs/byte)"},
         "range": [math.log10(lo), math.log10(hi)]},
        {"type": "log", "title": {"text": "achieved FLOP/s"}, "tickformat": "~s"})}


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
    return {"data": data, "layout": _layout(title, _time_axis(), yaxis)}


def ttft_figure(series: pd.DataFrame) -> dict:
    return _series_figure(series, "TTFT percentiles", {
        "ttft_p50": ("TTFT p50", "#0072B2"), "ttft_p95": ("TTFT p95", "#56B4E9")},
        {**SECONDS_AXIS, "title": {"text": "TTFT (seconds)"}}, "No TTFT samples yet")


def token_latency_figure(series: pd.DataFrame) -> dict:
    return _series_figure(series, "ITL and TPOT percentiles", {
        "itl_p50": ("ITL p50", "#009E73"), "itl_p95": ("ITL p95", "#7FCDB4"),
        "tpot_p50": ("TPOT p50", "#CC79A7"), "tpot_p95": ("TPOT p95", "#E5B3D2")},
        {**SECONDS_AXIS, "title": {"text": "seconds per token"}},
        "No ITL/TPOT samples yet")


def throughput_figure(series: pd.DataFrame) -> dict:
    return _series_figure(series, "Tokens per second", {
        "prompt_tokens_per_second": ("prompt tokens in", PHASE_COLORS["prefill"]),
        "output_tokens_per_second": ("output tokens out", PHASE_COLORS["decode"])},
        {"title": {"text": "tokens/s"}, "tickformat": "~s", "rangemode": "tozero"},
        "No tokens yet")


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
    note = (f" ({who(dict(zip(KEYS, sets[0], strict=True)))}; pick one to change)"
            if len(sets) > 1 else "")
    return {"data": data, "layout": _layout(
        title + note, _time_axis(),
        {"title": {"text": "share of request time"}, "tickformat": ".0%", "range": [0, 1]})}


# ---- requests -----------------------------------------------------------------------
def waterfall_figure(waterfall: pd.DataFrame) -> dict:
    """Recent requests as horizontal bars split into queue, prefill and decode."""
    title = "Recent requests: queue, prefill, decode"
    if waterfall.empty:
        return empty_figure(title, "No finished requests with all three phases yet")
    df = waterfall.sort_values("start").reset_index(drop=True)
    if (df["kind"] == "mean").all():
        title = "Mean request per pod: queue, prefill, decode"
    # "joined: <request>" where the exporter labels sources (a tap's request, the
    # engine's, or both joined), so a client-visible bar is never taken for an engine's
    labels = [(f"{src}: {x}" if src else str(x))[:28]
              for x, src in zip(df["label"], df["source"], strict=True)]
    base = df["start"].astype(float).to_numpy()
    data = []
    for p in PHASES:
        width = np.nan_to_num(df[p].astype(float).to_numpy())
        if p in OPTIONAL_PHASES and not width.any():
            continue  # a server that does not report it (preprocess: inside the queue)
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
    height = max(320, 60 + 14 * len(labels))
    return {"data": data, "layout": _layout(
        title, {"title": {"text": "seconds (0 = the newest request's end)"}},
        {"title": {"text": "request"}, "type": "category", "automargin": True,
         "tickfont": {"size": 9}}, barmode="overlay", height=height)}


def prompt_ttft_figure(prompt_points: pd.DataFrame, prompt_classes: pd.DataFrame) -> dict:
    """TTFT against prompt length: each request (where the source has them) and the p50
    and p95 of each prompt-length class, with prefill seconds per token on hover."""
    title = "TTFT against prompt length"
    if prompt_points.empty and prompt_classes.empty:
        return empty_figure(title, "No requests with a prompt length and a TTFT yet")
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
    return {"data": data, "layout": _layout(
        title, {"type": "log", "title": {"text": "prompt length (tokens)"}},
        {"type": "log", "title": {"text": "TTFT"}, **log_seconds_ticks(ys)})}


def class_midpoints(min_tokens: pd.Series, max_tokens: pd.Series) -> list[float]:
    """A prompt class's x: the middle of its token range (0-256 at 128), the open top
    class (no finite max) as if it ended at twice its min."""
    lo = min_tokens.astype(float)
    hi = max_tokens.astype(float)
    hi = hi.where(np.isfinite(hi), lo * 2)
    return ((lo + hi) / 2).clip(lower=1).tolist()


def duration_text(x: float) -> str:
    """An axis label in ms below a second, in s above: ``200 ms``, ``1.5 s``."""
    return f"{x * 1000:.3g} ms" if x < 1 else f"{x:.3g} s"


def log_seconds_ticks(values: list[float]) -> dict:
    """A log axis of durations labelled 1-2-5 per decade in ms or s: Plotly's own ``~s``
    labels mix units (``200m 100ms 90m``, where "m" reads as minutes) and crowd the
    minor ticks with labels."""
    ok = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    if not ok:
        return {"tickformat": "~s", "ticksuffix": "s"}
    lo = math.floor(math.log10(min(ok)))
    hi = math.ceil(math.log10(max(ok)))
    ticks = [m * 10.0 ** e for e in range(lo, max(hi, lo + 1) + 1) for m in (1, 2, 5)]
    ticks = [t for t in ticks if min(ok) / 2 <= t <= max(ok) * 2] or [10.0 ** lo]
    return {"tickmode": "array", "tickvals": ticks,
            "ticktext": [duration_text(t) for t in ticks]}
