"""Bearer-token authentication (--auth-token): every ingest path and the JSON API refuse
a missing or wrong token, with the refusal counted by receiver and reason, and accept
the right one; /metrics and the probes stay open. Real clients: the phasewatch client,
the OpenTelemetry SDK's OTLP exporters (gRPC and HTTP), the dashboard's source."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from phasewatch.app import Exporter
from phasewatch.client import PhasewatchClient
from phasewatch.config import ServeConfig
from phasewatch.dashboard.exporter_source import ExporterSource
from phasewatch.sim.otlp_shapes import OtlpSink
from phasewatch.sim.scenarios import scenario
from tests.conftest import TEST_PORTS, scrape

TOKEN = "s3cret-token"
RECORDS = scenario("chat").build(seed=2).run(4.0)


@pytest.fixture(scope="module")
def ex():
    with Exporter(ServeConfig(**TEST_PORTS, auth_token=TOKEN)) as exporter:
        yield exporter


def _finished(port: int, protocol: str) -> float:
    return scrape(port).value("phasewatch_ingest_accepted_total", protocol=protocol) or 0.0


def _refused(port: int, receiver: str, reason: str) -> float:
    return scrape(port).value("phasewatch_auth_refused_total", receiver=receiver,
                              reason=reason) or 0.0


@pytest.mark.parametrize("token,reason", [("", "missing_token"), ("wrong", "bad_token")])
def test_phasewatch_client_without_the_token_is_refused_and_counted(ex, token, reason):
    before = _refused(ex.http_port, "phasewatch", reason)
    client = PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine="vllm", token=token)
    for r in RECORDS[:10]:
        client.record_request(r)
    client.flush(timeout=10)
    client.close()
    # UNAUTHENTICATED is not retried: the client counts the batch as refused.
    assert client.stats["dropped_refused"] == 10 and client.stats["retries"] == 0
    assert _refused(ex.http_port, "phasewatch", reason) == before + 1
    assert _finished(ex.http_port, "phasewatch") == 0


def test_phasewatch_client_with_the_token_is_accepted(ex):
    client = PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine="vllm", token=TOKEN)
    for r in RECORDS:
        client.record_request(r)
    assert client.flush(timeout=10)
    client.close()
    assert client.stats["accepted"] == len(RECORDS)
    assert _finished(ex.http_port, "phasewatch") == len(RECORDS)


@pytest.mark.parametrize("protocol", ["otlp-grpc", "otlp-http"])
def test_otlp_sdk_exporters_need_the_token(ex, protocol):
    receiver = protocol.replace("-", "_")
    target = (f"127.0.0.1:{ex.otlp_grpc_port}" if protocol == "otlp-grpc"
              else f"http://127.0.0.1:{ex.otlp_http_port}/v1/traces")
    for token, reason in (("", "missing_token"), ("wrong", "bad_token")):
        before = _refused(ex.http_port, receiver, reason)
        sink = OtlpSink(protocol, target, "vllm", token=token)
        for r in RECORDS[:5]:
            sink.record_request(r)
        sink.close()
        assert sink.stats["failed"] == 5 and sink.stats["exported"] == 0, sink.stats
        assert _refused(ex.http_port, receiver, reason) >= before + 1
    assert _finished(ex.http_port, receiver) == 0
    sink = OtlpSink(protocol, target, "vllm", token=TOKEN)
    for r in RECORDS:
        sink.record_request(r)
    sink.close()
    assert sink.stats["exported"] == len(RECORDS), sink.stats
    assert _finished(ex.http_port, receiver) == len(RECORDS)


def _get(url: str, token: str = "") -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        assert e.code != 401 or e.headers["WWW-Authenticate"].startswith("Bearer")
        return e.code


def test_json_api_needs_the_token_but_metrics_and_probes_do_not(ex):
    base = f"http://127.0.0.1:{ex.http_port}"
    before = _refused(ex.http_port, "api", "missing_token")
    assert _get(f"{base}/api/v1/summary") == 401
    assert _get(f"{base}/api/v1/status", "wrong") == 401
    assert _get(f"{base}/api/v1/summary", TOKEN) == 200
    assert _refused(ex.http_port, "api", "missing_token") == before + 1
    assert _refused(ex.http_port, "api", "bad_token") >= 1
    for path in ("/metrics", "/healthz", "/readyz"):
        assert _get(base + path) == 200, path


def test_dashboard_source_passes_the_token(ex):
    url = f"http://127.0.0.1:{ex.http_port}"
    assert ExporterSource(url, token=TOKEN).fetch().error is None
    error = ExporterSource(url).fetch().error
    assert error is not None and error.kind == "http" and "401" in error.message


def test_without_a_token_configured_nothing_is_required():
    with Exporter(ServeConfig(**TEST_PORTS)) as ex:
        client = PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine="vllm", token="anything")
        for r in RECORDS[:5]:
            client.record_request(r)
        assert client.flush(timeout=10)
        client.close()
        assert _get(f"http://127.0.0.1:{ex.http_port}/api/v1/summary") == 200
        assert _finished(ex.http_port, "phasewatch") == 5
