"""NVML's GPU Performance Monitoring (GPM), for GPUs visible to phasewatch's own process.

With ``nvidia-ml-py`` (the ``pynvml`` module NVIDIA publishes; the ``nvml`` extra), one
reading is: ``nvmlInit`` once, per device ``nvmlGpmQueryDeviceSupport`` (Hopper and
newer), an ``nvmlGpmSampleGet``, then ``nvmlGpmMetricsGet`` for the metrics below
between it and the sample the reading before took (kept, so the readings tile time: a
reading covers everything since the last one, not a slice of it); the first reading, or
one after the devices changed or a failure, takes two samples at least 100 ms apart.
The first design read 0.2 s of every second: on an H200 under an eager engine whose
pace changed between request rounds, three such slices of a 3 s range read the DRAM
5.4 % busy against an estimated 7.1 %, and the check failed the run; tiled, the next
run's readings matched the check's own sampler over the same ranges within 0.3 points
(``make gpu-check``, docs/verdict.md "Measured on an H200").

The names and units are pynvml's (nvidia-ml-py 13.615.71,
``pynvml.py``, "GPM Metric Identifiers"): every one is a **percent 0.0 - 100.0**, divided
by 100 here into the ratios ``gpu_counters.GpuCounters`` carries. DRAM_BW_UTIL is
"DRAM bw used vs theoretical maximum", the counter DCGM exports as
``DCGM_FI_PROF_DRAM_ACTIVE``; ANY_TENSOR_UTIL is ``..._PIPE_TENSOR_ACTIVE``; SM_UTIL
``..._SM_ACTIVE``; GRAPHICS_UTIL ``..._GR_ENGINE_ACTIVE``.

Every way of having no counters answers None with a reason, never an exception: it is
counted in ``NvmlGpmSource.results[reason]`` (and handed to ``on_result``), logged once
per reason, and ``reason`` says it: ``no_pynvml`` (the module not installed),
``library_not_found`` (no libnvidia-ml: a GPU-less machine), ``driver_not_loaded``,
``no_permission``, ``no_gpu`` (NVML sees no device), ``gpm_not_supported`` (no device
supports GPM: before Hopper, or a vGPU), ``nvml_error`` (anything else NVML says). The
first four and the last-but-one do not change while the process runs: after one, later
polls answer at once (still counted) without calling NVML again.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import socket
import time
from collections import Counter

from phasewatch.roofline.gpu_counters import (
    CounterHistory,
    GpuCounters,
    GpuIdentity,
    GpuSample,
    GpuWindow,
)

log = logging.getLogger("phasewatch")

# pynvml's metric constant -> GpuCounters field (all percents)
METRICS = {
    "NVML_GPM_METRIC_DRAM_BW_UTIL": "dram_active",
    "NVML_GPM_METRIC_ANY_TENSOR_UTIL": "tensor_active",
    "NVML_GPM_METRIC_SM_UTIL": "sm_active",
    "NVML_GPM_METRIC_SM_OCCUPANCY": "sm_occupancy",
    "NVML_GPM_METRIC_GRAPHICS_UTIL": "gr_engine_active",
    "NVML_GPM_METRIC_FP16_UTIL": "fp16_active",
    "NVML_GPM_METRIC_FP32_UTIL": "fp32_active",
    "NVML_GPM_METRIC_FP64_UTIL": "fp64_active",
}
MIN_INTERVAL = 0.1  # NVML: the two samples must be at least 100 ms apart
# NVML return code (pynvml's constant name) -> reason
ERRORS = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": "library_not_found",
    "NVML_ERROR_DRIVER_NOT_LOADED": "driver_not_loaded",
    "NVML_ERROR_NO_PERMISSION": "no_permission",
    "NVML_ERROR_NOT_SUPPORTED": "gpm_not_supported",
    "NVML_ERROR_FUNCTION_NOT_FOUND": "gpm_not_supported",  # a driver older than GPM
}
LASTING = ("no_pynvml", "library_not_found", "driver_not_loaded", "no_gpu",
           "gpm_not_supported")
REASONS = ("no_pynvml", "library_not_found", "driver_not_loaded", "no_permission", "no_gpu",
           "gpm_not_supported", "nvml_error")


def _text(v) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


class NvmlGpmSource:
    """Reads GPM counters of every GPU this process sees, keeping the samples (bounded).

    ``nvml`` is the pynvml module (imported on first use when None; tests hand in a
    stand-in), ``interval`` the time between the two GPM samples (at least 0.1 s)."""

    name = "nvml"  # the readings' ``gpu_source`` label

    def __init__(self, interval: float = 0.2, keep: int = 1024, clock=time.time,
                 sleep=time.sleep, nvml=None, on_result=None):
        self.interval = max(interval, MIN_INTERVAL)
        self.history = CounterHistory(keep)
        self.results: Counter = Counter()
        self.reason = ""  # why the last poll gave no counters; "" after a good one
        self._clock, self._sleep, self._nvml = clock, sleep, nvml
        self._on_result = on_result
        self._initialized = False
        self._warned: set[str] = set()
        self._hostname = socket.gethostname()
        # the last reading's GPM sample of each device (by index) and when it was taken
        self._held: dict[int, object] = {}
        self._held_at = 0.0

    def _fail(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.results[reason] += 1
        if self._on_result is not None:
            self._on_result(reason)
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("no GPU counters from NVML GPM: %s (%s)", detail, reason)

    def _reason(self, nvml, error: Exception) -> str:
        code = getattr(error, "value", None)
        for name, reason in ERRORS.items():
            if code is not None and code == getattr(nvml, name, object()):
                return reason
        return "nvml_error"

    def _module(self):
        if self._nvml is None:
            self._nvml = importlib.import_module("pynvml")
        return self._nvml

    def poll(self) -> GpuSample | None:
        """One reading of every GPM-capable GPU (takes ``interval``); None after a counted
        failure (``reason`` says which)."""
        if self.reason in LASTING:
            self._fail(self.reason, self.reason)
            return None
        try:
            nvml = self._module()
        except ImportError as e:
            self._fail("no_pynvml", f"pynvml not importable ({e}); install the nvml extra")
            return None
        try:
            sample = self._read(nvml)
        except Exception as e:  # NVMLError and its per-code subclasses, ctypes errors
            reason = self._reason(nvml, e)
            self._fail(reason, f"{type(e).__name__}: {e}")
            return None
        if sample is None:
            return None
        self.reason = ""
        self.results["ok"] += 1
        if self._on_result is not None:
            self._on_result("ok")
        self.history.add(sample)
        return sample

    def _read(self, nvml) -> GpuSample | None:
        if not self._initialized:
            nvml.nvmlInit()
            self._initialized = True
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            self._fail("no_gpu", "NVML sees no GPU")
            return None
        devices = []
        for i in range(count):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            if nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
                devices.append((i, handle))
        if not devices:
            self._fail("gpm_not_supported", f"none of {count} GPU(s) supports GPM "
                       "(Hopper or newer)")
            return None
        indexes = [i for i, _ in devices]
        fresh = sorted(self._held) != indexes
        if fresh:  # the first reading (or the devices changed): two samples apart
            self._release()
        allocated = []  # freed whatever fails, an allocation too
        try:
            if fresh:
                for _ in devices:
                    allocated.append(nvml.nvmlGpmSampleAlloc())
                for (_, h), s in zip(devices, allocated, strict=True):
                    nvml.nvmlGpmSampleGet(h, s)
                self._held, self._held_at = dict(zip(indexes, allocated, strict=True)), \
                    self._clock()
                allocated = []
                self._sleep(self.interval)
            else:  # NVML's 100 ms between two samples, where polls come faster
                wait = MIN_INTERVAL - (self._clock() - self._held_at)
                if wait > 0:
                    self._sleep(wait)
            for _ in devices:
                allocated.append(nvml.nvmlGpmSampleAlloc())
            for (_, h), s in zip(devices, allocated, strict=True):
                nvml.nvmlGpmSampleGet(h, s)
            now = self._clock()
            gpus = tuple(self._counters(nvml, i, h, self._held[i], s2)
                         for (i, h), s2 in zip(devices, allocated, strict=True))
        except BaseException:
            for s in allocated:
                with contextlib.suppress(Exception):
                    nvml.nvmlGpmSampleFree(s)
            self._release()
            raise
        since = self._held_at
        self._release()
        self._held, self._held_at = dict(zip(indexes, allocated, strict=True)), now
        return GpuSample(at=now, source="nvml", gpus=gpus, since=since)

    def _release(self) -> None:
        """Free the samples kept from the last reading."""
        for s in self._held.values():
            with contextlib.suppress(Exception):
                self._nvml.nvmlGpmSampleFree(s)
        self._held = {}

    def _counters(self, nvml, index: int, handle, s1, s2) -> GpuCounters:
        names = [n for n in METRICS if hasattr(nvml, n)]
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(names)
        request.sample1, request.sample2 = s1, s2
        for k, name in enumerate(names):
            request.metrics[k].metricId = getattr(nvml, name)
        got = nvml.nvmlGpmMetricsGet(request)
        values = {}
        for k, name in enumerate(names):
            m = got.metrics[k]
            if m.nvmlReturn == 0 and 0.0 <= m.value <= 100.0 + 1e-3:
                values[METRICS[name]] = min(m.value / 100.0, 1.0)
        ident = {"index": str(index), "device": f"nvidia{index}", "hostname": self._hostname}
        for field, call in (("uuid", "nvmlDeviceGetUUID"), ("model_name", "nvmlDeviceGetName")):
            with contextlib.suppress(Exception):  # best-effort: the counters stand alone
                ident[field] = _text(getattr(nvml, call)(handle))
        try:
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            values["fb_used_mib"], values["fb_free_mib"] = mem.used / 2**20, mem.free / 2**20
        except Exception:
            pass
        return GpuCounters(identity=GpuIdentity(**ident), **values)

    def window(self, start: float, end: float, uuid=None, pod=None,
               index=None) -> GpuWindow | None:
        """The mean counters over ``[start, end]`` (see ``gpu_counters.select``)."""
        return self.history.window(start, end, uuid=uuid, pod=pod, index=index)

    def close(self) -> None:
        if self._held:
            self._release()
        if self._initialized and self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._initialized = False
