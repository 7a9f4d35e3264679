"""The GPU's own counters through the running exporter: a dcgm-exporter page (in the shape
its renderer writes) served over real HTTP to ``--gpu-metrics-url``, simulated traffic in
over gRPC, and what /metrics and the JSON API say; NVML on this GPU-less machine."""

from __future__ import annotations

import re
import time
from dataclasses import replace

import pytest

from phasewatch import catalog
from phasewatch.app import Exporter
from phasewatch.roofline.deployments import ModelOptions
from tests.conftest import scrape, wait_for
from tests.dashboard.test_dashboard_cause import words
from tests.engines.gpu_findings import failures, gpu_block
from tests.roofline.test_gpu_counters import U0, Server, page
from tests.roofline.test_roofline_e2e import BASE, _api, _send_simulated, _wait

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
REQUESTS = catalog.REQUESTS.name


@pytest.fixture
def dcgm():
    server = Server([page("dcgm-h100x2-t0.txt"), page("dcgm-h100x2-t1.txt")])
    yield server
    server.close()


def _entry_with_gpu(ex: Exporter) -> dict:
    return _wait(lambda: next((m for m in _api(ex, "/api/v1/roofline")["models"]
                               if m.get("gpu") and m["verdict"]), None), 30)


# The estimate's range ends where its requests are complete, some seconds before the
# newest one ended (``range_end_lag_seconds``: ~9 s for a minute of "chat"); the counters
# are read over that range, so they must have been read for longer than that before the
# simulated minute, which ends now, is sent.
COUNTED_FOR = 13.0


def _counted(ex: Exporter, seconds: float = COUNTED_FOR) -> None:
    """Wait until the counters have been read for ``seconds``."""
    source = ex.gpus.sources[0]
    first = _wait(source.history.latest, 10).at
    _wait(lambda: source.history.latest().at - first >= seconds, seconds + 10)


def test_an_estimate_above_the_counters_blames_the_configuration(dcgm):
    # an 8B model at decode rates no idle GPU (DRAM 4 %, tensor 0.3 %) can carry: the
    # configured model, dtype or GPU count is wrong, and the verdict claims no resource
    config = replace(BASE, gpu_metrics_url=dcgm.url, model_flags=ModelOptions(
        model=LLAMA, hardware="H100-SXM", gpu_select="pod=vllm-llama-8b-0"))
    with Exporter(config) as ex:
        _counted(ex)
        _send_simulated(ex, "chat", 60.0, model=LLAMA)
        m = _entry_with_gpu(ex)
        gpu, v = m["gpu"], m["verdict"]
        assert gpu["outcome"] == "overstated", gpu
        assert gpu["counters"]["source"] == "dcgm"
        assert gpu["counters"]["gpus"] == [f"gpu 0 ({U0})"]  # the pod's GPU, not GPU 1
        assert gpu["dram_measured"] == pytest.approx(0.042, abs=0.01)
        assert gpu["dram_ratio"] > 1.1
        assert v["resource"] == "unknown"
        assert f"configured model ({LLAMA.split('/')[-1]}" in v["text"] or \
            "configured model (" in v["text"]
        assert "GPU count (1)" in v["text"]
        assert v["evidence"]["gpu"]["outcome"] == "overstated"
        s = scrape(ex.http_port)
        assert s.value("phasewatch_gpu_dram_active_ratio", model=LLAMA,
                       gpu_source="dcgm") == pytest.approx(0.042, abs=0.01)
        assert s.value("phasewatch_gpu_tensor_active_ratio", model=LLAMA,
                       gpu_source="dcgm") < 0.01
        assert s.value("phasewatch_gpu_estimate_over_measured_ratio", model=LLAMA,
                       counter="dram") > 1.1
        assert s.value("phasewatch_gpu_counted_gpus", model=LLAMA, gpu_source="dcgm") == 1
        assert s.value("phasewatch_gpu_check_info", model=LLAMA, outcome="overstated") == 1
        # make gpu-check fails such a run, saying why
        whys = failures([{"streams": 8, "gpu_check": gpu_block(m)}], on_gpu=True)
        assert any("the estimate's dram share" in w for w in whys), whys
        assert s.value("phasewatch_gpu_counter_reads_total", gpu_source="dcgm",
                       result="ok") >= 3
        (status,) = _api(ex, "/api/v1/status")["gpu_counters"]
        assert status["source"] == "dcgm" and status["url"] == dcgm.url
        assert status["reads"]["ok"] >= 3 and status["last_error"] == ""


def test_an_idle_gpu_under_a_busy_engine_is_overhead_with_the_counters(dcgm):
    # the same traffic spread over 64 GPUs: the estimate sits below the counters, and
    # the GPU's DRAM (4 %) and tensor pipes (0.3 %) were idle while requests decoded
    config = replace(BASE, gpu_metrics_url=dcgm.url, model_flags=ModelOptions(
        model=LLAMA, hardware="H100-SXM", gpus=64, gpu_select=f"uuid={U0}"))
    with Exporter(config) as ex:
        _counted(ex)
        _send_simulated(ex, "chat", 60.0, model=LLAMA)
        m = _entry_with_gpu(ex)
        gpu, v = m["gpu"], m["verdict"]
        assert gpu["outcome"] == "idle", gpu
        assert gpu["dram_ratio"] < 1
        assert v["resource"] == "overhead"
        assert "The GPU was nearly idle while the engine had work" in v["text"]
        # the two pages' 0.3 % and 0.1 %, by how often each was read
        said = re.search(r"tensor pipes were active (\d\.\d)% of the range", v["text"])
        assert said and 0.1 <= float(said.group(1)) <= 0.3, v["text"]
        assert any("CUDA graphs" in lever for lever in v["levers"]), v["levers"]
        assert failures([{"streams": 8, "gpu_check": gpu_block(m)}], on_gpu=True) == []
        point = gpu["point"]
        assert point["measured_flops_per_second"] > point["estimated_flops_per_second"]


def test_counters_of_several_models_need_a_selector(dcgm):
    # two models, no selector: the counters could be either's, so neither gets them
    config = replace(BASE, gpu_metrics_url=dcgm.url, models=(
        ModelOptions(model=LLAMA, hardware="H100-SXM"),
        ModelOptions(model="mistralai/Mistral-7B-v0.1", hardware="H100-SXM")))
    with Exporter(config) as ex:
        _counted(ex, 1.0)
        _send_simulated(ex, "chat", 30.0, model=LLAMA)
        _wait(lambda: _api(ex, "/api/v1/roofline")["models"][0]["verdict"])
        assert "gpu" not in _api(ex, "/api/v1/roofline")["models"][0]
        assert "no --gpu-select" in ex.gpus.attribution(LLAMA).reason


def test_a_bad_selector_fails_at_start_with_the_form():
    config = replace(BASE, gpu_metrics_url="http://127.0.0.1:9/metrics",
                     model_flags=ModelOptions(model=LLAMA, hardware="H100-SXM",
                                              gpu_select="node=a"))
    with pytest.raises(ValueError, match="pod=NAME"):
        Exporter(config)


def test_nvml_without_a_gpu_is_counted_never_a_crash():
    # this machine has no GPU: the real pynvml finds no library (or no driver)
    config = replace(BASE, gpu_nvml=True, model_flags=ModelOptions(model=LLAMA,
                                                                   hardware="H100-SXM"))
    with Exporter(config) as ex:
        _send_simulated(ex, "chat", 30.0, model=LLAMA)
        _wait(lambda: _api(ex, "/api/v1/roofline")["models"][0]["verdict"])
        time.sleep(0.5)
        s = scrape(ex.http_port)
        reads = {x.labels["result"]: x.value for x in s.samples
                 if x.name == "phasewatch_gpu_counter_reads_total"}
        assert set(reads) <= {"library_not_found", "driver_not_loaded", "no_gpu",
                              "no_pynvml"} and sum(reads.values()) >= 2, reads
        (status,) = _api(ex, "/api/v1/status")["gpu_counters"]
        assert status["source"] == "nvml" and status["last_error"] in reads
        assert "gpu" not in _api(ex, "/api/v1/roofline")["models"][0]


GPU_PANELS = ("GPU DRAM active: counted and estimated",
              "GPU tensor pipes active: counted and estimated", "Estimate over counted activity")


def test_grafanas_gpu_panels_and_the_dashboard_through_a_real_prometheus(dcgm, tmp_path):
    """A real Prometheus scraping an exporter that reads a dcgm-exporter page: every
    expression of Grafana's GPU panels (as generated, variables filled as Grafana would)
    returns the counters and the estimate beside them, and the dashboard's Prometheus
    source puts them on the banner as the exporter's own source does."""
    import json
    import sys

    from phasewatch.dashboard import panels
    from phasewatch.dashboard.prometheus_source import PrometheusSource
    from tests.support import ROOT
    from tests.support.prom import PrometheusServer

    sys.path.insert(0, str(ROOT / "grafana"))
    import generate as grafana

    doc = json.loads(grafana.OUT.read_text())
    exprs = [(t, e) for t, e in grafana.expressions(doc) if t in GPU_PANELS]
    assert len(exprs) == 5, exprs
    values = {"$__rate_interval": "1m", "$__range": "5m", "$model": ".*", "$engine": ".*",
              "$source": ".*", "$pod": ".*", "$job": ".*"}
    config = replace(BASE, gpu_metrics_url=dcgm.url, model_flags=ModelOptions(
        model=LLAMA, hardware="H100-SXM", gpu_select="pod=vllm-llama-8b-0"))
    with Exporter(config) as ex, \
            PrometheusServer(tmp_path, [f"127.0.0.1:{ex.http_port}"]) as prom:
        _counted(ex)
        # a first few requests, scraped, so that the minute after is an increase Prometheus
        # sees (a counter born at its value rates 0, and the dashboard shows no verdict)
        _send_simulated(ex, "chat", 5.0, model=LLAMA)
        _wait(lambda: prom.query(REQUESTS), 30)
        _send_simulated(ex, "chat", 60.0, model=LLAMA)
        _entry_with_gpu(ex)
        for title, expr in exprs:
            rows = _wait(lambda e=expr: prom.query(grafana.substitute(e, values)), 30)
            assert rows[0]["metric"]["model"] == LLAMA, (title, rows)
        source = PrometheusSource(prom.url, rate_range="30s")
        seen = []

        def with_gpu():
            s = source.fetch()
            seen[:] = [s.error, s.verdicts.to_dict("records")]
            return s if not s.verdicts.empty and isinstance(
                s.verdicts.iloc[0]["gpu_outcome"], str) else None

        snap = wait_for(with_gpu, 30, interval=0.5)
        assert snap is not None, seen
        row = snap.verdicts.iloc[0]
        assert row["gpu_outcome"] == "overstated" and row["gpu_source"] == "dcgm"
        assert row["gpu_dram"] == pytest.approx(0.042, abs=0.01) and row["gpu_gpus"] == 1
        chips = " ".join(words(c) for c in panels.gpu_chips(row))
        assert "GPU DRAM active 4." in chips and "(dcgm, 1 GPU)" in chips, chips
