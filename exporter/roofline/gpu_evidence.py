"""The estimate beside the GPU's own counters over the same range (issue 39).

The estimate counts the least each phase must move and compute (the weights once per
step, the KV cache each step reads, the matmuls' FLOPs); the GPU counts all of it. Over
the estimate's range:

* estimated DRAM share = (prefill + decode bytes) / (range x the datasheet bandwidth),
  beside ``dram_active`` (the share of cycles the DRAM interface was busy: a streaming
  copy at 89 % of an H200's datasheet bandwidth read 0.888, so busy cycles track bytes
  at the datasheet's rate);
* estimated tensor share = (prefill + decode FLOPs) / (range x the datasheet dense peak
  of the compute dtype), beside ``tensor_active`` (the share of cycles any tensor pipe
  was busy: at or above the share of peak FLOPs done, never below).

The estimate is the minimum, so it sits at or below the counter: at ``OVERSTATED`` times
the counter or more, the configured model, dtype or GPU count is wrong, and the
comparison says so with the numbers. An engine with work (requests in prefill or decode
most of the range) whose GPU's tensor pipes and DRAM were nearly idle (``IDLE``) is
held up by something other than the GPU: its own overhead (the host, the scheduler,
Python, small batches) or a wait outside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from phasewatch.roofline.gpu_counters import GpuWindow

# the estimate over the counter at which the configured model, dtype or GPU count is
# wrong: the estimate is the minimum traffic, so 1.0 is its most; 10 % for the counters'
# own sampling (DCGM's and NVML's are means over their sample period, not the range)
OVERSTATED = 1.1
# the share of the range the counters' readings must cover (where they say what they
# cover: NVML GPM's) for a comparison: under it (phasewatch started inside the range)
# the readings speak for part of the range and the estimate for all of it
MIN_COVERAGE = 0.5


@dataclass(frozen=True)
class Idle:
    """What "the GPU was idle while the engine had work" takes: the engine busy (a
    request in prefill or decode) this share of the range at least, and the GPU's tensor
    pipes and DRAM both under these shares. A decode step at the bandwidth roofline keeps
    DRAM active above ~0.6 (a copy reads 0.89 on an H200), a prefill at the compute
    roofline the tensor pipes above ~0.8 (a bf16 GEMM read 0.94): an engine at a tenth
    of both is not held up by the GPU. The H100 run of issue 39 read tensor 0.003, DRAM
    0.042 for an engine busy the whole range."""

    engine_busy: float = 0.5
    tensor_active: float = 0.1
    dram_active: float = 0.1


IDLE = Idle()


@dataclass(frozen=True)
class GpuComparison:
    """The estimate and the counters over one range, for one model's GPUs."""

    counters: GpuWindow
    dram_estimated: float | None  # share of the datasheet bandwidth the estimate moved
    tensor_estimated: float | None  # share of the dense peak the estimate computed
    engine_busy: float | None  # share of the range a request was in prefill or decode

    @property
    def dram_measured(self) -> float | None:
        return self.counters.mean.dram_active

    @property
    def tensor_measured(self) -> float | None:
        return self.counters.mean.tensor_active

    @staticmethod
    def _ratio(estimated: float | None, measured: float | None) -> float | None:
        if estimated is None or not measured:
            return None
        return estimated / measured

    @property
    def dram_ratio(self) -> float | None:
        """Estimated over measured DRAM share (≤ 1 when the configuration is right)."""
        return self._ratio(self.dram_estimated, self.dram_measured)

    @property
    def tensor_ratio(self) -> float | None:
        return self._ratio(self.tensor_estimated, self.tensor_measured)

    def overstated(self) -> list[str]:
        """The counters the estimate exceeds by ``OVERSTATED`` or more: "dram", "tensor"."""
        return [name for name, r in (("dram", self.dram_ratio),
                                     ("tensor", self.tensor_ratio))
                if r is not None and r >= OVERSTATED]

    def idle(self, rule: Idle = IDLE) -> bool:
        """The engine had work and the GPU's tensor pipes and DRAM were nearly idle (both
        counters read; a missing one is no evidence of idleness)."""
        t, d = self.tensor_measured, self.dram_measured
        return (self.engine_busy is not None and self.engine_busy >= rule.engine_busy
                and t is not None and d is not None
                and t < rule.tensor_active and d < rule.dram_active)

    def activity_sentence(self) -> str:
        """The counters in words: "the GPU's tensor pipes were active 0.3 % of the range
        and its DRAM 4.2 % (dcgm, 2 GPUs, 30 samples)"."""
        parts = []
        if self.tensor_measured is not None:
            parts.append(f"tensor pipes were active {self.tensor_measured:.1%} of the range")
        if self.dram_measured is not None:
            parts.append(f"DRAM {self.dram_measured:.1%}")
        if not parts:
            return ""
        w = self.counters
        gpus = f"{len(w.gpus)} GPU{'s' if len(w.gpus) != 1 else ''}"
        return (f"the GPU's {' and its '.join(parts)} ({w.source}, {gpus}, "
                f"{w.samples} samples)")

    def overstated_sentence(self, model: str, dtype: str, gpus: int) -> str:
        """Why an estimate above the counters means a wrong configuration, with the
        numbers; "" when it is not above them."""
        over = self.overstated()
        if not over:
            return ""
        figures = []
        for name in over:
            est, meas = ((self.dram_estimated, self.dram_measured) if name == "dram"
                         else (self.tensor_estimated, self.tensor_measured))
            label = "DRAM traffic" if name == "dram" else "tensor work"
            figures.append(f"{label} {est:.1%} of the peak against the GPU's {meas:.1%} "
                           f"({est / meas:.2f}x)")
        return (f"the estimate exceeds what the GPU itself counted: {'; '.join(figures)}. "
                f"The estimate is the least the work can take, so the configured model "
                f"({model}), dtype ({dtype}) or GPU count ({gpus}) is wrong")


def compare(counters: GpuWindow | None, prefill_bytes: float, decode_bytes: float,
            prefill_flops: float, decode_flops: float, range_seconds: float,
            peak_bandwidth: float, peak_flops: float,
            engine_busy: float | None) -> GpuComparison | None:
    """The estimate's traffic and work over ``range_seconds`` as shares of the datasheet
    ceilings (``peak_bandwidth`` bytes/s and ``peak_flops`` FLOP/s, every GPU of the
    deployment together), beside ``counters``; None without counters or a range, or
    with readings that cover less than ``MIN_COVERAGE`` of it."""
    if counters is None or range_seconds <= 0:
        return None
    coverage = counters.coverage()
    if coverage is not None and coverage < MIN_COVERAGE:
        return None
    moved, done = prefill_bytes + decode_bytes, prefill_flops + decode_flops
    return GpuComparison(
        counters=counters,
        dram_estimated=moved / (range_seconds * peak_bandwidth) if peak_bandwidth > 0 else None,
        tensor_estimated=done / (range_seconds * peak_flops) if peak_flops > 0 else None,
        engine_busy=engine_busy)
