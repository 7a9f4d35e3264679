"""The dcgm-exporter reader: pages in the shape dcgm-exporter renders (tests/fixtures/gpu),
served by a real HTTP server; matching the engine's GPUs, the window mean, and every bad
page counted with its reason, never raised."""

from __future__ import annotations

import http.server
import threading
import time

import pytest

from phasewatch.roofline.dcgm_exporter import DcgmExporterSource, GpuPageError, parse_page
from phasewatch.roofline.gpu_counters import (
    GpuCounters,
    GpuIdentity,
    GpuSample,
    select,
    window_means,
)
from tests import support

FIXTURES = support.FIXTURES / "gpu"
U0 = "GPU-5f1c3e0e-8d7a-4c1b-9a7e-2b1f0c3d4e5a"
U1 = "GPU-a2b4c6d8-1e3f-4a5b-8c7d-9e0f1a2b3c4d"


def page(name: str) -> str:
    return (FIXTURES / name).read_text()


class Server:
    """Serves ``pages`` in turn (the last one repeated) on port 0; ``delay`` before each."""

    def __init__(self, pages: list, delay: float = 0.0, status: int = 200):
        self.pages, self.hits = list(pages), 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = outer.pages[min(outer.hits, len(outer.pages) - 1)]
                outer.hits += 1
                time.sleep(delay)
                body = body.encode() if isinstance(body, str) else body
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the client gave up (the timeout test)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve():
    started = []

    def start(pages, **kw):
        s = Server(pages, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_a_default_page_reads_both_gpus_with_their_identity_and_units():
    sample = parse_page(page("dcgm-h100x2-t0.txt"), at=5.0)
    assert sample.source == "dcgm" and sample.at == 5.0 and len(sample.gpus) == 2
    g0, g1 = sample.gpus
    assert g0.identity == GpuIdentity(
        index="0", uuid=U0, device="nvidia0", model_name="NVIDIA H100 80GB HBM3",
        hostname="gpu-node-1", pci_bus_id="00000000:18:00.0", pod="vllm-llama-8b-0",
        namespace="inference", container="vllm")
    assert g1.identity.pod == "" and g1.identity.uuid == U1
    assert g0.dram_active == pytest.approx(0.042)
    assert g0.tensor_active == pytest.approx(0.003)
    assert g0.gr_engine_active == pytest.approx(0.961)
    assert g0.gpu_util == pytest.approx(0.97)  # a percent on the page, a ratio here
    assert g0.mem_copy_util == pytest.approx(0.04)
    assert (g0.fb_used_mib, g0.fb_free_mib, g0.sm_clock_mhz) == (72436, 8123, 1980)
    assert g0.power_w == pytest.approx(182.5)
    # commented out in the default counters file: missing, not 0
    assert g0.sm_active is None and g0.sm_occupancy is None and g0.fp16_active is None
    assert g1.dram_active == 0.0  # present and zero is zero


def test_mig_instances_are_rows_of_their_own_under_the_parent_uuid():
    gpus = parse_page(page("dcgm-h100-mig.txt")).gpus
    assert [(g.identity.mig_profile, g.identity.mig_instance) for g in gpus] == [
        ("3g.40gb", "1"), ("3g.40gb", "2")]
    assert {g.identity.uuid for g in gpus} == {U0}
    assert gpus[0].sm_active == pytest.approx(0.93)
    assert gpus[0].sm_occupancy == pytest.approx(0.41)
    assert "MIG 3g.40gb instance 1" in gpus[0].identity.name()


def test_old_namespace_and_old_hostname_labels_are_read():
    text = ('# TYPE DCGM_FI_PROF_DRAM_ACTIVE gauge\n'
            'DCGM_FI_PROF_DRAM_ACTIVE{gpu="3",uuid="GPU-x",device="nvidia3",'
            'Hostname="h",pod_name="p",pod_namespace="ns",container_name="c"} 0.5\n')
    ident = parse_page(text).gpus[0].identity
    assert (ident.index, ident.uuid, ident.hostname, ident.pod, ident.namespace,
            ident.container) == ("3", "GPU-x", "h", "p", "ns", "c")


def test_select_by_uuid_pod_and_index():
    gpus = parse_page(page("dcgm-h100x2-t0.txt")).gpus
    assert [g.identity.index for g in select(gpus, uuid=U1)] == ["1"]
    assert [g.identity.index for g in select(gpus, uuid=[U0, U1])] == ["0", "1"]
    assert [g.identity.index for g in select(gpus, pod="vllm-llama-8b-0")] == ["0"]
    assert [g.identity.index for g in select(gpus, index=[1])] == ["1"]
    assert [g.identity.index for g in select(gpus, index="0")] == ["0"]
    assert select(gpus, uuid=U1, pod="vllm-llama-8b-0") == ()
    assert select(gpus) == gpus
    mig = parse_page(page("dcgm-h100-mig.txt")).gpus
    assert len(select(mig, uuid=U0)) == 2 and len(select(mig, pod="vllm-llama-8b-0")) == 1


def test_reader_over_http_and_the_window_mean(serve):
    server = serve([page("dcgm-h100x2-t0.txt"), page("dcgm-h100x2-t1.txt")])
    clock = Clock(100.0)
    src = DcgmExporterSource(server.url, clock=clock)
    assert src.poll() is not None
    clock.t = 105.0
    assert src.poll() is not None
    assert src.results == {"ok": 2} and src.last_error == ""
    w = src.window(99.0, 106.0, pod="vllm-llama-8b-0")
    assert w.source == "dcgm" and w.samples == 2 and w.gpus == (w.per_gpu[0][0],)
    assert w.mean.dram_active == pytest.approx(0.043)
    assert w.mean.tensor_active == pytest.approx(0.0025)
    assert w.mean.gpu_util == pytest.approx(0.98)
    assert w.mean.sm_active is None  # no sample carried it
    summary = w.summary()
    assert summary["gpus"] == [f"gpu 0 ({U0})"] and summary["samples"] == 2
    assert summary["dram_active"] == pytest.approx(0.043) and "sm_active" not in summary
    assert src.window(101.0, 106.0, pod="vllm-llama-8b-0").mean.dram_active == pytest.approx(0.044)
    both = src.window(0, 200)
    assert len(both.gpus) == 2 and both.mean.dram_active == pytest.approx(0.0215)
    assert src.window(200, 300) is None
    assert src.window(0, 200, uuid="GPU-none") is None


def test_window_mean_weighs_each_gpu_once():
    a = GpuCounters(GpuIdentity(index="0"), dram_active=0.2)
    b = GpuCounters(GpuIdentity(index="1"), dram_active=0.6)
    samples = [GpuSample(1.0, "dcgm", (a, b)), GpuSample(2.0, "dcgm", (a,)),
               GpuSample(3.0, "dcgm", (a,))]
    w = window_means(samples, 0, 10)
    assert w.samples == 3 and w.mean.dram_active == pytest.approx(0.4)


def test_readings_over_periods_count_by_the_part_inside_the_window():
    """NVML GPM's readings tile time, each from the one before: a window counts each by
    the seconds of its period inside it. The load of issue 39's H200 run: a slow round
    (DRAM 2.7 % busy) then a fast one (6.9 %); a window from 0.2 s into the fast round
    reads the fast round, where counting the reading that ends inside it whole read
    the slow second before it too."""
    g = GpuIdentity(index="0")

    def reading(since, at, dram):
        return GpuSample(at, "nvml", (GpuCounters(g, dram_active=dram),), since=since)

    samples = [reading(9.0, 10.0, 0.027), reading(10.0, 11.0, 0.069),
               reading(11.0, 12.0, 0.069), reading(12.0, 13.0, 0.069)]
    w = window_means(samples, 10.2, 12.5)
    assert w.samples == 3 and w.covered == pytest.approx(2.3)
    assert w.mean.dram_active == pytest.approx(0.069) and w.coverage() == pytest.approx(1.0)
    # a window straddling the change: each round by its seconds inside
    w = window_means(samples, 9.5, 10.5)
    assert w.mean.dram_active == pytest.approx((0.5 * 0.027 + 0.5 * 0.069) / 1.0)
    # the readings cover half of a window that runs past the newest one
    assert window_means(samples, 12.0, 14.0).coverage() == pytest.approx(0.5)
    # readings at a moment (dcgm-exporter's) count whole where taken, their cover unknown
    point = window_means([GpuSample(10.0, "dcgm", (GpuCounters(g, dram_active=0.5),))],
                         9.0, 11.0)
    assert point.mean.dram_active == 0.5 and point.covered is None
    assert point.coverage() is None


def test_the_history_is_bounded(serve):
    server = serve([page("dcgm-h100x2-t0.txt")])
    src = DcgmExporterSource(server.url, keep=3)
    for _ in range(5):
        src.poll()
    assert len(src.history) == 3


BAD = [
    ("unparsable", "this is { not prometheus\n"),
    ("no_dcgm_families", "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3\n"),
    ("out_of_range", '# TYPE DCGM_FI_PROF_DRAM_ACTIVE gauge\n'
                     'DCGM_FI_PROF_DRAM_ACTIVE{gpu="0",UUID="GPU-x"} 4.2\n'),
    ("out_of_range", '# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n'
                     'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-x"} 140\n'),
]


@pytest.mark.parametrize(("reason", "text"), BAD)
def test_a_bad_page_is_a_counted_described_failure(serve, reason, text, caplog):
    with pytest.raises(GpuPageError) as e:
        parse_page(text)
    assert e.value.reason == reason
    server = serve([page("dcgm-h100x2-t0.txt"), text])
    seen = []
    src = DcgmExporterSource(server.url, on_result=seen.append)
    assert src.poll() is not None
    with caplog.at_level("WARNING", logger="phasewatch"):
        assert src.poll() is None
        assert src.poll() is None
    assert src.results == {"ok": 1, reason: 2} and seen == ["ok", reason, reason]
    assert src.last_error and len(caplog.records) == 1  # said once while it lasts
    assert len(src.history) == 1  # the good sample is kept


def test_a_nan_value_is_missing_not_zero():
    text = ('# TYPE DCGM_FI_PROF_DRAM_ACTIVE gauge\n'
            'DCGM_FI_PROF_DRAM_ACTIVE{gpu="0",UUID="GPU-x"} NaN\n'
            '# TYPE DCGM_FI_DEV_FB_USED gauge\nDCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-x"} 10\n')
    g = parse_page(text).gpus[0]
    assert g.dram_active is None and g.fb_used_mib == 10


def test_size_cap_http_error_and_unreachable(serve):
    big = serve([page("dcgm-h100x2-t0.txt")])
    src = DcgmExporterSource(big.url, max_bytes=1000)
    assert src.poll() is None and src.results == {"too_large": 1}
    gone = serve(["nope"], status=404)
    src = DcgmExporterSource(gone.url)
    assert src.poll() is None and src.results == {"http_error": 1}
    assert "404" in src.last_error
    closed = DcgmExporterSource("http://127.0.0.1:9/metrics", timeout=1.0)
    assert closed.poll() is None and closed.results == {"unreachable": 1}


def test_a_hung_server_times_out(serve):
    hung = serve([page("dcgm-h100x2-t0.txt")], delay=3.0)
    src = DcgmExporterSource(hung.url, timeout=0.3)
    t0 = time.monotonic()
    assert src.poll() is None
    assert time.monotonic() - t0 < 2.5
    assert src.results == {"unreachable": 1} and "timed out" in src.last_error


def test_only_http_urls():
    with pytest.raises(ValueError, match="http"):
        DcgmExporterSource("file:///etc/passwd")
