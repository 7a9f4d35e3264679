"""Verdict rules: phase and resource, hysteresis at the boundaries, levers, text."""

from __future__ import annotations

import pytest

from phasewatch.roofline import catalog
from phasewatch.roofline.estimate import Deployment, RooflineEstimate, phase_estimate
from phasewatch.roofline.inputs import InputSource
from phasewatch.roofline.verdict import BOUND_FRACTION, HYSTERESIS, LEVERS, decide
from tests.support import ROOT

DEP = Deployment("Llama-3.1-8B", catalog.model("Llama-3.1-8B"), catalog.hardware("H100-SXM"))


def est(shares, decode_of_achievable_bw=0.8, prefill_of_achievable_flops=0.9, requests=100):
    hw = DEP.hardware
    busy = 10.0
    decode = phase_estimate(DEP, busy, 1e12, decode_of_achievable_bw * hw.achievable_bandwidth
                            * busy, requests)
    prefill = phase_estimate(DEP, busy, prefill_of_achievable_flops * hw.achievable_flops()
                             * busy, 1e12, requests)
    return RooflineEstimate("m", "e", 0.0, 30.0, 1.0, requests, prefill, decode, 8.0, 0.008,
                            dict(zip(("queue", "prefill", "decode"), shares, strict=True)),
                            {"decode_steps": InputSource("token_gaps")})


@pytest.mark.parametrize("shares,expected", [
    ((0.05, 0.05, 0.90), ("decode", "memory_bandwidth")),
    ((0.05, 0.85, 0.10), ("prefill", "compute")),
    ((0.70, 0.05, 0.25), ("queue", "capacity")),
])
def test_phase_and_resource(shares, expected):
    v = decide(est(shares), DEP)
    assert (v.phase, v.resource) == expected
    assert v.levers == LEVERS[expected]
    assert v.confidence_level == "high"


def test_far_below_both_ceilings_is_overhead():
    v = decide(est((0.0, 0.1, 0.9), decode_of_achievable_bw=0.3), DEP)
    assert (v.phase, v.resource) == ("decode", "overhead")
    assert "far below both ceilings" in v.text
    assert v.levers == ("larger batches", "CUDA graphs", "fewer tiny requests")


def test_product_levers_are_the_product_specs():
    assert LEVERS[("prefill", "compute")] == (
        "prompt (prefix) caching", "chunked prefill", "tensor parallelism", "FP8",
        "shorter prompts", "faster GPUs")
    assert LEVERS[("decode", "memory_bandwidth")] == (
        "weight quantization", "KV-cache quantization", "speculative decoding",
        "larger batches", "GQA/MQA models", "higher-bandwidth GPUs")
    assert LEVERS[("queue", "capacity")] == (
        "more replicas", "admission control", "disaggregated prefill/decode")


def test_phase_hysteresis_holds_until_the_margin_is_crossed():
    prefill = decide(est((0.0, 0.6, 0.4)), DEP)
    assert prefill.phase == "prefill"
    # decode ahead, but by less than the margin: the verdict stays
    near = decide(est((0.0, 0.5 - HYSTERESIS / 4, 0.5 + HYSTERESIS / 4)), DEP, prefill)
    assert near.phase == "prefill"
    # without a previous verdict the same reading says decode
    assert decide(est((0.0, 0.5 - HYSTERESIS / 4, 0.5 + HYSTERESIS / 4)), DEP).phase == "decode"
    far = decide(est((0.0, 0.45, 0.55)), DEP, near)
    assert far.phase == "decode"


def test_resource_hysteresis_around_the_bound():
    below = BOUND_FRACTION - HYSTERESIS / 2
    above = BOUND_FRACTION + HYSTERESIS / 2
    bound = decide(est((0.0, 0.1, 0.9), decode_of_achievable_bw=0.8), DEP)
    assert bound.resource == "memory_bandwidth"
    # dipping just under the bound does not flip a bandwidth verdict to overhead
    assert decide(est((0.0, 0.1, 0.9), below), DEP, bound).resource == "memory_bandwidth"
    overhead = decide(est((0.0, 0.1, 0.9), below), DEP)
    assert overhead.resource == "overhead"
    # and rising just over it does not flip overhead back
    assert decide(est((0.0, 0.1, 0.9), above), DEP, overhead).resource == "overhead"
    assert decide(est((0.0, 0.1, 0.9), BOUND_FRACTION + 2 * HYSTERESIS), DEP,
                  overhead).resource == "memory_bandwidth"


def test_verdict_text_carries_the_evidence():
    v = decide(est((0.02, 0.08, 0.90)), DEP)
    assert v.text.startswith("Decode takes 90% of request time and is memory-bandwidth-bound")
    assert "80% of the achievable memory bandwidth" in v.text
    assert "H100-SXM x1" in v.text
    assert v.evidence.phase_time_share["decode"] == 0.90
    assert v.evidence.utilization.mbu == pytest.approx(0.8 * 3.0e12 / 3.35e12)


def test_unconfigured_model_still_gets_a_phase():
    e = est((0.1, 0.2, 0.7))
    v = decide(e, None)
    assert (v.phase, v.resource) == ("decode", "unknown")
    assert "--model" in v.text and "--hardware" in v.text
    assert decide(est((0.8, 0.1, 0.1)), None).resource == "capacity"


def test_few_requests_and_tpot_only_lower_confidence():
    full = decide(est((0.0, 0.1, 0.9)), DEP)
    few = decide(est((0.0, 0.1, 0.9), requests=5), DEP)
    e = est((0.0, 0.1, 0.9))
    e.inputs["decode_steps"] = InputSource("tpot")
    tpot = decide(e, DEP)
    assert few.confidence < tpot.confidence < full.confidence
    assert few.confidence_level == "low"


def test_prefill_chunks_in_decode_steps_count_toward_compute():
    # Decode alone uses 45% of the bandwidth and almost no compute: overhead. With
    # prefill chunks doing 40% of the achievable FLOP/s inside the same steps, the two
    # resources explain the time, and the text says why compute is busy.
    e = est((0.0, 0.1, 0.9), decode_of_achievable_bw=0.45)
    assert decide(e, DEP).resource == "overhead"
    e.shared_step_flops = {"decode": 0.4 * DEP.hardware.achievable_flops() * 10.0}
    v = decide(e, DEP)
    assert v.resource == "memory_bandwidth"
    assert "40% of the achievable FLOP/s" in v.text
    assert "of the FLOPs in its steps are prefill chunks sharing them" in v.text


def test_a_dominant_preprocess_is_the_api_server_not_the_engine_queue():
    # vLLM with a CPU-bound API server: TTFT is mostly templating and tokenisation while
    # the engine's own queue is empty (the old split called this "queue / capacity")
    e = est((0.0, 0.05, 0.30))
    e.phase_time_share = {"preprocess": 0.65, "queue": 0.0, "prefill": 0.05, "decode": 0.30}
    v = decide(e, DEP)
    assert (v.phase, v.resource) == ("preprocess", "frontend")
    assert v.levers == LEVERS[("preprocess", "frontend")]
    assert any("API-server" in lever for lever in v.levers)
    assert "API server" in v.text and "engine queue 0%" in v.text


def test_the_levers_table_in_the_docs_is_the_code_s():
    """docs/verdict.md's table of levers by phase and resource is LEVERS, row for row."""

    doc = (ROOT / "docs" / "verdict.md").read_text()
    section = doc.split("### Levers by phase and resource", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 3 and cells[0] != "phase":
            rows[(cells[0], cells[1])] = tuple(cells[2].split("; "))
    assert rows == LEVERS


def test_a_cpu_is_offered_no_cuda_graphs():
    """Issue 37: an overhead-bound decode on a CPU (a calibrate profile measured there)
    was offered "CUDA graphs"; there the levers are the compiled model, the batch and
    the requests, and the GPU-only ones are said as what they stand for."""
    from dataclasses import replace as _replace

    from phasewatch.roofline.decode_step import DecodeStep, overhead_levers
    from phasewatch.roofline.verdict import LEVERS, for_hardware

    cpu = _replace(DEP, hardware=_replace(DEP.hardware, cpu=True))
    step = overhead_levers(DecodeStep(seconds=0.2, roofline_seconds=0.01))  # 20x
    for levers in (*LEVERS.values(), step):
        said = for_hardware(levers, cpu)
        assert not any("CUDA" in lv or "GPUs" in lv for lv in said), said
        assert for_hardware(levers, DEP) == levers
    assert for_hardware(step, cpu)[0].startswith("a compiled model or a faster serving engine")
    assert for_hardware(LEVERS[("decode", "overhead")], cpu) == ("larger batches",
                                                                  "fewer tiny requests")


def test_a_measured_part_is_not_said_to_have_datasheet_peaks():
    """Issue 37: the real vLLM on this CPU read "MBU 13% and MFU 13% of the datasheet
    peaks of AMD EPYC (2 cores)", a part calibrate measured and no datasheet lists."""
    from dataclasses import replace as _replace

    measured = _replace(DEP, hardware=_replace(DEP.hardware, datasheet=False))
    assert "of the measured peaks of H100-SXM x1" in decide(
        est((0.05, 0.05, 0.90)), measured).text
    assert "of the datasheet peaks of H100-SXM x1" in decide(est((0.05, 0.05, 0.90)), DEP).text
