"""The verdict's evidence as records (exporter/roofline/evidence.py): ``Evidence.as_dict``
is the JSON API's ``verdict.evidence`` as it was when the evidence was a dict built key by
key, the same keys, present and absent alike, in the same order (issue 38). The orders
below are the ones the API served before the records (every shape the tests of
tests/roofline, tests/publish and tests/app produced), and the verdicts decided here must
keep giving them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from phasewatch.roofline.decode_step import DecodeStep
from phasewatch.roofline.evidence import CeilingExceeded, Evidence, ModelMismatch, Utilization
from phasewatch.roofline.verdict import decide
from tests.roofline.test_ceiling import H100
from tests.roofline.test_ceiling import estimate as prefill_estimate
from tests.roofline.test_verdict import DEP, est

SHARES = {"preprocess": 0.0, "queue": 0.1, "prefill": 0.2, "decode": 0.7}
UTIL = Utilization(mfu=0.1, mbu=0.6, shared_step_flops_share=0.2, arithmetic_intensity=12.0,
                   ridge=295.0, of_achievable_flops=0.15, of_achievable_bandwidth=0.75)
STEP = DecodeStep(0.02, 0.01, 0.008, {"batch_low": 4, "batch_high": 16, "growth": 1.1,
                                      "step_low": 0.019, "step_high": 0.021}, 8.0)
STEP_KEYS = ["decode_step_seconds", "roofline_step_seconds", "step_over_roofline",
             "weights_step_seconds", "step_by_batch"]
UTIL_KEYS = ["mfu", "mbu", "shared_step_flops_share", "arithmetic_intensity", "ridge",
             "of_achievable_flops", "of_achievable_bandwidth"]


def test_a_verdict_built_by_hand_has_only_what_was_added():
    assert Evidence().as_dict() == {}
    assert Evidence(busy_share=0.14).as_dict() == {"busy_share": 0.14}
    base = Evidence(phase_time_share=SHARES, requests=40)
    assert base.as_dict() == {"phase_time_share": SHARES, "requests": 40}
    assert list(replace(base, busy_share=0.2, idle=True).as_dict()) == [
        "phase_time_share", "requests", "busy_share", "idle"]


def test_a_decode_against_the_roofline_keeps_its_keys_in_order():
    e = Evidence(phase_time_share=SHARES, requests=40, decode_batch_size=8.0, roofline=UTIL,
                 step=STEP, view="client")
    d = e.as_dict()
    assert list(d) == ["phase_time_share", "requests", "decode_batch_size", *UTIL_KEYS,
                       *STEP_KEYS, "view"]
    assert d["mbu"] == 0.6 and d["step_over_roofline"] == 2.0
    assert d["weights_step_seconds"] == 0.008 and d["step_by_batch"]["growth"] == 1.1
    over = replace(UTIL, over_achievable={"flops": 1.01})
    d = replace(e, roofline=over, step=None, view=None).as_dict()
    assert list(d) == ["phase_time_share", "requests", "decode_batch_size", "mfu", "mbu",
                       "shared_step_flops_share", "arithmetic_intensity", "ridge",
                       "over_achievable", "of_achievable_flops", "of_achievable_bandwidth"]
    assert d["over_achievable"] == {"flops": 1.01}


def test_a_ceiling_passed_and_a_model_mismatch_keep_their_keys_in_order():
    e = Evidence(phase_time_share=SHARES, requests=40, decode_batch_size=8.0,
                 roofline=CeilingExceeded({"flops": 1.4}, "dtype", "the dtype is wrong", 300.0))
    assert e.as_dict() == {"phase_time_share": SHARES, "requests": 40, "decode_batch_size": 8.0,
                           "ceiling_exceeded": {"flops": 1.4}, "ceiling_points_to": "dtype",
                           "ceiling_blame": "the dtype is wrong", "arithmetic_intensity": 300.0}
    assert list(e.as_dict()) == ["phase_time_share", "requests", "decode_batch_size",
                                 "ceiling_exceeded", "ceiling_points_to", "ceiling_blame",
                                 "arithmetic_intensity"]
    wrong = replace(e, roofline=ModelMismatch("a smaller model", 3.0), step=STEP)
    # the monitor's finding (bottleneck) stays where the roofline's record put it
    both = replace(wrong, busy_share=0.9, model_mismatch="a smaller model")
    assert list(both.as_dict()) == ["phase_time_share", "requests", "decode_batch_size",
                                    "model_mismatch", "arithmetic_intensity", *STEP_KEYS,
                                    "busy_share"]
    assert both.mismatch == "a smaller model" and both.ceiling_exceeded is None
    # found by the monitor alone (a queue verdict: no roofline record): last
    queue = Evidence(phase_time_share=SHARES, requests=40, busy_share=0.9,
                     model_mismatch="a smaller model")
    assert list(queue.as_dict()) == ["phase_time_share", "requests", "busy_share",
                                     "model_mismatch"]
    unavailable = Evidence(phase_time_share=SHARES, requests=40, unavailable="no TPOT")
    assert unavailable.as_dict() == {"phase_time_share": SHARES, "requests": 40,
                                     "unavailable": "no TPOT"}


def test_decided_verdicts_serve_the_old_shape():
    v = decide(est((0.02, 0.08, 0.90)), DEP)
    d = v.evidence.as_dict()
    # the window's estimate has no step figures: none of their keys
    assert list(d) == ["phase_time_share", "requests", "decode_batch_size", *UTIL_KEYS]
    assert d["mbu"] == v.evidence.utilization.mbu == pytest.approx(0.8 * 3.0e12 / 3.35e12)
    assert d["phase_time_share"] == {"queue": 0.02, "prefill": 0.08, "decode": 0.90}
    assert v.evidence.phase_time_share == d["phase_time_share"]
    queue = decide(est((0.70, 0.05, 0.25)), DEP).evidence.as_dict()
    assert list(queue) == ["phase_time_share", "requests", "decode_batch_size"]
    achievable = H100.hardware.achievable_flops("bf16")
    over = decide(prefill_estimate(H100, 0.99 * achievable * 10.0,
                                   shared=0.02 * achievable * 10.0), H100).evidence.as_dict()
    assert list(over)[3:] == ["mfu", "mbu", "shared_step_flops_share", "arithmetic_intensity",
                              "ridge", "over_achievable", "of_achievable_flops",
                              "of_achievable_bandwidth"]
    past = decide(prefill_estimate(H100, 3.0 * H100.peak_flops * 10.0), H100).evidence
    assert list(past.as_dict())[3:] == ["ceiling_exceeded", "ceiling_points_to",
                                        "ceiling_blame", "arithmetic_intensity"]
