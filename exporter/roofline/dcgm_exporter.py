"""A dcgm-exporter's ``/metrics`` page, read over HTTP on a timer like the engine's own.

The series and their units are dcgm-exporter's default counters file,
``etc/default-counters.csv`` in github.com/NVIDIA/dcgm-exporter (commit
d5e5f510a1b6b393f39a43293ccd9dc985defc79, May 2026): the ``DCGM_FI_PROF_*`` profiling
fields are gauges and **ratios** ("Ratio of cycles the device memory interface is
active ..."); ``DCGM_FI_DEV_GPU_UTIL`` and ``DCGM_FI_DEV_MEM_COPY_UTIL`` are percents;
framebuffer in MiB, clocks in MHz, power in W. The default file enables
``GR_ENGINE_ACTIVE``, ``PIPE_TENSOR_ACTIVE`` and ``DRAM_ACTIVE`` and leaves
``SM_ACTIVE``, ``SM_OCCUPANCY`` and the FP16/32/64 pipes commented out: they are read
when a site's counters file turns them on, and None otherwise.

The labels are those its renderer writes (``internal/pkg/rendermetrics/render_metrics.go``,
same commit): ``gpu``, ``UUID`` (``uuid`` under ``--use-old-namespace``), ``pci_bus_id``,
``device``, ``modelName``, ``GPU_I_PROFILE`` / ``GPU_I_ID`` for a MIG instance,
``hostname`` (``Hostname`` before #655), then the label-type fields
(``DCGM_FI_DRIVER_VERSION``) and the attributes its Kubernetes mapping adds
(``internal/pkg/transformation/const.go``: ``pod``, ``namespace``, ``container``; the old
namespace's ``pod_name``, ``pod_namespace``, ``container_name``).

A failed reading is counted by reason in ``DcgmExporterSource.results`` (and handed to
``on_result`` when given, for the self-counters) and leaves the kept samples alone:
``unreachable``, ``http_error``, ``too_large``, ``unparsable`` (not Prometheus text),
``no_dcgm_families`` (a page without any counter read here: the wrong URL, or the
engine's page), ``out_of_range`` (a ratio outside 0..1, a percent outside 0..100).
"""

from __future__ import annotations

import logging
import math
import time
import urllib.error
import urllib.request
from collections import Counter

from prometheus_client.parser import text_string_to_metric_families

from phasewatch.roofline.gpu_counters import (
    CounterHistory,
    GpuCounters,
    GpuIdentity,
    GpuSample,
    GpuWindow,
)

log = logging.getLogger("phasewatch")

# DCGM field -> (GpuCounters field, divisor to a ratio, or None for an absolute gauge)
FIELDS = {
    "DCGM_FI_PROF_DRAM_ACTIVE": ("dram_active", 1.0),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": ("tensor_active", 1.0),
    "DCGM_FI_PROF_SM_ACTIVE": ("sm_active", 1.0),
    "DCGM_FI_PROF_SM_OCCUPANCY": ("sm_occupancy", 1.0),
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": ("gr_engine_active", 1.0),
    "DCGM_FI_PROF_PIPE_FP16_ACTIVE": ("fp16_active", 1.0),
    "DCGM_FI_PROF_PIPE_FP32_ACTIVE": ("fp32_active", 1.0),
    "DCGM_FI_PROF_PIPE_FP64_ACTIVE": ("fp64_active", 1.0),
    "DCGM_FI_DEV_GPU_UTIL": ("gpu_util", 100.0),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("mem_copy_util", 100.0),
    "DCGM_FI_DEV_FB_USED": ("fb_used_mib", None),
    "DCGM_FI_DEV_FB_FREE": ("fb_free_mib", None),
    "DCGM_FI_DEV_SM_CLOCK": ("sm_clock_mhz", None),
    "DCGM_FI_DEV_POWER_USAGE": ("power_w", None),
}
# GpuIdentity field -> the labels that carry it, current name first
LABELS = {
    "index": ("gpu",), "uuid": ("UUID", "uuid"), "device": ("device",),
    "model_name": ("modelName",), "hostname": ("hostname", "Hostname"),
    "pci_bus_id": ("pci_bus_id",), "mig_profile": ("GPU_I_PROFILE",),
    "mig_instance": ("GPU_I_ID",), "pod": ("pod", "pod_name"),
    "namespace": ("namespace", "pod_namespace"), "container": ("container", "container_name"),
}
RATIO_SLACK = 1e-3  # DCGM's ratios are computed from counters: allow rounding above 1
MAX_PAGE_BYTES = 16 << 20
REASONS = ("unreachable", "http_error", "too_large", "unparsable", "no_dcgm_families",
           "out_of_range")


class GpuPageError(ValueError):
    """A page that gives no counters; ``reason`` is one of REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def _identity(labels: dict) -> GpuIdentity:
    found = {}
    for field, names in LABELS.items():
        for name in names:
            if labels.get(name):
                found[field] = labels[name]
                break
    return GpuIdentity(**found)


def parse_page(text: str, at: float = 0.0) -> GpuSample:
    """The counters of one dcgm-exporter page, one GpuCounters per GPU (or MIG instance,
    or pod sharing a GPU), in page order. Raises GpuPageError (never anything else) for a
    page that is not Prometheus text, carries no counter read here, or a ratio out of
    range; a series with a NaN value is left out (None)."""
    try:
        samples = [s for family in text_string_to_metric_families(text)
                   for s in family.samples if s.name in FIELDS]
    except Exception as e:  # the parser raises ValueError, and worse on some garbage
        raise GpuPageError("unparsable", f"not Prometheus text: {e}") from None
    if not samples:
        raise GpuPageError("no_dcgm_families",
                           "no DCGM counter on the page (" + ", ".join(list(FIELDS)[:3]) +
                           ", ...): is it a dcgm-exporter's /metrics?")
    rows: dict[GpuIdentity, dict[str, float]] = {}
    for s in samples:
        ident = _identity(s.labels)
        field, scale = FIELDS[s.name]
        value = float(s.value)
        if math.isnan(value):
            continue
        if scale is not None:
            if not -RATIO_SLACK <= value / scale <= 1 + RATIO_SLACK:
                unit = "a percent 0..100" if scale != 1.0 else "a ratio 0..1"
                raise GpuPageError("out_of_range", f"{s.name}={value} for {ident.name()} "
                                   f"is not {unit}")
            value = min(max(value / scale, 0.0), 1.0)
        rows.setdefault(ident, {})[field] = value
    return GpuSample(at=at, source="dcgm",
                     gpus=tuple(GpuCounters(identity=i, **v) for i, v in rows.items()))


class DcgmExporterSource:
    """Polls one dcgm-exporter ``/metrics`` URL and keeps its samples (bounded).

    ``poll()`` reads once (call it on a timer, as ``EngineMetricsSource``); ``window()``
    answers the mean counters over the roofline's window for the engine's GPUs. Nothing
    raises out of ``poll``: a failure is counted in ``results[reason]`` (``ok`` for a good
    reading), described in ``last_error``, logged when it changes, and passed to
    ``on_result(reason)`` when given."""

    name = "dcgm"  # the readings' ``gpu_source`` label

    def __init__(self, url: str, timeout: float = 5.0, keep: int = 1024, clock=time.time,
                 max_bytes: int = MAX_PAGE_BYTES, on_result=None):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"gpu_metrics_url must be an http(s) URL, got {url!r}")
        self.url, self.timeout, self.max_bytes = url, timeout, max_bytes
        self.history = CounterHistory(keep)
        self.results: Counter = Counter()
        self.last_error = ""
        self._clock = clock
        self._on_result = on_result

    def _count(self, result: str) -> None:
        self.results[result] += 1
        if self._on_result is not None:
            self._on_result(result)

    def fetch(self) -> str:
        """The page's text; raises GpuPageError with its reason."""
        try:
            req = urllib.request.Request(self.url, headers={"Accept": "text/plain"})
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = resp.read(self.max_bytes + 1)
        except urllib.error.HTTPError as e:
            raise GpuPageError("http_error", f"HTTP {e.code} {e.reason}") from None
        except (OSError, urllib.error.URLError, ValueError) as e:  # timeouts are OSError
            raise GpuPageError("unreachable", str(getattr(e, "reason", e)) or
                               type(e).__name__) from None
        if len(body) > self.max_bytes:
            raise GpuPageError("too_large", f"page larger than {self.max_bytes} bytes")
        return body.decode("utf-8", "replace")

    def poll(self) -> GpuSample | None:
        """Read once; the sample, or None after a counted failure."""
        try:
            sample = parse_page(self.fetch(), self._clock())
        except GpuPageError as e:
            self._count(e.reason)
            if str(e) != self.last_error:
                log.warning("GPU counters %s: %s (%s)", self.url, e, e.reason)
            self.last_error = str(e)
            return None
        self._count("ok")
        self.last_error = ""
        self.history.add(sample)
        return sample

    def window(self, start: float, end: float, uuid=None, pod=None,
               index=None) -> GpuWindow | None:
        """The mean counters over ``[start, end]`` of the GPUs matched (see
        ``gpu_counters.select``); None without a sample inside."""
        return self.history.window(start, end, uuid=uuid, pod=pod, index=index)
