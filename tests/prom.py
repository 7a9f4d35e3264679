"""A real Prometheus server (Debian's binary) for tests: started on a free port, cleaned up."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from tests.conftest import require_binary, terminate


def free_port() -> int:
    # Prometheus cannot report a port it picked itself, so reserve one and release it.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusServer:
    def __init__(self, tmp: Path, targets: list[str], scrape_interval: str = "1s",
                 target_labels: dict[str, dict[str, str]] | None = None,
                 rule_files: list[Path] = (), native_histograms: bool = False):
        """``target_labels``: extra labels per target, as Kubernetes service discovery
        adds ``pod`` to every series of a sidecar's scrape. ``rule_files`` are evaluated
        every ``scrape_interval``. ``native_histograms``: start with
        ``--enable-feature=native-histograms`` (Prometheus then scrapes protobuf)."""
        self.native_histograms = native_histograms
        self.binary = require_binary("prometheus", "the real-Prometheus tests scrape with it")
        self.tmp = tmp
        self.port = free_port()
        config = tmp / "prometheus.yml"
        groups = "".join(
            f"      - targets: {json.dumps([t])}\n"
            f"        labels: {json.dumps((target_labels or {}).get(t, {}))}\n"
            for t in targets) or "      - targets: []\n"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {scrape_interval}\n"
            f"  evaluation_interval: {scrape_interval}\n"
            + (f"rule_files: {json.dumps([str(f) for f in rule_files])}\n" if rule_files else "")
            + "scrape_configs:\n"
            "  - job_name: phasewatch\n"
            "    static_configs:\n" + groups)
        self.config = config
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> PrometheusServer:
        self.log = open(self.tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.config}",
             f"--storage.tsdb.path={self.tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
             *(["--enable-feature=native-histograms"] if self.native_histograms else [])],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("prometheus exited: " + (self.tmp / "prometheus.log")
                                   .read_text()[-2000:])
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("prometheus did not become ready in 30 s")

    def __exit__(self, *exc) -> None:
        terminate(self.proc)
        self.log.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        if body["status"] != "success":
            raise AssertionError(f"query failed: {expr}: {body}")
        return body["data"]["result"]

    def api(self, path: str) -> dict:
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}", timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def scalar(self, expr: str, at: float | None = None) -> float:
        result = self.query(expr, at)
        assert len(result) == 1, f"{expr} returned {result}"
        return float(result[0]["value"][1])
