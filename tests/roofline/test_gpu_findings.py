"""``make gpu-check``'s rules (tests/engines/gpu_findings.py) on roofline entries and a
calibrate profile in the shape phasewatch writes them (test_gpu_e2e.py holds the rules to
the running exporter's own entries): a run passes or fails for the reasons it says."""

from __future__ import annotations

import json

import pytest

from tests import support
from tests.engines.gpu_findings import (
    OVERSTATED,
    calibrate_line,
    calibrate_vs_datasheet,
    failures,
    gpu_block,
    gpu_line,
)

ENTRY = {"gpu": {"outcome": "idle", "counters": {"source": "nvml", "gpus": ["gpu 0"],
                                                 "samples": 30, "sm_active": 0.05},
                 "dram_estimated": 0.030, "dram_measured": 0.042, "dram_ratio": 0.714,
                 "tensor_estimated": 0.002, "tensor_measured": 0.003, "tensor_ratio": 0.667,
                 "engine_busy": 1.0}}


def phase(entry=ENTRY, mbu=0.03, streams=8):
    return {"streams": streams, "mode": "eager", "gpu_check": gpu_block(entry),
            "roofline": {"decode_mbu": mbu, "decode_mfu": 0.001, "prefill_mfu": 0.2}}


def test_the_h100_run_of_issue_39_passes_and_reads_as_it_did():
    assert failures([phase(), phase(streams=48)], on_gpu=True) == []
    line = gpu_line(gpu_block(ENTRY))
    assert "DRAM estimated 3.0% / measured 4.2% (x0.71)" in line
    assert "tensor estimated 0.2% / measured 0.3%" in line and "finding idle" in line


def test_an_estimate_above_the_counters_fails_with_both_figures():
    over = {"gpu": {**ENTRY["gpu"], "dram_estimated": 0.30, "dram_ratio": 0.30 / 0.042}}
    (why,) = failures([phase(over)], on_gpu=True)
    assert why == "eager 8 streams: the estimate's dram share 30.0% exceeds the GPU's 4.2% (x7.14)"


def test_a_utilization_over_one_fails():
    assert failures([phase(mbu=1.2)], on_gpu=True) == [
        "eager 8 streams: decode_mbu 1.200 exceeds 1"]


def test_no_counters_on_a_gpu_fails_and_on_a_cpu_does_not():
    assert failures([phase(entry={})], on_gpu=False) == []
    (why,) = failures([phase(entry={})], on_gpu=True)
    assert why.startswith("phasewatch read no GPU counters")


def test_calibrate_beside_the_datasheet():
    # issue 39's H100: 2,995 GB/s and 751 TFLOP/s bf16 against 3.35 TB/s and 989 TFLOP/s
    profile = {"format": "phasewatch-hardware/1", "part": "H100-SXM",
               "device": "NVIDIA H100 80GB HBM3",
               "measured": {"bandwidth_gbps": 2995.0, "flops_tflops": {"bf16": 751.0}}}
    dep = {"hardware": "H100-SXM", "peak_bandwidth_bytes_per_second": 3.35e12,
           "peak_flops_per_second": 989e12, "compute_dtype": "bf16"}
    c = calibrate_vs_datasheet(profile, dep)
    assert c["over_datasheet"]["bandwidth"] == pytest.approx(2995 / 3350)
    assert c["over_datasheet"]["bf16 FLOP/s"] == pytest.approx(751 / 989)
    assert failures([phase()], on_gpu=True, calibrated=c) == []
    assert "2,995 GB/s; bf16 751 TFLOP/s; bandwidth 89% of the datasheet" in calibrate_line(c)
    fast = calibrate_vs_datasheet({**profile, "measured": {"bandwidth_gbps": 4000.0,
                                                           "flops_tflops": {}}}, dep)
    assert failures([phase()], on_gpu=True, calibrated=fast) == [
        "calibrate: bandwidth 1.19x the datasheet"]


H200 = support.FIXTURES / "gpu" / "h200-transformers-5.17.0"


def test_the_h200_run_passes_on_what_phasewatch_wrote_there():
    """The device run of 2026-11-28: the rules pass on the pages phasewatch wrote on the
    H200, and its counters over each range agree with the check's own NVML sampler."""
    summary = json.loads((H200 / "summary.json").read_text())
    phases = summary["phases"]
    assert [(p["mode"], p["streams"]) for p in phases] == [
        ("eager", 8), ("eager", 48), ("graphs", 8), ("graphs", 48)]
    assert failures(phases, on_gpu=True, calibrated=summary["calibrate"]) == []
    for p in phases:
        page = json.loads((H200 / f"roofline-{p['mode']}-{p['streams']}.json").read_text())
        (entry,) = page["models"]
        block = gpu_block(entry)
        assert block == p["gpu_check"] and block["source"] == "nvml"
        # the check's sampler tiles time the same way: the same range reads the same
        assert block["dram_measured"] * 100 == pytest.approx(
            p["gpu_over_range"]["dram_bw_util"], abs=0.3)
        assert block["dram_ratio"] < OVERSTATED
        # every second of the range counted (the readings tile time)
        est = entry["estimate"]
        assert entry["gpu"]["counters"]["covered_seconds"] == pytest.approx(
            est["range_end"] - est["range_start"], rel=0.01)
        verdict = entry["verdict"]
        assert (verdict["phase"], verdict["resource"]) == ("decode", "overhead")
        assert block["outcome"] == ("idle" if p["mode"] == "eager" else "unchecked")
    profile = json.loads((H200 / "gpu-profile.json").read_text())
    c = calibrate_vs_datasheet(profile, json.loads(
        (H200 / "roofline-eager-8.json").read_text())["models"][0]["deployment"])
    assert c["over_datasheet"]["bandwidth"] == pytest.approx(0.89, abs=0.01)


def test_the_first_h200_run_read_slices_and_failed():
    """Before the readings tiled time: 3 samples of 0.2 s over a 3 s range."""
    page = json.loads((H200 / "first-run" / "roofline-eager-8.json").read_text())
    block = gpu_block(page["models"][0])
    assert block["samples"] == 3 and block["dram_ratio"] == pytest.approx(1.30, abs=0.01)
    assert "covered_seconds" not in page["models"][0]["gpu"]["counters"]
    (why,) = [w for w in failures([{"streams": 8, "mode": "eager", "gpu_check": block,
                                    "roofline": {}}], on_gpu=True) if "dram" in w]
    assert "exceeds the GPU's 5.4%" in why
