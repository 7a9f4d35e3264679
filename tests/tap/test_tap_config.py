"""Issue 38: one ``TapConfig`` for ``phasewatch tap`` and ``serve --tap-*``, both from one
table of tap options (``options.TAP_OPTIONS``).

Every option a tap inside the exporter can use is ``serve --tap-NAME`` with the tap's own
help and variable, and each new one reaches the in-process tap's behaviour: the body
limit, ask-usage, the timeout, the upstream's CA, the tap's own HTTPS, its event loop.
The tap command reads its variables when it parses, not when its parser is built.
"""

from __future__ import annotations

import argparse
import json
import pickle
import ssl
from dataclasses import replace

import pytest

from phasewatch.app import Exporter
from phasewatch.cli import build_parser
from phasewatch.config import ConfigError, add_serve_flags, load_serve_config
from phasewatch.options import (
    DASHBOARD_OPTIONS,
    DEMO_OPTIONS,
    IN_PROCESS_TAP,
    SERVE_OPTIONS,
    SERVE_TAP,
    TAP_OPTIONS,
)
from phasewatch.options_commands import (
    CALIBRATE_OPTIONS,
    DASHBOARD_SOURCE,
    ROOFLINE_OPTIONS,
    SIMULATE_OPTIONS,
    commands_markdown,
)
from phasewatch.tap import TapConfig
from phasewatch.transport.tls import ClientTls
from tests.conftest import TEST_PORTS, scrape, wait_for
from tests.support import ROOT
from tests.support.certs import make_certs
from tests.tap.test_tap import MODEL, STREAM, FakeServer, fetch, post


@pytest.fixture
def fake():
    server = FakeServer().start()
    yield server
    server.stop()


def serve_config(*flags: str, environ: dict[str, str] | None = None):
    """``phasewatch serve``'s settings from these flags (and variables), on free ports."""
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    config = load_serve_config(parser.parse_args(list(flags)), environ or {})
    return replace(config, **TEST_PORTS, tap=replace(config.tap, port=0))


def _helps(parser: argparse.ArgumentParser, command: str) -> dict[str, str]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {flag: a.help for a in sub.choices[command]._actions for flag in a.option_strings}


def test_every_in_process_tap_option_is_a_serve_flag_with_the_taps_own_help():
    helps, serve = _helps(build_parser(), "tap"), _helps(build_parser(), "serve")
    for o in IN_PROCESS_TAP:
        assert serve["--tap-" + o.flag[2:]] == helps[o.flag], o.name
        assert f"env PHASEWATCH_TAP_{o.name.upper()})" in helps[o.flag]
    for o in TAP_OPTIONS:  # every tap option is a tap flag
        assert o.flag in helps, o.name
    # the variables the tap read before stay its variables
    for old in ("PHASEWATCH_TAP_UPSTREAM_CA", "PHASEWATCH_TAP_TLS_CERT_FILE",
                "PHASEWATCH_TAP_TLS_KEY_FILE", "PHASEWATCH_TAP_OTLP_ENDPOINT",
                "PHASEWATCH_TAP_WORKERS"):
        assert any(f"env {old})" in h for h in helps.values()), old


def test_serves_tap_settings_and_the_tap_commands_make_the_same_tapconfig():
    args = build_parser().parse_args(
        ["tap", "--upstream", "https://u:1", "--upstream-ca", "ca.pem", "--ask-usage",
         "--host", "0.0.0.0", "--port", "9", "--tls-cert-file", "c.pem", "--tls-key-file",
         "k.pem", "--loop", "asyncio", "--engine", "vllm", "--timeout", "7",
         "--max-body-mib", "0.5"])
    from_tap = TapConfig.read(args)
    config = serve_config("--tap-upstream", "https://u:1", "--tap-upstream-ca", "ca.pem",
                          "--tap-ask-usage", "true", "--tap-host", "0.0.0.0", "--tap-port",
                          "9", "--tap-tls-cert-file", "c.pem", "--tap-tls-key-file", "k.pem",
                          "--tap-loop", "asyncio", "--tap-engine", "vllm", "--tap-timeout",
                          "7", "--tap-max-body-mib", "0.5")
    from_serve = replace(config.tap, port=9)
    assert from_serve == from_tap
    assert from_tap.max_body_bytes == 1 << 19 and from_tap.timeout == 7.0
    # a worker process gets the whole record
    with_client = replace(from_tap, client_tls=ClientTls("ca.pem"), token="t", workers=3)
    assert pickle.loads(pickle.dumps(with_client)) == with_client


def test_the_tap_reads_its_variables_when_it_parses(monkeypatch):
    parser = build_parser()  # built before the variables are set
    monkeypatch.setenv("PHASEWATCH_TAP_UPSTREAM", "http://from-env:1")
    monkeypatch.setenv("PHASEWATCH_TAP_TIMEOUT", "12.5")
    monkeypatch.setenv("PHASEWATCH_TAP_ASK_USAGE", "true")
    monkeypatch.setenv("PHASEWATCH_TAP_MAX_BODY_MIB", "2")
    monkeypatch.setenv("PHASEWATCH_AUTH_TOKEN", "secret")
    conf = TapConfig.read(parser.parse_args(["tap"]))
    assert (conf.upstream, conf.timeout, conf.ask_usage, conf.max_body_mib, conf.token) == (
        "http://from-env:1", 12.5, True, 2.0, "secret")
    assert pickle.loads(pickle.dumps(conf)) == conf  # a worker process gets it whole
    assert parser.parse_args(["tap", "--timeout", "3"]).timeout == 3.0  # the flag wins
    monkeypatch.delenv("PHASEWATCH_TAP_UPSTREAM")
    assert build_parser().parse_args(["tap", "--upstream", "http://u:1"]).timeout == 12.5


@pytest.mark.parametrize(("env", "value", "message"), [
    ("PHASEWATCH_TAP_TIMEOUT", "soon", "argument --timeout: must be a number from 0.001 to "
     "1e+09, got 'soon' (from $PHASEWATCH_TAP_TIMEOUT)"),
    ("PHASEWATCH_TAP_LOOP", "trio", "argument --loop: must be one of auto, asyncio, "
     "uvloop, got 'trio' (from $PHASEWATCH_TAP_LOOP)"),
    ("PHASEWATCH_TAP_ASK_USAGE", "maybe", "argument --ask-usage: must be true or false, "
     "got 'maybe' (from $PHASEWATCH_TAP_ASK_USAGE)"),
])
def test_a_bad_variable_is_named_and_a_missing_upstream_is_a_usage_error(
        monkeypatch, capsys, env, value, message):
    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tap", "--upstream", "http://u:1"])
    assert message in capsys.readouterr().err
    monkeypatch.delenv(env)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tap"])
    assert "the following arguments are required: --upstream" in capsys.readouterr().err


def test_serve_checks_the_new_tap_settings():
    with pytest.raises(ConfigError, match="tap_loop must be one of auto, asyncio, uvloop"):
        serve_config("--tap-loop", "trio")
    with pytest.raises(ConfigError, match="PHASEWATCH_TAP_TIMEOUT: tap_timeout must be"):
        serve_config(environ={"PHASEWATCH_TAP_TIMEOUT": "0"})
    assert serve_config(environ={"PHASEWATCH_TAP_MAX_BODY_MIB": "1"}).tap.max_body_mib == 1


def test_serve_tap_max_body_mib_leaves_a_larger_body_untimed(fake):
    config = serve_config("--tap-upstream", f"http://127.0.0.1:{fake.port}",
                          "--tap-max-body-mib", "0.004")  # 4 KiB
    with Exporter(config) as ex:
        big = {**STREAM, "max_tokens": 3, "pad": "x" * 300_000}
        assert fetch(ex.tap_port, big).complete
        assert fetch(ex.tap_port, STREAM).complete  # under the limit: timed
        s = wait_for(lambda: (lambda sc: sc if sc.total("phasewatch_requests_total")
                              else None)(scrape(ex.http_port)), 10)
        assert s.value("phasewatch_tap_requests_total", outcome="body_too_large_untimed") == 1
        assert s.value("phasewatch_tap_requests_total", outcome="completed") == 1
        assert s.total("phasewatch_requests_total") == 1
        assert fake.body_sizes[-2] == len(json.dumps(big))  # passed on whole


def test_serve_tap_ask_usage_asks_the_server_and_keeps_the_clients_stream(fake):
    ask = {"model": MODEL, "stream": True, "max_tokens": 5}  # no stream_options
    _, direct, _ = post(fake.port, ask)
    config = serve_config("--tap-upstream", f"http://127.0.0.1:{fake.port}",
                          environ={"PHASEWATCH_TAP_ASK_USAGE": "true"})
    with Exporter(config) as ex:
        status, through, _ = post(ex.tap_port, ask)
        assert status == 200 and through == direct and b'"usage"' not in through
        assert fake.asked[-1]["stream_options"] == {"include_usage": True}
        rows = wait_for(lambda: _requests(ex), 10)
        assert rows[0]["output_tokens"] == 5 and rows[0]["prompt_tokens"] == 12


def test_serve_tap_timeout_answers_a_silent_upstream_504(fake):
    config = serve_config("--tap-upstream", f"http://127.0.0.1:{fake.port}",
                          "--tap-timeout", "0.5")
    with Exporter(config) as ex:
        got = fetch(ex.tap_port, {"model": MODEL, "first_delay": 2})
        assert got.status == 504 and b"no answer within 0.5s" in got.data
        assert ex.tap.counts["upstream_timeout"] == 1


def test_serve_tap_upstream_ca_and_its_own_https_and_loop(tmp_path):
    certs = make_certs(tmp_path / "certs")
    up_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    up_tls.load_cert_chain(certs.server_cert, certs.server_key)
    upstream = FakeServer(ssl_context=up_tls).start()
    url = f"https://127.0.0.1:{upstream.port}"
    trusting = ssl.create_default_context(cafile=certs.ca)
    try:
        with Exporter(serve_config("--tap-upstream", url)) as ex:  # the system's CAs
            assert fetch(ex.tap_port, STREAM).status == 502
        config = serve_config("--tap-upstream", url, "--tap-upstream-ca", str(certs.ca),
                              "--tap-tls-cert-file", str(certs.server_cert),
                              "--tap-tls-key-file", str(certs.server_key),
                              "--tap-loop", "asyncio")
        with Exporter(config) as ex:
            got = fetch(ex.tap_port, STREAM, context=trusting)
            assert got.status == 200 and got.complete and b"[DONE]" in got.data
            assert ex._tap_server.scheme == "https"
            assert type(ex._tap_server._loop).__module__.startswith("asyncio")
    finally:
        upstream.stop()


def test_commands_md_lists_every_option_of_the_tables_as_they_say():
    """docs/commands.md's tables of every command's options (serve's, the tap's, the
    dashboard's, the demo's, simulate's, roofline's, calibrate's) are
    ``options``' own: rewrite them with ``python -m phasewatch.options_commands`` when
    an option changes."""
    doc = (ROOT / "docs" / "commands.md").read_text()
    for table in commands_markdown().split("\n\n"):
        assert table.strip() in doc, table.splitlines()[0]
    for o in (*TAP_OPTIONS, *DASHBOARD_OPTIONS, *DEMO_OPTIONS, *SERVE_OPTIONS,
              *SIMULATE_OPTIONS, *ROOFLINE_OPTIONS, *CALIBRATE_OPTIONS, *DASHBOARD_SOURCE):
        assert f"`{o.flag}" in doc or o in SERVE_TAP, o.name


def test_dashboard_and_demo_flags_come_from_their_tables(monkeypatch):
    monkeypatch.setenv("PHASEWATCH_DASHBOARD_AUTH", "u:p")  # its own variable, as before
    monkeypatch.setenv("PHASEWATCH_DASHBOARD_PORT", "8099")
    monkeypatch.setenv("PHASEWATCH_DEMO_DASHBOARD_PORT", "0")
    parser = build_parser()
    dash = parser.parse_args(["dashboard", "--exporter", "http://a:1"])
    assert (dash.basic_auth, dash.port, dash.refresh, dash.range) == ("u:p", 8099, 2.0, "1m")
    demo = parser.parse_args(["demo", "--no-dashboard"])
    assert (demo.dashboard_port, demo.no_dashboard, demo.duration) == (0, True, 0.0)
    helps = _helps(parser, "dashboard")
    for o in DASHBOARD_OPTIONS:
        assert (o.env or f"PHASEWATCH_DASHBOARD_{o.name.upper()}") in helps[o.flag]


def _requests(ex) -> list[dict]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{ex.http_port}/api/v1/requests",
                                timeout=5) as r:
        return json.load(r)["requests"]
