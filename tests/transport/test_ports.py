"""Every command's ports as a user meets them (issue 37, the first hour): a taken port is
one line naming the listener, its address and the flag, never a traceback; the demo's
own defaults give way to free ports and it says so. Real subprocesses, ports held by
the test."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import socket
import subprocess
import sys
import urllib.request

import pytest

from tests.conftest import terminate

PHASEWATCH = [sys.executable, "-m", "phasewatch.cli"]
FREE = ["--grpc-port", "0", "--http-port", "0", "--otlp-grpc-port", "0",
        "--otlp-http-port", "0"]
DEAD_UPSTREAM = "http://127.0.0.1:9"  # nothing listens there: the tap never reaches it


@contextlib.contextmanager
def held_port():
    """A port of 127.0.0.1 this test holds (listening) for as long as the block runs."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock.getsockname()[1]


def run(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*PHASEWATCH, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


# (command line with {port} for the held one, environment, the line it must print)
CASES = {
    "serve": (["serve", *FREE, "--grpc-port", "{port}"], {},
              "phasewatch serve: cannot listen on 127.0.0.1:{port} for the phasewatch gRPC "
              "receiver (--grpc-port): address already in use"),
    "serve-tap": (["serve", *FREE, "--tap-upstream", DEAD_UPSTREAM, "--tap-port", "{port}"],
                  {}, "phasewatch serve: cannot listen on 127.0.0.1:{port} for the stream "
                  "tap (--tap-port): address already in use"),
    "tap": (["tap", "--upstream", DEAD_UPSTREAM, "--port", "{port}"], {},
            "phasewatch tap: cannot listen on 127.0.0.1:{port} for the tap (--port): "
            "address already in use"),
    "tap-metrics": (["tap", "--upstream", DEAD_UPSTREAM, "--port", "0", "--metrics-port",
                     "{port}"], {},
                    "phasewatch tap: cannot listen on 127.0.0.1:{port} for the tap's counts "
                    "(--metrics-port): address already in use"),
    "tap-workers": (["tap", "--upstream", DEAD_UPSTREAM, "--workers", "2", "--port",
                     "{port}"], {},
                    "phasewatch tap: cannot listen on 127.0.0.1:{port} for the tap (--port): "
                    "address already in use"),
    "dashboard": (["dashboard", "--exporter", "http://127.0.0.1:9464", "--port", "{port}"],
                  {}, "phasewatch dashboard: cannot listen on 127.0.0.1:{port} for the "
                  "dashboard (--port): address already in use"),
    "demo-http": (["demo", "--duration", "5", *FREE, "--dashboard-port", "0",
                   "--http-port", "{port}", "--http-host", "127.0.0.1"], {},
                  "phasewatch demo: cannot listen on 127.0.0.1:{port} for /metrics and the "
                  "JSON API (--http-port): address already in use"),
    "demo-dashboard": (["demo", "--duration", "5", *FREE, "--dashboard-port", "{port}"], {},
                       "phasewatch demo: cannot listen on 127.0.0.1:{port} for the dashboard "
                       "(--dashboard-port): address already in use"),
    # a port from the environment is the user's too: kept, and it fails
    "demo-env": (["demo", "--duration", "5", "--grpc-port", "0", "--http-port", "0",
                  "--otlp-http-port", "0", "--dashboard-port", "0"],
                 {"PHASEWATCH_OTLP_GRPC_PORT": "{port}"},
                 "phasewatch demo: cannot listen on 127.0.0.1:{port} for OTLP/gRPC "
                 "(--otlp-grpc-port): address already in use"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_taken_port_is_one_line_naming_the_flag(case):
    """Issue 37: the tap said `[Errno 98] error while attempting to bind on address
    ('127.0.0.1', 33669)`, the dashboard printed Werkzeug's two lines, neither named its
    flag; the demo died on a port the user had given. Every command now words it as
    serve does, from the same function, and exits 2."""
    args, env, line = CASES[case]
    with held_port() as port:
        fill = {"port": str(port)}
        proc = run([a.format(**fill) for a in args],
                   {k: v.format(**fill) for k, v in env.items()})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [line.format(port=port)], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


DEFAULTS = {"dashboard": 8050, "metrics": 9464, "grpc": 50051, "otlp_grpc": 4317,
            "otlp_http": 4318}


@contextlib.contextmanager
def default_ports_taken():
    """Every default port of the demo taken: held by this test, or already held by
    another program on this machine (taken either way)."""
    with contextlib.ExitStack() as stack:
        for port in DEFAULTS.values():
            try:
                stack.enter_context(socket.create_server(("127.0.0.1", port)))
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
        yield


def test_the_demo_moves_a_taken_default_port_to_a_free_one_and_says_so():
    """Issue 37: `make demo` failed when one of its default ports was taken. Each
    default that is taken gives way to a free port, the line naming it says so, and
    the exporter and the dashboard really answer there."""
    with default_ports_taken():
        proc = subprocess.Popen([*PHASEWATCH, "demo", "--duration", "20",
                                 "--summary-every", "30", "--time-scale", "4"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if line.lstrip().startswith("sending:"):
                    break
            text = "".join(lines)
            found = {
                "dashboard": r"dashboard: http://127\.0\.0\.1:(\d+)/ \((\d+) was taken\)",
                "metrics": r"metrics: +http://127\.0\.0\.1:(\d+)/metrics \((\d+) was taken\)",
                "grpc": r"gRPC: +127\.0\.0\.1:(\d+) \((\d+) was taken\)",
                "otlp_grpc": r"OTLP: +127\.0\.0\.1:(\d+) \(gRPC; (\d+) was taken\)",
                "otlp_http": r"http://127\.0\.0\.1:(\d+)/v1/traces \((\d+) was taken\)"}
            ports = {}
            for name, pattern in found.items():
                m = re.search(pattern, text)
                assert m, f"no {name} line saying its default was taken:\n{text}"
                assert int(m[2]) == DEFAULTS[name] and int(m[1]) != DEFAULTS[name], text
                ports[name] = int(m[1])
            for url in (f"http://127.0.0.1:{ports['metrics']}/healthz",
                        f"http://127.0.0.1:{ports['dashboard']}/"):
                with urllib.request.urlopen(url, timeout=10) as r:
                    assert r.status == 200
        finally:
            terminate(proc, 30)
        err = proc.stderr.read()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
