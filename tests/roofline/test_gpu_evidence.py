"""The estimate beside the GPU's own counters (roofline/gpu_evidence.py), with the
figures issue 39 read on an H100 behind transformers serve."""

from __future__ import annotations

import pytest

from phasewatch.roofline.gpu_counters import (
    CounterHistory,
    GpuCounters,
    GpuIdentity,
    GpuSample,
)
from phasewatch.roofline.gpu_evidence import IDLE, OVERSTATED, compare

H100_BW, H100_BF16 = 3.35e12, 989e12
GPU0 = GpuIdentity(index="0", uuid="GPU-0")


def counters(dram, tensor, start=100.0, n=30, source="dcgm"):
    h = CounterHistory()
    for k in range(n):
        h.add(GpuSample(at=start + k, source=source, gpus=(
            GpuCounters(GPU0, dram_active=dram, tensor_active=tensor, sm_active=0.05),)))
    return h.window(start, start + n)


def test_an_idle_gpu_under_a_busy_engine_is_named_with_its_counters():
    # issue 39: 8 streams, decode MBU 3.0 % estimated, DRAM active 4.2 %, tensor 0.3 %
    range_s = 30.0
    c = compare(counters(0.042, 0.003), prefill_bytes=0.0,
                decode_bytes=0.030 * H100_BW * range_s, prefill_flops=0.0,
                decode_flops=0.002 * H100_BF16 * range_s, range_seconds=range_s,
                peak_bandwidth=H100_BW, peak_flops=H100_BF16, engine_busy=1.0)
    assert c.dram_estimated == pytest.approx(0.030)
    assert c.dram_ratio == pytest.approx(0.030 / 0.042)  # the minimum: below the counter
    assert c.overstated() == [] and c.overstated_sentence("m", "bf16", 1) == ""
    assert c.idle()
    assert c.activity_sentence() == ("the GPU's tensor pipes were active 0.3% of the range "
                                     "and its DRAM 4.2% (dcgm, 1 GPU, 30 samples)")


def test_an_estimate_above_the_counters_blames_the_configuration_with_the_numbers():
    # an 8B model configured, a ~100M one served: the estimate moves 20x what the GPU did
    c = compare(counters(0.05, 0.02), prefill_bytes=0.2 * H100_BW * 30, decode_bytes=0.8 *
                H100_BW * 30, prefill_flops=0.0, decode_flops=0.01 * H100_BF16 * 30,
                range_seconds=30.0, peak_bandwidth=H100_BW, peak_flops=H100_BF16,
                engine_busy=1.0)
    assert c.overstated() == ["dram"]  # tensor 0.01 / 0.02 is below
    text = c.overstated_sentence("Llama-3.1-8B", "bf16", 1)
    assert "DRAM traffic 100.0% of the peak against the GPU's 5.0% (20.00x)" in text
    assert "model (Llama-3.1-8B), dtype (bf16) or GPU count (1) is wrong" in text
    # the counters themselves say idle: what the GPU did is read from them, not from
    # the wrong model's estimate
    assert c.idle()


def test_the_threshold_and_the_idle_rule_are_their_own_data():
    assert OVERSTATED == 1.1
    edge = compare(counters(0.1, 0.5), 0.0, 1.101 * 0.1 * H100_BW, 0.0, 0.0, 1.0,
                   H100_BW, H100_BF16, 1.0)
    assert edge.overstated() == ["dram"]
    below = compare(counters(0.1, 0.5), 0.0, 1.09 * 0.1 * H100_BW, 0.0, 0.0, 1.0,
                    H100_BW, H100_BF16, 1.0)
    assert below.overstated() == []
    # busy engine, tensor idle but DRAM at the rule's edge: not idle
    assert not compare(counters(IDLE.dram_active, 0.0), 0, 0, 0, 0, 1.0, H100_BW, H100_BF16,
                       1.0).idle()
    # idle GPU, idle engine: nothing to say about the GPU holding it up
    assert not compare(counters(0.0, 0.0), 0, 0, 0, 0, 1.0, H100_BW, H100_BF16, 0.2).idle()


def test_a_missing_counter_is_no_evidence():
    h = CounterHistory()
    h.add(GpuSample(at=1.0, source="nvml", gpus=(GpuCounters(GPU0, dram_active=0.01),)))
    c = compare(h.window(0, 2), 0, 0, 0, 0, 2.0, H100_BW, H100_BF16, 1.0)
    assert c.tensor_measured is None and c.tensor_ratio is None
    assert not c.idle()  # DRAM low, tensor unknown
    assert c.activity_sentence() == "the GPU's DRAM 1.0% (nvml, 1 GPU, 1 samples)"


def test_no_counters_or_no_range_is_no_comparison():
    assert compare(None, 1, 1, 1, 1, 30.0, H100_BW, H100_BF16, 1.0) is None
    assert compare(counters(0.1, 0.1), 1, 1, 1, 1, 0.0, H100_BW, H100_BF16, 1.0) is None
    c = compare(counters(0.1, 0.0), 1, 1, 1, 1, 1.0, 0.0, 0.0, 1.0)  # no ceilings known
    assert c.dram_estimated is None and c.tensor_ratio is None and c.overstated() == []


def test_readings_that_cover_under_half_the_range_are_no_comparison():
    """NVML's readings say what they cover: where phasewatch started 20 s into a 30 s
    range they speak for a third of it, the estimate for all of it."""
    h = CounterHistory()
    for k in range(10):
        h.add(GpuSample(at=121.0 + k, since=120.0 + k, source="nvml", gpus=(
            GpuCounters(GPU0, dram_active=0.05, tensor_active=0.01),)))
    late = h.window(100.0, 130.0)
    assert late.coverage() == pytest.approx(10 / 30)
    assert compare(late, 1, 1, 1, 1, 30.0, H100_BW, H100_BF16, 1.0) is None
    whole = h.window(118.0, 131.0)  # 13 s, 10 of them covered
    assert compare(whole, 1, 1, 1, 1, 13.0, H100_BW, H100_BF16, 1.0) is not None
