"""``phasewatch calibrate``: measure this machine's achievable bandwidth and FLOP/s.

The datasheet is a ceiling no kernel reaches; the roofline is more honest against
what the part really does (measured on real parts: an H100 SXM copy reaches
about 3.0 of the datasheet's 3.35 TB/s). Two measurements, best of ``repeats``:

* memory bandwidth: a large streaming copy, counted as bytes read + bytes written
  (the convention of STREAM's Copy and of device-to-device copy benchmarks);
* matmul FLOP/s: square ``n x n`` products, 2 n^3 FLOPs each, **in each dtype a
  deployment computes in**: a ceiling holds only for its own dtype (a CPU with AMX
  multiplies bf16 about three times faster than fp32; a GPU's tensor cores likewise),
  so a bf16 model held to an fp32 ceiling shows a "utilization" above 100 %.

Where torch is importable the matmuls run with torch in bf16, fp16 and fp32, on the
GPU when one is present (and the copy there too), else on the CPU; without torch,
numpy measures fp32 only, and the profile then has no bf16 or fp16 ceiling (the
exporter says so rather than borrow the fp32 one). The copy on a CPU is numpy's,
single-threaded. The result is a hardware profile (JSON) that ``phasewatch serve
--hardware-profile`` and ``phasewatch roofline --hardware-profile`` load.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from phasewatch.roofline import catalog
from phasewatch.roofline.deployments import PROFILE_FORMAT

Progress = Callable[[str, int, int, float], None]


def _best(what: str, repeats: int, run: Callable[[], float], progress: Progress) -> float:
    best = 0.0
    for i in range(repeats):
        best = max(best, run())
        progress(what, i + 1, repeats, best)
    return best


def cpu_bandwidth(size_bytes: int, repeats: int, progress: Progress) -> float:
    src = np.ones(size_bytes // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch every page before timing

    def once() -> float:
        t = time.perf_counter()
        np.copyto(dst, src)
        return 2 * src.nbytes / (time.perf_counter() - t)

    return _best("bandwidth", repeats, once, progress)


def cpu_matmul(n: int, repeats: int, progress: Progress) -> float:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # warm up the BLAS threads

    def once() -> float:
        t = time.perf_counter()
        a @ b
        return 2 * n**3 / (time.perf_counter() - t)

    return _best("matmul fp32", repeats, once, progress)


TORCH_DTYPES = ("bf16", "fp16", "fp32")


def _cuda_timer(torch):
    def timed(fn) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    return timed


def _cpu_timer(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def torch_matmuls(n: int, repeats: int, progress: Progress, cuda: bool) -> dict[str, float]:
    """{dtype: FLOP/s} of torch ``n x n`` matmuls in bf16, fp16 and fp32, on the first
    CUDA device or on the CPU (torch's own threads, oneDNN/AMX where the CPU has it)."""
    import torch

    dev = torch.device("cuda:0" if cuda else "cpu")
    timed = _cuda_timer(torch) if cuda else _cpu_timer
    flops = {}
    for name in TORCH_DTYPES:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]
        a = torch.randn(n, n, dtype=dtype, device=dev)
        b = torch.randn(n, n, dtype=dtype, device=dev)
        a @ b  # warm up: kernels chosen, threads started
        flops[name] = _best(f"matmul {name}", repeats,
                            lambda a=a, b=b: 2 * n**3 / timed(lambda: a @ b), progress)
    return flops


def cpu_half_floor(flops: dict[str, float]) -> dict[str, float]:
    """On a CPU, raise a 16-bit ceiling measured below the fp32 one to it, in place; the
    figures raised, as measured. A CPU without bf16 or fp16 arithmetic units (no
    AVX512-BF16, AMX or AVX512-FP16: AVX2 parts) runs torch's 16-bit matmul on a slow
    path (here 0.9 GFLOP/s against 113 in fp32), while an engine's kernels convert to
    fp32 and use the fp32 units (vLLM on this CPU computed 6x that bf16 figure): no
    16-bit product costs the hardware more than an fp32 one, so fp32's figure is a
    ceiling for it and the lower measurement is not."""
    top = flops.get("fp32")
    raised = {k: flops[k] for k in ("bf16", "fp16") if top and flops.get(k, top) < top}
    for k in raised:
        flops[k] = top
    return raised


def gpu_measure(size_bytes: int, n: int, repeats: int, progress: Progress):
    """(device name, device count, bandwidth, {dtype: flops}) with torch on the first
    CUDA device."""
    import torch

    dev = torch.device("cuda:0")
    src = torch.empty(size_bytes // 2, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    timed = _cuda_timer(torch)
    bw = _best("bandwidth", repeats, lambda: 2 * src.numel() * 2 / timed(
        lambda: dst.copy_(src)), progress)
    flops = torch_matmuls(n, repeats, progress, cuda=True)
    return torch.cuda.get_device_name(0), torch.cuda.device_count(), bw, flops


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _torch_importable() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _gpu_available() -> bool:
    if not _torch_importable():
        return False
    import torch

    return bool(torch.cuda.is_available())


def calibrate(device: str = "auto", size_mib: int = 512, matmul_n: int = 2048,
              repeats: int = 5, progress: Progress | None = None) -> dict:
    """Measure and return a hardware profile (see the module docstring)."""
    if size_mib < 1 or matmul_n < 16 or repeats < 1:
        raise ValueError("size_mib >= 1, matmul_n >= 16 and repeats >= 1 are required")
    progress = progress or (lambda *a: None)
    use_gpu = device == "cuda" or (device == "auto" and _gpu_available())
    if device == "cuda" and not _gpu_available():
        raise ValueError("--device cuda needs torch with a CUDA GPU; use --device cpu")
    size = size_mib << 20
    if use_gpu:
        name, count, bw, flops = gpu_measure(size, matmul_n, repeats, progress)
        method = {"device": "cuda", "copy": "torch bf16 device-to-device copy_",
                  "matmul": f"torch {matmul_n}x{matmul_n} bf16/fp16/fp32 matmul"}
    else:
        name, count = f"{_cpu_name()} ({_cpu_count()} cores)", 1
        bw = cpu_bandwidth(size, repeats, progress)
        method = {"device": "cpu", "copy": "numpy copyto, one thread"}
        if _torch_importable():
            flops = torch_matmuls(matmul_n, repeats, progress, cuda=False)
            method["matmul"] = (f"torch {matmul_n}x{matmul_n} bf16/fp16/fp32 matmul on the "
                                "CPU (torch threads)")
            slow = cpu_half_floor(flops)
            if slow:
                method["half_precision"] = (
                    "torch's " + ", ".join(f"{k} {v / 1e9:.3g}" for k, v in slow.items())
                    + " GFLOP/s, below its fp32: this CPU has no faster 16-bit units, so "
                    "a 16-bit model is computed on the fp32 units (as vLLM's CPU kernels "
                    "do, converting), and the fp32 figure is its ceiling too")
        else:
            flops = {"fp32": cpu_matmul(matmul_n, repeats, progress)}
            method["matmul"] = (f"numpy {matmul_n}x{matmul_n} fp32 matmul (BLAS threads); "
                                "no torch here, so no bf16/fp16 ceiling: run calibrate "
                                "where torch is importable (the engine's image)")
    try:
        part = catalog.hardware(name).name
    except ValueError:
        part = None
    memory = _device_memory_gb(use_gpu)
    return {"format": PROFILE_FORMAT, "part": part, "device": name, "devices": 1,
            **({"memory_gb": memory} if memory else {}),
            "visible_devices": count,
            "measured": {"bandwidth_gbps": bw / 1e9,
                         "flops_tflops": {k: v / 1e12 for k, v in flops.items()}},
            "method": method | {"buffer_mib": size_mib, "repeats": repeats, "best_of": True},
            "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "host": platform.node()}


def _device_memory_gb(gpu: bool) -> float | None:
    """The accelerator's memory in GB (a GPU's, else this machine's RAM), for the
    records-only estimate of how full the KV cache is; None when unknown."""
    try:
        if gpu:
            import torch

            return torch.cuda.get_device_properties(0).total_memory / 1e9
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ImportError, ValueError, OSError, AttributeError):
        return None


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


def report(profile: dict) -> str:
    """The measurement beside the catalog's datasheet figures when the part is known."""
    m = profile["measured"]
    lines = [f"device: {profile['device']}"]
    spec = catalog.hardware(profile["part"]) if profile["part"] else None
    bw_sheet = f"{spec.bandwidth / 1e9:,.0f} GB/s datasheet" if spec else "no datasheet figure"
    share = f" ({m['bandwidth_gbps'] * 1e9 / spec.bandwidth:.0%})" if spec else ""
    lines.append(f"memory bandwidth  {m['bandwidth_gbps']:>12,.1f} GB/s    {bw_sheet}{share}")
    for dtype, tf in m["flops_tflops"].items():
        peak = spec.flops.get(dtype) if spec else None
        sheet = (f"{peak / 1e12:,.0f} TFLOP/s datasheet ({tf * 1e12 / peak:.0%})" if peak
                 else "no datasheet figure")
        lines.append(f"matmul {dtype:<10} {tf:>12,.3f} TFLOP/s {sheet}")
    return "\n".join(lines)


def write(profile: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile, indent=2) + "\n")


def stderr_progress(what: str, done: int, total: int, best: float) -> None:
    unit, scale = ("GB/s", 1e9) if what == "bandwidth" else ("TFLOP/s", 1e12)
    bar = "#" * done + "." * (total - done)
    sys.stderr.write(f"\r{what:<12} [{bar}] {done}/{total}  best {best / scale:,.3f} {unit}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()
