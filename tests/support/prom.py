"""A real Prometheus server (Debian's binary) for tests: started on a free port, cleaned up."""

from __future__ import annotations

import functools
import json
import re
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from tests.conftest import require_binary, terminate

# Prometheus 3.8 made native histograms stable: a scrape job reads them with
# scrape_native_histograms (3.9 made the feature flag a no-op); always_scrape_classic_
# histograms keeps a family's classic buckets beside native ones (docs/deploy.md).
NATIVE_SCRAPE_KEYS = {"scrape_native_histograms": True, "always_scrape_classic_histograms": True}


@functools.cache
def version(binary: str) -> tuple[int, int, int]:
    """``prometheus --version`` or ``promtool --version`` as (major, minor, patch)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"version (\d+)\.(\d+)\.(\d+)", out)
    if not m:
        raise RuntimeError(f"{binary} --version said {out!r}")
    return tuple(int(x) for x in m.groups())


def native_by_config(binary: str) -> bool:
    """Whether this Prometheus turns native histograms on in its scrape config (3.8+)
    rather than with --enable-feature=native-histograms (2.40 to 3.7)."""
    return version(binary) >= (3, 8, 0)


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
        every ``scrape_interval``. ``native_histograms``: scrape them
        (protobuf) as the binary at hand takes it: Prometheus 3.8+ by the scrape job's
        ``NATIVE_SCRAPE_KEYS``, older with ``--enable-feature=native-histograms``."""
        self.native_histograms = native_histograms
        self.binary = require_binary("prometheus", "the real-Prometheus tests scrape with it")
        self.tmp = tmp
        self.port = free_port()
        config = tmp / "prometheus.yml"
        groups = "".join(
            f"      - targets: {json.dumps([t])}\n"
            f"        labels: {json.dumps((target_labels or {}).get(t, {}))}\n"
            for t in targets) or "      - targets: []\n"
        native_keys = "".join(
            f"    {k}: {str(v).lower()}\n" for k, v in NATIVE_SCRAPE_KEYS.items()
        ) if native_histograms and native_by_config(self.binary) else ""
        config.write_text(
            "global:\n"
            f"  scrape_interval: {scrape_interval}\n"
            f"  evaluation_interval: {scrape_interval}\n"
            + (f"rule_files: {json.dumps([str(f) for f in rule_files])}\n" if rule_files else "")
            + "scrape_configs:\n"
            "  - job_name: phasewatch\n" + native_keys +
            "    static_configs:\n" + groups)
        self.config = config
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> PrometheusServer:
        self.log = open(self.tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.config}",
             f"--storage.tsdb.path={self.tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
             *(["--enable-feature=native-histograms"] if self.native_histograms
               and not native_by_config(self.binary) else [])],
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
