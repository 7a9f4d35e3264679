"""TLS and mutual TLS on every port, with certificates made in the test and real clients:
the phasewatch client, the OpenTelemetry SDK's OTLP/gRPC and OTLP/HTTP exporters,
HTTPS for /metrics and the JSON API. A client without the right certificate is
refused and the refusal counted; the right one succeeds; changed files are reloaded."""

from __future__ import annotations

import shutil
import socket
import ssl
import time
import urllib.error
import urllib.request
from dataclasses import replace

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from phasewatch.app import Exporter
from phasewatch.client import PhasewatchClient
from phasewatch.config import ServeConfig
from phasewatch.requests.record import RequestRecord
from phasewatch.sim.scenarios import scenario
from phasewatch.transport.tls import ClientTls
from tests.conftest import TEST_PORTS, Scrape
from tests.ingest.test_otlp import _send
from tests.support.certs import make_certs

# how a refused handshake reaches urllib: wrapped, or (TLS 1.3: the server's alert
# comes with the first read) as the SSL error itself
REFUSED = (urllib.error.URLError, ssl.SSLError, ConnectionError)


def _record(t0: float) -> RequestRecord:
    return RequestRecord("m", arrival=t0, scheduled=t0 + 0.01, first_token=t0 + 0.1,
                         last_token=t0 + 0.5, finish=t0 + 0.5, prompt_tokens=10,
                         output_tokens=5)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def mtls(certs):
    ex = Exporter(replace(ServeConfig(**TEST_PORTS), tls_cert_file=certs.server_cert,
                          tls_key_file=certs.server_key, tls_client_ca_file=certs.ca)).start()
    yield ex
    ex.stop(grace=1)


def _https(url: str, ca: str, cert: str = "", key: str = "") -> tuple[int, bytes]:
    ctx = ssl.create_default_context(cafile=ca)
    if cert:
        ctx.load_cert_chain(cert, key)
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _metrics(ex, certs) -> Scrape:
    code, body = _https(f"https://127.0.0.1:{ex.http_port}/metrics", certs.ca)
    assert code == 200
    return Scrape(body.decode())


def _refused(m: Scrape, receiver: str, reason: str) -> float:
    return m.value("phasewatch_auth_refused_total", receiver=receiver, reason=reason) or 0


def _phasewatch(ex, n: int, **tls) -> dict:
    client = PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine="vllm", timeout=2.0, **tls)
    for _ in range(n):
        client.record_request(_record(time.time() - 5))
    client.flush(timeout=3)
    client.close(timeout=1)
    return client.stats


def test_phasewatch_client_needs_a_certificate_from_the_ca(mtls, certs):
    good = _phasewatch(mtls, 5, tls_ca=certs.ca, tls_cert=certs.client_cert,
                       tls_key=certs.client_key)
    none = _phasewatch(mtls, 3, tls_ca=certs.ca)
    rogue = _phasewatch(mtls, 3, tls_ca=certs.ca, tls_cert=certs.rogue_cert,
                        tls_key=certs.rogue_key)
    assert good["accepted"] == 5
    for refused in (none, rogue):  # nothing delivered, and the client says so
        assert refused["accepted"] == 0
        assert sum(v for k, v in refused.items() if k.startswith("dropped_")) == 3, refused
    m = _metrics(mtls, certs)
    assert _refused(m, "phasewatch", "no_client_certificate") >= 1
    assert _refused(m, "phasewatch", "bad_certificate") >= 1
    assert m.value("phasewatch_ingest_accepted_total", protocol="phasewatch") == 5


@pytest.fixture(scope="module")
def spans():
    records = scenario("chat").build(seed=5).run(4.0, epoch=time.time() - 10)
    mem = InMemorySpanExporter()
    _send("vllm", mem, records)
    return mem.get_finished_spans()


def test_otel_sdk_exporters_over_mutual_tls(mtls, certs, spans, monkeypatch):
    # requests lets REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE override a session's own CA file
    # (psf/requests#3829), and this machine sets them: clear them so that the SDK's
    # certificate_file is what is trusted, as on a machine without them.
    for var in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
        monkeypatch.delenv(var, raising=False)
    def grpc_sdk(cert: str, key: str):
        creds = ClientTls(certs.ca, cert, key).grpc_credentials()
        return Grpc(endpoint=f"127.0.0.1:{mtls.otlp_grpc_port}", credentials=creds, timeout=3)

    def http_sdk(cert: str, key: str):
        return Http(endpoint=f"https://127.0.0.1:{mtls.otlp_http_port}/v1/traces",
                    certificate_file=certs.ca, client_certificate_file=cert or None,
                    client_key_file=key or None, timeout=3)

    for make in (grpc_sdk, http_sdk):
        ok = make(certs.client_cert, certs.client_key)
        assert ok.export(spans) == SpanExportResult.SUCCESS
        ok.shutdown()
        for cert, key in (("", ""), (certs.rogue_cert, certs.rogue_key)):
            bad = make(cert, key)
            assert bad.export(spans) == SpanExportResult.FAILURE
            bad.shutdown()
    m = _metrics(mtls, certs)
    for receiver in ("otlp_grpc", "otlp_http"):
        assert _refused(m, receiver, "no_client_certificate") >= 1, receiver
        assert _refused(m, receiver, "bad_certificate") >= 1, receiver
    # the same spans went over both: counted once, the second time as duplicates
    assert m.value("phasewatch_otlp_spans_total", protocol="otlp_grpc",
                   outcome="request") == len(spans)
    assert m.value("phasewatch_otlp_spans_total", protocol="otlp_http",
                   outcome="duplicate") == len(spans)


def test_https_metrics_open_api_needs_a_client_certificate(mtls, certs):
    base = f"https://127.0.0.1:{mtls.http_port}"
    assert _https(f"{base}/metrics", certs.ca)[0] == 200  # Prometheus without a cert
    assert _https(f"{base}/healthz", certs.ca)[0] == 200  # the kubelet
    assert _https(f"{base}/api/v1/summary", certs.ca)[0] == 403
    assert _https(f"{base}/api/v1/summary", certs.ca, certs.client_cert,
                  certs.client_key)[0] == 200
    with pytest.raises(REFUSED):  # a rogue certificate fails the handshake
        _https(f"{base}/api/v1/summary", certs.ca, certs.rogue_cert, certs.rogue_key)
    with socket.create_connection(("127.0.0.1", mtls.http_port)) as s:  # plain HTTP
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(5)
        try:
            answer = s.recv(100)
        except ConnectionResetError:
            answer = b""
        assert not answer.startswith(b"HTTP/1.1 200")
    time.sleep(0.2)
    m = _metrics(mtls, certs)
    assert _refused(m, "api", "no_client_certificate") == 1
    assert _refused(m, "http", "bad_certificate") == 1
    assert _refused(m, "http", "tls_handshake") == 1


def test_changed_certificates_are_reloaded_and_bad_ones_ignored(tmp_path, certs):
    live = tmp_path / "live"
    live.mkdir()
    cert, key = live / "tls.crt", live / "tls.key"
    shutil.copy(certs.server_cert, cert)
    shutil.copy(certs.server_key, key)
    ex = Exporter(replace(ServeConfig(**TEST_PORTS), tls_cert_file=str(cert),
                          tls_key_file=str(key))).start()
    try:
        url = f"https://127.0.0.1:{ex.http_port}/healthz"
        assert _https(url, certs.ca)[0] == 200
        fresh = make_certs(tmp_path / "fresh")  # a new CA, as cert-manager would rotate
        shutil.copy(fresh.server_key, key)
        shutil.copy(fresh.server_cert, cert)
        time.sleep(1.2)
        assert _https(url, fresh.ca)[0] == 200  # the new certificate is served
        with pytest.raises(REFUSED):
            _https(url, certs.ca)
        stats = _phasewatch(ex, 2, tls_ca=fresh.ca)  # gRPC ports too
        assert stats["accepted"] == 2
        cert.write_text("not a certificate")  # a broken write: keep serving the last good
        time.sleep(1.2)
        assert _https(url, fresh.ca)[0] == 200
        m = Scrape(_https(f"https://127.0.0.1:{ex.http_port}/metrics", fresh.ca)[1].decode())
        assert m.value("phasewatch_tls_reloads_total", result="ok") == 1
        assert m.value("phasewatch_tls_reloads_total", result="error") >= 1
    finally:
        ex.stop(grace=1)


def test_tls_files_must_be_usable_at_start(tmp_path, certs):
    bad = tmp_path / "bad.pem"
    bad.write_text("nope")
    for files in (dict(tls_cert_file=certs.server_cert),
                  dict(tls_cert_file=str(bad), tls_key_file=certs.server_key),
                  dict(tls_cert_file=certs.server_cert, tls_key_file=certs.rogue_key)):
        with pytest.raises(ValueError, match="TLS"):
            Exporter(replace(ServeConfig(**TEST_PORTS), **files)).start()


def test_the_commands_speak_tls(mtls, certs, tmp_path):
    """`phasewatch simulate` over each protocol and the dashboard's exporter source, with
    the client certificate flags, reach a mutual-TLS exporter."""
    import subprocess
    import sys

    from phasewatch.dashboard.exporter_source import ExporterSource
    flags = ["--exporter-tls-ca", certs.ca, "--exporter-tls-cert", certs.client_cert,
             "--exporter-tls-key", certs.client_key]
    targets = {"phasewatch": f"127.0.0.1:{mtls.grpc_port}",
               "otlp-grpc": f"127.0.0.1:{mtls.otlp_grpc_port}",
               "otlp-http": f"https://127.0.0.1:{mtls.otlp_http_port}/v1/traces"}
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")}  # see above
    for protocol, target in targets.items():
        out = subprocess.run([sys.executable, "-m", "phasewatch.cli", "simulate", "--protocol",
                              protocol, "--target", target, "--duration", "3",
                              "--time-scale", "20", *flags], capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.returncode == 0, out.stdout[-1500:] + out.stderr[-3000:]
    m = _metrics(mtls, certs)
    for protocol in ("phasewatch", "otlp_grpc", "otlp_http"):
        assert m.value("phasewatch_ingest_accepted_total", protocol=protocol), protocol
    source = ExporterSource(f"https://127.0.0.1:{mtls.http_port}",
                            tls=ClientTls(certs.ca, certs.client_cert, certs.client_key))
    snap = source.fetch()
    assert snap.error is None and len(snap.kpis)
    bare = ExporterSource(f"https://127.0.0.1:{mtls.http_port}", tls=ClientTls(certs.ca))
    assert bare.fetch().error.kind == "http"  # 403: the API needs the certificate
