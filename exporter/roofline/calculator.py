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
    dec = _Step(float(model_costs.weight_bytes_read(m, batch)) + kvpt * context * batch,
                batch * float(model_costs.decode_flops(m, context)), bw, peak)
    pre = _Step(float(model_costs.weight_bytes_read(m, prompt)) + kvpt * prompt,
                float(model_costs.prefill_flops(m, prompt)), bw, peak)
    rows = [*_sizes(m, hw, kvpt, bw, peak, compute_dtype, context, batch),
            *_decode(dec, batch), *_prefill(pre, prompt),
            Row("ridge point", peak / bw if peak else math.inf, "FLOPs/B",
                "intensity above it: compute-bound; below: bandwidth-bound")]
    if hw.measured_bandwidth:
        rows.append(Row("decode ceiling per sequence (measured bandwidth)",
                        1.0 / max(dec.bytes / hw.measured_bandwidth, dec.flops_time), "tok/s",
                        f"{hw.measured_bandwidth / 1e9:,.0f} GB/s achievable"))
    if tpot is not None:
        achieved = dec.bytes / tpot
        rows += [Row("achieved bandwidth at measured TPOT", achieved / 1e9, "GB/s",
                     f"TPOT {tpot * 1e3:g} ms"),
                 Row("MBU", achieved / bw, "", "of the datasheet bandwidth"),
                 Row("MFU (decode)", dec.flops / tpot / peak if peak else math.nan, "", "")]
    if ttft is not None:
        rows += [Row("achieved prefill FLOP/s at measured TTFT", pre.flops / ttft / 1e12,
                     "TFLOP/s", f"TTFT {ttft * 1e3:g} ms, queue time taken as 0"),
                 Row("MFU (prefill)", pre.flops / ttft / peak if peak else math.nan, "", "")]
    return rows


@dataclass(frozen=True)
class _Step:
    """A step's bytes and FLOPs, and the time each takes at the ceilings (no FLOP/s
    ceiling: 0)."""

    bytes: float
    flops: float
    bandwidth: float
    peak: float

    @property
    def bandwidth_time(self) -> float:
        return self.bytes / self.bandwidth

    @property
    def flops_time(self) -> float:
        return self.flops / self.peak if self.peak else 0.0

    @property
    def floor(self) -> float:
        return max(self.bandwidth_time, self.flops_time)


def _sizes(m: ModelSpec, hw: HardwareSpec, kvpt: float, bw: float, peak: float,
           compute_dtype: str, context: int, batch: int) -> list[Row]:
    """The model, the hardware, the weights and the KV cache."""
    weights = model_costs.weight_bytes(m)
    return [
        Row("model", m.name, "", m.note),
        Row("hardware", f"{hw.name} x{hw.gpus}", "", f"{bw / 1e9:,.0f} GB/s, "
            f"{peak / 1e12:,.0f} TFLOP/s dense {compute_dtype}" if peak else
            f"{bw / 1e9:,.0f} GB/s, no FLOP/s figure"),
        Row("weights", weights / 1e9, "GB", f"{m.params / 1e9:g}B params x "
            f"{dtype_bytes(m.weight_dtype):g} B ({m.weight_dtype}) = {weights / GIB:.2f} GiB"),
        Row("KV cache per token", kvpt, "B", "2 x layers x kv_heads x head_dim x "
            f"{dtype_bytes(m.kv_dtype):g} B ({m.kv_dtype})" if kvpt else "not counted: "
            "architecture unknown"),
        Row("KV cache at context x batch", kvpt * context * batch / GIB, "GiB",
            f"{context} tokens x {batch}")]


def _decode(step: _Step, batch: int) -> list[Row]:
    """A decode step of the whole batch at the roofline."""
    t_bw, t_fl = step.bandwidth_time, step.flops_time
    return [
        Row("decode step bytes", step.bytes / 1e9, "GB", "weights once + each sequence's KV"),
        Row("decode step FLOPs", step.flops / 1e12, "TFLOP", "batch x (2 x active params "
            "+ attention)"),
        Row("decode step time floor", step.floor * 1e3, "ms",
            f"bandwidth {t_bw * 1e3:.2f} ms, compute {t_fl * 1e3:.3f} ms"),
        Row("decode ceiling per sequence", 1.0 / step.floor, "tok/s",
            f"binds: {_binding(t_bw, t_fl)}"),
        Row("decode ceiling, whole batch", batch / step.floor, "tok/s", f"batch {batch}"),
        Row("decode arithmetic intensity", step.flops / step.bytes, "FLOPs/B", "")]


def _prefill(step: _Step, prompt: int) -> list[Row]:
    """One prompt's prefill at the roofline."""
    p_bw, p_fl = step.bandwidth_time, step.flops_time
    return [
        Row("prefill FLOPs", step.flops / 1e12, "TFLOP", f"{prompt} tokens, causal attention"),
        Row("prefill time floor", step.floor * 1e3, "ms",
            f"bandwidth {p_bw * 1e3:.2f} ms, compute {p_fl * 1e3:.2f} ms"),
        Row("prefill ceiling", prompt / step.floor, "tok/s", f"binds: {_binding(p_bw, p_fl)}"),
        Row("prefill arithmetic intensity", step.flops / step.bytes, "FLOPs/B", "")]


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
