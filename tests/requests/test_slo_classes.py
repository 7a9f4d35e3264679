"""Latency objectives per prompt-length class (issue 28): ``KEY@CLASS:MS`` in --slo,
PHASEWATCH_SLO and a config file's ``slo`` (top level and ``[[models]]``); each request
judged against its own class's thresholds; the overrides on /metrics
(``phasewatch_slo_objective_seconds{prompt_class}``), in the JSON summary
(``by_prompt_class``) and in the verdict's sentence.

Parsing and judging in process (as tests/requests/test_slo.py); one exporter started on port 0
and fed over gRPC for /metrics and /api/v1/summary.
"""

from __future__ import annotations

import argparse
import json
import re
import time
import urllib.request

import numpy as np
import pytest

from phasewatch.aggregation.aggregate import Aggregator
from phasewatch.aggregation.window import RollingWindow
from phasewatch.app import Exporter
from phasewatch.client import PhasewatchClient
from phasewatch.config import ConfigError, ServeConfig, add_serve_flags, load_serve_config
from phasewatch.publish.slo_metrics import SloCollector
from phasewatch.requests.buckets import PROMPT_CLASSES
from phasewatch.requests.objectives import (
    CLASSES,
    MET,
    MISSED,
    OBJECTIVES,
    Objectives,
    ObjectivesByModel,
    parse_objectives,
)
from phasewatch.requests.record import RequestBatch, RequestRecord
from phasewatch.roofline.slo_verdict import attainment, lead
from tests.conftest import TEST_PORTS, Scrape, wait_for

T = 1000.0
CLASSY = "ttft:500,tpot:50,ttft@4k-16k:3000,ttft@16k-64k:8000"
VALID = "0-256, 257-1k, 1k-4k, 4k-16k, 16k-64k, 64k+"


# ---- parsing --------------------------------------------------------------------------------
def test_a_class_override_parses_and_round_trips():
    o = parse_objectives(CLASSY)
    assert (o.ttft, o.tpot, o.itl, o.e2el) == (0.5, 0.05, None, None)
    assert o.by_class == (("ttft", "4k-16k", 3.0), ("ttft", "16k-64k", 8.0))
    assert o.overrides("ttft") == {"4k-16k": 3.0, "16k-64k": 8.0} and not o.overrides("tpot")
    assert o.text() == CLASSY and parse_objectives(o.text()) == o
    # the order given does not matter; e2e is e2el's alias with a class too; case folded
    assert parse_objectives("ttft@16K-64K:8000 tpot:50, ttft@4k-16k:3000 ttft:500") == o
    assert parse_objectives("e2e@64k+:20000").by_class == (("e2el", "64k+", 20.0),)
    # vLLM's own spelling is unchanged: no overrides
    assert parse_objectives("ttft:500,tpot:50") == Objectives(ttft=0.5, tpot=0.05)
    assert ", ".join(CLASSES) == VALID == ", ".join(label for _, label in PROMPT_CLASSES)


def test_an_override_without_a_plain_value_sets_the_class_only():
    o = parse_objectives("tpot:50,ttft@4k-16k:3000")
    assert o and o.set() == {"tpot": 0.05} and o.judged() == ["ttft", "tpot"]
    assert o.text() == "tpot:50,ttft@4k-16k:3000"
    rows = o.class_array()  # one row per prompt_class_codes code, the last unknown
    assert rows.shape == (len(CLASSES) + 1, len(OBJECTIVES))
    ttft = rows[:, OBJECTIVES.index("ttft")]
    assert ttft[CLASSES.index("4k-16k")] == 3.0
    assert np.isnan(np.delete(ttft, CLASSES.index("4k-16k"))).all()
    assert (rows[:, OBJECTIVES.index("tpot")] == 0.05).all()
    assert bool(parse_objectives("itl@64k+:100")) and bool(ObjectivesByModel(
        by_model={"m": parse_objectives("itl@64k+:100")}))
    # with a plain value: the plain one everywhere but the class, unknown length included
    plain = parse_objectives("ttft:500,ttft@4k-16k:3000").class_array()[:, 0]
    assert plain.tolist() == [0.5, 0.5, 0.5, 3.0, 0.5, 0.5, 0.5]


@pytest.mark.parametrize("text,message", [
    ("ttft@8k:3000", f"'ttft@8k:3000': unknown prompt class '8k'; CLASS is one of {VALID}"),
    ("ttft:500,ttft@:3000", f"'ttft@:3000': unknown prompt class ''; CLASS is one of {VALID}"),
    ("ttft@unknown:700", "'ttft@unknown:700': unknown prompt class 'unknown'"),
    ("ttft@4k-16k:1 ttft@4k-16k:2", "'ttft@4k-16k:2': ttft@4k-16k is given twice"),
    ("e2e@64k+:1,e2el@64k+:2", "'e2el@64k+:2': e2el@64k+ is given twice"),
    ("p99@4k-16k:3", "'p99@4k-16k:3': unknown objective 'p99'"),
    ("ttft@4k-16k", "'ttft@4k-16k' has no colon"),
    ("ttft@4k-16k:soon", "'ttft@4k-16k:soon': 'soon' is not a number of milliseconds"),
    ("ttft@4k-16k:-3", "'ttft@4k-16k:-3': the value must be a finite, non-negative"),
])
def test_a_bad_override_names_the_pair_and_the_classes(text, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        parse_objectives(text)


def test_a_plain_value_and_its_class_are_not_twice():
    o = parse_objectives("ttft:500,ttft@4k-16k:3000,ttft@0-256:200")
    assert (o.ttft, o.overrides("ttft")) == (0.5, {"0-256": 0.2, "4k-16k": 3.0})


# ---- judged per class -----------------------------------------------------------------------
def _rec(rid: str, prompt: int | None, ttft: float, model: str = "m") -> RequestRecord:
    """A streamed request: ``ttft`` seconds to its first token (most of it queued), then
    3 tokens 20 ms apart (TPOT 20 ms)."""
    first = T + ttft
    times = [first, first + 0.02, first + 0.04]
    return RequestRecord(model, arrival=T, queued=T, scheduled=T + ttft * 0.9,
                         first_token=first, last_token=times[-1], finish=times[-1],
                         prompt_tokens=prompt, output_tokens=3, token_times=times,
                         request_id=rid)


# request id: (prompt tokens, TTFT seconds) and its TTFT outcome under CLASSY
BATCH = {
    "long-met": (8000, 2.0, MET),  # 4k-16k: 3000 ms, met though over 500 ms
    "long-at": (16384, 3.0, MET),  # the class's last token count, exactly at 3000 ms
    "long-missed": (9000, 3.5, MISSED),  # over its class's 3000 ms
    "short-missed": (100, 0.7, MISSED),  # 0-256: the plain 500 ms
    "short-met": (256, 0.3, MET),
    "mid-missed": (2000, 2.0, MISSED),  # 1k-4k: no override, the plain 500 ms
    "longer-met": (20_000, 7.5, MET),  # 16k-64k: 8000 ms
    "no-length": (None, 0.7, MISSED),  # prompt length unknown: the plain 500 ms
}


def _ingest(slo: str) -> Aggregator:
    agg = Aggregator(window=RollingWindow(600, clock=lambda: T + 10), clock=lambda: T + 10,
                     objectives=ObjectivesByModel(parse_objectives(slo)))
    recs = [_rec(rid, p, t) for rid, (p, t, _) in BATCH.items()]
    agg.ingest(RequestBatch.from_records(recs, engine="vllm"), "phasewatch")
    return agg


def _samples(agg: Aggregator) -> dict[tuple, float]:
    return {(s.name, *sorted((k, v) for k, v in s.labels.items() if k not in ("model",
                                                                               "engine"))):
            s.value for fam in SloCollector(agg).collect() for s in fam.samples}


def test_each_request_is_judged_against_its_own_class():
    agg = _ingest(CLASSY)
    snap = agg.slo.snapshot()
    want_met = sum(o == MET for *_, o in BATCH.values())
    assert snap.outcomes[0, 0].tolist() == [want_met, len(BATCH) - want_met, 0]
    assert snap.outcomes[0, 1].tolist() == [len(BATCH), 0, 0]  # TPOT 20 ms: all met
    assert int(snap.good[0]) == want_met == 4
    s = _samples(agg)
    assert s[("phasewatch_slo_missed_requests_total", ("objective", "ttft"),
              ("phase", "queue"))] == 4
    (series,) = agg.window.summarize(agg.labels.pairs(), names=agg.labels.names).series
    assert series.slo.good_requests == 4
    # without the overrides every long prompt misses 500 ms: only short-met meets it
    assert int(_ingest("ttft:500,tpot:50").slo.snapshot().good[0]) == 1  # short-met


def test_an_override_alone_judges_only_its_class():
    agg = _ingest("ttft@4k-16k:3000")
    snap = agg.slo.snapshot()
    assert snap.outcomes[0, 0].tolist() == [2, 1, 0]  # long-met, long-at; long-missed
    assert snap.outcomes[0, 1:].sum() == 0  # nothing else judged
    assert int(snap.good[0]) == 2  # the other classes' requests are not good: none set
    s = _samples(agg)
    objective = {k: v for k, v in s.items() if k[0] == "phasewatch_slo_objective_seconds"}
    assert objective == {("phasewatch_slo_objective_seconds", ("objective", "ttft"),
                          ("prompt_class", "4k-16k")): 3.0}
    (series,) = agg.window.summarize(agg.labels.pairs(), names=agg.labels.names).series
    assert series.as_dict()["slo"]["objectives"] == {"ttft": {
        "objective_seconds": None, "by_prompt_class": {"4k-16k": 3.0}, "met": 2,
        "missed": 1, "unknown": 0, "attainment": 2 / 3}}


def test_retargeting_brings_the_classes_along():
    agg = _ingest("ttft:500")
    assert int(agg.slo.snapshot().good[0]) == 1
    agg.slo.retarget(ObjectivesByModel(parse_objectives(CLASSY)))
    assert agg.slo.snapshot().objectives(0) == parse_objectives(CLASSY)
    recs = [_rec(rid, p, t) for rid, (p, t, _) in BATCH.items()]
    agg.ingest(RequestBatch.from_records(recs, engine="vllm"), "phasewatch")
    assert int(agg.slo.snapshot().good[0]) == 1 + 4


def test_the_verdicts_sentence_names_the_class_objective():
    def figures(slo: str, missed: int):
        outcome = np.full((100, len(OBJECTIVES)), -1, np.int8)
        outcome[:, 0] = MET
        outcome[:missed, 0] = MISSED
        phase = np.where(outcome == MISSED, 1, -1).astype(np.int8)  # the queue
        return attainment(parse_objectives(slo), outcome, phase)

    both = figures("ttft:500,ttft@4k-16k:3000,ttft@64k+:9000", 0)
    assert both.objectives["ttft"].by_prompt_class == {"4k-16k": 3.0, "64k+": 9.0}
    assert lead(both, None) == ("All objectives met: TTFT 500 ms (3000 ms for 4k-16k, "
                                "9000 ms for 64k+ prompts) by 100%.")
    alone = figures("ttft@4k-16k:3000", 30)
    assert alone.objectives["ttft"].objective_seconds is None
    assert lead(alone, None) == "30% of requests missed TTFT 3000 ms for 4k-16k prompts."
    assert "by_prompt_class" not in figures("ttft:500", 0).objectives["ttft"].as_dict()


# ---- where they are given -------------------------------------------------------------------
def _parse(argv):
    p = argparse.ArgumentParser()
    add_serve_flags(p)
    return p.parse_args(argv)


def test_flag_environment_and_file_take_the_classes(tmp_path):
    assert load_serve_config(_parse(["--slo", CLASSY]), {}).objectives([]).default \
        == parse_objectives(CLASSY)
    env = load_serve_config(_parse([]), {"PHASEWATCH_SLO": "ttft@64k+:20000"})
    assert env.objectives([]).default.by_class == (("ttft", "64k+", 20.0),)
    cfg = tmp_path / "pw.toml"
    cfg.write_text('slo = "ttft:500,ttft@1k-4k:900"\n\n[[models]]\nmodel = "Llama-3.1-8B"\n'
                   'served_model_name = "llama"\nslo = "ttft:300 ttft@16k-64k:6000"\n')
    by = load_serve_config(_parse(["--config", str(cfg)]), {}).objectives(["llama"])
    assert by.for_model("llama") == Objectives(ttft=0.3, by_class=(("ttft", "16k-64k", 6.0),))
    assert by.for_model("other") == Objectives(ttft=0.5, by_class=(("ttft", "1k-4k", 0.9),))


@pytest.mark.parametrize("argv,env,toml,message", [
    (["--slo", "ttft:500,ttft@4k:3000"], {}, None,
     f"--slo: 'ttft@4k:3000': unknown prompt class '4k'; CLASS is one of {VALID}"),
    ([], {"PHASEWATCH_SLO": "ttft@0-256:1 ttft@0-256:2"}, None,
     "PHASEWATCH_SLO: 'ttft@0-256:2': ttft@0-256 is given twice"),
    ([], {}, 'slo = "tpot@64K:5"\n', ": slo: 'tpot@64K:5': unknown prompt class '64k'"),
    ([], {}, '[[models]]\nmodel = "x"\nslo = "ttft@16k-64k:x"\n',
     "[[models]] #1: slo: 'ttft@16k-64k:x': 'x' is not a number"),
])
def test_a_bad_override_fails_at_start_naming_where(tmp_path, argv, env, toml, message):
    if toml is not None:
        cfg = tmp_path / "pw.toml"
        cfg.write_text(toml)
        argv = [*argv, "--config", str(cfg)]
    with pytest.raises(ConfigError) as e:
        load_serve_config(_parse(argv), env)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---- an exporter, end to end ----------------------------------------------------------------
def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_an_exporter_publishes_the_class_objectives():
    """Started on port 0 with ``CLASSY``, fed the batch over gRPC (times shifted to now):
    /metrics shows the plain and the class objectives and counts each request against
    its class's; /api/v1/summary shows the overrides in seconds."""
    shift = float(int(time.time() - T - 20))
    with Exporter(ServeConfig(**TEST_PORTS, slo=CLASSY)) as ex:
        with PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine="vllm") as c:
            for rid, (p, t, _) in BATCH.items():
                r = _rec(rid, p, 2.9 if rid == "long-at" else t)  # no boundary on the wire
                c.record("m", arrival=r.arrival + shift, queued=r.queued + shift,
                         scheduled=r.scheduled + shift, first_token=r.first_token + shift,
                         last_token=r.last_token + shift, finish=r.finish + shift,
                         prompt_tokens=p, output_tokens=3,
                         token_times=[x + shift for x in r.token_times], request_id=rid)
            assert c.flush(timeout=20)
        base = f"http://127.0.0.1:{ex.http_port}"
        scrape = wait_for(lambda: (s := Scrape(_get(base + "/metrics"))).total(
            "phasewatch_slo_requests_total", objective="ttft") == len(BATCH) and s)
        summary = json.loads(_get(base + "/api/v1/summary"))
    assert scrape, "the requests were not counted"
    objective = {(s.labels["objective"], s.labels["prompt_class"]): s.value
                 for s in scrape.samples if s.name == "phasewatch_slo_objective_seconds"}
    assert objective == {("ttft", ""): 0.5, ("ttft", "4k-16k"): 3.0,
                         ("ttft", "16k-64k"): 8.0, ("tpot", ""): 0.05}
    assert 'objective="ttft",prompt_class=""} 0.5' in scrape.text
    assert scrape.value("phasewatch_slo_requests_total", objective="ttft",
                        outcome="met") == 4
    assert scrape.value("phasewatch_slo_requests_total", objective="ttft",
                        outcome="missed") == 4
    assert scrape.value("phasewatch_slo_good_requests_total", model="m") == 4
    assert scrape.value("phasewatch_slo_missed_requests_total", objective="ttft",
                        phase="queue") == 4
    (model,) = summary["models"]
    assert model["slo"]["good_requests"] == 4
    assert model["slo"]["objectives"]["ttft"] == {
        "objective_seconds": 0.5, "by_prompt_class": {"4k-16k": 3.0, "16k-64k": 8.0},
        "met": 4, "missed": 4, "unknown": 0, "attainment": 0.5}
    assert "by_prompt_class" not in model["slo"]["objectives"]["tpot"]
