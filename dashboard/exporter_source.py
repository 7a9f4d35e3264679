"""Frames from one exporter's JSON API (``/api/v1/summary``, ``roofline``, ``history``,
``requests``): the embedded default, and what ``--exporter URL`` reads."""

from __future__ import annotations

import math
import time
from urllib.parse import urlencode

import pandas as pd

from phasewatch.dashboard.frames import (
    ALL,
    CEILING_COLUMNS,
    KEYS,
    KPI_COLUMNS,
    LATENCIES,
    LATENCY_STATS,
    POINT_COLUMNS,
    PROMPT_CLASS_COLUMNS,
    PROMPT_POINT_COLUMNS,
    REPLICA_COLUMNS,
    SERIES_COLUMNS,
    SERIES_METRICS,
    VERDICT_COLUMNS,
    WATERFALL_COLUMNS,
    Selection,
    Snapshot,
    class_text,
    frame,
    in_window_only,
)
from phasewatch.dashboard.http import FetchError, base_url, get_json
from phasewatch.dashboard.replicas import replicas_from_frames
from phasewatch.dashboard.theme import (
    CLIENT_PHASES,
    OPTIONAL_PHASES,
    PHASES,
    REQUIRED_PHASES,
)
from phasewatch.roofline.verdict_text import headline
from phasewatch.transport.tls import ClientTls

WATERFALL_REQUESTS = 40  # bars in the request waterfall
PROMPT_POINTS = 2000  # newest requests in the TTFT-vs-prompt scatter


def _finite(x) -> float:
    return float(x) if x is not None and math.isfinite(float(x)) else math.nan


def _key(row: dict) -> dict:
    """An entry's label set; ``pod`` and ``source`` only where the exporter labels them
    (--pod-label, --source-label), else ""."""
    return {"model": row["model"], "engine": row["engine"], "pod": row.get("pod", ""),
            "source": row.get("source", "")}


class ExporterSource:
    name = "exporter"

    def __init__(self, url: str, timeout: float = 3.0, history_seconds: float = 600.0,
                 token: str = "", tls: ClientTls | None = None):
        """``token``: the exporter's --auth-token, for its JSON API; ``tls``: the CA (and,
        under mutual TLS, the client certificate) for an https exporter."""
        self.url = base_url(url, "http://127.0.0.1:9464")
        self.token = token
        self.tls = tls
        self.timeout = timeout
        self.history_seconds = history_seconds

    def _get(self, path: str, **params) -> dict:
        query = f"?{urlencode(params)}" if params else ""
        return get_json(f"{self.url}{path}{query}", self.timeout, "exporter",
                        token=self.token, tls=self.tls)

    def fetch(self, selection: Selection = ALL) -> Snapshot:
        try:
            summary = self._get("/api/v1/summary")
            roofline = self._get("/api/v1/roofline")
            history = self._get("/api/v1/history", seconds=self.history_seconds)
            one_model = selection.models[0] if len(selection.models) == 1 else None
            params = {"limit": PROMPT_POINTS, **({"model": one_model} if one_model else {})}
            requests = self._get("/api/v1/requests", **params)["requests"]
            status = self._get("/api/v1/status")
        except FetchError as e:
            return Snapshot(self.name, self.url, error=e.error, fetched_at=time.time())
        snap = in_window_only(snapshot_from_api(summary, roofline, history, requests, self.url),
                              status.get("label_sets"))
        snap = snap.select(selection.models, selection.engines, selection.pods,
                           selection.sources)
        # a central exporter's pods (--pod-label) side by side, the selected ones only
        snap.replicas = frame(REPLICA_COLUMNS, replicas_from_frames(snap.kpis, snap.verdicts))
        return snap


def snapshot_from_api(summary: dict, roofline: dict, history: dict, requests: list[dict],
                      url: str = "") -> Snapshot:
    """The frames of one exporter's answers (pure; unit-tested on recorded answers)."""
    kpis, classes = _kpi_rows(summary, roofline)
    verdicts, points, ceilings = _roofline_rows(roofline)
    # an older exporter's history lacks the newer columns (the objectives'): empty there
    series = [pd.DataFrame({"at": s["at"], **{m: s.get(m, [None] * len(s["at"]))
                                              for m in SERIES_METRICS}})
              .melt(id_vars="at", var_name="metric", value_name="value")
              .assign(**_key(s)).dropna(subset=["value"])
              for s in history.get("series", [])]
    snap = Snapshot("exporter", url, window_seconds=summary.get("window_seconds", 30.0),
                    kpis=frame(KPI_COLUMNS, kpis), verdicts=frame(VERDICT_COLUMNS, verdicts),
                    points=frame(POINT_COLUMNS, points),
                    ceilings=frame(CEILING_COLUMNS, ceilings),
                    series=(pd.concat(series, ignore_index=True)[list(SERIES_COLUMNS)]
                            if series else frame(SERIES_COLUMNS)),
                    waterfall=frame(WATERFALL_COLUMNS, _waterfall(requests)),
                    prompt_points=frame(PROMPT_POINT_COLUMNS, [
                        {**_key(q), "prompt_tokens": q["prompt_tokens"], "ttft": q["ttft"]}
                        for q in requests
                        if q.get("prompt_tokens") is not None and q.get("ttft") is not None]),
                    prompt_classes=frame(PROMPT_CLASS_COLUMNS, classes),
                    fetched_at=time.time())
    keys = [*snap.kpis[list(KEYS)].to_dict("records"),
            *snap.verdicts[list(KEYS)].to_dict("records")]
    snap.labels = frame(KEYS, keys).drop_duplicates().sort_values(list(KEYS)).reset_index(
        drop=True)
    return snap


def _kpi_rows(summary: dict, roofline: dict) -> tuple[list[dict], list[dict]]:
    """Per label set, the KPI row (latencies, rates, shares, MBU/MFU) and the TTFT rows
    per prompt class."""
    roof = {tuple(_key(r).values()): r for r in roofline.get("models", [])}
    kpis, classes = [], []
    for m in summary.get("models", []):
        k = _key(m)
        est = (roof.get(tuple(k.values())) or {}).get("estimate") or {}
        share = m["phase_time_share"]
        kpis.append({**k, **{f"{name}_{q}": m[f"{name}_seconds"].get(q)
                             for name in LATENCIES for q in LATENCY_STATS},
                     "requests_in_range": m.get("requests_in_window"),
                     "prompt_tokens_in_range": m.get("prompt_tokens_in_window"),
                     "output_tokens_in_range": m.get("output_tokens_in_window"),
                     "range_seconds": m.get("covered_seconds", summary.get("covered_seconds")),
                     "request_rate": m["request_rate"],
                     "prompt_tokens_per_second": m["prompt_tokens_per_second"],
                     "output_tokens_per_second": m["output_tokens_per_second"],
                     "mbu": (est.get("decode") or {}).get("bandwidth_utilization"),
                     "mfu": (est.get("prefill") or {}).get("flops_utilization"),
                     "decode_batch_size": est.get("decode_batch_size"),
                     **{f"{p}_share": share.get(p) for p in PHASES},
                     "sampled_share": (m.get("trace_sampling") or {}).get("sampled_share"),
                     **slo_columns(m.get("slo"))})
        for c in m.get("ttft_by_prompt_class", []):
            classes.append({**k, "prompt_class": c["prompt_class"],
                            "min_tokens": c["min_tokens"], "max_tokens": c["max_tokens"],
                            "ttft_p50": c["ttft_seconds"]["p50"],
                            "ttft_p95": c["ttft_seconds"]["p95"],
                            "prefill_per_token_p50": c["prefill_seconds_per_token"]["p50"],
                            "count": c["ttft_seconds"]["count"]})
    return kpis, classes


def _roofline_rows(roofline: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """Per label set, the verdict row, the roofline chart's points (its trail) and the
    ceilings it is drawn against."""
    verdicts, points, ceilings = [], [], []
    for r in roofline.get("models", []):
        k = _key(r)
        est = r.get("estimate") or {}
        v = r.get("verdict")
        gpu = r.get("gpu")
        if v is not None:
            verdicts.append({**k, **_verdict_row(v, est, r.get("engine_state")),
                             **gpu_columns(gpu), "predictions": tuple(
                                 p["text"] for p in r.get("predictions") or ())})
        points += [{**k, **p} for p in gpu_points(gpu)]
        trail = r.get("trail") or []
        for j, p in enumerate(trail):
            for phase in ("prefill", "decode"):
                op = p.get(phase)
                if op:
                    points.append({**k, "at": p["at"], "phase": phase,
                                   "intensity": _finite(op["arithmetic_intensity"]),
                                   "flops": _finite(op["achieved_flops_per_second"]),
                                   "latest": j == len(trail) - 1})
        d = r.get("deployment")
        if d:
            ceilings.append({**k, "hardware": f"{d['hardware']} x{d['gpus']}",
                             "ceiling": ("measured" if d.get("peak_source") == "calibrated"
                                         else "datasheet"),
                             "bandwidth": d["peak_bandwidth_bytes_per_second"],
                             "flops": d["peak_flops_per_second"]})
            ceilings.append({**k, "hardware": f"{d['hardware']} x{d['gpus']}",
                             "ceiling": ("measured" if d.get("achievable_source") == "calibrated"
                                         else "achievable"),
                             "bandwidth": d["achievable_bandwidth_bytes_per_second"],
                             "flops": d["achievable_flops_per_second"]})
    return verdicts, points, ceilings


def gpu_columns(gpu: dict | None) -> dict:
    """An entry's ``gpu`` block (the GPU's counters beside the estimate) as the verdict
    row's ``gpu_*`` columns; {} without one."""
    if not gpu:
        return {}
    counters = gpu.get("counters") or {}
    return {"gpu_outcome": gpu.get("outcome", ""), "gpu_source": counters.get("source", ""),
            "gpu_gpus": len(counters.get("gpus") or ()),
            "gpu_dram": gpu.get("dram_measured"), "gpu_dram_estimated": gpu.get("dram_estimated"),
            "gpu_tensor": gpu.get("tensor_measured"),
            "gpu_tensor_estimated": gpu.get("tensor_estimated")}


def gpu_points(gpu: dict | None) -> list[dict]:
    """The roofline chart's two points of an entry's ``gpu`` block: the estimate over its
    range and the GPU's counted traffic at the same intensity; [] without them."""
    point = (gpu or {}).get("point")
    if not point:
        return []
    x = _finite(point["arithmetic_intensity"])
    return [{"at": point["at"], "phase": phase, "intensity": x,
             "flops": _finite(point[key]), "latest": True}
            for phase, key in (("estimate", "estimated_flops_per_second"),
                               ("gpu", "measured_flops_per_second"))]


def slo_columns(slo: dict | None) -> dict:
    """A summary entry's ``slo`` block (objectives set) as KPI columns; {} without one."""
    if not slo:
        return {}
    out = {"goodput": slo.get("goodput"), "good_ratio": slo.get("good_ratio")}
    for name, o in (slo.get("objectives") or {}).items():
        out |= {f"{name}_objective": o.get("objective_seconds"),
                f"{name}_classes": class_text(o.get("by_prompt_class")),
                f"{name}_attainment": o.get("attainment"), f"{name}_met": o.get("met"),
                f"{name}_missed": o.get("missed")}
    return out


def _verdict_row(v: dict, est: dict, engine_state: dict | None) -> dict:
    """One verdict of ``/api/v1/roofline`` as a row of VERDICT_COLUMNS. An older exporter's
    verdict (no headline, no cause) still makes a row."""
    share = v["evidence"].get("phase_time_share", {})
    detail = v.get("cause_detail") or {}
    cause = v.get("cause") or ""
    return {"phase": v["phase"], "resource": v["resource"],
            "headline": v.get("headline") or headline(v["phase"], v["resource"], cause or None),
            "cause": cause, "cause_text": detail.get("text", ""),
            "cause_source": detail.get("source", ""),
            "engine_scraped": engine_state is not None,
            "confidence": v["confidence"], "text": v["text"], "levers": tuple(v["levers"]),
            **{f"{p}_share": share.get(p) for p in PHASES},
            "mbu": (est.get("decode") or {}).get("bandwidth_utilization"),
            "mfu": (est.get("prefill") or {}).get("flops_utilization"),
            "ceiling_exceeded": _exceeded(v, est), "agreeing": 1, "reporting": 1,
            "idle": bool(v["evidence"].get("idle"))}


def _exceeded(v: dict, est: dict) -> tuple[tuple[str, str, float], ...]:
    """(phase, ceiling, ratio) for every rate over its ceiling: the estimate's (over the
    datasheet peak) and the verdict's (over the achievable one, for its phase; the ratio
    its text gives wins)."""
    over = {(phase, what): ratio for phase in ("prefill", "decode")
            for what, ratio in ((est.get(phase) or {}).get("ceiling_exceeded") or {}).items()}
    over |= {(v["phase"], what): ratio
             for what, ratio in (v["evidence"].get("ceiling_exceeded") or {}).items()}
    return tuple((phase, what, float(ratio)) for (phase, what), ratio in sorted(over.items()))


def _waterfall(requests: list[dict]) -> list[dict]:
    """The newest requests as bars, placed on a shared clock ending at the newest end."""
    rows = []
    for q in requests[:WATERFALL_REQUESTS]:
        parts = {p: q.get(p) for p in PHASES}
        client = parts["queue"] is None and parts["prefill"] is None  # a tap's record
        if q.get("arrival") is None or any(
                parts[p] is None for p in (CLIENT_PHASES if client else REQUIRED_PHASES)):
            continue
        if client:
            parts.update(preprocess=0.0, queue=0.0, prefill=0.0)
        else:  # ttft is the sum of the phases drawn
            parts["ttft"] = 0.0
        for p in OPTIONAL_PHASES:  # unknown preprocess is inside the queue; no transfer
            parts[p] = parts[p] or 0.0
        # a tap's record has no request id of the engine's: its place in the list names it
        rows.append({**_key(q), "label": q["request_id"] or f"request {len(rows) + 1}",
                     "kind": "request",
                     "arrival": q["arrival"], **parts, "prompt_tokens": q.get("prompt_tokens"),
                     "output_tokens": q.get("output_tokens")})
    if rows:
        newest = max(r["arrival"] + sum(r[p] for p in PHASES) for r in rows)
        for r in rows:
            r["start"] = r.pop("arrival") - newest
    return rows
