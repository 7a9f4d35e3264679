"""The frame every figure shares: the title under Plotly's mode bar, the legend under
the x axis with room for all its rows, the note across an empty figure, and log axes
labelled 1-2-5 per decade. Plain dicts, as ``phasewatch.dashboard.figures`` builds them."""

from __future__ import annotations

import math

# Plotly's mode bar is 22 px tall, 2 px from the figure's top right (plotly.js's
# ``.modebar`` style): the title starts below it, so a title as long as the panel is
# wide never runs under its buttons (at 1280 px the roofline's did).
MODEBAR_BOTTOM = 24
TITLE_TOP = MODEBAR_BOTTOM + 6


def _layout(title: str, xaxis: dict, yaxis: dict, **extra) -> dict:
    # Title on the left, under the mode bar's strip; legend below the x-axis title.
    return {"title": {"text": title, "font": {"size": 14}, "x": 0.01, "xanchor": "left",
                      "y": 1, "yref": "container", "yanchor": "top",
                      "pad": {"t": TITLE_TOP}},
            "uirevision": title, "margin": {"l": 60, "r": 10, "t": TITLE_TOP + 28, "b": 90},
            "height": 360, "legend": {"orientation": "h", "yanchor": "top", "y": -0.28,
                                      "font": {"size": 11}},
            "xaxis": xaxis, "yaxis": yaxis, "hovermode": "closest",
            "paper_bgcolor": "#fff", "plot_bgcolor": "#fff", **extra}


# A horizontal legend under the x axis, Plotly-packed left to right in rows: the
# figure keeps room for every row, so the legend never rides up over the axis title
# (a legend placed at a fixed fraction under the plot does, once Plotly grows the
# bottom margin for a legend that overflows it and shrinks the plot).
PLOT_PX = 220  # the plot area's height
LEGEND_ROW_PX = 20  # one row of entries at font size 11
LEGEND_WIDTH_PX = 440  # the narrowest a legend gets: a two-column panel at 1100 px
BELOW_AXIS_PX = {"date": 78, "other": 62}  # tick labels (two lines for dates), title


def legend_rows(names: list[str], width: float = LEGEND_WIDTH_PX) -> int:
    """Rows a horizontal legend of ``names`` takes: each entry its symbol (~46 px) and
    its text (~6.5 px a character at 11 px, generous so as not to fall short)."""
    rows, used = 1, 0.0
    for name in names:
        w = 46 + 6.5 * len(name)
        if used and used + w > width:
            rows, used = rows + 1, 0.0
        used += w
    return rows


def figure(data: list[dict], title: str, xaxis: dict, yaxis: dict,
           plot_px: int = PLOT_PX, **extra) -> dict:
    """``data`` with its layout: a bottom margin holding the x axis and every row of the
    legend, and a plot area ``plot_px`` tall."""
    names = [t["name"] for t in data if t.get("showlegend", True) and t.get("name")]
    below = BELOW_AXIS_PX["date" if xaxis.get("type") == "date" else "other"]
    bottom = below + legend_rows(names) * LEGEND_ROW_PX + 12 if names else below + 8
    layout = _layout(title, xaxis, yaxis, **extra)
    layout["margin"]["b"] = bottom
    layout["height"] = layout["margin"]["t"] + plot_px + bottom
    layout["legend"]["y"] = -below / plot_px
    return {"data": data, "layout": layout}


def empty_figure(title: str, message: str) -> dict:
    return {"data": [], "layout": _layout(title, {"visible": False}, {"visible": False},
                                          annotations=[note(message)])}


def note(text: str) -> dict:
    """A figure's message across its middle (as ``empty_figure`` gives it)."""
    return {"text": text, "showarrow": False, "xref": "paper", "yref": "paper",
            "x": 0.5, "y": 0.5, "font": {"size": 14, "color": "#777"},
            "bgcolor": "rgba(255,255,255,0.8)"}


def duration_text(x: float) -> str:
    """An axis label in ms below a second, in s above: ``200 ms``, ``1.5 s``."""
    return f"{x * 1000:.3g} ms" if x < 1 else f"{x:.3g} s"


def _ticks_125(values: list[float]) -> list[float]:
    """1-2-5 per decade, over ``values`` (positive, finite) and a little past them."""
    lo = math.floor(math.log10(min(values)))
    hi = math.ceil(math.log10(max(values)))
    ticks = [m * 10.0 ** e for e in range(lo, max(hi, lo + 1) + 1) for m in (1, 2, 5)]
    return [t for t in ticks if min(values) / 2 <= t <= max(values) * 2] or [10.0 ** lo]


def log_seconds_ticks(values: list[float]) -> dict:
    """A log axis of durations labelled 1-2-5 per decade in ms or s: Plotly's own ``~s``
    labels mix units (``200m 100ms 90m``, where "m" reads as minutes) and crowd the
    minor ticks with labels."""
    ok = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    if not ok:
        return {"tickformat": "~s", "ticksuffix": "s"}
    ticks = _ticks_125(ok)
    return {"tickmode": "array", "tickvals": ticks,
            "ticktext": [duration_text(t) for t in ticks]}


def count_text(x: float) -> str:
    """A token count as an axis label: ``500``, ``2k``, ``10k``."""
    return f"{x / 1000:g}k" if x >= 1000 else f"{x:g}"


def log_tokens_ticks(values: list[float]) -> dict:
    """A log axis of token counts labelled 1-2-5 per decade (``100 200 500 1k 2k``):
    Plotly labels every minor tick with a bare digit (``9 2 3 4 5 6 7 8 9``), which reads
    as a count of 2, not 200, and crowds a panel."""
    ok = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    if not ok:
        return {}
    ticks = _ticks_125(ok)
    return {"tickmode": "array", "tickvals": ticks, "ticktext": [count_text(t) for t in ticks]}
