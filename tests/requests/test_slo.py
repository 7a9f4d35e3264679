"""Latency objectives (--slo) and goodput: parsing, exact per-request counts, the phase
that broke each miss, what /metrics and the JSON API show, and vLLM bench's own goodput
on the peers' fixture.

In process, no listener: the aggregator (or an ``Exporter`` that is never started) is
fed batches directly. The fixture's requests through a live exporter (gRPC, float32
gaps, today's clock) are checked in tests/requests/test_peers.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re

import numpy as np
import pytest

from phasewatch import catalog, cli
from phasewatch.aggregation.aggregate import Aggregator
from phasewatch.aggregation.window import RollingWindow
from phasewatch.app import Exporter
from phasewatch.config import ConfigError, ServeConfig, add_serve_flags, load_serve_config
from phasewatch.protocol import exposition_pb2 as pb
from phasewatch.publish import exposition
from phasewatch.publish.api import bench_json
from phasewatch.publish.slo_metrics import SloCollector
from phasewatch.requests.objectives import (
    Objectives,
    ObjectivesByModel,
    judge,
    parse_objectives,
)
from phasewatch.requests.phases import split_phases
from phasewatch.requests.record import RequestBatch, RequestRecord
from phasewatch.roofline.deployments import ModelOptions
from tests.publish import test_golden_metrics as golden
from tests.support import FIXTURES

FIXTURE = FIXTURES / "peers" / "requests.json"
T = 1000.0
SLO = "ttft:200,tpot:50 itl:80, e2e:1000"  # comma and space, e2e for e2el


# ---- parsing --------------------------------------------------------------------------------
def test_parse_takes_vllms_goodput_form():
    o = parse_objectives(SLO)
    assert o == Objectives(ttft=0.2, tpot=0.05, itl=0.08, e2el=1.0)
    assert o.text() == "ttft:200,tpot:50,itl:80,e2el:1000"
    assert parse_objectives("  TTFT:0.5  ") == Objectives(ttft=0.0005)
    assert not parse_objectives("") and not parse_objectives(" , ")
    assert parse_objectives("e2el:2500").e2el == 2.5


@pytest.mark.parametrize("text,message", [
    ("ttft=500", "'ttft=500' has no colon"),
    ("ttft", "'ttft' has no colon"),
    ("ttft:500,p99:3", "'p99:3': unknown objective 'p99'"),
    ("ttft:fast", "'ttft:fast': 'fast' is not a number of milliseconds"),
    ("ttft:", "'ttft:': '' is not a number"),
    ("tpot:-1", "'tpot:-1': the value must be a finite, non-negative number"),
    ("tpot:nan", "'tpot:nan': the value must be a finite"),
    ("e2el:inf", "'e2el:inf': the value must be a finite"),
    ("e2e:100 e2el:200", "'e2el:200': e2el is given twice"),
])
def test_parse_names_the_bad_pair(text, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        parse_objectives(text)


def _parse(argv):
    p = argparse.ArgumentParser()
    add_serve_flags(p)
    return p.parse_args(argv)


def test_flag_environment_and_file(tmp_path):
    assert load_serve_config(_parse(["--slo", "ttft:500"]), {}).slo == "ttft:500"
    assert load_serve_config(_parse([]), {"PHASEWATCH_SLO": "tpot:40"}).slo == "tpot:40"
    cfg = tmp_path / "pw.toml"
    cfg.write_text('[serve]\nslo = "ttft:300"\n\n[[models]]\nmodel = "Llama-3.1-8B"\n'
                   'served_model_name = "llama"\nslo = "ttft:100 e2el:4000"\n\n'
                   '[[models]]\nmodel = "Qwen2.5-7B"\n')
    c = load_serve_config(_parse(["--config", str(cfg)]), {})
    assert c.slo == "ttft:300"
    assert [o.slo for o in c.model_options()] == ["ttft:100 e2el:4000", ""]
    by = c.objectives(["llama", "Qwen2.5-7B"])
    assert by.for_model("llama") == Objectives(ttft=0.1, e2el=4.0)  # its own, whole
    assert by.for_model("Qwen2.5-7B") == by.for_model("any") == Objectives(ttft=0.3)
    # the flag wins over the file
    assert load_serve_config(_parse(["--config", str(cfg), "--slo", "tpot:9"]), {}).slo \
        == "tpot:9"


@pytest.mark.parametrize("argv,env,toml,message", [
    (["--slo", "ttft=500"], {}, None, "--slo: 'ttft=500' has no colon"),
    ([], {"PHASEWATCH_SLO": "ttft:500,tpt:40"}, None,
     "PHASEWATCH_SLO: 'tpt:40': unknown objective 'tpt'"),
    ([], {}, 'slo = "e2el:-5"\n', ": slo: 'e2el:-5': the value must be a finite"),
    ([], {}, '[[models]]\nmodel = "x"\nslo = "ttft:abc"\n',
     "[[models]] #1: slo: 'ttft:abc': 'abc' is not a number"),
    ([], {}, '[[models]]\nmodel = "x"\nslo = 500\n', "[[models]] #1: slo must be a string"),
])
def test_bad_objectives_fail_at_start_naming_where(tmp_path, argv, env, toml, message):
    if toml is not None:
        cfg = tmp_path / "pw.toml"
        cfg.write_text(toml)
        argv = [*argv, "--config", str(cfg)]
    with pytest.raises(ConfigError) as e:
        load_serve_config(_parse(argv), env)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_serve_exits_2_with_one_line(capsys, monkeypatch):
    for k in [k for k in os.environ if k.startswith("PHASEWATCH_")]:
        monkeypatch.delenv(k)
    assert cli.main(["serve", "--slo", "ttft:500,tpot"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["phasewatch: error: --slo: 'tpot' has no colon: KEY:VALUE pairs, comma- "
                   "or space-separated, KEY one of ttft, tpot, itl, e2el, VALUE milliseconds "
                   "(as vllm bench serve --goodput), e.g. ttft:500,tpot:50; KEY@CLASS:VALUE "
                   "for one prompt-length class, e.g. ttft@4k-16k:3000"], err


# ---- a hand-checked batch ---------------------------------------------------------------------
def _times(start: float, gaps: list[float]) -> list[float]:
    return [start + x for x in np.concatenate([[0.0], np.cumsum(gaps)]).tolist()]


def hand_batch() -> RequestBatch:
    """Objectives ttft 200 ms, tpot 50 ms, itl 80 ms, e2el 1000 ms (``SLO``); each row's
    values and outcome by hand in the comments (met / missed / unknown)."""
    a = _times(T + 0.15, [0.04, 0.05, 0.06, 0.03])
    b = _times(T + 0.6, [0.05, 0.2])
    f = _times(T + 0.6, [0.02])
    recs = [
        # A: ttft .15 met, tpot .18/4=.045 met, itl max .06 met, e2el .33 met: good
        RequestRecord("m", arrival=T, queued=T + 0.01, scheduled=T + 0.05, first_token=a[0],
                      last_token=a[-1], finish=T + 0.34, prompt_tokens=10, output_tokens=5,
                      token_times=a, request_id="A"),
        # B: ttft .6 missed (queue .49 the largest), tpot .25/2 missed, itl .2 missed,
        # e2el .85 met
        RequestRecord("m", arrival=T, queued=T + 0.01, scheduled=T + 0.5, first_token=b[0],
                      last_token=b[-1], finish=T + 0.86, prompt_tokens=10, output_tokens=3,
                      token_times=b, request_id="B"),
        # C, not streamed: ttft .5 missed (prefill .48; queue from arrival .02), tpot 1/10
        # missed, itl unknown (11 tokens, no emission times), e2el to the last token 1.5
        # missed (decode 1.0 the largest part)
        RequestRecord("m", arrival=T, scheduled=T + 0.02, first_token=T + 0.5,
                      last_token=T + 1.5, finish=T + 1.6, prompt_tokens=10, output_tokens=11,
                      request_id="C"),
        # D, no first token: ttft unknown, tpot and itl met (one output token: TPOT 0, no
        # gap), e2el to the finish .3 met (no last token): not good
        RequestRecord("m", arrival=T, finish=T + 0.3, prompt_tokens=10, output_tokens=1,
                      request_id="D"),
        # E, output tokens unknown: ttft .1 met, tpot and itl unknown, e2el .2 met
        RequestRecord("m", arrival=T, first_token=T + 0.1, last_token=T + 0.2, finish=T + 0.2,
                      prompt_tokens=10, request_id="E"),
        # F, disaggregated (kv_transfer .4 set below): ttft .6 missed (kv_transfer .4 >
        # prefill .15 > queue .05), tpot .02 met, itl .02 met, e2el .62 met
        RequestRecord("m", arrival=T, scheduled=T + 0.05, first_token=f[0], last_token=f[-1],
                      finish=T + 0.63, prompt_tokens=10, output_tokens=2, token_times=f,
                      request_id="F"),
        # G, rejected (first token before arrival): counted nowhere
        RequestRecord("m", arrival=T, first_token=T - 1, last_token=T + 1, finish=T + 1,
                      prompt_tokens=10, output_tokens=3, request_id="G"),
        # H, TTFT exactly at the objective: met (value <= objective, as vLLM); one token,
        # e2el to the finish .25: good
        RequestRecord("m", arrival=T, first_token=T + 0.2, finish=T + 0.25, prompt_tokens=10,
                      output_tokens=1, request_id="H"),
    ]
    batch = RequestBatch.from_records(recs, engine="vllm")
    batch.kv_transfer[5] = 0.4
    return batch


def _aggregator(slo: str = SLO, **kw) -> Aggregator:
    window = RollingWindow(600, clock=lambda: T + 2)
    return Aggregator(window=window, clock=lambda: T + 2,
                      objectives=ObjectivesByModel(parse_objectives(slo)), **kw)


def _samples(agg: Aggregator) -> dict[tuple, float]:
    out = {}
    for fam in SloCollector(agg).collect():
        for s in fam.samples:
            out[(s.name, *sorted(s.labels.items()))] = s.value
    return out


def _get(samples, name, **labels):
    return samples[(name, *sorted({"model": "m", "engine": "vllm", **labels}.items()))]


def test_judge_by_hand():
    batch = hand_batch()
    ph = split_phases(batch)
    assert ph.kept.tolist() == [True] * 6 + [False, True]
    j = judge(batch, ph, np.tile(parse_objectives(SLO).array(), (len(batch), 1)))
    met, missed, unknown = 0, 1, 2
    want = {  # ttft, tpot, itl, e2el
        "A": [met, met, met, met], "B": [missed, missed, missed, met],
        "C": [missed, missed, unknown, missed], "D": [unknown, met, met, met],
        "E": [met, unknown, unknown, met], "F": [missed, met, met, met],
        "H": [met, met, met, met]}
    rows = dict(zip("ABCDEFGH", range(8), strict=True))
    for rid, outcome in want.items():
        assert j.outcome[rows[rid]].tolist() == outcome, rid
    assert [rid for rid in want if j.good[rows[rid]]] == ["A", "H"]
    phase = {rid: j.phase[rows[rid]].tolist() for rid in want}
    # MISS_PHASES: preprocess, queue, prefill, kv_transfer, decode, unknown
    assert phase["B"] == [1, 4, 4, -1] and phase["C"] == [2, 4, -1, 4]
    assert phase["F"] == [3, -1, -1, -1] and phase["A"] == [-1] * 4


def test_counts_by_hand_in_metrics_and_summary():
    agg = _aggregator()
    agg.ingest(hand_batch(), "phasewatch")
    s = _samples(agg)
    R = "phasewatch_slo_requests_total"
    counts = {(o, out): _get(s, R, objective=o, outcome=out)
              for o in ("ttft", "tpot", "itl", "e2el") for out in ("met", "missed", "unknown")}
    assert counts == {
        ("ttft", "met"): 3, ("ttft", "missed"): 3, ("ttft", "unknown"): 1,
        ("tpot", "met"): 4, ("tpot", "missed"): 2, ("tpot", "unknown"): 1,
        ("itl", "met"): 4, ("itl", "missed"): 1, ("itl", "unknown"): 2,
        ("e2el", "met"): 6, ("e2el", "missed"): 1, ("e2el", "unknown"): 0}
    assert _get(s, "phasewatch_slo_good_requests_total") == 2
    M = "phasewatch_slo_missed_requests_total"
    missed = {(dict(k[1:])["objective"], dict(k[1:])["phase"]): v
              for k, v in s.items() if k[0] == M and v}
    assert missed == {("ttft", "queue"): 1, ("ttft", "prefill"): 1, ("ttft", "kv_transfer"): 1,
                      ("tpot", "decode"): 2, ("itl", "decode"): 1, ("e2el", "decode"): 1}
    # every miss is put down to exactly one phase
    for o in ("ttft", "tpot", "itl", "e2el"):
        assert sum(v for k, v in s.items() if k[0] == M and dict(k[1:])["objective"] == o) \
            == counts[(o, "missed")]
    objective = {o: _get(s, "phasewatch_slo_objective_seconds", objective=o, prompt_class="")
                 for o in ("ttft", "tpot", "itl", "e2el")}
    assert objective == {"ttft": 0.2, "tpot": 0.05, "itl": 0.08, "e2el": 1.0}

    summary = agg.window.summarize(agg.labels.pairs(), names=agg.labels.names)
    (series,) = summary.series
    slo = series.as_dict()["slo"]
    assert slo["good_requests"] == 2 and series.requests == 7
    assert slo["goodput"] == pytest.approx(2 / series.covered_seconds, rel=1e-12)
    assert slo["good_ratio"] == pytest.approx(2 / 7)
    assert slo["objectives"]["ttft"] == {"objective_seconds": 0.2, "met": 3, "missed": 3,
                                         "unknown": 1, "attainment": 3 / 7}
    assert slo["objectives"]["itl"]["attainment"] == 4 / 7
    bench = bench_json(summary)["models"][0]
    assert bench["figures"]["good_requests"] == 2
    lines = bench["text"].splitlines()
    at = lines.index(next(x for x in lines if x.startswith("Request throughput")))
    assert lines[at + 1] == f"{'Request goodput (req/s):':<40} {2 / series.covered_seconds:<10.2f}"\
        .rstrip()


def test_objectives_set_only_partly_judge_only_those():
    agg = _aggregator("ttft:200")
    agg.ingest(hand_batch(), "phasewatch")
    s = _samples(agg)
    assert {dict(k[1:])["objective"] for k in s
            if k[0] == "phasewatch_slo_requests_total"} == {"ttft"}
    assert _get(s, "phasewatch_slo_good_requests_total") == 3  # A, E, H
    (series,) = agg.window.summarize(agg.labels.pairs(), names=agg.labels.names).series
    assert list(series.as_dict()["slo"]["objectives"]) == ["ttft"]


def test_without_objectives_nothing_is_published():
    agg = Aggregator(window=RollingWindow(600, clock=lambda: T + 2))
    agg.ingest(hand_batch(), "phasewatch")
    assert agg.slo is None and list(SloCollector(agg).collect()) == []
    (series,) = agg.window.summarize(agg.labels.pairs(), names=agg.labels.names).series
    assert "slo" not in series.as_dict()
    bench = bench_json(agg.window.summarize(agg.labels.pairs(), names=agg.labels.names))
    assert "goodput" not in bench["models"][0]["text"]
    assert "good_requests" not in bench["models"][0]["figures"]


def test_per_model_objectives_and_the_catalogs_families():
    """A [[models]] table's slo for its model, --slo for the others; a model with neither
    shows nothing. The page's SLO families are the catalog's (type, HELP, labels)."""
    config = ServeConfig(grpc_port=0, http_port=0, otlp_grpc_port=0, otlp_http_port=0,
                         slo="ttft:200", models=(
                             ModelOptions(model="Llama-3.1-8B", hardware="H100-SXM",
                                          served_model_name="llama", slo="ttft:700,tpot:50"),))
    ex = Exporter(config, clock=lambda: T + 2)
    batch = hand_batch()
    # the first by a name of the configured model; the second a model the catalog knows
    # as another (with one model configured, a name it does not know would be that one)
    for name in ("Llama-3.1-8B", "Qwen2.5-7B"):
        batch.strings = [name if s == "m" else s for s in batch.strings]
        ex.aggregator.ingest(batch, "phasewatch")
        batch = hand_batch()
    body, _ = ex.metrics_page.render(golden.ACCEPT["protobuf"])
    fams = {f.name: f for f in exposition.read_delimited(body)}
    for f in catalog.SLO:
        fam = fams[f.name]
        # one short sentence, as tests/publish/test_metrics_page.py holds every HELP to
        assert len(f.help) <= 130 and f.help.endswith(".") \
            and not re.search(r"[.;] \S", f.help), f.help
        assert ({pb.COUNTER: "counter", pb.GAUGE: "gauge"}[fam.type], fam.help) == (f.type, f.help)
        assert [p.name for p in fam.metric[0].label] == f.label_names()
    gauge = {(m.label[0].value, m.label[2].value): m.gauge.value
             for m in fams["phasewatch_slo_objective_seconds"].metric}
    assert gauge == {("llama", "ttft"): 0.7, ("llama", "tpot"): 0.05,
                     ("Qwen2.5-7B", "ttft"): 0.2}
    good = {m.label[0].value: m.counter.value
            for m in fams["phasewatch_slo_good_requests_total"].metric}
    # llama, ttft <= .7 and tpot <= .05: A, F, H (D's TTFT and E's TPOT are unknown);
    # Qwen2.5-7B, ttft <= .2: A, E, H
    assert good == {"llama": 3, "Qwen2.5-7B": 3}
    text, _ = ex.metrics_page.render(golden.ACCEPT["text"])
    assert b'phasewatch_slo_requests_total{engine="vllm",model="Qwen2.5-7B",objective="ttft",' \
        b'outcome="met"} 3.0' in text


# ---- vLLM bench's own goodput on the peers' fixture -----------------------------------------
@pytest.fixture(scope="module")
def peers() -> dict:
    return json.loads(FIXTURE.read_text())


def test_goodput_equals_vllm_bench_on_the_peers_fixture(peers):
    """The fixture's requests (replayed at Unix time 1000 s, where a float64 second
    carries its microsecond times exactly) through the aggregator with the objectives
    vLLM's ``calculate_metrics`` was given: the good requests are vLLM's, exactly, and
    good requests over the fixture's duration (vLLM's ``dur_s``: the benchmark's start,
    time 0, before the first request, to the end of the last stream) is its
    ``request_goodput``. The window's own goodput divides by what the window covers
    (first arrival to last finish, as /api/v1/bench's duration)."""
    vllm = peers["expected"]["vllm"]
    gp = vllm["goodput"]
    slo = " ".join(f"{k}:{v:g}" for k, v in gp["goodput_config_ms"].items())
    objectives = parse_objectives(slo)
    reqs = peers["requests"]
    # the objectives sit clear of every value, so no float rounding can decide a request
    per = vllm["per_request"]
    for key, seconds in objectives.set().items():
        got = [per[r["id"]][key] or 0.0 for r in reqs]  # TPOT None: one output token
        assert min(abs(v - seconds) for v in got) > 1e-6, key
    first = min(r["arrival"] for r in reqs)
    last = max(r["finish"] for r in reqs)
    agg = Aggregator(window=RollingWindow(600, clock=lambda: T + last), clock=lambda: T + last,
                     objectives=ObjectivesByModel(objectives))
    recs = [RequestRecord("peers", arrival=T + r["arrival"], first_token=T + r["chunk_times"][0],
                          last_token=T + r["chunk_times"][-1], finish=T + r["finish"],
                          prompt_tokens=r["prompt_tokens"],
                          cached_prompt_tokens=r["cached_tokens"],
                          output_tokens=r["output_tokens"], finish_reason=r["finish_reason"],
                          request_id=r["id"], token_times=[T + t for t in r["chunk_times"]])
            for r in reqs]
    for i in range(0, len(recs), 100):
        result = agg.ingest(RequestBatch.from_records(recs[i:i + 100], engine="vllm"),
                            "phasewatch")
        assert result.accepted == len(recs[i:i + 100])
    snap = agg.slo.snapshot()
    (row,) = snap.rows()
    good = int(snap.good[row])
    assert good == gp["good_requests"] == 136
    assert good / gp["dur_s"] == pytest.approx(gp["request_goodput"], rel=1e-12, abs=0)
    assert gp["dur_s"] == vllm["duration_s"]
    # each objective's met count, from vLLM's own per-request figures (TPOT 0 for one
    # output token, as its goodput regards it)
    met = {"ttft": sum(per[r["id"]]["ttft"] <= objectives.ttft for r in reqs),
           "tpot": sum((per[r["id"]]["tpot"] or 0.0) <= objectives.tpot for r in reqs),
           "e2el": sum(per[r["id"]]["e2el"] <= objectives.e2el for r in reqs)}
    assert {k: int(snap.outcomes[row, i, 0]) for k, i in (("ttft", 0), ("tpot", 1),
                                                          ("e2el", 3))} == met
    assert snap.outcomes[row, :, 2].sum() == 0  # nothing unknown: every value is known
    (series,) = agg.window.summarize(agg.labels.pairs(), names=agg.labels.names).series
    assert series.slo.good_requests == good
    assert math.isclose(series.covered_seconds, last - first, rel_tol=1e-12)
    assert series.slo.goodput == pytest.approx(good / (last - first), rel=1e-12)
