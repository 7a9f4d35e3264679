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
