"""The GPU's own counters on the dashboard: from the exporter's JSON entry (written by the
exporter's own ``roofline_json`` for a result the counters checked), the banner's chips
say measured beside estimated and what the counters found, and the roofline chart puts
the range's work beside the DRAM traffic the GPU counted."""

from __future__ import annotations

from dataclasses import replace

import pytest

from phasewatch.dashboard import figures, panels
from phasewatch.dashboard.exporter_source import snapshot_from_api
from phasewatch.publish.api import roofline_json
from phasewatch.roofline.bottleneck import Result
from phasewatch.roofline.cause import diagnose
from phasewatch.roofline.estimate import RooflineEstimate, phase_estimate
from phasewatch.roofline.gpu_check import check, range_point
from phasewatch.roofline.gpu_verdict import apply
from phasewatch.roofline.inputs import InputSource
from phasewatch.roofline.verdict import decide
from tests.dashboard.test_dashboard_cause import DECODE, DEP, LLAMA, _entry, _lines, _records
from tests.roofline.test_gpu_watch import comparison


def _with_gpu(dram: float, tensor: float, dram_est: float, tensor_est: float) -> dict:
    """A decode-bound entry whose GPU counters read ``dram``/``tensor`` against the
    estimate's shares, as the exporter's monitor hands it to the API: the verdict told
    (``gpu_verdict.apply``), the entry written by ``roofline_json``."""
    est = RooflineEstimate(LLAMA, "vllm", 0.0, 30.0, 1.0, 40,
                           phase_estimate(DEP, 5.0, 4e15, 1e12, 40),
                           phase_estimate(DEP, 30.0, 1e15, 6e13, 40), 8.0, 0.02, DECODE,
                           {"decode_steps": InputSource("tpot")})
    v = decide(est, DEP, None, lambda phase: diagnose(phase, est, DEP, _records(), None))
    c = comparison(dram, tensor, dram_est, tensor_est)
    found = check(c, v.resource, DEP.model.name, DEP.compute_dtype, 1)
    flops, nbytes = tensor_est * DEP.peak_flops * 30, dram_est * DEP.peak_bandwidth * 30
    found = replace(found, point=range_point(c, flops, nbytes, 30.0, DEP.peak_bandwidth, 30.0))
    apply(v, found)
    return roofline_json(Result(LLAMA, "vllm", (LLAMA, "vllm"), DEP, est, v, gpu=found))


def _snapshot(entry: dict):
    return snapshot_from_api({"models": []}, {"models": [entry]}, {"series": []}, [])


def test_the_banner_shows_the_counters_beside_the_estimate():
    snap = _snapshot(_with_gpu(0.61, 0.05, 0.55, 0.02))
    (banner,) = panels.banners(snap)
    _, lines = _lines(banner)
    chips = lines[-2]
    assert "GPU DRAM active 61% (estimate 55%)" in chips
    assert "GPU tensor pipes active 5.0% (estimate 2.0%)" in chips
    assert "the GPU's counters confirm it (nvml, 1 GPU)" in chips
    row = snap.verdicts.iloc[0]
    assert row["gpu_outcome"] == "confirmed" and row["gpu_dram"] == pytest.approx(0.61)


def test_an_idle_gpu_shows_tenths_of_a_percent_and_says_so():
    snap = _snapshot(_with_gpu(0.042, 0.003, 0.030, 0.002))
    (banner,) = panels.banners(snap)
    chips = _lines(banner)[1][-2]
    assert "GPU DRAM active 4.2% (estimate 3.0%)" in chips
    assert "GPU tensor pipes active 0.3% (estimate 0.2%)" in chips
    assert "the GPU idle while the engine had work" in chips


def test_no_counters_no_chips():
    snap = _snapshot(_entry(DECODE, None))
    chips = _lines(panels.banners(snap)[0])[1][-2]
    assert "GPU" not in chips


def test_the_roofline_chart_puts_the_counted_traffic_above_the_estimate():
    snap = _snapshot(_with_gpu(0.042, 0.003, 0.030, 0.002))
    fig = figures.roofline_figure(snap.points, snap.ceilings)
    (trace,) = [t for t in fig["data"] if t.get("meta") == "gpu"]
    (x_est, x_gpu), (y_est, y_gpu) = trace["x"], trace["y"]
    assert x_est == x_gpu  # the same work, at its intensity
    assert y_gpu / y_est == pytest.approx(0.042 / 0.030)  # 1 / the estimate's ratio


def test_the_verdict_and_its_evidence_carry_what_the_counters_found():
    entry = _with_gpu(0.042, 0.003, 0.030, 0.002)
    v = entry["verdict"]
    assert v["resource"] == "overhead" and v["text"].startswith("The GPU was nearly idle")
    assert v["evidence"]["gpu"]["outcome"] == "idle" == entry["gpu"]["outcome"]
    assert entry["gpu"]["counters"]["source"] == "nvml"
