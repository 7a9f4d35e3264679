"""Frames from PromQL over Prometheus's HTTP API: a whole cluster, aggregated across pods.

Every expression comes from ``phasewatch.dashboard.queries``. Queries of one refresh run
concurrently; the first failure becomes the snapshot's error, naming the query
(or the URL, when Prometheus cannot be reached).
"""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlencode

from phasewatch.dashboard import queries as q
from phasewatch.dashboard.frames import (
    ALL,
    CEILING_COLUMNS,
    KEYS,
    KPI_COLUMNS,
    POINT_COLUMNS,
    PROMPT_CLASS_COLUMNS,
    REPLICA_COLUMNS,
    SERIES_COLUMNS,
    VERDICT_COLUMNS,
    WATERFALL_COLUMNS,
    Selection,
    Snapshot,
    SourceError,
    frame,
    in_window_only,
)
from phasewatch.dashboard.http import FetchError, base_url, get_json
from phasewatch.dashboard.prometheus_verdicts import slo_figures, slo_kpis, verdict_rows
from phasewatch.dashboard.replicas import replica_rows
from phasewatch.dashboard.theme import OPTIONAL_PHASES, PHASES, REQUIRED_PHASES
from phasewatch.requests.buckets import PROMPT_CLASS_RANGES


def _value(raw: str) -> float:
    v = float(raw)
    return v if math.isfinite(v) else math.nan


_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def duration_seconds(text: str) -> float:
    """Seconds in a Prometheus duration (``30s``, ``5m``, ``1h30m``); ValueError if not one."""
    parts = re.findall(r"(\d+)(ms|[smhdwy])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return float(sum(int(n) * _UNITS[u] for n, u in parts))


class PrometheusSource:
    name = "prometheus"

    def __init__(self, url: str, rate_range: str = "1m", timeout: float = 5.0,
                 history_seconds: float = 600.0, trail_seconds: float = 120.0,
                 pod_label: str = "pod", clock=time.time):
        self.url = base_url(url, "http://prometheus:9090")
        self.rate_range = rate_range
        try:  # a range Prometheus refuses is reported by the first query, naming it
            self.range_seconds: float | None = duration_seconds(rate_range)
        except ValueError:
            self.range_seconds = None
        self.timeout = timeout
        self.history_seconds = history_seconds
        self.trail_seconds = trail_seconds
        self.pod_label = pod_label
        self._clock = clock
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="pw-promql")

    # ---- HTTP API ----------------------------------------------------------------
    def _api(self, path: str, expr: str, **params) -> list[dict]:
        url = f"{self.url}{path}?{urlencode({'query': expr, **params})}"
        try:
            body = get_json(url, self.timeout, "Prometheus", target=self.url)
        except FetchError as e:
            if e.error.kind == "unreachable":
                raise
            raise FetchError(SourceError("query", f"Prometheus query failed: "
                                         f"{e.error.message}", expr)) from None
        if not isinstance(body, dict) or body.get("status") != "success":
            raise FetchError(SourceError("query", f"Prometheus query failed: "
                                         f"{body.get('error') if isinstance(body, dict) else body}",
                                         expr))
        return body["data"]["result"]

    def instant(self, expr: str, at: float) -> list[tuple[dict, float]]:
        return [(r["metric"], _value(r["value"][1]))
                for r in self._api("/api/v1/query", expr, time=at)]

    def range(self, expr: str, start: float, end: float, step: float
              ) -> list[tuple[dict, list[tuple[float, float]]]]:
        rows = self._api("/api/v1/query_range", expr, start=start, end=end, step=step)
        return [(r["metric"], [(float(t), _value(v)) for t, v in r["values"]]) for r in rows]

    # ---- one refresh -----------------------------------------------------------
    def fetch(self, selection: Selection = ALL) -> Snapshot:
        now = self._clock()
        sel = q.matcher(selection.models, selection.engines, selection.pods, self.pod_label,
                        selection.sources)

        def expr(template: str) -> str:
            return q.render(template, sel, self.rate_range, self.pod_label)

        step = max(1.0, self.history_seconds / 200)
        trail_step = max(1.0, self.trail_seconds / 30)
        instant = {f"kpi:{k}": expr(t) for k, t in q.KPIS.items()}
        instant |= {"share": expr(q.PHASE_SHARE), "mean": expr(q.PHASE_MEAN),
                    "votes": expr(q.VERDICT_VOTES), "reporting": expr(q.VERDICT_REPORTING),
                    "confidence": expr(q.VERDICT_CONFIDENCE), "causes": expr(q.VERDICT_CAUSES),
                    "engine_kv": expr(q.ENGINE_KV_USAGE),
                    "engine_requests": expr(q.ENGINE_REQUESTS),
                    "engine_preemptions": expr(q.ENGINE_PREEMPTIONS),
                    "ceiling_exceeded": expr(q.CEILING_EXCEEDED), "intensity": expr(q.INTENSITY),
                    "flops": expr(q.ACHIEVED_FLOPS), "peak_bw": expr(q.PEAK_BANDWIDTH),
                    "peak_flops": expr(q.PEAK_FLOPS),
                    "slo_outcomes": expr(q.SLO_OUTCOMES), "slo_missed": expr(q.SLO_MISSED_BY_PHASE),
                    "slo_goodput": expr(q.SLO_GOODPUT), "slo_objective": expr(q.SLO_OBJECTIVE),
                    "slo_class_objective": expr(q.SLO_CLASS_OBJECTIVE),
                    "labels": q.render(q.LABEL_SETS, "", self.rate_range, self.pod_label)}
        instant |= {f"class:{k}": expr(t) for k, t in q.PROMPT_CLASS.items()}
        instant |= {f"replica:{k}": expr(t) for k, t in q.REPLICAS.items()}
        instant |= {f"gpu:{k}": expr(t) for k, t in q.GPU.items()}
        ranged = {f"series:{k}": (expr(t), now - self.history_seconds, step)
                  for k, t in q.SERIES.items()}
        ranged |= {"trail:intensity": (expr(q.INTENSITY), now - self.trail_seconds, trail_step),
                   "trail:flops": (expr(q.ACHIEVED_FLOPS), now - self.trail_seconds,
                                   trail_step)}
        futures = {k: self._pool.submit(self.instant, e, now) for k, e in instant.items()}
        futures |= {k: self._pool.submit(self.range, e, start, now, st)
                    for k, (e, start, st) in ranged.items()}
        results = {}
        for k, f in futures.items():
            try:
                results[k] = f.result()
            except FetchError as e:
                return Snapshot(self.name, self.url, error=e.error, fetched_at=now)
        return self._snapshot(results, now)

    def _snapshot(self, r: dict, now: float) -> Snapshot:
        def key(metric: dict, pod: bool = False) -> dict:
            return {"model": metric.get("model", ""), "engine": metric.get("engine", ""),
                    "pod": metric.get(self.pod_label, "") if pod else "",
                    "source": metric.get("source", "")}  # "": no --source-label

        kpis: dict[tuple, dict] = defaultdict(dict)
        for name in q.KPIS:
            for metric, v in r[f"kpi:{name}"]:
                kpis[tuple(key(metric).values())][name] = v
        for metric, v in r["share"]:
            kpis[tuple(key(metric).values())][f"{metric.get('phase')}_share"] = v
        slo = slo_figures(r, key)
        for k, figures in slo.items():
            kpis[k].update(slo_kpis(figures, kpis[k].get("request_rate")))
        # A label set is in the window when it finished requests over the range: one whose
        # series Prometheus still holds at a rate of 0 has stopped (exporter_source's
        # summary likewise lists only label sets with requests in its window).
        kpi_rows = [{**dict(zip(KEYS, k, strict=True)), **v, "range_seconds": self.range_seconds}
                    for k, v in kpis.items() if v.get("request_rate", 0.0) > 0]
        snap = Snapshot("prometheus", self.url, window_seconds=self.range_seconds or 0.0,
                        fetched_at=now,
                        kpis=frame(KPI_COLUMNS, kpi_rows),
                        verdicts=frame(VERDICT_COLUMNS, with_gpu(verdict_rows(
                            r, kpis, key, self._range_text(), slo), r, key)),
                        points=frame(POINT_COLUMNS, self._points(r, key, now)),
                        ceilings=frame(CEILING_COLUMNS, self._ceilings(r, key)),
                        series=frame(SERIES_COLUMNS, self._series(r, key)),
                        waterfall=frame(WATERFALL_COLUMNS, self._waterfall(r, key)),
                        prompt_classes=frame(PROMPT_CLASS_COLUMNS, self._classes(r, key)),
                        replicas=frame(REPLICA_COLUMNS,
                                       replica_rows(r, key, self.range_seconds)),
                        labels=frame(KEYS, [key(m, pod=True) for m, _ in r["labels"]]))
        snap.labels = snap.labels.drop_duplicates().sort_values(list(KEYS)).reset_index(
            drop=True)
        return in_window_only(snap, len(snap.labels))

    def _range_text(self) -> str:
        """The rate range as the banner says it: "60 s" (or as given, "1h30m")."""
        return f"{self.range_seconds:g} s" if self.range_seconds else self.rate_range

    def _points(self, r: dict, key, now: float) -> list[dict]:
        rows = []
        flops = {(tuple(key(m).values()), m.get("phase")): v for m, v in r["flops"]}
        for m, v in r["intensity"]:
            k = tuple(key(m).values())
            f = flops.get((k, m.get("phase")))
            if f is not None:
                rows.append({**dict(zip(KEYS, k, strict=True)), "at": now,
                             "phase": m.get("phase"), "intensity": v, "flops": f,
                             "latest": True})
        trail_flops = {(tuple(key(m).values()), m.get("phase")): dict(vals)
                       for m, vals in r["trail:flops"]}
        for m, vals in r["trail:intensity"]:
            k = tuple(key(m).values())
            f = trail_flops.get((k, m.get("phase")), {})
            rows.extend({**dict(zip(KEYS, k, strict=True)), "at": t, "phase": m.get("phase"),
                         "intensity": v, "flops": f[t], "latest": False}
                        for t, v in vals if t in f)
        return rows

    @staticmethod
    def _ceilings(r: dict, key) -> list[dict]:
        flops = {(tuple(key(m).values()), m.get("ceiling")): v for m, v in r["peak_flops"]}
        return [{**key(m), "hardware": "", "ceiling": m.get("ceiling", ""), "bandwidth": v,
                 "flops": flops.get((tuple(key(m).values()), m.get("ceiling")), math.nan)}
                for m, v in r["peak_bw"]]

    @staticmethod
    def _series(r: dict, key) -> list[dict]:
        rows = []
        for name in q.SERIES:
            for m, vals in r[f"series:{name}"]:
                metric = (f"{m.get('phase')}_share" if name == "phase_share" else
                          f"{m.get('objective')}_attainment" if name == "attainment" else name)
                rows.extend({**key(m), "at": t, "metric": metric, "value": v}
                            for t, v in vals if not math.isnan(v))
        return rows

    def _waterfall(self, r: dict, key) -> list[dict]:
        means: dict[tuple, dict] = defaultdict(dict)
        for m, v in r["mean"]:
            means[tuple(key(m, pod=True).values())][m.get("phase")] = v
        rows = []
        for k, phases in sorted(means.items()):
            if any(math.isnan(phases.get(p, math.nan)) for p in REQUIRED_PHASES):
                continue
            for p in OPTIONAL_PHASES:  # not reported: inside the queue, or no transfer
                if math.isnan(phases.get(p, math.nan)):
                    phases[p] = 0.0
            model, engine, pod, source = k
            rows.append({"model": model, "engine": engine, "pod": pod, "source": source,
                         "label": f"mean request, {pod or model}", "kind": "mean",
                         "start": -sum(phases[p] for p in PHASES),
                         **{p: phases[p] for p in PHASES}})
        return rows

    @staticmethod
    def _classes(r: dict, key) -> list[dict]:
        bounds = PROMPT_CLASS_RANGES
        rows: dict[tuple, dict] = {}
        for name in q.PROMPT_CLASS:
            for m, v in r[f"class:{name}"]:
                label = m.get("prompt_class", "")
                if label not in bounds:
                    continue
                k = (*key(m).values(), label)
                rows.setdefault(k, {**key(m), "prompt_class": label,
                                    "min_tokens": bounds[label][0],
                                    "max_tokens": bounds[label][1]})[name] = v
        return [row for row in rows.values() if row.get("count", 0) > 0]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)



def with_gpu(rows: list[dict], r: dict, key) -> list[dict]:
    """The verdict rows with the GPU's own counters of their label sets (``frames.
    GPU_VERDICT``) where Prometheus holds them: the means over the pods, the GPUs counted,
    and what most pods' counters say of the verdict."""
    found: dict[tuple, dict] = defaultdict(dict)
    for name in ("dram", "tensor", "dram_estimated", "tensor_estimated"):
        for metric, v in r.get(f"gpu:{name}", ()):
            k = tuple(key(metric).values())
            found[k][f"gpu_{name}"] = v
            if "gpu_source" in metric:
                found[k]["gpu_source"] = metric["gpu_source"]
    for metric, v in r.get("gpu:gpus", ()):
        k = tuple(key(metric).values())
        found[k]["gpu_gpus"] = found[k].get("gpu_gpus", 0.0) + v
    votes: dict[tuple, list] = defaultdict(list)
    for metric, n in r.get("gpu:outcome", ()):
        votes[tuple(key(metric).values())].append((n, metric.get("outcome", "")))
    for k, counted in votes.items():
        found[k]["gpu_outcome"] = max(counted)[1]
    return [{**row, **found.get(tuple(row[c] for c in KEYS), {})} for row in rows]
