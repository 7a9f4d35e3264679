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
single-threaded. Each dtype's matmuls stay within about ``matmul_seconds``
(``measure.measure_matmul``: a smaller matrix or fewer runs for a slow one, said in the
profile's ``method.matmul_runs``), and on a CPU a 16-bit dtype far below fp32 stops at its
first size. The result is a hardware profile (JSON) that ``phasewatch serve
--hardware-profile`` and ``phasewatch roofline --hardware-profile`` load.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from phasewatch.roofline import catalog
from phasewatch.roofline.deployments import PROFILE_FORMAT
from phasewatch.roofline.measure import (
    MATMUL_SECONDS,
    MatmulRun,
    Progress,
    Silent,
    best_of,
    gflops,
    measure_matmul,
    measured_line,
    stderr_progress,  # noqa: F401 (the command's progress: calibrate.stderr_progress)
)

# On a CPU, a 16-bit dtype whose probe runs below this share of fp32's rate at the same
# size has no 16-bit units behind it (AVX2: bf16 and fp16 1.4 GFLOP/s at 256x256 against
# fp32's 66): it is not measured larger, since its ceiling is fp32's anyway
# (``_cpu_half_floor``). On a machine busy with other work torch's fp32 threads wait on
# each other and fp32 fell to 1-2 GFLOP/s at that size: the probe then decides nothing
# and the time bound does (24 s instead of 7 here).
FAR_BELOW_FP32 = 0.25


def cpu_bandwidth(size_bytes: int, repeats: int, progress: Progress) -> float:
    src = np.ones(size_bytes // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch every page before timing

    def once() -> float:
        t = time.perf_counter()
        np.copyto(dst, src)
        return 2 * src.nbytes / (time.perf_counter() - t)

    return best_of("bandwidth", repeats, once, progress)


def _cpu_timer(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cpu_matmul(n: int, repeats: int, progress: Progress,
               seconds: float = MATMUL_SECONDS) -> MatmulRun:
    """fp32 with numpy (its BLAS threads), where torch is not importable."""
    rng = np.random.default_rng(0)

    def product(k: int):
        a = rng.standard_normal((k, k), dtype=np.float32)
        b = rng.standard_normal((k, k), dtype=np.float32)
        return lambda: a @ b

    run = measure_matmul("matmul fp32", n, repeats, seconds, product, _cpu_timer, progress)
    progress.say(measured_line("matmul fp32", run.runs, repeats, run.flops, run.seconds, run))
    return run


TORCH_DTYPES = ("bf16", "fp16", "fp32")


def _cuda_timer(torch):
    def timed(fn) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    return timed


def _far_below(fp32: MatmulRun):
    """On a CPU: a reason to stop a 16-bit dtype at its probe, from fp32's rate at the
    same size ("" when it is not far below; see FAR_BELOW_FP32)."""
    def probe_stop(n: int, rate: float) -> str:
        ref = fp32.rates.get(n)
        if not ref or rate >= FAR_BELOW_FP32 * ref:
            return ""
        return (f"probed at {n}x{n} only: {gflops(rate)} against fp32's {gflops(ref)} "
                "there, so no faster 16-bit units; its ceiling is fp32's (half_precision)")
    return probe_stop


def torch_matmuls(n: int, repeats: int, progress: Progress, cuda: bool,
                  seconds: float = MATMUL_SECONDS) -> dict[str, MatmulRun]:
    """{dtype: MatmulRun} of torch matmuls up to ``n x n`` in bf16, fp16 and fp32, on the
    first CUDA device or on the CPU (torch's own threads, oneDNN/AMX where the CPU has it;
    fp32 first there, and a 16-bit dtype far below it stops at its probe)."""
    import torch

    dev = torch.device("cuda:0" if cuda else "cpu")
    timed = _cuda_timer(torch) if cuda else _cpu_timer
    runs: dict[str, MatmulRun] = {}
    for name in TORCH_DTYPES if cuda else ("fp32", "bf16", "fp16"):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]

        def product(k: int, dtype=dtype):
            a = torch.randn(k, k, dtype=dtype, device=dev)
            b = torch.randn(k, k, dtype=dtype, device=dev)
            return lambda: a @ b

        stop = None if cuda or name == "fp32" else _far_below(runs["fp32"])
        runs[name] = measure_matmul(f"matmul {name}", n, repeats, seconds, product, timed,
                                    progress, stop)
        r = runs[name]
        progress.say(measured_line(f"matmul {name}", r.runs, repeats, r.flops, r.seconds, r))
    return {k: runs[k] for k in TORCH_DTYPES}


def _cpu_half_floor(flops: dict[str, float]) -> dict[str, float]:
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


def _half_precision_note(slow: dict[str, float], runs: dict[str, MatmulRun]) -> str:
    """The profile's word on 16-bit figures ``_cpu_half_floor`` raised: what was measured."""
    return ("torch's " + ", ".join(f"{k} {gflops(v)} ({runs[k].n}x{runs[k].n})"
                                   for k, v in slow.items())
            + f", below its fp32 ({gflops(runs['fp32'].flops)}): this CPU has no faster "
            "16-bit units, so a 16-bit model is computed on the fp32 units (as vLLM's CPU "
            "kernels do, converting), and the fp32 figure is its ceiling too")


def gpu_measure(size_bytes: int, n: int, repeats: int, progress: Progress,
                seconds: float = MATMUL_SECONDS):
    """(device name, device count, bandwidth, {dtype: MatmulRun}) with torch on the first
    CUDA device."""
    import torch

    dev = torch.device("cuda:0")
    src = torch.empty(size_bytes // 2, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    timed = _cuda_timer(torch)
    dst.copy_(src)  # warm up
    t0 = time.perf_counter()
    bw = best_of("bandwidth", repeats, lambda: 2 * src.numel() * 2 / timed(
        lambda: dst.copy_(src)), progress)
    progress.say(measured_line("bandwidth", repeats, repeats, bw, time.perf_counter() - t0))
    runs = torch_matmuls(n, repeats, progress, cuda=True, seconds=seconds)
    return torch.cuda.get_device_name(0), torch.cuda.device_count(), bw, runs


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
              repeats: int = 5, progress: Progress | None = None,
              matmul_seconds: float = MATMUL_SECONDS) -> Profile:
    """Measure and return a hardware profile (see the module docstring); each dtype's
    matmuls within about ``matmul_seconds`` (``measure_matmul``)."""
    if size_mib < 1 or matmul_n < 16 or repeats < 1 or not matmul_seconds > 0:
        raise ValueError("size_mib >= 1, matmul_n >= 16, repeats >= 1 and matmul_seconds > 0 "
                         "are required")
    progress = progress or Silent()
    use_gpu = device == "cuda" or (device == "auto" and _gpu_available())
    if device == "cuda" and not _gpu_available():
        raise ValueError("--device cuda needs torch with a CUDA GPU; use --device cpu")
    size, t0 = size_mib << 20, time.perf_counter()
    torch = use_gpu or _torch_importable()
    dtypes = ("bf16, fp16 and fp32" if use_gpu else "fp32, bf16 and fp16" if torch
              else "fp32 (numpy: no torch here)")
    progress.say(plan_line("the GPU" if use_gpu else "the CPU", size_mib, matmul_n, repeats,
                           matmul_seconds, dtypes))
    if use_gpu:
        name, count, bw, runs = gpu_measure(size, matmul_n, repeats, progress, matmul_seconds)
        method = {"device": "cuda", "copy": "torch bf16 device-to-device copy_",
                  "matmul": f"torch bf16/fp16/fp32 matmul up to {matmul_n}x{matmul_n}"}
    else:
        name, count = f"{_cpu_name()} ({_cpu_count()} cores)", 1
        bw = cpu_bandwidth(size, repeats, progress)
        progress.say(measured_line("bandwidth", repeats, repeats, bw, time.perf_counter() - t0))
        method = {"device": "cpu", "copy": "numpy copyto, one thread"}
        if torch:
            runs = torch_matmuls(matmul_n, repeats, progress, False, matmul_seconds)
            method["matmul"] = (f"torch bf16/fp16/fp32 matmul up to {matmul_n}x{matmul_n} on "
                                "the CPU (torch threads)")
        else:
            runs = {"fp32": cpu_matmul(matmul_n, repeats, progress, matmul_seconds)}
            method["matmul"] = (f"numpy fp32 matmul up to {matmul_n}x{matmul_n} (BLAS "
                                "threads); no torch here, so no bf16/fp16 ceiling: run "
                                "calibrate where torch is importable (the engine's image)")
    flops = {k: r.flops for k, r in runs.items()}
    if not use_gpu and (slow := _cpu_half_floor(flops)):
        method["half_precision"] = _half_precision_note(slow, runs)
    method |= {"matmul_seconds": matmul_seconds,
               "matmul_runs": {k: r.as_dict() for k, r in runs.items()}}
    try:
        part = catalog.hardware(name).name
    except ValueError:
        part = None
    memory = _device_memory_gb(use_gpu)
    progress.say(f"calibrate: done in {time.perf_counter() - t0:.1f} s")
    return Profile(name, part, bw / 1e9, {k: v / 1e12 for k, v in flops.items()},
                   visible_devices=count, memory_gb=memory or None,
                   method=method | {"buffer_mib": size_mib, "repeats": repeats, "best_of": True},
                   measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
                   host=platform.node())


@dataclass(frozen=True)
class Profile:
    """A hardware profile as ``calibrate`` measures it; ``as_json`` is the file
    ``--hardware-profile`` reads (``deployments.load_profile``), key for key."""

    device: str  # the GPU's name, or the CPU's with its cores
    part: str | None  # the catalog's part, where the device is one
    bandwidth_gbps: float
    flops_tflops: dict[str, float]  # by dtype
    visible_devices: int = 1
    memory_gb: float | None = None
    # how it was measured (the copy, the matmuls, each dtype's runs): the file's own words
    method: dict = field(default_factory=dict)
    measured_at: str = ""
    host: str = ""

    @property
    def matmul_runs(self) -> dict[str, dict]:
        """Each dtype's matmul runs as the file has them (``MatmulRun.as_dict``)."""
        return self.method.get("matmul_runs", {})

    def as_json(self) -> dict:
        return {"format": PROFILE_FORMAT, "part": self.part, "device": self.device,
                "devices": 1, **({"memory_gb": self.memory_gb} if self.memory_gb else {}),
                "visible_devices": self.visible_devices,
                "measured": {"bandwidth_gbps": self.bandwidth_gbps,
                             "flops_tflops": self.flops_tflops},
                "method": self.method, "measured_at": self.measured_at, "host": self.host}


def plan_line(where: str, size_mib: int, n: int, repeats: int, seconds: float,
              dtypes: str) -> str:
    """What calibrate is about to measure, and the bound on it, before it starts."""
    return (f"calibrate on {where}: memory bandwidth (a {size_mib} MiB copy, best of "
            f"{repeats}), then {dtypes} matmuls up to {n}x{n}, best of {repeats}, each "
            f"dtype within about {seconds:g} s (--matmul-seconds)")


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


def report(profile: Profile) -> str:
    """The measurement beside the catalog's datasheet figures when the part is known, and
    each dtype measured smaller or fewer times than asked, with why."""
    bw = profile.bandwidth_gbps
    lines = [f"device: {profile.device}"]
    spec = catalog.hardware(profile.part) if profile.part else None
    bw_sheet = f"{spec.bandwidth / 1e9:,.0f} GB/s datasheet" if spec else "no datasheet figure"
    share = f" ({bw * 1e9 / spec.bandwidth:.0%})" if spec else ""
    lines.append(f"memory bandwidth  {bw:>12,.1f} GB/s    {bw_sheet}{share}")
    for dtype, tf in profile.flops_tflops.items():
        peak = spec.flops.get(dtype) if spec else None
        sheet = (f"{peak / 1e12:,.0f} TFLOP/s datasheet ({tf * 1e12 / peak:.0%})" if peak
                 else "no datasheet figure")
        lines.append(f"matmul {dtype:<10} {tf:>12,.3f} TFLOP/s {sheet}")
    lines += [f"  {k}: {r['bounded']}" for k, r in profile.matmul_runs.items()
              if r.get("bounded")]
    return "\n".join(lines)


def write(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.as_json(), indent=2) + "\n")
