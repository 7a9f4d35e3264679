"""``phasewatch roofline``: the offline calculator, model x hardware -> ceilings.

The same arithmetic as the live estimator (``model_costs``), for one operating
point: a decode step of ``batch`` sequences at ``context`` tokens each, and a
prefill of ``prompt`` tokens. With a measured TPOT (or tokens/s) and TTFT it also
gives the achieved bandwidth and FLOP/s and the utilizations (MBU, MFU), as in
the examples of Databricks ("LLM Inference Performance Engineering") and gpt-fast.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from phasewatch.roofline import model_costs
from phasewatch.roofline.catalog import HardwareSpec, ModelSpec, dtype_bytes

GIB = 2**30


@dataclass(frozen=True)
class Row:
    name: str
    value: float | str
    unit: str = ""
    note: str = ""


def generic_model(params: float, weight_dtype: str = "bf16") -> ModelSpec:
    """A model known only by its parameter count: weights and 2 x params FLOPs per
    token, no KV cache or attention terms (there is no architecture to count them)."""
    dtype_bytes(weight_dtype)
    return ModelSpec(name=f"{params / 1e9:g}B", layers=0, hidden=0, heads=0, kv_heads=0,
                     head_dim=0, params=params, active_params=params,
                     weight_dtype=weight_dtype, note="architecture unknown")


def parse_params(text: str) -> float:
    """'7B', '70b', '405e9', '1.5T' -> parameters."""
    t = text.strip().upper()
    scale = {"B": 1e9, "M": 1e6, "T": 1e12}.get(t[-1:], 1.0)
    try:
        value = float(t[:-1] if scale != 1.0 else t) * scale
    except ValueError:
        raise ValueError(f"--params wants a count such as 7B or 70e9, got {text!r}") from None
    if not value > 0:
        raise ValueError(f"--params must be positive, got {text!r}")
    return value


def _binding(bw_time: float, compute_time: float) -> str:
    return "memory bandwidth" if bw_time >= compute_time else "compute"


def table(m: ModelSpec, hw: HardwareSpec, *, batch: int = 1, context: int = 1024,
          prompt: int = 512, compute_dtype: str = "bf16", tpot: float | None = None,
          ttft: float | None = None) -> list[Row]:
    """The calculator's rows (see the module docstring)."""
    if batch < 1 or context < 0 or prompt < 1:
        raise ValueError("batch and prompt must be >= 1 and context >= 0")
    bw = hw.bandwidth or hw.measured_bandwidth or 0.0
    peak = hw.peak_flops(compute_dtype) or hw.measured_flops.get(compute_dtype, 0.0)
    if bw <= 0:
        raise ValueError(f"{hw.name} has no bandwidth figure")
    kvpt = model_costs.kv_bytes_per_token(m) if m.layers else 0.0
    weights = model_costs.weight_bytes(m)
    step_weights = float(model_costs.weight_bytes_read(m, batch))
    step_kv = kvpt * context * batch
    step_bytes = step_weights + step_kv
    step_flops = batch * float(model_costs.decode_flops(m, context))
    t_bw = step_bytes / bw
    t_fl = step_flops / peak if peak else 0.0
    step = max(t_bw, t_fl)
    pre_flops = float(model_costs.prefill_flops(m, prompt))
    pre_bytes = float(model_costs.weight_bytes_read(m, prompt)) + kvpt * prompt
    p_bw, p_fl = pre_bytes / bw, (pre_flops / peak if peak else 0.0)
    gpus = f"{hw.name} x{hw.gpus}"
    rows = [
        Row("model", m.name, "", m.note),
        Row("hardware", gpus, "", f"{bw / 1e9:,.0f} GB/s, {peak / 1e12:,.0f} TFLOP/s "
            f"dense {compute_dtype}" if peak else f"{bw / 1e9:,.0f} GB/s, no FLOP/s figure"),
        Row("weights", weights / 1e9, "GB", f"{m.params / 1e9:g}B params x "
            f"{dtype_bytes(m.weight_dtype):g} B ({m.weight_dtype}) = {weights / GIB:.2f} GiB"),
        Row("KV cache per token", kvpt, "B", "2 x layers x kv_heads x head_dim x "
            f"{dtype_bytes(m.kv_dtype):g} B ({m.kv_dtype})" if kvpt else "not counted: "
            "architecture unknown"),
        Row("KV cache at context x batch", kvpt * context * batch / GIB, "GiB",
            f"{context} tokens x {batch}"),
        Row("decode step bytes", step_bytes / 1e9, "GB", "weights once + each sequence's KV"),
        Row("decode step FLOPs", step_flops / 1e12, "TFLOP", "batch x (2 x active params "
            "+ attention)"),
        Row("decode step time floor", step * 1e3, "ms",
            f"bandwidth {t_bw * 1e3:.2f} ms, compute {t_fl * 1e3:.3f} ms"),
        Row("decode ceiling per sequence", 1.0 / step, "tok/s", f"binds: {_binding(t_bw, t_fl)}"),
        Row("decode ceiling, whole batch", batch / step, "tok/s", f"batch {batch}"),
        Row("decode arithmetic intensity", step_flops / step_bytes, "FLOPs/B", ""),
        Row("prefill FLOPs", pre_flops / 1e12, "TFLOP", f"{prompt} tokens, causal attention"),
        Row("prefill time floor", max(p_bw, p_fl) * 1e3, "ms",
            f"bandwidth {p_bw * 1e3:.2f} ms, compute {p_fl * 1e3:.2f} ms"),
        Row("prefill ceiling", prompt / max(p_bw, p_fl), "tok/s",
            f"binds: {_binding(p_bw, p_fl)}"),
        Row("prefill arithmetic intensity", pre_flops / pre_bytes, "FLOPs/B", ""),
        Row("ridge point", peak / bw if peak else math.inf, "FLOPs/B",
            "intensity above it: compute-bound; below: bandwidth-bound"),
    ]
    if hw.measured_bandwidth:
        rows.append(Row("decode ceiling per sequence (measured bandwidth)",
                        1.0 / max(step_bytes / hw.measured_bandwidth, t_fl), "tok/s",
                        f"{hw.measured_bandwidth / 1e9:,.0f} GB/s achievable"))
    if tpot is not None:
        achieved = step_bytes / tpot
        rows += [Row("achieved bandwidth at measured TPOT", achieved / 1e9, "GB/s",
                     f"TPOT {tpot * 1e3:g} ms"),
                 Row("MBU", achieved / bw, "", "of the datasheet bandwidth"),
                 Row("MFU (decode)", step_flops / tpot / peak if peak else math.nan, "", "")]
    if ttft is not None:
        rows += [Row("achieved prefill FLOP/s at measured TTFT", pre_flops / ttft / 1e12,
                     "TFLOP/s", f"TTFT {ttft * 1e3:g} ms, queue time taken as 0"),
                 Row("MFU (prefill)", pre_flops / ttft / peak if peak else math.nan, "", "")]
    return rows


def render(rows: list[Row]) -> str:
    width = max(len(r.name) for r in rows)
    lines = []
    for r in rows:
        if isinstance(r.value, str):
            value = r.value
        elif r.unit == "" and r.name.startswith("M"):
            value = f"{r.value:.1%}"
        elif abs(r.value) >= 100 or r.value == 0:
            value = f"{r.value:,.0f} {r.unit}"
        else:
            value = f"{r.value:,.3g} {r.unit}"
        lines.append(f"{r.name:<{width}}  {value:<22} {r.note}".rstrip())
    return "\n".join(lines)


def as_json(rows: list[Row]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=2)
