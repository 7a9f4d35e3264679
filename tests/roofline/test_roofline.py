"""The estimator on hand-computed cases: interval algebra, one-at-a-time requests."""

from __future__ import annotations

import numpy as np
import pytest

from phasewatch.aggregation.aggregate import Aggregator
from phasewatch.aggregation.window import RollingWindow
from phasewatch.requests.record import RequestBatch, RequestRecord
from phasewatch.roofline import catalog, model_costs
from phasewatch.roofline.estimate import Deployment, _estimate_in, estimate
from phasewatch.roofline.inputs import InputSource
from phasewatch.roofline.intervals import inside_fraction, union_length

M = catalog.model("Llama-3.1-8B")
DEP = Deployment("Llama-3.1-8B", M, catalog.hardware("H100-SXM"))


def test_union_length_equals_brute_force():
    rng = np.random.default_rng(3)
    starts = rng.uniform(0, 100, 300)
    ends = starts + rng.exponential(2.0, 300)
    grid = np.linspace(10, 90, 800_001)
    covered = np.zeros(grid.size, dtype=bool)
    for s, e in zip(starts, ends, strict=True):
        covered[(grid >= s) & (grid <= e)] = True
    assert union_length(starts, ends, 10, 90) == pytest.approx(covered.mean() * 80, abs=1e-3)
    assert union_length(np.array([5.0]), np.array([4.0]), 0, 10) == 0.0


def test_the_phases_union_from_one_interval_a_request_equals_the_two():
    """estimate._overlap: a request's prefill [start, first] and decode [first, last]
    taken as one interval give the union and the sampled busy time of the two, with NaN
    times, out-of-order ones (a start after the first token, a last token before it),
    weights and ranges that cut them."""
    from phasewatch.roofline.intervals import busy_time

    rng = np.random.default_rng(1)
    for trial in range(2000):
        n = int(rng.integers(1, 40))
        s = rng.uniform(0, 10, n)
        f = s + rng.uniform(-1, 3, n)
        last = f + rng.uniform(-1, 4, n)
        for times in (s, f, last):
            times[rng.random(n) < 0.15] = np.nan
        w = np.ones(n) if trial % 2 else rng.integers(1, 5, n).astype(float)
        lo, hi = sorted(rng.uniform(0, 14, 2))
        two = busy_time(np.concatenate([s, f]), np.concatenate([f, last]),
                        np.concatenate([w, w]), lo, hi)
        one = busy_time(np.where(s <= f, s, f), np.fmax(f, last), w, lo, hi)
        assert one == pytest.approx(two, abs=1e-9), (trial, one, two)


def test_inside_fraction():
    f = inside_fraction(np.array([0.0, 5.0, 8.0, 3.0]), np.array([10.0, 6.0, 12.0, 3.0]), 4, 9)
    assert f.tolist() == pytest.approx([0.5, 1.0, 0.25, 0.0])


def _cols(records):
    window = RollingWindow(30.0, capacity=10_000)
    Aggregator(window=window).ingest(RequestBatch.from_records(records, engine="e"), "test")
    return window.columns()


def _sequential(n=20, prompt=100, output=11, step=0.01, token_times=True):
    """n requests one after another: prefill 50 ms, then output-1 decode steps of ``step``."""
    out = []
    for k in range(n):
        t = 1000.0 + k
        first = t + 0.05
        times = [first + i * step for i in range(output)]
        out.append(RequestRecord(model="Llama-3.1-8B", arrival=t, scheduled=t, first_token=first,
                                 last_token=times[-1], finish=times[-1] + 0.001,
                                 prompt_tokens=prompt, cached_prompt_tokens=0,
                                 output_tokens=output,
                                 token_times=times if token_times else None))
    return out


@pytest.mark.parametrize("token_times", [True, False])
def test_batch_of_one_decode_matches_the_formula(token_times):
    est = estimate(_cols(_sequential(token_times=token_times)), DEP, 30.0)
    d = est.decode
    # Each decode step reads the weights once plus the KV cache at its context
    # (prompt + j for the j-th step): mean context 100 + 11/2.
    per_step = M.params * 2 + model_costs.kv_bytes_per_token(M) * (100 + 5.5)
    assert d.achieved_bytes_per_second == pytest.approx(per_step / 0.01, rel=1e-6)
    assert d.bandwidth_utilization == pytest.approx(per_step / 0.01 / 3.35e12, rel=1e-6)
    flops = 2 * M.active_params + model_costs.attention_flops_per_context_token(M) * 105.5
    assert d.achieved_flops_per_second == pytest.approx(flops / 0.01, rel=1e-6)
    assert est.decode_batch_size == pytest.approx(1.0)
    assert est.decode_step_seconds == pytest.approx(0.01)
    assert est.inputs["decode_steps"] == InputSource("token_gaps" if token_times else "tpot")
    p = est.prefill
    assert p.achieved_flops_per_second == pytest.approx(
        float(model_costs.prefill_flops(M, 100)) / 0.05, rel=1e-6)
    assert p.arithmetic_intensity == pytest.approx(
        float(model_costs.prefill_flops(M, 100)) / (M.params * 2 +
                                                   model_costs.kv_bytes_per_token(M) * 100))


def test_overlapping_requests_give_the_batch_size():
    # Four streams, each a copy of the sequential run shifted by 0.25 s: 4 decode
    # intervals overlap at any time... except the gaps between requests.
    records = [r for shift in (0.0, 0.25, 0.5, 0.75) for r in _sequential()]
    for i, r in enumerate(records):
        s = (i // 20) * 0.25
        r.arrival += s
        r.scheduled += s
        r.first_token += s
        r.last_token += s
        r.finish += s
        r.token_times = [t + s for t in r.token_times]
    est = estimate(_cols(records), DEP, 30.0)
    # decode occupies 0.1 s of every second per stream, offsets keep them apart
    assert est.decode_batch_size == pytest.approx(1.0, rel=0.01)
    records = [r for _ in range(4) for r in _sequential()]  # 4 identical streams
    est = estimate(_cols(records), DEP, 30.0)
    assert est.decode_batch_size == pytest.approx(4.0, rel=1e-6)
    # 4 sequences share one weight read per step: bytes per step grow by KV only
    per_step = M.params * 2 + 4 * model_costs.kv_bytes_per_token(M) * 105.5
    assert est.decode.achieved_bytes_per_second == pytest.approx(per_step / 0.01, rel=1e-6)


def _slot_limited(slots=4, n=200, seed=0):
    """An engine step by step under a slot limit: waiting requests fill free slots and
    are prefilled in the next step (200 ms), beside one decode token for every running
    request (a 10 ms step without a prefill). Output lengths vary, so the one or two
    requests left of a batch decode through the long step that prefills the rest's
    replacements. Returns the records (TPOT only: no token times) and the number of
    steps that carried decode tokens."""
    rng = np.random.default_rng(seed)
    outputs = rng.integers(20, 40, n)
    t, waiting, running, records, decode_steps = 1000.0, list(range(n)), {}, [], 0
    first, made = {}, {}
    while waiting or running:
        admitted = []
        while waiting and len(running) + len(admitted) < slots:
            admitted.append(waiting.pop(0))
        start = t
        t += 0.01 + (0.2 if admitted else 0.0)
        decode_steps += bool(running)
        for r in list(running):
            made[r] += 1
            if made[r] == outputs[r]:
                del running[r]
                records.append(RequestRecord(
                    model="Llama-3.1-8B", arrival=1000.0, scheduled=first[r][0],
                    first_token=first[r][1], last_token=t, finish=t + 0.001,
                    prompt_tokens=100, cached_prompt_tokens=0, output_tokens=int(outputs[r])))
        for r in admitted:
            first[r], made[r], running[r] = (start, t), 1, True
    return records, decode_steps


def test_long_prefill_steps_beside_few_decodes_count_once():
    """A step that prefills beside one decode counts as one decode step, not its length
    over the mean TPOT (vLLM under --max-num-seqs: phasewatch read 1.13-1.23x its
    decode bytes before). Busy time over the mean TPOT overcounts this engine's steps by
    more than 10 %; the count from tokens and concurrency is within 2 %."""
    records, steps = _slot_limited()
    window = RollingWindow(600.0, capacity=10_000)
    Aggregator(window=window).ingest(RequestBatch.from_records(records, engine="e"), "test")
    c = window.columns()
    lo, hi = 1000.0, float(np.nanmax(c.last_token_at))
    est = _estimate_in(c, DEP, lo, hi, "m", "e")
    d = est.decode
    counted = d.weight_bytes / float(model_costs.weight_bytes_read(M, est.decode_batch_size))
    assert counted == pytest.approx(steps, rel=0.02)
    tpot = float(np.sum(c.last_token_at - c.first_token_at) / np.sum(c.steps))
    assert d.busy_seconds / tpot > 1.1 * steps  # what the mean TPOT alone counted
    assert est.decode_step_seconds == pytest.approx(d.busy_seconds / counted)


def test_a_stall_does_not_add_decode_steps():
    """Four requests decode together, one step every 10 ms, and one step in the middle
    lasts 2 s (the host stalled): 100 steps, however long one of them took."""
    records = []
    for _ in range(4):
        times = [2000.0 + 0.01 * i + (2.0 if i >= 50 else 0.0) for i in range(101)]
        records.append(RequestRecord(
            model="Llama-3.1-8B", arrival=1999.9, scheduled=1999.95, first_token=times[0],
            last_token=times[-1], finish=times[-1] + 0.001, prompt_tokens=100,
            cached_prompt_tokens=0, output_tokens=101))
    c = _cols(records)
    est = _estimate_in(c, DEP, 1999.0, 2004.0, "m", "e")
    counted = est.decode.weight_bytes / float(model_costs.weight_bytes_read(M, 4.0))
    assert counted == pytest.approx(100, rel=1e-6)
    assert est.decode_step_seconds == pytest.approx(3.0 / 100)


def test_without_a_deployment_only_shares():
    est = estimate(_cols(_sequential()), None, 30.0)
    assert est.decode is None and est.prefill is None
    assert est.phase_time_share["decode"] == pytest.approx(0.1 / 0.15)
    assert "no deployment" in str(est.inputs["roofline"])


def test_nothing_to_estimate():
    assert estimate(_cols(_sequential(n=1)), DEP, 30.0) is None
