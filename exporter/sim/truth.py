"""Ground truth of a simulation over a time range, in the estimator's terms.

What the roofline estimator infers from request records, computed here from the
simulator's per-step record instead (``SimEngine.truth``):

* decode busy time = duration of steps that decoded at least one sequence;
  decode bytes = those steps' weight reads + decode KV traffic; decode FLOPs;
  mean decode batch = decode sequences per step weighted by step duration;
* prefill busy time = duration of steps that carried prefill tokens; prefill
  FLOPs; prefill bytes = those steps' weight reads + prefill KV traffic.

A step counts in proportion to its overlap with the range.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PhaseTruth:
    busy_seconds: float
    flops: float
    bytes: float

    def utilization(self, peak_flops: float, peak_bandwidth: float) -> tuple[float, float]:
        """(MFU, MBU) of this phase against the given peaks."""
        return (self.flops / self.busy_seconds / peak_flops,
                self.bytes / self.busy_seconds / peak_bandwidth)


@dataclass(frozen=True)
class RangeTruth:
    decode: PhaseTruth
    prefill: PhaseTruth
    decode_batch_size: float
    shared_step_flops: dict  # phase -> the other phase's FLOPs inside its steps


def truth_between(steps: dict[str, np.ndarray], lo: float, hi: float, epoch: float = 0.0
                  ) -> RangeTruth:
    """Truth over [lo, hi] (Unix seconds; ``epoch`` = Unix time of engine time 0)."""
    start = steps["start"] + epoch
    end = start + steps["duration"]
    overlap = np.clip(np.minimum(end, hi) - np.maximum(start, lo), 0.0, None)
    w = np.where(steps["duration"] > 0, overlap / steps["duration"], 0.0)
    dec = steps["decode_seqs"] > 0
    pre = steps["prefill_tokens"] > 0

    def phase(mask: np.ndarray, flops: str, kv: str) -> PhaseTruth:
        return PhaseTruth(busy_seconds=float(overlap[mask].sum()),
                          flops=float((steps[flops] * w)[mask].sum()),
                          bytes=float(((steps["weight_bytes"] + steps[kv]) * w)[mask].sum()))

    busy = overlap[dec].sum()
    return RangeTruth(
        decode=phase(dec, "decode_flops", "decode_kv_bytes"),
        prefill=phase(pre, "prefill_flops", "prefill_kv_bytes"),
        decode_batch_size=float((steps["decode_seqs"] * overlap)[dec].sum() / busy)
        if busy else 0.0,
        shared_step_flops={"decode": float((steps["prefill_flops"] * w)[dec].sum()),
                           "prefill": float((steps["decode_flops"] * w)[pre].sum())})
