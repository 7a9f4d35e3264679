"""What ``make gpu-check`` holds a run to, from what it read: the roofline entry of each
phase (``/api/v1/roofline``, with phasewatch's own GPU counters: serve ``--gpu-nvml``)
and ``phasewatch calibrate``'s profile beside the part's datasheet. Pure functions of
those documents, so they are tested without a GPU (``tests/roofline/
test_gpu_findings.py``, on pages phasewatch itself wrote) and run there by
``gpu_tap_check.py``.

A run fails when:

* the estimate exceeds what the GPU counted (``dram_ratio`` or ``tensor_ratio`` at
  ``OVERSTATED`` or more): the estimate is the least the work moves, so its own model of
  the run is wrong;
* a utilization exceeds 1: decode MBU or MFU, prefill MFU (over the datasheet), a counter
  (a share of cycles), or calibrate's bandwidth or FLOP/s above the datasheet's by more
  than ``DATASHEET_SLACK``;
* on a GPU, phasewatch read no GPU counters in any phase (the reader is what is checked).
"""

from __future__ import annotations

import math

OVERSTATED = 1.1  # phasewatch.roofline.gpu_evidence.OVERSTATED
DATASHEET_SLACK = 1.05  # boost clocks: a copy or a GEMM a few percent over the datasheet


def gpu_block(entry: dict | None) -> dict | None:
    """A phase's GPU figures from its roofline entry: the counters beside the estimate and
    what the verdict made of them; None without counters."""
    g = (entry or {}).get("gpu")
    if not g:
        return None
    counters = g.get("counters") or {}
    return {"outcome": g.get("outcome"), "source": counters.get("source"),
            "gpus": counters.get("gpus"), "samples": counters.get("samples"),
            "dram_estimated": g.get("dram_estimated"), "dram_measured": g.get("dram_measured"),
            "dram_ratio": g.get("dram_ratio"), "tensor_estimated": g.get("tensor_estimated"),
            "tensor_measured": g.get("tensor_measured"), "tensor_ratio": g.get("tensor_ratio"),
            "sm_active": counters.get("sm_active"), "engine_busy": g.get("engine_busy")}


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def gpu_line(block: dict | None) -> str:
    """One line for the report: estimated beside measured, their ratio, the finding."""
    if block is None:
        return "GPU counters (phasewatch): none read"
    ratio = block["dram_ratio"]
    return (f"GPU counters (phasewatch, {block['source']}, {len(block['gpus'] or ())} GPU, "
            f"{block['samples']} samples): DRAM estimated {_pct(block['dram_estimated'])} / "
            f"measured {_pct(block['dram_measured'])}"
            + (f" (x{ratio:.2f})" if ratio is not None else "")
            + f"; tensor estimated {_pct(block['tensor_estimated'])} / measured "
            f"{_pct(block['tensor_measured'])}; SM {_pct(block['sm_active'])}; "
            f"finding {block['outcome']}")


def calibrate_line(c: dict | None) -> str:
    """calibrate against the datasheet in one line."""
    if not c:
        return "calibrate: not run"
    flops = ", ".join(f"{k} {v / 1e12:.0f} TFLOP/s" for k, v in c["flops"].items())
    over = ", ".join(f"{k} {v:.0%} of the datasheet" for k, v in c["over_datasheet"].items())
    bw = f"{c['bandwidth'] / 1e9:,.0f} GB/s" if c["bandwidth"] else "no bandwidth"
    return (f"calibrate on {c.get('device')} ({c.get('hardware') or c.get('part')}): {bw}; "
            f"{flops}" + (f"; {over}" if over else ""))


def failures(phases: list[dict], on_gpu: bool, calibrated: dict | None = None) -> list[str]:
    """Why the run fails, one line each ([] when it passes). ``phases``: each with
    ``streams``, ``mode`` and ``roofline`` (the figures ``gpu_tap_check`` keeps) and
    ``gpu_check`` (``gpu_block``); ``calibrated``: ``calibrate_vs_datasheet``'s."""
    out = []
    read = False
    for p in phases:
        name = f"{p.get('mode', '')} {p['streams']} streams".strip()
        r = p.get("roofline") or {}
        for key in ("decode_mbu", "decode_mfu", "prefill_mfu"):
            v = r.get(key)
            if v is not None and v > 1:
                out.append(f"{name}: {key} {v:.3f} exceeds 1")
        g = p.get("gpu_check")
        if g is None:
            continue
        read = True
        for counter in ("dram", "tensor"):
            ratio = g.get(f"{counter}_ratio")
            if ratio is not None and ratio >= OVERSTATED:
                out.append(f"{name}: the estimate's {counter} share "
                           f"{_pct(g[f'{counter}_estimated'])} exceeds the GPU's "
                           f"{_pct(g[f'{counter}_measured'])} (x{ratio:.2f})")
        for key in ("dram_measured", "tensor_measured", "sm_active"):
            v = g.get(key)
            if v is not None and v > 1:
                out.append(f"{name}: counter {key} {v:.3f} exceeds 1")
    if on_gpu and phases and not read:
        out.append("phasewatch read no GPU counters in any phase (serve --gpu-nvml): see "
                   "phasewatch_gpu_counter_reads_total in metrics-*.txt")
    for what, ratio in (calibrated or {}).get("over_datasheet", {}).items():
        if ratio is not None and ratio > DATASHEET_SLACK:
            out.append(f"calibrate: {what} {ratio:.2f}x the datasheet")
    return out


def calibrate_vs_datasheet(profile: dict, deployment: dict | None) -> dict:
    """``phasewatch calibrate``'s profile beside the datasheet peaks phasewatch serve's
    ``--hardware auto`` found for the part (a roofline entry's ``deployment``): each
    measured figure over its datasheet one."""
    measured = profile.get("measured") or {}
    out = {"part": profile.get("part"), "device": profile.get("device"),
           "bandwidth": (measured.get("bandwidth_gbps") or 0) * 1e9 or None,
           "flops": {k: v * 1e12 for k, v in (measured.get("flops_tflops") or {}).items()},
           "over_datasheet": {}}
    if not deployment:
        return out
    peak_bw = deployment.get("peak_bandwidth_bytes_per_second")
    if out["bandwidth"] and peak_bw:
        out["over_datasheet"]["bandwidth"] = out["bandwidth"] / peak_bw
    dtype = deployment.get("compute_dtype") or "bf16"
    done = out["flops"].get(dtype)
    peak = deployment.get("peak_flops_per_second")
    if done and peak and math.isfinite(peak):
        out["over_datasheet"][f"{dtype} FLOP/s"] = done / peak
    out["hardware"] = deployment.get("hardware")
    return out
