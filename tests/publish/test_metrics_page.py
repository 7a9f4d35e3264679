"""/metrics as a reader meets it (issue 26): every HELP one sentence, every family's labels
in one order, and the series budget docs/metrics.md states, with the flags that trim it
merging exactly what they merge."""

from __future__ import annotations

import re
import time
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families as parse_text

from phasewatch.aggregation.aggregate import COUNTERS, HISTOGRAMS
from phasewatch.catalog import HISTOGRAMS as HISTOGRAM_NAMES
from phasewatch.client import PhasewatchClient
from phasewatch.publish import exposition
from phasewatch.publish.families import Exposure, coarse
from phasewatch.publish.metrics import HotText
from tests.publish.test_exposition import _aggregator
from tests.support import ROOT
from tests.support.serve import ServeProcess

OPENMETRICS = "application/openmetrics-text;version=1.0.0"
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\} ")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """A served page with every kind of family on it: requests of every prompt class and
    finish reason, a roofline and a verdict; in the text format and in OpenMetrics."""
    sp = ServeProcess(tmp_path_factory.mktemp("page"), "--model", "Llama-3.1-8B",
                      "--hardware", "H100-SXM", "--roofline-interval", "0.2",
                      # the in-process tap's families are on the page too
                      "--tap-upstream", "http://127.0.0.1:9", "--tap-port", "0").start()
    try:
        with PhasewatchClient(f"127.0.0.1:{sp.grpc_port}", engine="vllm") as c:
            t0 = time.time() - 20
            for i, prompt in enumerate((100, 900, 3000, 9000, 40_000, 90_000) * 10):
                a = t0 + i * 0.2
                times = [a + 0.3 + 0.02 * k for k in range(8)]
                c.record("Llama-3.1-8B", arrival=a, queued=a + 0.001, scheduled=a + 0.01,
                         first_token=times[0], last_token=times[-1], finish=times[-1],
                         prompt_tokens=prompt, output_tokens=8, token_times=times,
                         finish_reason=("stop", "length")[i % 2])
            assert c.flush(timeout=20)
        base = f"http://127.0.0.1:{sp.http_port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
            if "phasewatch_bottleneck_info{" in text:
                break
            time.sleep(0.2)
        req = urllib.request.Request(base + "/metrics", headers={"Accept": OPENMETRICS})
        om = urllib.request.urlopen(req, timeout=10).read().decode()
    finally:
        sp.stop()
    assert "phasewatch_bottleneck_info{" in text, text[-2000:]
    assert "# HELP phasewatch_tap_requests_total " in text
    return {"text": text, "openmetrics": om}


@pytest.mark.parametrize("fmt", ["text", "openmetrics"])
def test_every_help_is_one_short_sentence(pages, fmt):
    """A HELP is read in a tooltip: one sentence; label values and reasons are listed in
    docs/metrics.md, not in the page."""
    helps = re.findall(r"^# HELP (\S+) (.*)$", pages[fmt], re.M)
    assert len(helps) > 40
    long = [(n, h) for n, h in helps
            if len(h) > 130 or re.search(r"[.;] \S", h) or not h.endswith(".")]
    assert not long, "\n".join(f"{n}: {h}" for n, h in long)


@pytest.mark.parametrize("fmt", ["text", "openmetrics"])
def test_every_sample_lists_its_labels_in_one_order(pages, fmt):
    """The hot families (rendered by phasewatch) and the rest (by prometheus_client) write
    label names alike: alphabetically, le among them."""
    seen = 0
    for line in pages[fmt].splitlines():
        m = SAMPLE.match(line)
        if not m:
            continue
        names = [n for n, _ in LABEL.findall(m[2])]
        assert names == sorted(names), line
        seen += "model=" in line
    assert seen > 500


def test_the_page_is_described_in_the_docs(pages):
    """Every family on the page has a row or a mention in docs/metrics.md."""
    doc = (ROOT / "docs" / "metrics.md").read_text()
    families = set(re.findall(r"^# TYPE (\S+) ", pages["text"], re.M))
    missing = sorted(f for f in families
                     if f.removesuffix("_total") not in doc and not f.startswith(("process_",
                                                                                 "python_")))
    assert not missing, missing


def _series(text: str) -> dict[str, int]:
    """Series per family of one label set (model="Llama-3.1-8B", engine="vllm")."""
    out: dict[str, int] = {}
    for fam in parse_text(text):
        n = sum(1 for s in fam.samples if s.labels.get("model") == "Llama-3.1-8B"
                and s.labels.get("engine") == "vllm")
        if n:
            out[fam.name] = n
    return out


def _budget_table() -> dict[str, dict[str, int]]:
    """docs/metrics.md's budget table: family -> {column: series}."""
    doc = (ROOT / "docs" / "metrics.md").read_text()
    section = doc.split("## Cardinality budget", 1)[1].split("\n## ", 1)[0]
    out = {}
    for r in section.splitlines():
        cells = [c.strip() for c in r.strip().strip("|").split("|")]
        if not r.startswith("| ") or cells[0] == "family" or len(cells) != 5:
            continue
        out[cells[0].strip("`")] = dict(zip(("full", "no_class", "coarse", "both"),
                                            map(int, cells[1:5]), strict=True))
    return out


def test_the_documented_budget_is_what_a_page_carries():
    """The budget table's histogram rows are the series one label set shows once every
    prompt class, phase and bucket has a request, with each flag setting."""
    table = _budget_table()
    for fam in HISTOGRAMS:  # the most a label set can show: every sub-value, all buckets
        name = HISTOGRAM_NAMES[fam.key][0]
        k = len(fam.sub_values)
        nk = 1 if fam.sub_label == "prompt_class" else k
        want = {"full": k * (len(fam.buckets.bounds) + 3),
                "no_class": nk * (len(fam.buckets.bounds) + 3),
                "coarse": k * (len(coarse(fam.buckets).bounds) + 3),
                "both": nk * (len(coarse(fam.buckets).bounds) + 3)}
        assert table[name] == want, (name, table.get(name), want)
    counters = sum(len(COUNTERS[k][1]) for k in ("tokens", "requests"))
    assert set(table["phasewatch_tokens_total, phasewatch_requests_total"].values()) == {
        counters}
    assert set(table["phasewatch_sampled_requests_total"].values()) == {  # sampled traces
        len(COUNTERS["sampled_requests"][1])}
    total = {c: sum(row[c] for name, row in table.items() if name != "total")
             for c in ("full", "no_class", "coarse", "both")}
    assert table["total"] == total, (table["total"], total)


def test_the_gauges_stay_within_the_documented_budget(pages):
    """The roofline, verdict and engine-state gauges one label set carries on a page with
    a roofline and a verdict: within the table's row."""
    hist = {HISTOGRAM_NAMES[f.key][0] for f in HISTOGRAMS}
    counters = {"phasewatch_tokens", "phasewatch_requests"}
    per_family = _series(pages["text"])
    gauges = sum(n for name, n in per_family.items() if name not in hist | counters)
    budget = _budget_table()["roofline, verdict and engine-state gauges"]["full"]
    assert 10 <= gauges <= budget, (gauges, per_family)
    assert per_family["gen_ai_server_time_to_first_token_seconds"] <= _budget_table()[
        "gen_ai_server_time_to_first_token_seconds"]["full"]


@pytest.mark.parametrize("exposure", [Exposure(False, "full"), Exposure(True, "coarse"),
                                      Exposure(False, "coarse")])
def test_trimmed_pages_merge_exactly(exposure):
    """Without prompt classes each TTFT bucket is the sum over classes; with coarse
    buckets each kept bound's cumulative count is the full page's at that bound; the
    counts, sums and native histograms agree with the full page's."""
    agg = _aggregator(pod_label=False)
    full = {f.name: f for f in parse_text(HotText(agg).render(False).decode())}
    trimmed = {f.name: f for f in parse_text(HotText(agg, exposure).render(False).decode())}
    assert set(full) == set(trimmed)

    def merged(fam, drop: set[str]) -> dict:
        out: dict = {}
        for s in fam.samples:
            key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in drop)))
            out[key] = out.get(key, 0.0) + s.value
        return out

    for name, fam in full.items():
        drop = {"prompt_class"} if not exposure.prompt_class_label else set()
        want, got = merged(fam, drop), merged(trimmed[name], set())
        les = {dict(k[1]).get("le") for k in got} - {None}
        if exposure.classic_buckets == "coarse" and les:
            assert len(les) < len({dict(k[1]).get("le") for k in want} - {None}), name
        for key, value in got.items():
            assert want[key] == pytest.approx(value), (name, key)
        assert not any(dict(k[1]).keys() & drop for k in got)
    # the protobuf page (what Prometheus with native histograms reads) merges alike
    fams = {f.name: f for f in exposition.HotProto(agg, exposure).families()}
    whole = {f.name: f for f in exposition.HotProto(agg).families()}
    for name in ("gen_ai_server_time_to_first_token_seconds_native",
                 "gen_ai_server_time_to_first_token_seconds"):
        count = sum(m.histogram.sample_count for m in fams[name].metric)
        assert count == sum(m.histogram.sample_count for m in whole[name].metric)
        if not exposure.prompt_class_label:
            assert not any(lp.name == "prompt_class" for m in fams[name].metric
                           for lp in m.label)
    native = fams["gen_ai_server_time_to_first_token_seconds_native"]
    for m in native.metric:  # every native histogram's buckets add up to its count
        h = m.histogram
        assert h.zero_count + int(np.cumsum(h.positive_delta).sum()) == h.sample_count


def test_a_bad_classic_buckets_value_is_refused_at_start(capsys):
    from phasewatch.cli import main

    assert main(["serve", "--classic-buckets", "few", "--http-port", "0"]) == 2
    assert "classic_buckets must be one of full, coarse, not 'few'" in capsys.readouterr().err


def test_serve_help_comes_in_sections():
    """53 flags in one list was the stumble: every flag sits in a titled section, the model
    and hardware first."""
    import argparse

    from phasewatch.config import SERVE_GROUPS, SERVE_OPTIONS, add_serve_flags

    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    titled = {a.dest: g.title for g in parser._action_groups for a in g._group_actions}
    assert all(titled[o.name] not in ("options", "optional arguments") for o in SERVE_OPTIONS)
    assert SERVE_GROUPS[0][0] == "model and hardware"
    help_text = parser.format_help()
    assert help_text.index("model and hardware:") < help_text.index("listeners:")
    assert "(default ;" not in help_text


def test_serve_trims_its_page_with_the_two_flags(tmp_path):
    """The flags reach the served page: no prompt_class, only 1-2-5 bounds (and the top
    one), and the same request count as an untrimmed page would show."""
    sp = ServeProcess(tmp_path, "--prompt-class-label", "false", "--classic-buckets",
                      "coarse").start()
    try:
        with PhasewatchClient(f"127.0.0.1:{sp.grpc_port}", engine="vllm") as c:
            t0 = time.time() - 5
            for prompt in (100, 5000, 90_000):
                c.record("m", arrival=t0, scheduled=t0 + 0.01, first_token=t0 + 0.3,
                         last_token=t0 + 0.5, finish=t0 + 0.5, prompt_tokens=prompt,
                         output_tokens=3, token_times=[t0 + 0.3, t0 + 0.4, t0 + 0.5])
            assert c.flush(timeout=20)
        text = urllib.request.urlopen(f"http://127.0.0.1:{sp.http_port}/metrics",
                                      timeout=10).read().decode()
    finally:
        sp.stop()
    ttft = {f.name: f for f in parse_text(text)}["gen_ai_server_time_to_first_token_seconds"]
    assert not any("prompt_class" in s.labels for s in ttft.samples)
    les = [s.labels["le"] for s in ttft.samples if s.name.endswith("_bucket")]
    kept = coarse(next(f.buckets for f in HISTOGRAMS if f.key == "ttft")).bounds
    assert les[-1] == "+Inf" and [float(x) for x in les[:-1]] == list(kept), les
    assert 1.0 in kept  # the TTFT SLO alert's default threshold stays a bound
    count = next(s.value for s in ttft.samples if s.name.endswith("_count"))
    assert count == 3
