"""The engine's own FLOP and byte counters, scraped from its ``/metrics`` page.

vLLM and SGLang started with ``--enable-mfu-metrics`` count, per GPU, the FLOPs and
bytes their analytic per-step model says each forward pass needed
(references.md section 1): ``vllm:estimated_flops_per_gpu_total``,
``vllm:estimated_read_bytes_per_gpu_total``, ``vllm:estimated_write_bytes_per_gpu_total``
(``sglang:`` likewise), plus the running-requests gauge (vLLM
``num_requests_running``, SGLang ``num_running_reqs``). They carry no
peak and no phase split; the monitor divides by the peaks and splits by the
phases' inferred proportions. Rates come from consecutive scrapes, a counter
reset (engine restart) restarting the difference from zero, like PromQL's rate().
A failed scrape is counted and leaves the previous samples alone: the estimator
falls back to inference when the samples go stale.

vLLM exposes the MFU counters even without ``--enable-mfu-metrics``, at 0 forever:
a counter that does not move while requests finish is taken as absent, not as zero
work (``BottleneckMonitor`` falls back to inference and says why). vLLM's spans say
nothing of prefix-cache hits; its ``prompt_tokens_cached_total`` over
``prompt_tokens_total`` (else ``prefix_cache_hits_total`` over
``prefix_cache_queries_total``) gives the share of prompt tokens the cache served,
which the estimator applies to requests whose cached tokens are unknown.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from exporter.selfstats import SelfStats

log = logging.getLogger("phasewatch")

PREFIXES = ("vllm:", "sglang:")
COUNTERS = {"estimated_flops_per_gpu_total": "flops",
            "estimated_read_bytes_per_gpu_total": "read_bytes",
            "estimated_write_bytes_per_gpu_total": "write_bytes",
            "prompt_tokens_total": "prompt_tokens",
            "prompt_tokens_cached_total": "cached_tokens",
            "prefix_cache_hits_total": "cache_hits",
            "prefix_cache_queries_total": "cache_queries"}
RUNNING = ("num_requests_running", "num_running_reqs")  # vLLM, SGLang
RANK_LABELS = ("tp_rank", "pp_rank")
MAX_PAGE_BYTES = 16 << 20


@dataclass(frozen=True)
class EngineSample:
    at: float  # exporter clock
    flops: float | None
    read_bytes: float | None
    write_bytes: float | None
    running: float | None
    prompt_tokens: float | None = None
    cached_tokens: float | None = None
    cache_hits: float | None = None
    cache_queries: float | None = None


@dataclass(frozen=True)
class EngineRates:
    """Per-GPU rates over a span of scrapes, summed over the engine's data-parallel ranks.
    A counter that did not move over the span is None here, and named in ``flat``."""

    seconds: float
    flops_per_gpu: float | None
    bytes_per_gpu: float | None  # read + write
    mean_running: float | None
    cached_prompt_share: float | None = None  # prompt tokens the prefix cache served
    cached_share_source: str = ""  # the counters it came from
    flat: tuple[str, ...] = ()  # "flops", "bytes": present but never moved


def parse_page(text: str, model: str | None = None, at: float = 0.0) -> EngineSample:
    """Sum the MFU counters and running requests over the page's series.

    Series of different data-parallel engines add up; the same per-GPU counter
    reported by several tensor/pipeline ranks (SGLang's ``tp_rank``) is averaged,
    not added. With ``model``, only series whose ``model_name`` equals it count
    (an engine serving several models); series without the label always count.
    """
    groups: dict[tuple[str, tuple], list[float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            prefix = next((p for p in PREFIXES if s.name.startswith(p)), None)
            if prefix is None:
                continue
            key = s.name[len(prefix):]
            field = COUNTERS.get(key) or ("running" if key in RUNNING else None)
            if field is None:
                continue
            if model is not None and s.labels.get("model_name", model) != model:
                continue
            series = tuple(sorted((k, v) for k, v in s.labels.items() if k not in RANK_LABELS))
            groups.setdefault((field, series), []).append(float(s.value))
    sums: dict[str, float] = {}
    for (field, _), values in groups.items():
        sums[field] = sums.get(field, 0.0) + sum(values) / len(values)
    return EngineSample(at=at, flops=sums.get("flops"), read_bytes=sums.get("read_bytes"),
                        write_bytes=sums.get("write_bytes"), running=sums.get("running"),
                        prompt_tokens=sums.get("prompt_tokens"),
                        cached_tokens=sums.get("cached_tokens"),
                        cache_hits=sums.get("cache_hits"),
                        cache_queries=sums.get("cache_queries"))


def _increase(values: list[float]) -> float:
    """Total increase of a counter across samples, restarting from 0 after a reset."""
    total = 0.0
    for a, b in itertools.pairwise(values):
        total += b - a if b >= a else b
    return total


class EngineMetricsSource:
    """Polls one engine's ``/metrics`` URL and keeps recent samples (bounded)."""

    def __init__(self, url: str, model: str | None, stats: SelfStats, timeout: float = 2.0,
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

    def rates(self, seconds: float) -> EngineRates | None:
        """Rates over the samples of the last ``seconds``; None without two fresh samples."""
        now = self._clock()
        with self._lock:
            recent = [s for s in self._samples if s.at >= now - seconds]
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

        flops, read, write = rate("flops"), rate("read_bytes"), rate("write_bytes")
        bytes_rate = None if read is None else read + (write or 0.0)
        flat = tuple(name for name, v in (("flops", flops), ("bytes", bytes_rate)) if v == 0)
        running = [s.running for s in recent if s.running is not None]
        share, source = None, ""
        for part, whole, name in (("cached_tokens", "prompt_tokens", "prompt_tokens_cached"),
                                  ("cache_hits", "cache_queries", "prefix_cache_hits")):
            p, w = increase(part), increase(whole)
            if p is not None and w:
                share, source = min(max(p / w, 0.0), 1.0), name
                break
        return EngineRates(
            seconds=span, flops_per_gpu=None if flops == 0 else flops,
            bytes_per_gpu=None if bytes_rate == 0 else bytes_rate,
            mean_running=sum(running) / len(running) if running else None,
            cached_prompt_share=share, cached_share_source=source, flat=flat)
