"""`phasewatch calibrate` on this machine's CPU: a real measurement, a loadable profile."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from phasewatch.roofline import calibrate
from phasewatch.roofline.deployments import ModelOptions, load_profile, resolve

ROOT = Path(__file__).resolve().parent.parent
CALIBRATE = [sys.executable, "-m", "phasewatch.cli", "calibrate"]


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
    # without torch numpy measures fp32 alone: a bf16 model keeps bf16 and gets no FLOP/s
    # ceiling (borrowing fp32's would show a bf16 engine at "184 %" of it)
    assert set(m["flops_tflops"]) == {"fp32"}, m
    assert "no torch here" in profile["method"]["matmul"]
    d = resolve(ModelOptions(model="Llama-3.1-8B", hardware_profile=str(out)))
    assert d.compute_dtype == "bf16" and d.hardware_source == "profile"
    assert d.peak_flops == 0
    fp32 = resolve(ModelOptions(model="Llama-3.1-8B", hardware_profile=str(out),
                                compute_dtype="fp32"))
    assert fp32.peak_flops == m["flops_tflops"]["fp32"] * 1e12
    # the offline calculator says so instead of a compute ceiling of 0
    roofline = subprocess.run([sys.executable, "-m", "phasewatch.cli", "roofline", "--model",
                               "Llama-3.1-8B", "--hardware-profile", str(out)],
                              capture_output=True, text=True, timeout=60)
    assert roofline.returncode == 2, roofline.stdout
    assert "has no bf16 FLOP/s figure (it has: fp32)" in roofline.stderr
    assert "phasewatch calibrate" in roofline.stderr


def test_calibration_with_torch_measures_each_dtype(tmp_path):
    """Where torch is importable (the engine's virtualenv here), the CPU's matmuls are
    measured in bf16, fp16 and fp32, and a bf16 model is held to the bf16 ceiling."""
    from tests.test_real_vllm import VLLM_PY, require_vllm

    require_vllm()
    out = tmp_path / "torch.json"
    proc = subprocess.run(
        [str(VLLM_PY), "-c", "import sys; from phasewatch.roofline import calibrate as c; "
         "c.write(c.calibrate('cpu', 64, 512, 2), sys.argv[1])", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    profile = json.loads(out.read_text())
    assert set(profile["measured"]["flops_tflops"]) == {"bf16", "fp16", "fp32"}, profile
    assert "torch" in profile["method"]["matmul"] and profile["memory_gb"] > 0
    d = resolve(ModelOptions(model="Llama-3.1-8B", hardware_profile=str(out)))
    assert d.compute_dtype == "bf16"
    assert d.peak_flops == profile["measured"]["flops_tflops"]["bf16"] * 1e12


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


def test_a_cpu_without_16_bit_units_holds_16_bit_models_to_its_fp32_ceiling():
    """On an AVX2 CPU torch's bf16 matmul ran 0.9 GFLOP/s against 113 in fp32, and vLLM's
    CPU kernels (converting to fp32) computed a bf16 model at 6x the bf16 figure: a
    16-bit ceiling below fp32's is raised to it, and the profile says what was measured."""
    from phasewatch.roofline.calibrate import cpu_half_floor

    flops = {"bf16": 0.9e9, "fp16": 0.86e9, "fp32": 113e9}
    assert cpu_half_floor(flops) == {"bf16": 0.9e9, "fp16": 0.86e9}
    assert flops == {"bf16": 113e9, "fp16": 113e9, "fp32": 113e9}
    amx = {"bf16": 300e9, "fp16": 90e9, "fp32": 100e9}  # AMX: bf16 faster, kept
    assert cpu_half_floor(amx) == {"fp16": 90e9} and amx["bf16"] == 300e9
