"""Which GPUs are a model's (``GpuSelector``), read through a real dcgm-exporter-shaped
page over HTTP (``GpuWatch``), and what the counters do to a verdict (``gpu_check``)."""

from __future__ import annotations

import pytest

from phasewatch.roofline.dcgm_exporter import DcgmExporterSource
from phasewatch.roofline.gpu_check import BOUND_ACTIVITY, check
from phasewatch.roofline.gpu_counters import CounterHistory, GpuCounters, GpuIdentity, GpuSample
from phasewatch.roofline.gpu_evidence import compare
from phasewatch.roofline.gpu_watch import GpuSelector, GpuSelectorError, GpuWatch
from tests.roofline.test_gpu_counters import U0, U1, Clock, page, serve  # noqa: F401

H100_BW, H100_BF16 = 3.35e12, 989e12


@pytest.mark.parametrize(("text", "want"), [
    ("", GpuSelector()),
    ("pod=vllm-0", GpuSelector(pod=("vllm-0",))),
    ("uuid=GPU-a|GPU-b", GpuSelector(uuid=("GPU-a", "GPU-b"))),
    (" gpu = 0|1 , pod=p ", GpuSelector(pod=("p",), index=("0", "1"))),
])
def test_a_selector_reads_pod_uuid_and_gpu(text, want):
    got = GpuSelector.parse(text)
    assert got == want
    assert got.any or GpuSelector.parse(str(got)) == got  # str() reads back
    assert str(GpuSelector()) == "every GPU"


@pytest.mark.parametrize("text", ["pod", "node=x", "uuid=", "pod=a,pod=b"])
def test_a_bad_selector_says_the_form(text):
    with pytest.raises(GpuSelectorError, match="gpu_select"):
        GpuSelector.parse(text)


def test_the_watch_reads_a_page_over_http_and_answers_each_models_gpus(serve):  # noqa: F811
    server = serve([page("dcgm-h100x2-t0.txt"), page("dcgm-h100x2-t1.txt")])
    clock = Clock(1000.0)
    source = DcgmExporterSource(server.url, clock=clock)
    watch = GpuWatch([source], {"llama": GpuSelector.parse("pod=vllm-llama-8b-0"),
                                "other": GpuSelector.parse(f"uuid={U1}")}, models=2)
    watch.poll()
    clock.t = 1005.0
    watch.poll()
    assert source.results["ok"] == 2 and server.hits == 2
    mine = watch.window("llama", 990.0, 1010.0)
    assert mine.samples == 2 and [g.uuid for g in mine.gpus] == [U0]
    assert mine.mean.dram_active == pytest.approx(0.042, abs=0.01)
    assert [g.uuid for g in watch.window("other", 990.0, 1010.0).gpus] == [U1]
    assert watch.window("llama", 1006.0, 1010.0) is None  # no sample in the range
    # a model no selector names, beside another: its counters could be anyone's
    assert watch.window("third", 990.0, 1010.0) is None
    assert "2 models" in watch.attribution("third").reason


def test_one_model_takes_every_gpu_the_source_sees(serve):  # noqa: F811
    server = serve([page("dcgm-h100x2-t0.txt")])
    watch = GpuWatch([DcgmExporterSource(server.url, clock=Clock(50.0))], {})
    watch.poll()
    got = watch.window("any", 0.0, 100.0)
    assert {g.uuid for g in got.gpus} == {U0, U1}


def test_a_failing_source_is_counted_and_the_next_is_read(serve):  # noqa: F811
    bad = serve(["not a page {"])
    good = serve([page("dcgm-h100x2-t0.txt")])
    first = DcgmExporterSource(bad.url, clock=Clock(50.0))
    second = DcgmExporterSource(good.url, clock=Clock(50.0))
    watch = GpuWatch([first, second], {})
    watch.poll()
    assert first.results["unparsable"] == 1 and second.results["ok"] == 1
    assert watch.window("m", 0.0, 100.0).source == "dcgm"


GPU0 = GpuIdentity(index="0", uuid="GPU-0")


def comparison(dram, tensor, dram_est, tensor_est, busy=1.0, n=30):
    h = CounterHistory()
    for k in range(n):
        h.add(GpuSample(at=100.0 + k, source="nvml", gpus=(
            GpuCounters(GPU0, dram_active=dram, tensor_active=tensor),)))
    rng = float(n)
    return compare(h.window(100.0, 100.0 + rng), 0.0, dram_est * H100_BW * rng, 0.0,
                   tensor_est * H100_BF16 * rng, rng, H100_BW, H100_BF16, busy)


def test_an_idle_gpu_turns_a_roofline_resource_into_overhead():
    # issue 39's H100: decode 3.0 % of the bandwidth estimated, DRAM 4.2 %, tensor 0.3 %
    got = check(comparison(0.042, 0.003, 0.030, 0.002), "memory_bandwidth", "m", "bf16", 1)
    assert got.outcome == "idle" and got.resource == "overhead"
    assert "tensor pipes were active 0.3% of the range" in got.sentence
    assert "100% of the range" in got.sentence


def test_an_idle_gpu_leaves_a_capacity_cause_and_adds_the_counters():
    got = check(comparison(0.042, 0.003, 0.030, 0.002), "capacity", "m", "bf16", 1)
    assert got.outcome == "idle" and got.resource is None
    assert got.sentence.startswith("GPU counters: the GPU's tensor pipes")


def test_an_estimate_above_the_counters_claims_no_resource_and_says_why():
    got = check(comparison(0.05, 0.02, 0.50, 0.01), "memory_bandwidth", "Llama-3.1-8B",
                "bf16", 2)
    assert got.outcome == "overstated" and got.resource == "unknown"
    assert "configured model (Llama-3.1-8B), dtype (bf16) or GPU count (2)" in got.sentence
    assert "the counters read 1 GPU, the deployment says 2" in got.sentence


@pytest.mark.parametrize(("dram", "busy", "outcome"), [
    (0.80, 1.0, "confirmed"), (0.40, 1.0, "not_confirmed"),
    (0.40, 0.5, "confirmed"),  # 0.8 of the time the engine was busy
])
def test_a_bandwidth_claim_is_checked_against_dram_while_busy(dram, busy, outcome):
    got = check(comparison(dram, 0.3, dram * 0.8, 0.1, busy=busy), "memory_bandwidth",
                "m", "bf16", 1)
    assert got.outcome == outcome and got.resource is None
    assert (min(dram / busy, 1.0) >= BOUND_ACTIVITY) == (outcome == "confirmed")


def test_a_compute_claim_is_checked_against_the_tensor_pipes():
    assert check(comparison(0.3, 0.9, 0.2, 0.7), "compute", "m", "bf16", 1).outcome == \
        "confirmed"
    got = check(comparison(0.3, 0.3, 0.2, 0.25), "compute", "m", "bf16", 1)
    assert got.outcome == "not_confirmed" and "tensor pipes were active 30%" in got.sentence


def test_a_resource_no_counter_bears_on_is_unchecked_with_the_counters_said():
    got = check(comparison(0.3, 0.3, 0.2, 0.2), "frontend", "m", "bf16", 1)
    assert got.outcome == "unchecked" and got.sentence.startswith("GPU counters:")
    summary = got.summary()
    assert summary["outcome"] == "unchecked"
    assert summary["dram_measured"] == pytest.approx(0.3)
    assert summary["counters"]["source"] == "nvml"
