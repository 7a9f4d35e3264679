"""The NVML GPM reader: the real pynvml's failure path on this GPU-less machine, and
the reading itself against a stand-in with pynvml's structures (percent -> ratio)."""

from __future__ import annotations

import os
import sys
import types

import pytest

from phasewatch.roofline.nvml_gpm import NvmlGpmSource


def real_pynvml():
    try:
        import pynvml
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("pynvml (nvidia-ml-py, the nvml/dev extra) is not installed")
    return pynvml


def has_gpu(pynvml) -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_the_real_library_without_a_gpu_answers_no_counters_once(caplog):
    pynvml = real_pynvml()
    if has_gpu(pynvml):
        pytest.skip("this machine has a GPU: the failure path is not the one taken")
    seen = []
    src = NvmlGpmSource(on_result=seen.append, sleep=lambda s: None)
    with caplog.at_level("WARNING", logger="phasewatch"):
        assert src.poll() is None
        assert src.poll() is None
    assert src.reason in ("library_not_found", "driver_not_loaded", "no_gpu")
    assert src.results == {src.reason: 2} and seen == [src.reason] * 2
    assert len(caplog.records) == 1 and "no GPU counters" in caplog.text
    assert src.window(0, 1e12) is None
    src.close()


def test_the_real_library_on_a_gpu():
    pynvml = real_pynvml()
    if not has_gpu(pynvml):
        pytest.skip("no GPU visible to NVML")
    src = NvmlGpmSource(interval=0.1)
    sample = src.poll()
    if sample is None:  # a pre-Hopper GPU, or no permission: said, not raised
        assert src.reason in ("gpm_not_supported", "no_permission", "nvml_error")
        return
    for g in sample.gpus:
        for v in (g.dram_active, g.tensor_active, g.sm_active, g.gr_engine_active):
            assert v is None or 0.0 <= v <= 1.0
    src.close()


def test_no_pynvml_is_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # what an absent module imports as
    src = NvmlGpmSource()
    assert src.poll() is None and src.reason == "no_pynvml" and src.results == {"no_pynvml": 1}


class FakeError(Exception):
    def __init__(self, value):
        super().__init__(f"NVML error {value}")
        self.value = value


def fake_nvml(support=(True, True), fail=None, percents=None, sample_fail=None):
    """A stand-in with pynvml's names and its GPM structures (real ctypes ones)."""
    pynvml = real_pynvml()
    percents = percents or {10: 4.2, 5: 0.3, 2: 5.0, 1: 96.0, 3: 12.0}
    calls = []
    m = types.SimpleNamespace(**{k: getattr(pynvml, k) for k in dir(pynvml)
                                 if k.startswith(("NVML_GPM_", "NVML_ERROR_", "c_nvmlGpm"))})

    def init():
        calls.append("init")
        if fail is not None:
            raise FakeError(fail)

    def metrics_get(req):
        calls.append("metrics")
        for k in range(req.numMetrics):
            metric = req.metrics[k]
            if metric.metricId in percents:
                metric.value, metric.nvmlReturn = percents[metric.metricId], 0
            else:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return req

    m.nvmlInit = init
    m.nvmlShutdown = lambda: calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: len(support)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlGpmQueryDeviceSupport = lambda h: types.SimpleNamespace(isSupportedDevice=support[h])
    def alloc():
        calls.append("alloc")
        return pynvml.c_nvmlGpmSample_t()

    m.nvmlGpmSampleAlloc = alloc
    m.nvmlGpmSampleFree = lambda s: calls.append("free")
    def sample_get(h, s):
        calls.append(f"sample{h}")
        if sample_fail is not None:
            raise FakeError(sample_fail)

    m.nvmlGpmSampleGet = sample_get
    m.nvmlGpmMetricsGet = metrics_get
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{h}"
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=2**30, free=2**31)
    return m, calls


def test_a_reading_of_a_hopper_is_two_samples_apart_in_ratios():
    nvml, calls = fake_nvml(support=(True, False))
    slept = []
    src = NvmlGpmSource(interval=0.05, nvml=nvml, sleep=slept.append, clock=lambda: 42.0)
    sample = src.poll()
    assert slept == [0.1]  # never under NVML's 100 ms
    got = [c for c in calls if c != "alloc"]
    assert got[:3] == ["init", "sample0", "sample0"] and calls.count("free") == 1
    assert sample.source == "nvml" and sample.at == 42.0 and len(sample.gpus) == 1
    g = sample.gpus[0]
    assert (g.identity.index, g.identity.uuid, g.identity.model_name, g.identity.device) == (
        "0", "GPU-0", "NVIDIA H100 80GB HBM3", "nvidia0")
    assert g.dram_active == pytest.approx(0.042) and g.tensor_active == pytest.approx(0.003)
    assert g.sm_active == pytest.approx(0.05) and g.gr_engine_active == pytest.approx(0.96)
    assert g.sm_occupancy == pytest.approx(0.12)
    assert g.fp16_active is None  # NVML said not supported for it
    assert (g.fb_used_mib, g.fb_free_mib) == (1024, 2048)
    assert src.results == {"ok": 1} and src.reason == ""
    assert src.window(0, 100, uuid="GPU-0").mean.dram_active == pytest.approx(0.042)
    src.poll()
    assert calls.count("init") == 1
    src.close()
    assert calls[-1] == "shutdown"
    assert calls.count("free") == calls.count("alloc")  # the kept sample too, on close


def test_readings_tile_time_each_from_the_sample_the_last_one_took():
    """A reading covers everything since the reading before (its sample kept), not a
    slice of each poll period: one new sample a reading, the metrics between the two."""
    nvml, calls = fake_nvml(support=(True,))
    t = [100.0]

    def sleep(seconds):
        t[0] += seconds

    src = NvmlGpmSource(interval=0.1, nvml=nvml, sleep=sleep, clock=lambda: t[0])
    first = src.poll()
    assert (first.since, first.at) == (100.0, pytest.approx(100.1))
    n = calls.count("sample0")
    sleep(1.0)
    second = src.poll()
    sleep(1.0)
    third = src.poll()
    assert calls.count("sample0") == n + 2  # one sample a reading after the first
    assert (second.since, second.at) == (first.at, pytest.approx(101.1))
    assert (third.since, third.at) == (second.at, pytest.approx(102.1))
    sleep(0.02)  # polls closer than NVML's 100 ms wait for the rest of it
    assert src.poll().at == pytest.approx(102.2)
    assert calls.count("alloc") - calls.count("free") == 1  # the last one's, kept
    # a window from inside the second reading to 0.1 s into the third: a share of each
    w = src.window(100.6, 101.2)
    assert w.samples == 2 and w.covered == pytest.approx(0.6)
    assert w.coverage() == pytest.approx(1.0)
    src.close()
    assert calls.count("alloc") == calls.count("free")


def test_a_failed_reading_starts_the_next_afresh():
    pynvml = real_pynvml()
    nvml, calls = fake_nvml(support=(True,))
    src = NvmlGpmSource(nvml=nvml, sleep=lambda s: None)
    assert src.poll() is not None

    def broken(h, s):
        raise FakeError(pynvml.NVML_ERROR_UNKNOWN)

    good, nvml.nvmlGpmSampleGet = nvml.nvmlGpmSampleGet, broken
    assert src.poll() is None and src.reason == "nvml_error"
    assert calls.count("alloc") == calls.count("free")  # the kept sample freed too
    nvml.nvmlGpmSampleGet = good
    n = calls.count("sample0")
    assert src.poll() is not None and calls.count("sample0") == n + 2  # two apart again
    src.close()


@pytest.mark.parametrize(("code", "reason", "lasting"), [
    ("NVML_ERROR_NO_PERMISSION", "no_permission", False),
    ("NVML_ERROR_DRIVER_NOT_LOADED", "driver_not_loaded", True),
    ("NVML_ERROR_LIBRARY_NOT_FOUND", "library_not_found", True),
    ("NVML_ERROR_UNKNOWN", "nvml_error", False),
])
def test_nvml_errors_are_reasons_said_once(code, reason, lasting, caplog):
    pynvml = real_pynvml()
    nvml, calls = fake_nvml(fail=getattr(pynvml, code))
    src = NvmlGpmSource(nvml=nvml, sleep=lambda s: None)
    with caplog.at_level("WARNING", logger="phasewatch"):
        for _ in range(3):
            assert src.poll() is None
    assert src.reason == reason and src.results == {reason: 3}
    assert len(caplog.records) == 1
    assert calls.count("init") == (1 if lasting else 3)


def test_gpm_not_supported_before_hopper():
    nvml, calls = fake_nvml(support=(False, False))
    src = NvmlGpmSource(nvml=nvml, sleep=lambda s: None)
    assert src.poll() is None and src.reason == "gpm_not_supported"
    assert src.poll() is None and src.results == {"gpm_not_supported": 2}
    assert "sample0" not in calls


def test_no_permission_to_sample_frees_the_samples_and_says_so():
    pynvml = real_pynvml()
    nvml, calls = fake_nvml(support=(True, True), sample_fail=pynvml.NVML_ERROR_NO_PERMISSION)
    src = NvmlGpmSource(nvml=nvml, sleep=lambda s: None)
    assert src.poll() is None and src.reason == "no_permission"
    assert calls.count("free") == calls.count("alloc") > 0
    assert src.results == {"no_permission": 1}
