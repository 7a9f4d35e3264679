"""The simulated engine: scenarios stress the phase they claim; ground truth is exact."""

from collections import defaultdict

import numpy as np
import pytest

from phasewatch.requests.phases import split_phases
from phasewatch.requests.record import RequestBatch
from phasewatch.roofline import model_costs
from phasewatch.sim.scenarios import scenario


def shares(records):
    ph = split_phases(RequestBatch.from_records(records))
    assert ph.kept.all() and not ph.rejected
    q, p, d = (float(np.nansum(x)) for x in (ph.queue, ph.prefill, ph.decode))
    total = q + p + d
    return {"queue": q / total, "prefill": p / total, "decode": d / total}


@pytest.mark.parametrize("name,dominant", [
    ("long_generation", "decode"), ("rag", "prefill"), ("overload", "queue"),
    ("chat", "decode"),
])
def test_scenario_spends_most_time_where_it_claims(name, dominant):
    for seed in (0, 1):
        s = shares(scenario(name).build(seed=seed).run(300.0 if name == "rag" else 60.0))
        assert s[dominant] > 0.5, (name, seed, s)


def test_decode_step_bytes_are_weights_plus_kv_of_the_running_batch():
    engine = scenario("chat").build(seed=2)
    epoch = 1_000_000.0  # engine time 0 in Unix seconds, small enough for exact keys
    records = engine.run(20.0, epoch=epoch)
    truth = engine.truth.arrays()
    kvpt = model_costs.kv_bytes_per_token(engine.model)
    weights = model_costs.weight_bytes(engine.model)
    # Rebuild each step's decoding batch from the emitted token times alone: a request
    # that emits its k-th token (k >= 1) at a step's end decoded in that step, at
    # context prompt + k (everything before it, plus itself).
    contexts = defaultdict(float)
    decoders = defaultdict(int)
    for r in records:
        for k, t in enumerate(r.token_times[1:], start=1):
            contexts[round(t - epoch, 6)] += r.prompt_tokens + k
            decoders[round(t - epoch, 6)] += 1
    ends = truth["start"] + truth["duration"]
    pure = (truth["prefill_tokens"] == 0) & (truth["decode_seqs"] > 0)
    checked = 0
    for i in np.flatnonzero(pure):
        key = round(ends[i], 6)
        if decoders.get(key) != truth["decode_seqs"][i]:
            continue  # some of its requests were still running at the end: no record
        expected = weights + kvpt * contexts[key]
        assert truth["bytes"][i] == pytest.approx(expected, rel=1e-9)
        checked += 1
    assert checked > 100


def test_paced_run_follows_the_wall_clock():
    import time

    engine = scenario("chat").build(seed=1)
    t0 = time.monotonic()
    engine.run(2.0, time_scale=4.0)  # 2 engine seconds at 4x: ~0.5 s of wall time
    assert 0.4 <= time.monotonic() - t0 < 2.0
