"""`phasewatch calibrate` on this machine's CPU: a real measurement, a loadable profile."""

from __future__ import annotations

import json
import subprocess
import sys

from exporter.roofline import calibrate
from exporter.roofline.deployments import ModelOptions, load_profile, resolve

CALIBRATE = [sys.executable, "-m", "exporter.cli", "calibrate"]


def test_cpu_calibration_writes_a_profile_the_exporter_loads(tmp_path):
    out = tmp_path / "cpu.json"
    proc = subprocess.run([*CALIBRATE, "--device", "cpu", "--size-mib", "64", "--repeats", "2",
                           "--matmul-n", "512", "--output", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "bandwidth" in proc.stderr and "2/2" in proc.stderr  # progress while it runs
    assert "memory bandwidth" in proc.stdout and "no datasheet figure" in proc.stdout
    profile = json.loads(out.read_text())
    m = profile["measured"]
    # any machine that runs the tests streams more than 0.1 GB/s and multiplies faster
    # than 0.1 GFLOP/s; these guard against unit slips (bytes vs GB), not speed
    assert 0.1 < m["bandwidth_gbps"] < 10_000
    assert 1e-4 < m["flops_tflops"]["fp32"] < 1_000
    hw = load_profile(out, gpus=1)
    assert hw.measured_bandwidth == m["bandwidth_gbps"] * 1e9
    d = resolve(ModelOptions(model="Llama-3.1-8B", hardware_profile=str(out)))
    assert d.compute_dtype == "fp32" and d.hardware_source == "profile"


def test_cuda_without_torch_or_gpu_says_so(tmp_path):
    proc = subprocess.run([*CALIBRATE, "--device", "cuda", "--output", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--device cuda needs torch with a CUDA GPU" in proc.stderr


def test_report_puts_measurement_beside_the_datasheet():
    profile = {"device": "NVIDIA H100 80GB HBM3", "part": "H100-SXM",
               "measured": {"bandwidth_gbps": 3000.0, "flops_tflops": {"bf16": 800.0}}}
    text = calibrate.report(profile)
    assert "3,000.0 GB/s    3,350 GB/s datasheet (90%)" in text
    assert "800.000 TFLOP/s 989 TFLOP/s datasheet (81%)" in text
