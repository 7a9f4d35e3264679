"""The phasewatch command as a user runs it: a real subprocess."""

import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from phasewatch.commands import SCENARIO_MENU
from tests.conftest import Scrape
from tests.support import ROOT

PHASEWATCH = [sys.executable, "-m", "phasewatch.cli"]


def test_demo_serves_live_metrics_then_exits_zero():
    proc = subprocess.Popen([*PHASEWATCH, "demo", "--duration", "5", "--http-port", "0",
                             "--grpc-port", "0", "--otlp-grpc-port", "0", "--otlp-http-port", "0",
                             "--dashboard-port", "0", "--summary-every", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = dashboard = None
        for line in proc.stdout:
            m = re.search(r"dashboard:\s+(http://\S+)", line)
            if m:
                dashboard = m.group(1)
                assert line.rstrip().endswith(f"(switch the workload with {SCENARIO_MENU})")
            m = re.search(r"metrics:\s+(http://\S+/metrics)", line)
            if m:
                url = m.group(1)
                break
        assert url, "demo did not print its metrics URL"
        assert dashboard, "demo did not print its dashboard URL"
        with urllib.request.urlopen(dashboard, timeout=10) as r:
            assert r.status == 200 and b"<title>phasewatch</title>" in r.read()
        seen = 0.0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not seen:
            time.sleep(0.5)
            with urllib.request.urlopen(url, timeout=5) as r:
                seen = Scrape(r.read().decode()).total(
                    "gen_ai_server_request_duration_seconds_count")
        assert seen > 0, "no request reached /metrics while the demo ran"
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill() if proc.poll() is None else None
    assert proc.returncode == 0, err
    assert "req/s" in out and "TTFT p50" in out
    # the demo configures the exporter with the simulated model and hardware
    assert "verdict Llama-3.1-8B: Decode takes" in out


def test_dashboard_command_serves_the_page_and_stops_on_sigterm(exporter):
    proc = subprocess.Popen([*PHASEWATCH, "dashboard", "--exporter",
                             f"http://127.0.0.1:{exporter.http_port}", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"phasewatch dashboard on (http://\S+) reading exporter", line)
        assert m, line
        with urllib.request.urlopen(m.group(1), timeout=10) as r:
            assert r.status == 200 and b"<title>phasewatch</title>" in r.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        proc.kill() if proc.poll() is None else None


@pytest.mark.parametrize(("args", "message"), [
    ([], "one of the arguments --exporter --prometheus is required"),
    (["--exporter", "localhost:9464"], "must look like http://127.0.0.1:9464"),
    (["--exporter", "http://a:1", "--prometheus", "http://b:2"], "not allowed with"),
])
def test_dashboard_command_fails_fast_on_a_bad_source(args, message):
    r = subprocess.run([*PHASEWATCH, "dashboard", "--port", "0", *args], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_serve_help_names_every_flag_and_its_variable():
    out = subprocess.run([*PHASEWATCH, "serve", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag in ("--grpc-port", "--http-port", "--config", "PHASEWATCH_GRPC_PORT"):
        assert flag in out


@pytest.mark.parametrize("command", ["serve", "simulate", "demo", "dashboard", "roofline",
                                     "calibrate", "tap"])
def test_every_command_prints_its_help(command):
    r = subprocess.run([*PHASEWATCH, command, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "usage: phasewatch" in r.stdout, r.stderr[-2000:]


@pytest.mark.parametrize("args,message", [
    (["--grpc-port", "70000"], "grpc_port must be between 0 and 65535"),
    (["--window-seconds", "abc"], "window_seconds must be float"),
    (["--slo", "ttft=500"], "phasewatch: error: --slo: 'ttft=500' has no colon"),
    (["--slo", "ttft:500,p99:2"], "--slo: 'p99:2': unknown objective 'p99'"),
])
def test_bad_flags_fail_fast_with_the_fix(args, message):
    r = subprocess.run([*PHASEWATCH, "serve", *args], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and message in r.stderr


def test_bad_config_file_names_the_known_keys(tmp_path):
    cfg = tmp_path / "pw.toml"
    cfg.write_text("grpc_prot = 1\n")
    r = subprocess.run([*PHASEWATCH, "serve", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2
    assert "unknown keys ['grpc_prot']" in r.stderr and "grpc_port" in r.stderr


def test_simulate_drives_a_running_exporter(exporter):
    r = subprocess.run([*PHASEWATCH, "simulate", "--target", f"127.0.0.1:{exporter.grpc_port}",
                        "--scenario", "long_generation", "--duration", "20",
                        "--time-scale", "100"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    n = int(re.search(r"(\d+) accepted", r.stdout).group(1))
    assert n > 0
    from tests.conftest import scrape

    assert scrape(exporter.http_port).total("gen_ai_server_request_duration_seconds_count") == n


def test_serve_logs_its_ports_and_stops_on_sigterm():
    import signal

    proc = subprocess.Popen([*PHASEWATCH, "serve", "--grpc-port", "0", "--http-port", "0",
                             "--otlp-grpc-port", "0", "--otlp-http-port", "0",
                             "--http-host", "127.0.0.1"], stderr=subprocess.PIPE, text=True)
    try:
        http = None
        for line in proc.stderr:
            m = re.search(r"metrics on http://[\d.]+:(\d+)/metrics", line)
            if m:
                http = int(m.group(1))
                break
        assert http
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/readyz", timeout=5) as r:
            assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("flags,message", [
    (["--model", "Llama-3.1-8", "--hardware", "H100"], "close matches: Llama-3.1-8B"),
    (["--model", "Llama-3.1-8", "--hardware", "H100"],
     "or give the model's Hugging Face config.json with --hf-config"),
    (["--model", "Llama-3.1-8B", "--hardware", "H1OO"], "unknown hardware 'H1OO'"),
    (["--hf-config", "/nonexistent/config.json", "--hardware", "H100"],
     "cannot read Hugging Face config"),
])
def test_serve_fails_fast_on_bad_model_or_hardware(flags, message):
    proc = subprocess.run([*PHASEWATCH, "serve", "--http-port", "0", "--grpc-port", "0", *flags],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.parametrize("flag,host,what", [
    ("--otlp-grpc-port", "127.0.0.1", "OTLP/gRPC"),
    ("--otlp-http-port", "127.0.0.1", "OTLP/HTTP"),
    ("--grpc-port", "127.0.0.1", "the phasewatch gRPC receiver"),
    ("--http-port", "0.0.0.0", "/metrics and the JSON API"),
])
def test_serve_on_a_taken_port_names_the_listener_and_flag(flag, host, what):
    """Issue 26: gRPC died with a traceback, HTTP said only "[Errno 98]"."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        free = {"--grpc-port": "0", "--http-port": "0", "--otlp-grpc-port": "0",
                "--otlp-http-port": "0", flag: str(port)}
        proc = subprocess.run([*PHASEWATCH, "serve", *(w for kv in free.items() for w in kv)],
                              capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"phasewatch serve: cannot listen on {host}:{port} for {what} ({flag}): "
        "address already in use"]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("protocol,shape", [("otlp-grpc", "vllm"), ("otlp-http", "sglang")])
def test_simulate_over_otlp_with_the_sdk_exporter(exporter, protocol, shape):
    target = (f"127.0.0.1:{exporter.otlp_grpc_port}" if protocol == "otlp-grpc"
              else f"http://127.0.0.1:{exporter.otlp_http_port}/v1/traces")
    r = subprocess.run([*PHASEWATCH, "simulate", "--protocol", protocol, "--span-shape", shape,
                        "--target", target, "--scenario", "chat", "--duration", "20",
                        "--time-scale", "100"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    n = int(re.search(rf"(\d+) sent as {shape} spans over {protocol}", r.stdout).group(1))
    assert n > 0
    from tests.conftest import scrape

    s = scrape(exporter.http_port)
    assert s.total("gen_ai_server_request_duration_seconds_count", engine=shape) == n
    assert s.total("phasewatch_phase_duration_seconds_count", phase="prefill") == n


def test_serve_logs_the_resolved_roofline_at_start(tmp_path):
    """Issue 26: what the roofline was resolved to (model, part x GPUs, dtype, ceilings,
    their sources) was nowhere in the log."""
    from tests.support.serve import ServeProcess

    serve = ServeProcess(tmp_path, "--model", "Llama-3.1-8B", "--hardware", "H100-SXM").start()
    try:
        deadline = time.monotonic() + 10  # logged right after the ports ServeProcess waits for
        while "roofline for" not in (log := serve.log_path.read_text()) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        serve.stop()
    assert ("roofline for 'Llama-3.1-8B': model Llama-3.1-8B (catalog), H100-SXM x 1 "
            "(catalog), compute bf16; peak 3.35 TB/s, 989 TFLOP/s; achievable 3 TB/s, "
            "800 TFLOP/s (published); engine metrics none (--engine-metrics-url)") in log


def _roofline_lines(*flags: str, tmp_path) -> list[str]:
    """``serve`` (every port 0) started with ``flags``: its log lines about the roofline."""
    from tests.support.serve import ServeProcess

    serve = ServeProcess(tmp_path, *flags).start()
    try:
        deadline = time.monotonic() + 10  # logged with the ports, or right after them
        while "roofline" not in serve.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        serve.stop()
    lines = serve.log_path.read_text().splitlines()
    if any("detected through NVML" in line for line in lines):
        pytest.skip("this machine's GPU was detected: the hardware is not missing here")
    return [line for line in lines if "roofline" in line]


def test_serve_without_hardware_says_once_that_the_hardware_is_missing(tmp_path):
    """Issue 37: without --hardware on a GPU-less machine the log said the hardware was
    missing, then "roofline: no model configured (--model or --hf-config, with
    --hardware)" though --model was given. One line now, naming what is missing and the
    way to give it, calibrate included for a CPU."""
    (line,) = _roofline_lines("--model", "Llama-3.1-8B", tmp_path=tmp_path)
    assert "no roofline for Llama-3.1-8B: the hardware is missing" in line
    assert "--hardware NAME" in line and "`phasewatch calibrate --output FILE`" in line
    assert "--hardware-profile FILE" in line and "no model configured" not in line
    (line,) = _roofline_lines(tmp_path=tmp_path)  # no model: that is what is missing
    assert "roofline: no model configured" in line


@pytest.mark.parametrize("cpu", ["cpu", "AMD EPYC 7B13"])
def test_serve_with_a_cpu_for_hardware_points_at_calibrate(cpu):
    """A CPU is in no catalog: --hardware cpu fails at start with the way to measure it."""
    proc = subprocess.run([*PHASEWATCH, "serve", "--http-port", "0", "--grpc-port", "0",
                           "--otlp-grpc-port", "0", "--otlp-http-port", "0",
                           "--model", "Llama-3.1-8B", "--hardware", cpu],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert f"unknown hardware {cpu!r}" in proc.stderr
    assert ("for a CPU, or a part the catalog lacks, measure it with `phasewatch calibrate "
            "--output FILE` and pass --hardware-profile FILE") in proc.stderr


def test_help_names_every_phase():
    """Issue 26: the overview named three phases of four (five when disaggregated)."""
    out = subprocess.run([*PHASEWATCH, "--help"], capture_output=True, text=True,
                         timeout=30).stdout
    text = " ".join(out.split())
    assert "preprocess, queue, prefill and decode; KV transfer where prefill and decode " \
           "are disaggregated" in text


def test_metrics_carry_build_info_and_every_phase_in_the_share_help(exporter):
    from importlib import metadata

    with urllib.request.urlopen(f"http://127.0.0.1:{exporter.http_port}/metrics",
                                timeout=10) as r:
        text = r.read().decode()
    assert Scrape(text).value("phasewatch_build_info",
                              version=metadata.version("phasewatch")) == 1.0
    help_line = next(line for line in text.splitlines()
                     if line.startswith("# HELP phasewatch_phase_time_share_ratio "))
    for phase in ("preprocess", "queue", "prefill", "kv_transfer", "decode"):
        assert phase in help_line


def _sections(help_text: str) -> dict[str, str]:
    """``--help``'s argument groups: title -> the text under it."""
    parts = re.split(r"^(\S[^\n]*):\n", help_text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_tap_help_reads_as_sections_and_names_each_side_of_tls():
    """Issue 26: --tls-cert/--tls-key/--tls-ca (to the exporter) and --tls-cert-file/
    --tls-key-file (the tap's own listener) differed by a suffix and meant opposite
    sides; the help was one list."""
    out = subprocess.run([*PHASEWATCH, "tap", "--help"], capture_output=True, text=True,
                         check=True, timeout=30).stdout
    sections = _sections(out)
    assert list(sections) == ["options", "upstream", "listener", "to the exporter",
                              "limits"], out
    flags = {title: set(re.findall(r"^  (--[\w-]+)", text, flags=re.M))
             for title, text in sections.items()}
    assert flags["upstream"] == {"--upstream", "--upstream-ca", "--ask-usage"}
    assert flags["listener"] == {"--host", "--port", "--tls-cert-file", "--tls-key-file",
                                 "--metrics-port", "--loop", "--workers"}
    assert flags["to the exporter"] == {"--target", "--otlp-endpoint", "--token",
                                        "--exporter-tls-ca",
                                        "--exporter-tls-cert", "--exporter-tls-key",
                                        "--engine", "--model"}
    assert flags["limits"] == {"--timeout", "--max-body-mib"}
    assert not re.search(r"--tls-(ca|cert|key)\b(?!-file)", out)  # the old spellings: hidden


@pytest.mark.parametrize("command", [["tap", "--upstream", "http://127.0.0.1:1"],
                                     ["simulate"], ["dashboard", "--exporter", "http://a:1"]])
def test_old_client_tls_spellings_reach_the_exporter_side(command):
    from phasewatch.cli import build_parser

    args = build_parser().parse_args([*command, "--tls-ca", "ca.pem", "--tls-cert", "c.pem",
                                      "--tls-key", "k.pem"])
    assert (args.exporter_tls_ca, args.exporter_tls_cert, args.exporter_tls_key) == (
        "ca.pem", "c.pem", "k.pem")
    assert args.deprecated_flags == ["--tls-ca", "--tls-cert", "--tls-key"]
    if command[0] == "tap":  # not the listener's
        assert (args.tls_cert_file, args.tls_key_file) == ("", "")
    fresh = build_parser().parse_args(command)
    assert not getattr(fresh, "deprecated_flags", None)


def test_client_tls_flags_default_to_their_environment_variables(monkeypatch):
    from phasewatch.cli import build_parser

    monkeypatch.setenv("PHASEWATCH_CLIENT_TLS_CA", "env-ca.pem")
    monkeypatch.setenv("PHASEWATCH_TAP_TLS_CERT_FILE", "listener.pem")
    args = build_parser().parse_args(["tap", "--upstream", "http://127.0.0.1:1"])
    assert (args.exporter_tls_ca, args.tls_cert_file) == ("env-ca.pem", "listener.pem")


def test_the_readme_and_the_demo_name_the_scenario_menu_where_the_page_has_it():
    """Issue 37: the README and the demo said the scenario selector was "at the top
    right"; the page has it in its top bar (the dark header), after the model and
    engine menus, at the left on a wide screen. One wording, in both, of that place."""

    from phasewatch.dashboard.app import ScenarioControl, create_app
    from phasewatch.dashboard.exporter_source import ExporterSource

    readme = " ".join((ROOT / "README.md").read_text()
                      .split())
    assert f"Switch the workload with {SCENARIO_MENU}" in readme
    assert "top right" not in readme
    control = ScenarioControl(("chat", "rag"), "chat", lambda name: None)
    page = create_app(ExporterSource("http://127.0.0.1:9464"), scenario=control).layout()
    top = page.children[0]  # the page's first row: the top bar
    assert top.className == "pw-header"
    selectors = next(c for c in top.children if getattr(c, "className", "") == "pw-selectors")
    last = selectors.children[-1]  # after the model and engine menus
    assert [c.id for c in selectors.children[:2]] == ["model", "engine"]
    assert last.children[0].children.strip() == "scenario" and last.children[1].id == "scenario"
