"""Frames, figures and panels on frames: empty, one request, many models, one model seen
by two sources (engine and tap, --source-label).

Frames come from a real exporter's JSON API (fed with the phasewatch client), so
the tests read what the dashboard reads; figures and panels are then pure
functions of those frames, checked without a browser.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from phasewatch.app import Exporter
from phasewatch.client import PhasewatchClient
from phasewatch.config import ServeConfig
from phasewatch.dashboard import figures, panels, queries
from phasewatch.dashboard.app import GRAPHS, build_figures
from phasewatch.dashboard.exporter_source import ExporterSource, snapshot_from_api
from phasewatch.dashboard.frames import ALL, Selection, Snapshot, SourceError
from phasewatch.roofline.deployments import ModelOptions
from phasewatch.sim.scenarios import scenario
from tests.conftest import TEST_PORTS
from tests.support import ROOT
from tests.support.prom import free_port

MODELS = {"Llama-3.1-8B": "long_generation", "Qwen2.5-7B": "rag", "Mistral-7B": "chat"}


def _config(*models: str, source_label: bool = False) -> ServeConfig:
    return ServeConfig(**TEST_PORTS, roofline_interval=600, source_label=source_label,
                       models=tuple(ModelOptions(model=m, hardware="H100-SXM") for m in models))


def _settle(ex: Exporter) -> None:
    """What the exporter's timer does every interval, done now: roofline and history."""
    ex.monitor.update()
    labels = ex.aggregator.labels
    ex.history.record(ex.aggregator.window.summary(labels.pairs(), names=labels.names))


def _snapshot(ex: Exporter, selection: Selection = ALL) -> Snapshot:
    snap = ExporterSource(f"http://127.0.0.1:{ex.http_port}").fetch(selection)
    assert snap.error is None, snap.error
    return snap


@pytest.fixture(scope="module")
def many():
    """Three models, each running its own scenario for 40 simulated seconds."""
    with Exporter(_config(*MODELS)) as ex:
        with PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine="vllm") as client:
            for model, name in MODELS.items():
                engine = scenario(name).build(seed=1, model=model)
                for r in engine.run(40.0, epoch=time.time() - 40.0):
                    client.record_request(r)
            assert client.flush(10)
        _settle(ex)
        time.sleep(0.01)
        _settle(ex)  # twice: a trail point and a history sample before the newest
        yield ex, _snapshot(ex)


SOURCES = ("engine", "tap")


@pytest.fixture(scope="module")
def two_sources():
    """One model seen two ways by an exporter run with --source-label: the engine's own
    records and a stream tap's (client-visible), 30 simulated seconds of each."""
    with Exporter(_config("Llama-3.1-8B", source_label=True)) as ex:
        for seed, source in enumerate(SOURCES, 1):
            with PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine="vllm",
                                  source=source) as client:
                engine = scenario("chat").build(seed=seed, model="Llama-3.1-8B")
                for r in engine.run(30.0, epoch=time.time() - 30.0):
                    client.record_request(r)
                assert client.flush(10)
        _settle(ex)
        time.sleep(0.01)
        _settle(ex)
        yield ex, _snapshot(ex)


# ---- empty --------------------------------------------------------------------------
def test_empty_frames_give_empty_figures_and_the_no_data_state():
    snap = Snapshot("exporter", "http://127.0.0.1:9464")
    figs = build_figures(snap)
    assert len(figs) == len(GRAPHS)
    for fig in figs:
        assert fig["data"] == []
        assert fig["layout"]["annotations"][0]["text"]  # says why it is empty
    state = panels.state_panel(snap)
    assert state.id == "state-empty" and "http://127.0.0.1:9464" in str(state.children)
    assert panels.banners(snap) == []


def test_an_idle_exporter_answers_empty_frames_with_every_column():
    with Exporter(_config("Llama-3.1-8B")) as ex:
        _settle(ex)
        snap = _snapshot(ex)
    assert snap.empty
    reference = Snapshot("exporter", "")
    for name in Snapshot.FRAMES:
        assert list(getattr(snap, name).columns) == list(getattr(reference, name).columns)


# ---- one request -----------------------------------------------------------------
def test_one_request_is_one_waterfall_bar_and_one_scatter_point():
    t = time.time() - 5
    with Exporter(_config("Llama-3.1-8B")) as ex:
        with PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine="vllm") as c:
            c.record("Llama-3.1-8B", arrival=t, scheduled=t + 0.1, first_token=t + 0.3,
                     last_token=t + 0.8, finish=t + 0.8, prompt_tokens=1500,
                     output_tokens=51, request_id="only",
                     token_times=[t + 0.3 + 0.01 * i for i in range(51)])
            assert c.flush(10)
        _settle(ex)
        snap = _snapshot(ex)
    (k,) = snap.kpis.to_dict("records")
    assert k["ttft_p50"] == pytest.approx(0.3, abs=1e-5)
    assert k["tpot_p50"] == pytest.approx(0.01, abs=1e-5)
    assert k["decode_share"] == pytest.approx(0.5 / 0.8, abs=1e-4)

    fig = figures.waterfall_figure(snap.waterfall)
    # no queued time in this record: no preprocess bar (it is inside the queue)
    assert [t["name"] for t in fig["data"]] == ["queue", "prefill", "decode"]
    widths = [t["x"][0] for t in fig["data"]]
    assert widths == pytest.approx([0.1, 0.2, 0.5], abs=1e-5)
    bases = [t["base"][0] for t in fig["data"]]
    assert bases == pytest.approx([-0.8, -0.7, -0.5], abs=1e-5)  # ends at 0: the newest end
    assert fig["data"][0]["y"] == ["only"]

    fig = figures.prompt_ttft_figure(snap.prompt_points, snap.prompt_classes)
    (points,) = [t for t in fig["data"] if t["name"] == "request"]
    assert points["x"] == [1500] and points["y"] == pytest.approx([0.3], abs=1e-5)
    p50 = next(t for t in fig["data"] if t["name"] == "class TTFT p50")
    assert p50["customdata"][0][0] == "1k-4k"

    cards = panels.kpi_cards(snap.kpis)
    ttft = next(c for c in cards if c.id == "kpi-ttft_p50")
    assert "300 ms" in str(ttft.children)


# ---- many models -------------------------------------------------------------------
def test_many_models_each_get_a_verdict_and_roofline_points(many):
    _, snap = many
    assert set(snap.labels["model"]) == set(MODELS)
    assert set(snap.labels["source"]) == {""}  # no --source-label: no source anywhere
    verdicts = {r["model"]: (r["phase"], r["resource"]) for r in snap.verdicts.to_dict(
        "records")}
    assert verdicts["Llama-3.1-8B"] == ("decode", "memory_bandwidth")
    assert verdicts["Qwen2.5-7B"] == ("prefill", "compute")
    fig = figures.roofline_figure(snap.points, snap.ceilings)
    markers = [t for t in fig["data"] if t.get("meta")]
    # one "now" marker per (model, phase), each named for its model when several are shown
    assert {(t["meta"], t["name"].split(" · ")[1].split("/")[0]) for t in markers} == {
        (p, m) for m in MODELS for p in ("prefill", "decode")}
    (ceiling,) = [t for t in fig["data"] if t["name"].startswith("datasheet")]
    ridge = 989e12 / 3.35e12
    assert ceiling["x"][1] == pytest.approx(ridge) and ceiling["y"][1] == pytest.approx(989e12)
    assert fig["layout"]["xaxis"]["type"] == fig["layout"]["yaxis"]["type"] == "log"
    banners = panels.banners(snap)
    assert len(banners) == 3 and {b.to_plotly_json()["props"]["data-model"]
                                  for b in banners} == set(MODELS)


def _filtered(ex, everything: Snapshot, selection: Selection, label: str) -> Snapshot:
    """The snapshot of ``selection`` (one value of ``label``): every frame holds that
    value only, and is not empty where the whole snapshot's is not."""
    snap = _snapshot(ex, selection)
    (wanted,) = getattr(selection, f"{label}s")
    for name in Snapshot.FRAMES:
        df = getattr(snap, name)
        assert set(df[label]) <= {wanted}, name
        if not getattr(everything, name).empty:
            assert not df.empty, name
    return snap


def test_selecting_one_model_filters_every_frame(many):
    ex, everything = many
    snap = _filtered(ex, everything, Selection(models=("Qwen2.5-7B",)), "model")
    assert set(snap.labels["model"]) == set(MODELS)  # the selector still offers all
    for fig in build_figures(snap):
        names = json.dumps([t.get("name") for t in fig["data"]])
        assert "Llama" not in names and "Mistral" not in names


def test_series_figures_draw_one_line_per_model_and_metric(many):
    _, snap = many
    fig = figures.ttft_figure(snap.series)
    assert sorted(t["name"] for t in fig["data"]) == sorted(
        f"TTFT {q} · {m}/vllm" for m in MODELS for q in ("p50", "p95"))
    shares = figures.shares_figure(snap.series)
    # the simulated engine reports when its engine queued each request: four phases
    assert [t["name"].split(" ·")[0] for t in shares["data"]] == [
        "preprocess", "queue", "prefill", "decode"]
    assert [t["stackgroup"] for t in shares["data"]] == ["shares"] * 4
    assert "pick one" in shares["layout"]["title"]["text"]


def _profile(path, part, device: str, bandwidth_gbps: float, tflops: float):
    """A hardware profile as ``phasewatch calibrate`` writes one."""
    path.write_text(json.dumps({
        "format": "phasewatch-hardware-profile/1", "part": part, "device": device,
        "devices": 1, "measured": {"bandwidth_gbps": bandwidth_gbps, "flops_tflops": {
            "bf16": tflops, "fp16": tflops, "fp32": tflops}}}))
    return str(path)


def test_roofline_names_a_calibrated_ceiling_measured_and_a_datasheet_one_datasheet(tmp_path):
    """Issue 37: on a CPU calibrate said "no datasheet figure", and the chart labelled its
    line "datasheet ceiling (AMD EPYC ...)". A part the catalog lacks has only its measured
    ceiling; a calibrated catalog part has both; a catalog part its datasheet's and the
    achievable one."""
    cpu = "AMD EPYC 7B13 (2 cores)"
    models = {"Llama-3.1-8B": ModelOptions(model="Llama-3.1-8B", hardware_profile=_profile(
                  tmp_path / "cpu.json", None, cpu, 19.4, 0.073)),
              "Qwen2.5-7B": ModelOptions(model="Qwen2.5-7B", hardware_profile=_profile(
                  tmp_path / "h100.json", "H100-SXM", "NVIDIA H100 80GB HBM3", 3000.0, 800.0)),
              "Mistral-7B": ModelOptions(model="Mistral-7B", hardware="H100-SXM")}
    config = ServeConfig(**TEST_PORTS, roofline_interval=600, models=tuple(models.values()))
    with Exporter(config) as ex:
        with PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine="vllm") as client:
            for model in models:
                for r in scenario("chat").build(seed=1, model=model).run(
                        10.0, epoch=time.time() - 10.0):
                    client.record_request(r)
            assert client.flush(10)
        _settle(ex)
        snap = _snapshot(ex)
    lines = {t["name"]: t for t in figures.roofline_figure(snap.points, snap.ceilings)["data"]
             if t["name"].endswith(")") and " ceiling (" in t["name"]}
    assert sorted(lines) == sorted([
        f"measured ceiling (calibrate, {cpu} x1)",  # its peaks are its measurement: one line
        "datasheet ceiling (H100-SXM x1)", "measured ceiling (calibrate, H100-SXM x1)",
        "achievable ceiling (H100-SXM x1)"])
    assert lines[f"measured ceiling (calibrate, {cpu} x1)"]["y"][1] == pytest.approx(0.073e12)
    assert lines["datasheet ceiling (H100-SXM x1)"]["y"][1] == pytest.approx(989e12)
    assert lines["measured ceiling (calibrate, H100-SXM x1)"]["y"][1] == pytest.approx(800e12)
    assert figures.ceiling_name("datasheet", "") == "datasheet ceiling"  # Prometheus: no part


def test_roofline_tolerates_a_ceiling_without_a_figure():
    from phasewatch.dashboard.frames import CEILING_COLUMNS, POINT_COLUMNS, frame

    ceilings = frame(CEILING_COLUMNS, [
        {"model": "m", "engine": "e", "hardware": "", "ceiling": "datasheet",
         "bandwidth": 3.35e12, "flops": float("nan")},
        {"model": "m", "engine": "e", "hardware": "", "ceiling": "achievable",
         "bandwidth": 3.0e12, "flops": 8e14}])
    points = frame(POINT_COLUMNS, [{"model": "m", "engine": "e", "at": 1.0, "phase": "decode",
                                    "intensity": 20.0, "flops": 5e13, "latest": True}])
    fig = figures.roofline_figure(points, ceilings)
    assert [t["name"] for t in fig["data"]] == ["achievable ceiling", "decode"]


def test_snapshot_from_api_is_pure_and_skips_missing_phases():
    summary = {"window_seconds": 30, "models": []}
    requests = [{"request_id": "a", "model": "m", "engine": "e", "arrival": 10.0, "queue": 1.0,
                 "prefill": None, "decode": 2.0, "prompt_tokens": 5, "ttft": None}]
    snap = snapshot_from_api(summary, {"models": []}, {"series": []}, requests)
    assert snap.waterfall.empty and snap.prompt_points.empty and snap.empty


# ---- states ---------------------------------------------------------------------------
def test_error_states_name_what_failed_and_keep_the_last_time():
    down = Snapshot("exporter", "http://x:1", error=SourceError(
        "unreachable", "cannot reach the exporter: refused", "http://x:1/api/v1/summary"))
    state = panels.state_panel(down, last_ok=time.time())
    assert state.id == "state-unreachable"
    text = json.dumps(state.to_plotly_json(), default=str)
    assert "Exporter unreachable" in text and "http://x:1/api/v1/summary" in text
    assert "figures below show the data of" in text
    failing = Snapshot("prometheus", "http://p:9090", error=SourceError(
        "query", "Prometheus query failed: parse error", "rate(x[1q])"))
    state = panels.state_panel(failing)
    assert state.id == "state-query-error" and "rate(x[1q])" in json.dumps(
        state.to_plotly_json(), default=str)


def test_the_exporter_source_names_the_url_when_unreachable():
    url = f"http://127.0.0.1:{free_port()}"
    snap = ExporterSource(url, timeout=1).fetch()
    assert snap.error.kind == "unreachable" and snap.error.target.startswith(url)
    with pytest.raises(ValueError, match=re.escape("http://127.0.0.1:9464")):
        ExporterSource("localhost:9464")


# ---- PromQL -------------------------------------------------------------------------
def test_queries_render_the_selection_and_escape_regex_values():
    sel = queries.matcher(models=("Llama-3.1-8B", 'we"ird'), pods=("p-1",))
    assert sel == 'model=~"Llama-3\\\\.1-8B|we\\"ird",pod=~"p-1"'
    q = queries.render(queries.KPIS["output_tokens_per_second"], sel, "1m")
    # source kept apart (engine, tap, joined); series without it aggregate as before
    assert q == ('sum by (model, engine, source) (rate(phasewatch_tokens_total{' + sel +
                 ',kind="output"}[1m]))')
    bare = queries.render(queries.KPIS["ttft_p95"], "", "5m")
    assert bare == ("histogram_quantile(0.95, sum by (model, engine, source) (rate("
                    "gen_ai_server_time_to_first_token_seconds_native[5m]))) or "
                    "histogram_quantile(0.95, sum by (model, engine, source, le) (rate("
                    "gen_ai_server_time_to_first_token_seconds_bucket[5m])))")
    assert queries.render(queries.LABEL_SETS, "", "1m", pod_label="kubernetes_pod") == (
        "count by (model, engine, source, kubernetes_pod) (phasewatch_requests_total)")
    assert queries.matcher(models=("m",), sources=("joined", "tap")) == (
        'model=~"m",source=~"joined|tap"')


def test_frames_keep_their_columns_after_selection(many):
    _, snap = many
    picked = snap.select(models=("nope",))
    for name in Snapshot.FRAMES:
        assert list(getattr(picked, name).columns) == list(getattr(snap, name).columns)
        assert getattr(picked, name).empty
    assert picked.empty and len(picked.labels) == len(snap.labels)


def test_bench_compare_lays_out_the_kpis_as_vllm_bench_serve():
    """The "Compare with vllm bench serve" block: one per label set, vLLM's rows and
    units (ms), unknown figures as "-", never a made-up 0."""
    from phasewatch.dashboard.frames import KPI_COLUMNS, LATENCIES, LATENCY_STATS, frame

    row = {"model": "m", "engine": "vllm", "pod": "", "requests_in_range": 120.0,
           "prompt_tokens_in_range": 24_000.0, "output_tokens_in_range": 6_000.0,
           "range_seconds": 60.0,
           **{f"{k}_{s}": 0.001 * (i + 1) * (j + 1)
              for i, k in enumerate(LATENCIES) for j, s in enumerate(LATENCY_STATS)}}
    row["itl_p99"] = float("nan")
    (pre,) = panels.bench_blocks(frame(KPI_COLUMNS, [row]), "prometheus")
    lines = dict(line.split(":", 1) for line in pre.children.splitlines() if ":" in line)
    assert lines["Successful requests"].strip() == "120"
    assert float(lines["Request throughput (req/s)"]) == pytest.approx(2.0)
    assert float(lines["Total Token throughput (tok/s)"]) == pytest.approx(500.0)
    assert float(lines["Mean TTFT (ms)"]) == pytest.approx(1.0)
    assert float(lines["P99 E2EL (ms)"]) == pytest.approx(4 * 5.0)
    assert lines["P99 ITL (ms)"].strip() == "-"
    assert "m/vllm (prometheus, last 60 s)" in lines["Source"]


# ---- sources (--source-label) ---------------------------------------------------------
def _names(fig: dict) -> list[str]:
    return [t.get("name") or "" for t in fig["data"]]


def test_two_sources_are_told_apart_in_every_figure_and_panel(two_sources):
    """A tap's client-visible TTFT and the engine's own are two label sets, never pooled:
    each gets its own KPIs, lines, roofline points and verdict, named by its source."""
    _, snap = two_sources
    assert sorted(snap.labels["source"]) == sorted(SOURCES)
    for name in Snapshot.FRAMES:
        # the waterfall holds the newest requests only (here all from the tap, sent last);
        # one exporter labels no pods, so it has no replicas side by side
        if name not in ("waterfall", "replicas"):
            assert set(getattr(snap, name)["source"]) == set(SOURCES), name
    assert sorted(snap.kpis["source"]) == sorted(SOURCES)  # one row each
    assert sorted(_names(figures.ttft_figure(snap.series))) == sorted(
        f"TTFT {q} · Llama-3.1-8B/vllm ({s})" for s in SOURCES for q in ("p50", "p95"))
    markers = [t for t in figures.roofline_figure(snap.points, snap.ceilings)["data"]
               if t.get("meta")]
    assert sorted(t["name"] for t in markers) == sorted(
        f"{p} · Llama-3.1-8B/vllm ({s})" for s in SOURCES for p in ("prefill", "decode"))
    prompt = _names(figures.prompt_ttft_figure(snap.prompt_points, snap.prompt_classes))
    assert {n.split(" · ")[1] for n in prompt} == {f"Llama-3.1-8B/vllm ({s})" for s in SOURCES}
    bars = figures.waterfall_figure(snap.waterfall)["data"][0]["y"]
    assert bars and all(y.split(": ")[0] in SOURCES for y in bars)  # "tap: <request id>"
    banners = [b.to_plotly_json()["props"] for b in panels.banners(snap)]
    assert sorted(b["data-source"] for b in banners) == sorted(SOURCES)
    ttft = next(c for c in panels.kpi_cards(snap.kpis) if c.id == "kpi-ttft_p50")
    assert all(f"Llama-3.1-8B/vllm ({s})" in str(ttft.children) for s in SOURCES)


def test_selecting_a_source_filters_every_frame(two_sources):
    ex, everything = two_sources
    snap = _filtered(ex, everything, Selection(sources=("tap",)), "source")
    assert sorted(snap.labels["source"]) == sorted(SOURCES)  # the selector still offers both
    assert len(snap.kpis) == 1 and len(snap.verdicts) == 1
    for fig in build_figures(snap):
        assert "engine" not in json.dumps(_names(fig))
    bars = figures.waterfall_figure(snap.waterfall)["data"][0]["y"]
    assert bars and all(y.startswith("tap: ") for y in bars)


def _refresh(app, sources=None) -> dict:
    """One refresh of the page, as the browser asks for it: the callback's outputs by id."""
    client = app.server.test_client()
    assert client.get("/").status_code == 200
    (key,) = app.callback_map
    outputs = [dict(zip(("id", "property"), o.rsplit(".", 1), strict=True))
               for o in key.strip(".").split("...")]
    inputs = [{"id": i, "property": p, "value": v} for i, p, v in (
        ("tick", "n_intervals", 1), ("model", "value", None), ("engine", "value", None),
        ("pod", "value", None), ("request-source", "value", sources))]
    r = client.post("/_dash-update-component", json={
        "output": key, "outputs": outputs, "inputs": inputs,
        "changedPropIds": ["tick.n_intervals"], "state": []})
    assert r.status_code == 200, r.data
    return json.loads(r.data)["response"]


class _Fixed:
    """A source answering one snapshot, narrowed to each selection, as the exporter's."""

    name, url = "exporter", "http://127.0.0.1:9464"

    def __init__(self, snap: Snapshot):
        self.snap = snap
        self.selections: list[Selection] = []

    def fetch(self, selection: Selection) -> Snapshot:
        self.selections.append(selection)
        return self.snap.select(selection.models, selection.engines, selection.pods,
                                selection.sources)


def test_the_source_selector_shows_only_when_sources_are_reported(two_sources, many):
    from phasewatch.dashboard.app import create_app

    source = _Fixed(two_sources[1])
    page = _refresh(create_app(source))
    assert page["request-source-wrap"]["style"] == {}
    assert [o["value"] for o in page["request-source"]["options"]] == sorted(SOURCES)
    assert page["pod-wrap"]["style"] == {"display": "none"}
    picked = _refresh(create_app(source), sources=["tap"])
    assert source.selections[-1] == Selection(sources=("tap",))
    assert "(engine)" not in json.dumps(picked["cards"]) and "engine" not in json.dumps(
        _names(picked["ttft-series"]["figure"]))
    # the choice stays offered with the other one, so it can be widened again
    assert [o["value"] for o in picked["request-source"]["options"]] == sorted(SOURCES)
    # an exporter without --source-label: no selector, as before
    page = _refresh(create_app(_Fixed(many[1])))
    assert page["request-source-wrap"]["style"] == {"display": "none"}
    assert page["request-source"]["options"] == []


def test_prompt_classes_sit_at_their_middle_and_ttft_reads_in_ms_and_s():
    """Issue 26: the 0-256 class was drawn at 2 tokens, and the log TTFT axis printed
    ``200m 100ms 90m`` (mixed units, crowded minor labels)."""
    from phasewatch.dashboard.frames import PROMPT_CLASS_COLUMNS, PROMPT_POINT_COLUMNS, frame

    key = {"model": "m", "engine": "vllm", "pod": "", "source": ""}
    classes = frame(PROMPT_CLASS_COLUMNS, [
        {**key, "prompt_class": c, "min_tokens": lo, "max_tokens": hi, "ttft_p50": p50,
         "ttft_p95": p50 * 3, "prefill_per_token_p50": 1e-4, "count": 10}
        for c, lo, hi, p50 in (("0-256", 0, 256, 0.03), ("256-1024", 256, 1024, 0.08),
                               ("8192+", 8192, float("inf"), 0.9))])
    fig = figures.prompt_ttft_figure(frame(PROMPT_POINT_COLUMNS), classes)
    line = next(t for t in fig["data"] if t["name"].startswith("class TTFT p50"))
    assert line["x"] == [128.0, 640.0, 12288.0]  # the open top: as if up to 2x its min
    y = fig["layout"]["yaxis"]
    assert y["tickmode"] == "array" and "tickformat" not in y
    assert all(re.fullmatch(r"[0-9.]+ (ms|s)", t) for t in y["ticktext"]), y["ticktext"]
    assert "100 ms" in y["ticktext"] and "1 s" in y["ticktext"]
    assert min(y["tickvals"]) <= 0.03 and max(y["tickvals"]) >= 2.7
    assert len(y["tickvals"]) <= 3 * 3  # 1-2-5 in each of the decades shown, no more
    x = fig["layout"]["xaxis"]  # prompt lengths likewise: 100 200 500 1k ..., not "2"
    assert x["ticktext"] == ["100", "200", "500", "1k", "2k", "5k", "10k", "20k"], x


def test_a_stopped_workload_drops_its_verdict_and_says_so():
    """Issue 26: once the window empties, the roofline's last verdict must not stay on
    the page, and the page says the window is empty, not "point your traces here"."""
    from phasewatch.dashboard.exporter_source import in_window_only
    from phasewatch.dashboard.frames import VERDICT_COLUMNS, frame

    row = {"model": "m", "engine": "vllm", "pod": "", "source": "", "phase": "decode",
           "resource": "memory_bandwidth", "confidence": 1.0}
    stopped = in_window_only(snapshot_from_api({"window_seconds": 30, "models": []},
                                               {"models": []}, {"series": []}, []), 1)
    stopped.verdicts = frame(VERDICT_COLUMNS, [row])
    stopped = in_window_only(stopped, 1)
    assert stopped.verdicts.empty and stopped.idle
    state = panels.state_panel(stopped)
    assert state.id == "state-idle" and "No requests in the last 30 s" in str(state.children)
    assert panels.banners(stopped) == []
    figs = dict(zip(GRAPHS, build_figures(stopped), strict=True))
    for g in ("roofline", "prompt-ttft", "waterfall"):  # not "... yet"
        assert figs[g]["layout"]["annotations"][0]["text"] == "No requests in the last 30 s"
    never = in_window_only(snapshot_from_api({"models": []}, {"models": []},
                                             {"series": []}, []), 0)
    assert not never.idle and panels.state_panel(never).id == "state-empty"
    assert "--model" in build_figures(never)[0]["layout"]["annotations"][0]["text"]


# ---- docs ----------------------------------------------------------------------------------
def test_every_scenario_the_dropdown_offers_is_documented():
    """Issue 26: the demo's scenario dropdown offered ``api_bound``, which no doc named.
    docs/commands.md's scenario table lists exactly the simulator's scenarios (the
    dropdown offers every one), each with its workload and the banner it gives."""

    from phasewatch.sim.scenarios import SCENARIOS

    text = (ROOT / "docs" / "commands.md").read_text()
    table = text.split("| scenario | workload | the banner reads |", 1)[1].split("\n\n", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in table.strip().splitlines()[1:]]
    documented = [row[0].strip("`") for row in rows]
    assert sorted(documented) == sorted(SCENARIOS), documented
    assert all(len(row) == 3 and row[1] and row[2] for row in rows), rows


# ---- the roofline's trail ----------------------------------------------------------
def _trail_note(fig: dict) -> str:
    return " ".join(a["text"] for a in fig["layout"].get("annotations", ()))


def test_the_roofline_says_what_its_trail_is_and_it_grows_toward_now():
    """Issue 26: the faint trail of earlier operating points was in no legend. The figure
    says what the small dots are (each phase over the span they cover, newest largest),
    they grow toward now, and each trail hides and shows with its phase's point now."""
    from phasewatch.dashboard.frames import CEILING_COLUMNS, POINT_COLUMNS, frame

    key = {"model": "m", "engine": "vllm", "pod": "", "source": ""}
    points = frame(POINT_COLUMNS, [
        {**key, "at": 1000.0 + t, "phase": phase, "intensity": i * (1 + t / 1000),
         "flops": f, "latest": t == 120}
        for phase, i, f in (("prefill", 800.0, 7e14), ("decode", 10.0, 2e13))
        for t in range(0, 121, 15)])
    fig = figures.roofline_figure(points, frame(CEILING_COLUMNS))
    assert _trail_note(fig) == ("Small dots: each phase over the last 2 min, newest "
                                "largest; big dots: now")
    for phase in ("prefill", "decode"):
        (now,) = [t for t in fig["data"] if t.get("meta") == phase]
        (trail,) = [t for t in fig["data"] if not t.get("meta")
                    and t.get("legendgroup") == now["legendgroup"]]
        sizes = trail["marker"]["size"]
        assert len(sizes) == 8 and sizes == sorted(sizes) and sizes[0] < sizes[-1]
        assert sizes[-1] < now["marker"]["size"]  # the point now stays the largest
        assert trail["customdata"][0] == 120 and trail["customdata"][-1] == 15  # s ago
    assert figures.span_text(40) == "40 s" and figures.span_text(300) == "5 min"
    only_now = points[points["latest"]]  # no trail yet: nothing to explain
    assert _trail_note(figures.roofline_figure(only_now, frame(CEILING_COLUMNS))) == ""


def test_a_live_roofline_explains_its_trail(many):
    """The trails of a real exporter's points: one per (model, phase), explained."""
    _, snap = many
    fig = figures.roofline_figure(snap.points, snap.ceilings)
    groups = {t["legendgroup"] for t in fig["data"] if t.get("meta")}
    trails = {t["legendgroup"] for t in fig["data"]
              if t.get("legendgroup") and not t.get("meta")}
    assert groups and trails == groups, (groups, trails)
    assert "newest largest" in _trail_note(fig)


def test_every_legend_row_has_room_under_the_x_axis():
    """A legend wrapped over several rows rode up over the x-axis title (Plotly grew the
    bottom margin for it and shrank the plot, and the legend sits at a fraction of the
    plot). The bottom margin holds the axis and every row, whatever the entries."""
    from phasewatch.dashboard import layout as layout_

    short = [f"e{i}" for i in range(3)]
    long = [f"class TTFT p95 · Model-{i}/vllm (engine)" for i in range(6)]
    assert layout_.legend_rows(short) == 1
    assert layout_.legend_rows(long) == 6  # each ~290 px: one a row at 440 px
    for names in (short, long):
        data = [{"type": "scatter", "name": n, "x": [1], "y": [1]} for n in names]
        layout = layout_.figure(data, "t", {"type": "date"}, {})["layout"]
        rows = layout_.legend_rows(names)
        plot = layout["height"] - layout["margin"]["t"] - layout["margin"]["b"]
        assert plot == layout_.PLOT_PX
        below = -layout["legend"]["y"] * plot  # px from the plot's bottom to the legend
        assert below >= layout_.BELOW_AXIS_PX["date"]
        assert layout["margin"]["b"] >= below + rows * layout_.LEGEND_ROW_PX


def test_an_idle_engines_banner_says_why_it_offers_no_lever():
    """An engine busy a few % of the window gets "Nothing to fix" and no lever from the
    exporter; the banner's lever line said "not enough evidence yet" beside it."""
    key = {"model": "m", "engine": "sglang"}
    verdict = {"phase": "prefill", "resource": "compute", "confidence": 0.9, "levers": [],
               "text": "Nothing to fix: the engine had a request in prefill or decode only "
                       "7% of the window. Prefill takes 66% of request time.",
               "evidence": {"phase_time_share": {"prefill": 0.66, "decode": 0.34},
                            "busy_share": 0.07, "idle": True}}
    summary = {"window_seconds": 10, "models": []}
    for idle, words in ((True, "No lever: the engine is idle most of the window"),
                        (False, "No lever: not enough evidence yet")):
        v = {**verdict, "evidence": {**verdict["evidence"], "idle": idle}}
        snap = snapshot_from_api(summary, {"models": [{**key, "verdict": v}]},
                                 {"series": []}, [])
        (banner,) = panels.banners(snap)
        assert words in str(banner.to_plotly_json()), idle
    prometheus = {**snap.verdicts.iloc[0].to_dict(), "idle": float("nan")}  # unknown
    assert "not enough evidence" in str(panels.banner(prometheus).to_plotly_json())


def test_prometheus_states_speak_of_prometheus_and_its_range():
    """The empty, stopped and no-verdict states through Prometheus: what it holds and its
    --range, not one exporter's window (its range may outlast an exporter's window, whose
    verdict then goes first: "requests are arriving" was wrong then)."""
    from phasewatch.dashboard.frames import KPI_COLUMNS, frame

    url = "http://prometheus:9090"
    empty = panels.state_panel(Snapshot("prometheus", url, window_seconds=60.0))
    assert empty.id == "state-empty" and "scrape" in str(empty.children)
    idle = panels.state_panel(Snapshot("prometheus", url, window_seconds=60.0, idle=True))
    assert idle.id == "state-idle" and "No requests in the last 60 s" in str(idle.children)
    assert "--range" in str(idle.children)
    row = {"model": "m", "engine": "vllm", "pod": "", "source": "", "request_rate": 0.5}
    for source, words in (("prometheus", "drops it once that window has none"),
                          ("exporter", "estimated every few seconds")):
        snap = Snapshot(source, url, window_seconds=60.0, kpis=frame(KPI_COLUMNS, [row]))
        (waiting,) = panels.banners(snap)
        assert waiting.id == "state-no-verdict" and words in str(waiting.children), source
        assert "arriving" not in str(waiting.children)
