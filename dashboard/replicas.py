"""A fleet's replicas side by side, and the ones that differ from the rest.

Each pod of a label set (model, engine, source) gets a row of ``frames.REPLICA_COLUMNS``: its
request rate, TTFT p50/p95 from its own histogram, the share of its request time spent
in the engine's queue, its engine's KV-cache usage and its verdict. A replica is an
outlier when one of ``OUTLIER_RULES`` holds: its figure is at least ``ratio`` times the
median of the *other* replicas' and at least ``margin`` above it (in the figure's unit),
judged only where the replica, and the replicas it is compared with, finished
``MIN_REQUESTS`` requests in the range (a percentile of a handful of requests is
noise; the KV-cache rule needs no traffic). Its verdict differs when every other
replica, two or more, reports one verdict and it reports another.

The median of the others, not of all: with two replicas a median of both is their mean,
which a replica can never reach twice of; and one slow replica cannot drag the yardstick
it is measured by. Pure functions of the query answers (``queries.REPLICAS``) or of a
central exporter's per-pod frames, unit-tested on samples.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass

import pandas as pd

from phasewatch.dashboard.frames import KEYS, REPLICA_FIGURES
from phasewatch.roofline.verdict_text import headline


@dataclass(frozen=True)
class OutlierRule:
    column: str  # the replica's figure
    words: str  # how the sentence names it
    ratio: float  # at least this many times the median of the other replicas' ...
    margin: float  # ... and at least this much above it, in the figure's unit
    unit: str  # "seconds" or "share" (0..1)
    needs_traffic: bool = True  # judged only on replicas with MIN_REQUESTS in the range


# Twice the others' median: identical replicas' TTFT p95 over a minute of traffic differ
# by well under that (sampling noise; the native histograms' ~4.4 % buckets), while a
# replica that queues doubles it within seconds. The margins keep fast services quiet (a
# 4 ms against 2 ms p50 is twice, and nothing to act on): 50 ms of TTFT, 20 points of
# request time in the queue, 30 points of KV cache (a cache half again as full as the
# others' and a third of it more: 90 % against 60 %).
OUTLIER_RULES = (
    OutlierRule("ttft_p95", "TTFT p95", 2.0, 0.050, "seconds"),
    OutlierRule("ttft_p50", "TTFT p50", 2.0, 0.050, "seconds"),
    OutlierRule("queue_share", "queue share of request time", 2.0, 0.20, "share"),
    OutlierRule("kv_usage", "KV-cache usage", 1.5, 0.30, "share", needs_traffic=False),
)
MIN_REQUESTS = 30  # a replica's finished requests in the range before its latency counts


def figure_text(value: float, unit: str) -> str:
    """A figure in a sentence: "412 ms", "1.52 s", "45%", "0.3%" (a share under 1 % keeps a
    decimal: "80% against 0%" would read as nothing against nothing)."""
    if unit == "share":
        return f"{value:.1%}" if 0 < value < 0.01 else f"{value:.0%}"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def ratio_text(ratio: float) -> str:
    return f"{ratio:.1f}x" if ratio < 10 else f"{ratio:.0f}x"


def _known(x) -> bool:
    return x is not None and not pd.isna(x) and math.isfinite(float(x))


def _judged(row: dict, rule: OutlierRule) -> float | None:
    """The row's figure for ``rule``, or None where it is not to be judged."""
    v = row.get(rule.column)
    if not _known(v):
        return None
    if rule.needs_traffic and not (row.get("requests_in_range") or 0) >= MIN_REQUESTS:
        return None
    return float(v)


def _rule_sentence(rule: OutlierRule, value: float, median: float) -> str:
    v, m = figure_text(value, rule.unit), figure_text(median, rule.unit)
    if median <= 0:
        return f"{rule.words} {v} against {m} on the other replicas (median)"
    return (f"{rule.words} {ratio_text(value / median)} the median of the other replicas "
            f"({v} against {m})")


def _verdict_sentence(mine: str, others: list[str]) -> str | None:
    """Where every other replica (two or more) reports one verdict and this one another."""
    if len(others) < 2 or len(set(others)) != 1 or not mine or mine == others[0]:
        return None
    return f'verdict "{mine}", while the other {len(others)} replicas report "{others[0]}"'


def mark_outliers(rows: list[dict]) -> list[dict]:
    """``rows`` (one label set's replicas, or several label sets') with ``outlier``,
    ``flagged`` (the figures that stand out) and ``why`` (a sentence per figure) set."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["model"], row["engine"], row["source"])].append(row)
    for group in groups.values():
        for row in group:
            others = [o for o in group if o is not row]
            flagged, why = [], []
            for rule in OUTLIER_RULES:
                value = _judged(row, rule)
                theirs = [x for o in others if (x := _judged(o, rule)) is not None]
                if value is None or not theirs:
                    continue
                median = statistics.median(theirs)
                if value >= rule.ratio * median and value - median >= rule.margin:
                    flagged.append(rule.column)
                    why.append(_rule_sentence(rule, value, median))
            differs = _verdict_sentence(row.get("headline", ""),
                                        [o["headline"] for o in others if o.get("headline")])
            if differs:
                flagged.append("headline")
                why.append(differs)
            row.update(outlier=bool(flagged), flagged=tuple(flagged),
                       why="; ".join(why))
    return rows


def _fleets_only(rows: dict[tuple, dict], range_seconds: float | None) -> list[dict]:
    """The rows of label sets with two replicas or more, one of them with requests in the
    range, each row with its verdict's headline and its requests in the range."""
    by_set: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows.values():
        by_set[(row["model"], row["engine"], row["source"])].append(row)
    out = []
    for _, group in sorted(by_set.items()):
        if len(group) < 2 or not any((r.get("request_rate") or 0) > 0 for r in group):
            continue
        for row in sorted(group, key=lambda r: r["pod"]):
            rate = row.get("request_rate")
            if "requests_in_range" not in row:
                row["requests_in_range"] = (rate * range_seconds if _known(rate)
                                            and range_seconds else math.nan)
            if row.get("phase"):
                row["headline"] = headline(row["phase"], row["resource"],
                                           row.get("cause") or None)
            out.append(row)
    return mark_outliers(out)


def replica_rows(r: dict, key, range_seconds: float | None) -> list[dict]:
    """Rows of REPLICA_COLUMNS from the answers to ``queries.REPLICAS`` (``r`` holds them
    as ``replica:<name>``: (metric, value) pairs); ``key(metric, pod=True)`` names a
    series' label set with its pod."""
    rows: dict[tuple, dict] = {}
    for name in REPLICA_FIGURES:
        for metric, v in r.get(f"replica:{name}", ()):
            k = key(metric, pod=True)
            if k["pod"] and (name != "kv_usage" or tuple(k.values()) in rows):
                rows.setdefault(tuple(k.values()), dict(k))[name] = v
    votes: dict[tuple, Counter] = defaultdict(Counter)
    for metric, n in r.get("replica:verdict", ()):
        k = tuple(key(metric, pod=True).values())
        if k in rows and metric.get("phase"):
            votes[k][(metric["phase"], metric.get("resource", ""),
                      metric.get("cause", ""))] += n
    for k, options in votes.items():
        (phase, resource, cause), _ = options.most_common(1)[0]
        rows[k].update(phase=phase, resource=resource, cause=cause)
    return _fleets_only(rows, range_seconds)


def replicas_from_frames(kpis: pd.DataFrame, verdicts: pd.DataFrame) -> list[dict]:
    """The same rows from a central exporter that labels pods (--pod-label): its per-pod
    KPIs and verdicts (it scrapes no engine, so no KV-cache usage)."""
    rows: dict[tuple, dict] = {}
    for _, kpi in kpis[kpis["pod"] != ""].iterrows():
        k = tuple(kpi[list(KEYS)])
        rows[k] = {**dict(zip(KEYS, k, strict=True)),
                   **{c: kpi.get(c) for c in ("request_rate", "ttft_p50", "ttft_p95",
                                              "queue_share", "requests_in_range")}}
    for _, v in verdicts.iterrows():
        k = tuple(v[list(KEYS)])
        if k in rows:
            rows[k].update(phase=v["phase"], resource=v["resource"], cause=v["cause"])
    return _fleets_only(rows, None)
