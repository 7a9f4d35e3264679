"""The GPU's own activity counters, one type for both sources, and their window means.

Two readers fill it: ``dcgm_exporter.py`` (a dcgm-exporter's ``/metrics`` page, the
``DCGM_FI_PROF_*`` profiling fields) and ``nvml_gpm.py`` (NVML's GPU Performance
Monitoring, for a GPU visible to phasewatch's own process). Every activity here is a
**ratio 0..1 of time or cycles**, whatever the source wrote: DCGM's PROF fields are
ratios already (their HELP says "Ratio of cycles ..."), DCGM's ``DCGM_FI_DEV_GPU_UTIL``
and ``DCGM_FI_DEV_MEM_COPY_UTIL`` and every NVML GPM metric are percents (0..100) and are
divided by 100 on reading. A counter the source did not give is None, never 0: a missing
DRAM counter is no evidence of an idle GPU.

What they mean (docs/verdict.md, "The GPU's own counters"): ``dram_active`` is the share
of cycles the device-memory interface was busy sending or receiving, not bytes (L2 hits
never reach it); ``tensor_active`` the share of cycles any tensor pipe was busy;
``sm_active`` the share of cycles an SM had at least one warp resident (averaged over
SMs), ``sm_occupancy`` the resident warps over the most an SM holds; ``gr_engine_active``
the share of time the graphics/compute engine had work.

``CounterHistory`` keeps the samples a reader took (bounded) and answers the mean of each
counter over ``[start, end]``, the roofline's window, for the GPUs ``select`` matches. A
reading that covers a period (NVML GPM's: from the reading before it to this one, so
the readings tile time) counts by the part of the period inside the window: a reading
that ends a second into the window is mostly the second before it. A reading at a moment
(a dcgm-exporter page: DCGM's own average over a period it does not say) counts whole
where it was taken inside the window.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, fields

# the activity ratios (0..1) and the absolute gauges a GpuCounters carries
RATIOS = ("dram_active", "tensor_active", "sm_active", "sm_occupancy", "gr_engine_active",
          "fp16_active", "fp32_active", "fp64_active", "gpu_util", "mem_copy_util")
GAUGES = ("fb_used_mib", "fb_free_mib", "sm_clock_mhz", "power_w")


@dataclass(frozen=True)
class GpuIdentity:
    """Which GPU (or MIG instance) a row is about, and the pod using it, if mapped."""

    index: str = ""  # dcgm-exporter's ``gpu`` label / NVML's device index
    uuid: str = ""  # ``UUID`` (``uuid`` with dcgm-exporter's old namespace)
    device: str = ""  # ``nvidia0``
    model_name: str = ""  # ``modelName``: "NVIDIA H100 80GB HBM3"
    hostname: str = ""  # ``hostname`` (``Hostname`` before dcgm-exporter #655)
    pci_bus_id: str = ""
    mig_profile: str = ""  # ``GPU_I_PROFILE``: "1g.10gb"; "" for a whole GPU
    mig_instance: str = ""  # ``GPU_I_ID``
    pod: str = ""  # Kubernetes pod mapping (``pod`` / old ``pod_name``)
    namespace: str = ""
    container: str = ""

    def name(self) -> str:
        """A short label for evidence lines: ``gpu 0 (GPU-ab12...)``, MIG instance added."""
        out = f"gpu {self.index}" if self.index else "gpu"
        if self.uuid:
            out += f" ({self.uuid})"
        if self.mig_instance:
            out += " MIG " + " ".join(p for p in (self.mig_profile, "instance") if p)
            out += f" {self.mig_instance}"
        return out


@dataclass(frozen=True)
class GpuCounters:
    """One GPU's counters at one reading; ratios 0..1, None where not given."""

    identity: GpuIdentity
    dram_active: float | None = None  # DCGM_FI_PROF_DRAM_ACTIVE / GPM DRAM_BW_UTIL
    tensor_active: float | None = None  # ..._PIPE_TENSOR_ACTIVE / GPM ANY_TENSOR_UTIL
    sm_active: float | None = None  # ..._SM_ACTIVE / GPM SM_UTIL
    sm_occupancy: float | None = None  # ..._SM_OCCUPANCY / GPM SM_OCCUPANCY
    gr_engine_active: float | None = None  # ..._GR_ENGINE_ACTIVE / GPM GRAPHICS_UTIL
    fp16_active: float | None = None  # ..._PIPE_FP16_ACTIVE / GPM FP16_UTIL
    fp32_active: float | None = None
    fp64_active: float | None = None
    gpu_util: float | None = None  # DCGM_FI_DEV_GPU_UTIL / 100 (coarse: "a kernel ran")
    mem_copy_util: float | None = None  # DCGM_FI_DEV_MEM_COPY_UTIL / 100
    fb_used_mib: float | None = None
    fb_free_mib: float | None = None
    sm_clock_mhz: float | None = None
    power_w: float | None = None


@dataclass(frozen=True)
class GpuSample:
    """One reading of every GPU a source sees."""

    at: float  # exporter clock
    source: str  # "dcgm" or "nvml"
    gpus: tuple[GpuCounters, ...]
    # where the reading covers a period: its start (NVML GPM: the reading before it);
    # None for a reading at a moment (dcgm-exporter's page)
    since: float | None = None

    def weight(self, start: float, end: float) -> float:
        """How much this reading counts in ``[start, end]``: the seconds of its period
        inside (0 when none), or 1 for a reading at a moment taken inside."""
        if self.since is not None and self.since < self.at:
            return max(0.0, min(self.at, end) - max(self.since, start))
        return 1.0 if start <= self.at <= end else 0.0


@dataclass(frozen=True)
class CounterMeans:
    """The mean of each counter over a window; None where no sample carried it."""

    dram_active: float | None = None
    tensor_active: float | None = None
    sm_active: float | None = None
    sm_occupancy: float | None = None
    gr_engine_active: float | None = None
    fp16_active: float | None = None
    fp32_active: float | None = None
    fp64_active: float | None = None
    gpu_util: float | None = None
    mem_copy_util: float | None = None
    fb_used_mib: float | None = None
    fb_free_mib: float | None = None
    sm_clock_mhz: float | None = None
    power_w: float | None = None

    def present(self) -> dict[str, float]:
        """The counters given, by field name (for the JSON API and evidence lines)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class GpuWindow:
    """The GPUs' counters over ``[start, end]``: ``mean`` is the mean over the matched
    GPUs of each GPU's mean over its samples (a GPU sampled more often does not weigh
    more); ``per_gpu`` the same per GPU; ``samples`` the readings that fell inside;
    ``covered`` the seconds of the window their periods cover (None for readings at a
    moment, whose periods are not known)."""

    start: float
    end: float
    source: str
    samples: int
    gpus: tuple[GpuIdentity, ...]
    mean: CounterMeans
    per_gpu: tuple[tuple[GpuIdentity, CounterMeans], ...] = ()
    covered: float | None = None

    def coverage(self) -> float | None:
        """The share of the window the readings cover (None: not known)."""
        span = self.end - self.start
        if self.covered is None or span <= 0:
            return None
        return min(self.covered / span, 1.0)

    def summary(self) -> dict:
        """For the JSON API and the verdict's evidence: the source, the span, the GPUs
        by name and the mean counters given (None left out)."""
        return {"source": self.source, "start": self.start, "end": self.end,
                "samples": self.samples, "covered_seconds": self.covered,
                "gpus": [g.name() for g in self.gpus], **self.mean.present()}


def select(gpus, uuid=None, pod=None, index=None) -> tuple[GpuCounters, ...]:
    """The rows of ``gpus`` that are the engine's: by UUID (one or several; a MIG
    instance matches its parent's UUID, which is what dcgm-exporter writes), by the
    Kubernetes ``pod`` label, or by index (``gpu`` label, ints or strings). Criteria given
    together must all hold; none given keeps every row. Accepts GpuCounters or
    GpuIdentity rows alike."""

    def as_set(v):
        if v is None:
            return None
        return {str(x) for x in ([v] if isinstance(v, (str, int)) else v)}

    uuids, pods, indexes = as_set(uuid), as_set(pod), as_set(index)
    out = []
    for row in gpus:
        ident = row.identity if isinstance(row, GpuCounters) else row
        if uuids is not None and ident.uuid not in uuids:
            continue
        if pods is not None and ident.pod not in pods:
            continue
        if indexes is not None and ident.index not in indexes:
            continue
        out.append(row)
    return tuple(out)


def _means(rows: list, weights: list[float] | None = None) -> CounterMeans:
    """The mean of each counter over ``rows`` (GpuCounters, or the CounterMeans of
    several GPUs), weighted by ``weights`` (each 1 when None), the rows that lack it
    left out."""
    weights = weights if weights is not None else [1.0] * len(rows)
    values = {}
    for name in RATIOS + GAUGES:
        got = [(getattr(r, name), w) for r, w in zip(rows, weights, strict=True)
               if getattr(r, name) is not None]
        total = sum(w for _, w in got)
        if got and total > 0:
            values[name] = sum(v * w for v, w in got) / total
    return CounterMeans(**values)


def window_means(samples, start: float, end: float, uuid=None, pod=None,
                 index=None) -> GpuWindow | None:
    """The counters of ``samples`` (GpuSample, any order) over ``[start, end]`` (each by
    ``GpuSample.weight``), for the GPUs ``select`` keeps; None when no sample fell
    inside or none matched."""
    by_gpu: dict[GpuIdentity, list[tuple[GpuCounters, float]]] = {}
    source, taken, covered = "", 0, None  # taken: the samples that held one of the GPUs
    for s in samples:
        weight = s.weight(start, end)
        if weight <= 0:
            continue
        rows = select(s.gpus, uuid=uuid, pod=pod, index=index)
        for row in rows:
            by_gpu.setdefault(row.identity, []).append((row, weight))
        if rows:
            source, taken = source or s.source, taken + 1
            if s.since is not None and s.since < s.at:
                covered = (covered or 0.0) + weight
    if not by_gpu:
        return None
    per_gpu = tuple((ident, _means([r for r, _ in rows], [w for _, w in rows]))
                    for ident, rows in by_gpu.items())
    return GpuWindow(start=start, end=end, source=source, samples=taken,
                     gpus=tuple(by_gpu), mean=_means([m for _, m in per_gpu]),
                     per_gpu=per_gpu, covered=covered)


class CounterHistory:
    """The samples a reader took, newest last, at most ``keep`` (thread-safe)."""

    def __init__(self, keep: int = 1024):
        self._samples: deque[GpuSample] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def add(self, sample: GpuSample) -> None:
        with self._lock:
            self._samples.append(sample)

    def window(self, start: float, end: float, uuid=None, pod=None,
               index=None) -> GpuWindow | None:
        """``window_means`` over the kept samples."""
        with self._lock:
            kept = list(self._samples)
        return window_means(kept, start, end, uuid=uuid, pod=pod, index=index)

    def latest(self) -> GpuSample | None:
        with self._lock:
            return self._samples[-1] if self._samples else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._samples)
