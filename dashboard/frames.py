"""The frames every data source produces and every figure reads.

A source (the exporter's JSON API, or PromQL over Prometheus's HTTP API) turns its
answers into a ``Snapshot``: pandas frames with the columns below, keyed by
``model``, ``engine``, ``pod`` ("" where the source does not split by pod) and
``source`` (who saw the requests: ``engine``, ``tap`` or ``joined``, from an exporter
run with ``--source-label``; "" without it). The figures in ``phasewatch.dashboard.figures`` only
ever see these frames, so they are the same whatever the source. Times are Unix
seconds, durations seconds, rates per second.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from phasewatch.dashboard.theme import PHASES
from phasewatch.requests.objectives import OBJECTIVES

KEYS = ("model", "engine", "pod", "source")
SHARES = tuple(f"{p}_share" for p in PHASES)  # each phase's share of request time

# One row per label set: the KPI cards and the ``vllm bench serve`` comparison (mean and
# percentiles of each latency; requests and tokens that finished in ``range_seconds``).
LATENCIES = ("ttft", "tpot", "itl", "e2e")
LATENCY_STATS = ("mean", "p50", "p90", "p95", "p99")
# ``sampled_share``: where traces were sampled upstream, the requests received over those
# they stand for (counts are weighted by 1 / p; latencies are the samples); NaN where
# every request counted once.
# With objectives (--slo), per label set: goodput (good requests/s), the share of requests
# that met every objective set (``good_ratio``), and per objective (vLLM's goodput keys:
# ttft, tpot, itl, e2el) its threshold in seconds, the share met (``attainment``), and
# the requests that met and missed it, over the range, and ``classes``: the prompt-length
# classes' own thresholds ("3000 ms for 4k-16k"; "" for none); NaN where no objective
# is set. An objective set only for some classes has no plain threshold (NaN) but an
# attainment.
SLO_FIGURES = ("objective", "attainment", "met", "missed", "classes")
KPI_COLUMNS = (*KEYS, *(f"{k}_{s}" for k in LATENCIES for s in LATENCY_STATS),
               "request_rate", "prompt_tokens_per_second",
               "output_tokens_per_second", "mbu", "mfu", "decode_batch_size",
               "requests_in_range", "prompt_tokens_in_range", "output_tokens_in_range",
               "range_seconds", *SHARES, "goodput", "good_ratio", "sampled_share",
               *(f"{o}_{c}" for o in OBJECTIVES for c in SLO_FIGURES))
# One row per label set: the verdict banner. ``headline`` names the phase with the cause
# ("Decode: KV cache full"); ``cause`` is a cause's name or "" (phasewatch.roofline.cause);
# ``cause_text`` says it in words with numbers ("KV cache full: 32 preemptions in 30 s at
# 100 % usage"); ``cause_source`` is where it came from: ``engine_metrics`` (the engine's
# own /metrics) or ``records``, and ``engine_scraped`` whether the engine's /metrics was
# read at all. ``text`` is the whole verdict, cause sentence included. ``levers`` holds
# a tuple of strings; ``ceiling_exceeded`` a tuple of (phase, ceiling, achieved / ceiling)
# where an achieved rate went over its ceiling (no utilization is shown then);
# ``agreeing``/``reporting`` count the pods that report this verdict (1/1 for one exporter).
# ``idle``: the engine was busy so little of the window that nothing needs fixing (the
# exporter's verdict then offers no lever); unknown (None) from Prometheus.
# ``gpu_*``: the GPU's own counters over the estimate's range (--gpu-metrics-url,
# --gpu-nvml), NaN without: what they say of the verdict (``gpu_outcome``: overstated,
# idle, confirmed, not_confirmed, unchecked), the reader (dcgm, nvml), the GPUs counted,
# the DRAM and tensor activity measured and the estimate's share of the peaks beside it.
# ``predictions``: a tuple of sentences, what pulling each lever would change
# (``roofline.lever_effects``; the exporter's source only).
GPU_VERDICT = ("gpu_outcome", "gpu_source", "gpu_gpus", "gpu_dram", "gpu_dram_estimated",
               "gpu_tensor", "gpu_tensor_estimated")
VERDICT_COLUMNS = (*KEYS, "phase", "resource", "headline", "cause", "cause_text",
                   "cause_source", "engine_scraped", "confidence", "text", "levers",
                   *SHARES, "mbu", "mfu", "ceiling_exceeded",
                   "agreeing", "reporting", "idle", *GPU_VERDICT, "predictions")
# Roofline operating points, the newest (``latest``) and the trail before it; ``phase``
# prefill or decode, or, with the GPU's counters, ``estimate`` (the engine's work over
# the estimate's range: its FLOPs over its bytes, its FLOPs over the range) and ``gpu``
# (the same intensity at the DRAM traffic the GPU counted: higher, as the estimate is the
# least the work moves).
POINT_COLUMNS = (*KEYS, "at", "phase", "intensity", "flops", "latest")
# Roofline ceilings: ``ceiling`` is datasheet, achievable or measured.
CEILING_COLUMNS = (*KEYS, "hardware", "ceiling", "bandwidth", "flops")
# Time series, long form: one row per (label set, time, metric).
SERIES_COLUMNS = (*KEYS, "at", "metric", "value")
# Waterfall bars: one row per request (exporter) or one mean request per label set
# (Prometheus, ``kind`` = "mean"); ``start`` is seconds before the newest bar's end.
WATERFALL_COLUMNS = (*KEYS, "label", "kind", "start", *PHASES,
                     "prompt_tokens", "output_tokens")
# TTFT against prompt length: per request, where the source has requests.
PROMPT_POINT_COLUMNS = (*KEYS, "prompt_tokens", "ttft")
# TTFT and prefill seconds per token by prompt-length class (both sources).
PROMPT_CLASS_COLUMNS = (*KEYS, "prompt_class", "min_tokens", "max_tokens", "ttft_p50",
                        "ttft_p95", "prefill_per_token_p50", "count")

# The replicas (pods) of each label set served by two or more, side by side
# (``phasewatch.dashboard.replicas``): each one's request rate, TTFT p50/p95, share of
# request time in the queue, its engine's KV-cache usage (0..1) and its verdict
# (``headline`` as the banner words it), with ``outlier`` set where it differs from the
# other replicas, ``flagged`` the columns that do and ``why`` in words ("TTFT p95 3.1x the
# median of the other replicas (412 ms against 133 ms)").
REPLICA_FIGURES = ("request_rate", "ttft_p50", "ttft_p95", "queue_share", "kv_usage")
REPLICA_COLUMNS = (*KEYS, *REPLICA_FIGURES, "requests_in_range", "phase", "resource",
                   "cause", "headline", "outlier", "flagged", "why")

SLO_SERIES = ("good_ratio", *(f"{o}_attainment" for o in OBJECTIVES))
SERIES_METRICS = ("ttft_p50", "ttft_p95", "itl_p50", "itl_p95", "tpot_p50", "tpot_p95",
                  "prompt_tokens_per_second", "output_tokens_per_second", *SHARES,
                  *SLO_SERIES)


def frame(columns: tuple[str, ...], rows: list[dict] | None = None) -> pd.DataFrame:
    """A frame with exactly ``columns`` (missing values as NaN/None), in that order."""
    df = pd.DataFrame(rows or [], columns=list(columns))
    for k in KEYS:
        if k in df.columns:
            df[k] = df[k].astype(object).where(df[k].notna(), "").astype(str)
    return df


@dataclass(frozen=True)
class SourceError:
    """Why the source could not answer: ``kind`` is unreachable, http or query."""

    kind: str
    message: str
    target: str  # the URL tried, or the PromQL that failed


@dataclass(frozen=True)
class Selection:
    """What the user picked; an empty tuple means all."""

    models: tuple[str, ...] = ()
    engines: tuple[str, ...] = ()
    pods: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()  # engine, tap, joined


ALL = Selection()


@dataclass
class Snapshot:
    source: str  # "exporter" or "prometheus"
    target: str  # the base URL
    window_seconds: float = 30.0
    kpis: pd.DataFrame = field(default_factory=lambda: frame(KPI_COLUMNS))
    verdicts: pd.DataFrame = field(default_factory=lambda: frame(VERDICT_COLUMNS))
    points: pd.DataFrame = field(default_factory=lambda: frame(POINT_COLUMNS))
    ceilings: pd.DataFrame = field(default_factory=lambda: frame(CEILING_COLUMNS))
    series: pd.DataFrame = field(default_factory=lambda: frame(SERIES_COLUMNS))
    waterfall: pd.DataFrame = field(default_factory=lambda: frame(WATERFALL_COLUMNS))
    prompt_points: pd.DataFrame = field(default_factory=lambda: frame(PROMPT_POINT_COLUMNS))
    prompt_classes: pd.DataFrame = field(default_factory=lambda: frame(PROMPT_CLASS_COLUMNS))
    replicas: pd.DataFrame = field(default_factory=lambda: frame(REPLICA_COLUMNS))
    # Every label set the source knows (for the selectors), whatever was selected.
    labels: pd.DataFrame = field(default_factory=lambda: frame(KEYS))
    error: SourceError | None = None
    fetched_at: float = 0.0
    # The source has seen requests, but none finished in the window: a stopped workload,
    # not an exporter that was never sent anything.
    idle: bool = False

    FRAMES = ("kpis", "verdicts", "points", "ceilings", "series", "waterfall",
              "prompt_points", "prompt_classes", "replicas")

    @property
    def empty(self) -> bool:
        return self.kpis.empty and self.verdicts.empty

    def select(self, models=(), engines=(), pods=(), sources=()) -> Snapshot:
        """A copy whose frames hold only the chosen label sets (an empty choice keeps all);
        ``labels`` keeps every label set."""
        out = Snapshot(self.source, self.target, self.window_seconds, labels=self.labels,
                       error=self.error, fetched_at=self.fetched_at, idle=self.idle)
        for name in self.FRAMES:
            df = getattr(self, name)
            keep = pd.Series(True, index=df.index)
            for col, wanted in (("model", models), ("engine", engines), ("pod", pods),
                                ("source", sources)):
                if wanted:
                    keep &= df[col].isin(list(wanted))
            setattr(out, name, df[keep].reset_index(drop=True))
        return out


def class_text(by_class: dict | None) -> str:
    """Prompt-length classes' own thresholds in words: "3000 ms for 4k-16k"."""
    return ", ".join(f"{s * 1000:g} ms for {c}" for c, s in (by_class or {}).items())


def who(row) -> str:
    """A label set as the page names it: ``model/engine[/pod]``, then `` (source)`` where
    the exporter labels sources (``Llama-3.1-8B/vllm (joined)``)."""
    name = "/".join(p for p in (row["model"], row["engine"], row["pod"]) if p)
    return f"{name} ({row['source']})" if row.get("source") else name


def in_window_only(snap: Snapshot, label_sets_seen: int | None) -> Snapshot:
    """Verdicts and roofline points only for label sets with requests in the window
    (those with a KPI row: the exporter's summary lists no other, and the Prometheus
    source keeps only those with a request rate over its range): a verdict outlives the
    window (the exporter's roofline lookback; a gauge Prometheus still holds), and a
    stopped workload has no bottleneck. ``label_sets_seen``: the label sets the source
    has ever seen (the exporter's ``/api/v1/status``, the series Prometheus holds); when
    it has seen some and none is in the window, the snapshot is ``idle``."""
    live = set(snap.kpis[list(KEYS)].itertuples(index=False, name=None))
    for name in ("verdicts", "points"):
        df = getattr(snap, name)
        keep = [k in live for k in df[list(KEYS)].itertuples(index=False, name=None)]
        setattr(snap, name, df[pd.Series(keep, index=df.index, dtype=bool)]
                .reset_index(drop=True))
    snap.idle = not live and bool(label_sets_seen)
    return snap
