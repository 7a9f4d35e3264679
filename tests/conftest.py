"""Shared fixtures: a real exporter on port 0, /metrics parsing, real component lookup."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from phasewatch.app import Exporter
from phasewatch.config import ServeConfig

# Every port 0 (the OS picks), loopback only: the config of every in-process test exporter.
TEST_PORTS = dict(grpc_port=0, http_port=0, otlp_grpc_port=0, otlp_http_port=0,
                  http_host="127.0.0.1")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_binary(name: str, why: str) -> str:
    """Path of a real component; in CI its absence fails the test, elsewhere it skips."""
    path = shutil.which(name)
    if path:
        return path
    message = f"{name} is not installed ({why}); `make test` installs it"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


def terminate(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """Stop a child process: SIGTERM, then SIGKILL if it has not exited in ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    """Poll ``predicate`` until it returns something true or ``timeout`` passes; its
    last value either way."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


@pytest.fixture
def exporter():
    ex = Exporter(ServeConfig(**TEST_PORTS)).start()
    yield ex
    ex.stop(grace=1)


class Scrape:
    """One /metrics scrape, queried like client_python's get_sample_value."""

    def __init__(self, text: str):
        self.text = text
        self.samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]

    def value(self, name: str, **labels) -> float | None:
        for s in self.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
        return None

    def total(self, name: str, **labels) -> float:
        return sum(s.value for s in self.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def scrape(port: int) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return Scrape(r.read().decode())


def component_text(component) -> str:
    """Every string under a Dash component (its children, depth first), joined by spaces:
    what a panel says, for tests that build panels without a browser."""
    if isinstance(component, str):
        return component
    if isinstance(component, (list, tuple)):
        return " ".join(component_text(c) for c in component)
    return component_text(getattr(component, "children", None) or "")


# What the tracker shows of a CI log is the run's first lines after its progress (the
# start of the failures' reports, cut after ~100 lines) and its last two: each failure's
# own message goes first there, before the reports (their code listings filled those
# lines in stop 48's CI, and this digest, then printed last, was cut), cut at DIGEST
# characters from its start, where the tests put the figures that say what went wrong.
# A message several failures share (a module fixture's error) is said once.
DIGEST = 2500


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outside the terminal reporter's own
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    _digest(terminalreporter)
    return (yield)


def _digest(terminalreporter) -> None:
    """Each failure's message once, then the runs made once more and why."""
    from tests.support.reruns import MADE_AGAIN  # (one list, however conftest was imported)

    seen: dict[str, list[str]] = {}
    for kind in ("failed", "error"):
        for report in terminalreporter.stats.get(kind, ()):
            crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
            message = (crash.message if crash is not None else str(report.longrepr))
            seen.setdefault(message[:DIGEST], []).append(report.nodeid)
    if seen:
        terminalreporter.section("what each failure said (their reports follow)")
    for message, nodeids in seen.items():
        more = f" (and {len(nodeids) - 1} more with this message)" if len(nodeids) > 1 else ""
        terminalreporter.write_line(f"{nodeids[0]}{more}:")
        terminalreporter.write_line("  " + message.replace("\n", "\n  "))
    if MADE_AGAIN:
        terminalreporter.section("runs made once more, and why")
        for why in MADE_AGAIN:
            terminalreporter.write_line("  " + why.replace("\n", "\n  "))
