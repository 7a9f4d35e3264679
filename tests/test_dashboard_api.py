"""The dashboard's exporter source against a real exporter, up and down."""

import pytest

from dashboard.exporter_api import ExporterApi, ExporterUnreachable
from exporter.client import PhasewatchClient
from tests.prom import free_port

T = 1_700_000_000.0


def test_reads_summary_and_requests(exporter):
    with PhasewatchClient(f"127.0.0.1:{exporter.grpc_port}", engine="tgi") as c:
        c.record("m", arrival=T, scheduled=T + 0.1, first_token=T + 0.3, last_token=T + 0.5,
                 finish=T + 0.5, output_tokens=5, request_id="a")
        assert c.flush(10)
    api = ExporterApi(f"http://127.0.0.1:{exporter.http_port}")
    (m,) = api.summary()["models"]
    assert (m["model"], m["engine"], m["requests_in_window"]) == ("m", "tgi", 1)
    (r,) = api.recent_requests(limit=10, model="m")
    assert r["request_id"] == "a" and r["queue"] == pytest.approx(0.1, abs=1e-6)


def test_unreachable_exporter_names_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ExporterUnreachable) as e:
        ExporterApi(url, timeout=1).summary()
    assert url in str(e.value)
    with pytest.raises(ValueError, match="http://host:9464"):
        ExporterApi("localhost:9464")
