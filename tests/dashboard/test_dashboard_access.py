"""The dashboard is read-only, caps request bodies, and can ask for basic auth."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import pytest

from phasewatch.dashboard.app import MAX_BODY_BYTES, DashboardServer, create_app
from phasewatch.dashboard.exporter_source import ExporterSource


def _call(url: str, method: str = "GET", body: bytes | None = None, auth: str = "",
          ctype: str = "application/json") -> tuple[int, dict]:
    headers = {"Content-Type": ctype} if body is not None else {}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)


@pytest.fixture
def dashboard(exporter):
    source = ExporterSource(f"http://127.0.0.1:{exporter.http_port}")
    server = DashboardServer(create_app(source, basic_auth="sre:s3cret"), port=0).start()
    yield server.url.rstrip("/")
    server.stop()


def test_basic_auth_is_required_when_configured(dashboard):
    code, headers = _call(dashboard + "/")
    assert code == 401 and headers["WWW-Authenticate"] == 'Basic realm="phasewatch"'
    assert _call(dashboard + "/", auth="sre:wrong")[0] == 401
    assert _call(dashboard + "/", auth="other:s3cret")[0] == 401
    assert _call(dashboard + "/_dash-layout")[0] == 401
    assert _call(dashboard + "/", auth="sre:s3cret")[0] == 200
    assert _call(dashboard + "/_dash-layout", auth="sre:s3cret")[0] == 200


def test_read_only_and_bodies_capped(dashboard):
    auth = "sre:s3cret"
    for method in ("PUT", "DELETE", "PATCH"):
        assert _call(dashboard + "/", method, b"{}", auth)[0] == 405
    assert _call(dashboard + "/anything", "POST", b"{}", auth)[0] == 405
    big = json.dumps({"output": "x" * (MAX_BODY_BYTES + 1)}).encode()
    assert _call(dashboard + "/_dash-update-component", "POST", big, auth)[0] == 413


def test_no_auth_configured_means_open(exporter):
    source = ExporterSource(f"http://127.0.0.1:{exporter.http_port}")
    server = DashboardServer(create_app(source), port=0).start()
    try:
        assert _call(server.url.rstrip("/") + "/")[0] == 200
    finally:
        server.stop()


def test_basic_auth_needs_user_and_password(exporter):
    source = ExporterSource(f"http://127.0.0.1:{exporter.http_port}")
    with pytest.raises(ValueError, match="user:password"):
        create_app(source, basic_auth="justapassword")
