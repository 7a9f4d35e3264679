"""The scenario matrix: the estimator against the simulator's ground truth.

For every scenario on three model x hardware pairs (dense, large dense on 4 GPUs,
MoE on 2 GPUs), requests go through the real ingest path (phases, window) and the
monitor; the estimate must land within 15% of the truth (25% with token times
stripped, TPOT only) and the verdict must equal the one the same rules give on
the true figures, which in turn must be what the scenario was built to show.
"""

from __future__ import annotations

import dataclasses

import pytest

from phasewatch.aggregation.aggregate import Aggregator
from phasewatch.aggregation.window import RollingWindow
from phasewatch.requests.record import RequestBatch
from phasewatch.roofline.bottleneck import BottleneckMonitor
from phasewatch.roofline.deployments import Deployments
from phasewatch.roofline.estimate import Deployment, RooflineEstimate, phase_estimate
from phasewatch.roofline.inputs import InputSource
from phasewatch.roofline.verdict import decide
from phasewatch.sim.scenarios import SCENARIOS
from phasewatch.sim.truth import truth_between

EPOCH = 1.7e9
PAIRS = [("Llama-3.1-8B", "H100-SXM", 1), ("Llama-3.1-70B", "H200", 4),
         ("Mixtral-8x7B", "H200", 2)]
EXPECTED = {"chat": ("decode", "memory_bandwidth"), "rag": ("prefill", "compute"),
            "long_generation": ("decode", "memory_bandwidth"), "overload": ("queue", "capacity"),
            "tiny_batch": ("decode", "overhead"), "api_bound": ("preprocess", "frontend")}
# Long requests need a longer run: the range ends a 90th-percentile request time
# before the newest request, and the run must reach a steady state first.
DURATION = {"long_generation": 150.0, "rag": 150.0}


def _estimate(records, dep: Deployment, strip: bool):
    if strip:
        records = [dataclasses.replace(r, token_times=None) for r in records]
    window = RollingWindow(30.0, capacity=200_000)
    agg = Aggregator(window=window)
    for i in range(0, len(records), 1000):
        agg.ingest(RequestBatch.from_records(records[i:i + 1000], engine="sim"), "test")
    monitor = BottleneckMonitor(window, agg.labels, Deployments([dep]), window_seconds=30.0)
    [result] = monitor.update()
    return result


def _truth_estimate(truth, est: RooflineEstimate, dep: Deployment) -> RooflineEstimate:
    """The true figures in the estimator's shape, so one rule set judges both."""
    return dataclasses.replace(
        est, inputs={"decode_steps": InputSource("token_gaps")},
        decode=phase_estimate(dep, truth.decode.busy_seconds, truth.decode.flops,
                              truth.decode.bytes, est.requests),
        prefill=phase_estimate(dep, truth.prefill.busy_seconds, truth.prefill.flops,
                               truth.prefill.bytes, est.requests),
        decode_batch_size=truth.decode_batch_size, shared_step_flops=truth.shared_step_flops)


def _close(est: float, true: float, tol: float, what: str) -> None:
    assert est == pytest.approx(true, rel=tol), f"{what}: estimated {est:.4g}, true {true:.4g}"


@pytest.fixture(scope="module", params=PAIRS, ids=lambda p: f"{p[0]}@{p[1]}x{p[2]}")
def pair(request):
    return request.param


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_estimate_and_verdict_match_ground_truth(pair, name):
    model, hardware, gpus = pair
    engine = SCENARIOS[name].build(seed=1, model=model, hardware=hardware, gpus=gpus)
    records = engine.run(DURATION.get(name, 90.0), epoch=EPOCH)
    dep = Deployment(model, engine.model, engine.hw)
    steps = engine.truth.arrays()
    for strip, tol in ((False, 0.15), (True, 0.25)):
        result = _estimate(records, dep, strip)
        est = result.estimate
        assert est.inputs["decode_steps"] == InputSource("tpot" if strip else "token_gaps")
        truth = truth_between(steps, est.range_start, est.range_end, EPOCH)
        _, mbu_true = truth.decode.utilization(dep.peak_flops, dep.peak_bandwidth)
        _close(est.decode.bandwidth_utilization, mbu_true, tol, "decode MBU")
        _close(est.decode_batch_size, truth.decode_batch_size, tol, "decode batch")
        pf_true, _ = truth.prefill.utilization(dep.peak_flops, dep.peak_bandwidth)
        _close(est.prefill.flops_utilization, pf_true, tol, "prefill MFU")
        for phase, flops in truth.shared_step_flops.items():
            if flops > 0.05 * getattr(truth, phase).flops:  # only where it matters
                _close(est.shared_step_flops[phase], flops, 0.25, f"{phase} mixed-step FLOPs")
        true_verdict = decide(_truth_estimate(truth, est, dep), dep)
        assert (true_verdict.phase, true_verdict.resource) == EXPECTED[name]
        assert (result.verdict.phase, result.verdict.resource) == EXPECTED[name], \
            result.verdict.text


def test_a_label_set_without_requests_in_the_window_has_no_verdict():
    """Traffic stops: once the window holds none of its requests (the estimator still
    reads further back for overlaps), the label set has no estimate and no verdict, so
    no banner or phasewatch_bottleneck_info stays behind from a workload that ended."""
    now = [EPOCH + 100.0]
    engine = SCENARIOS["chat"].build(seed=1)
    records = engine.run(60.0, epoch=EPOCH + 40.0)
    dep = Deployment("Llama-3.1-8B", engine.model, engine.hw)
    window = RollingWindow(30.0, capacity=200_000, clock=lambda: now[0])
    agg = Aggregator(window=window)
    agg.ingest(RequestBatch.from_records(records, engine="sim"), "test")
    monitor = BottleneckMonitor(window, agg.labels, Deployments([dep]), window_seconds=30.0,
                                clock=lambda: now[0])
    [result] = monitor.update()
    assert result.verdict is not None
    now[0] += 31.0  # the window (30 s of ingest time) is empty; the lookback is not
    assert monitor.update() == [] and monitor.results() == []
