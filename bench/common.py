"""What every benchmark row shares: the row record, processes pinned to a core, CPU time
and counters read off a /metrics page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.conftest import terminate  # noqa: E402
from tests.support.serve import ServeProcess  # noqa: E402

SERVER_CORE = 0  # the exporter (and the baseline) run here, alone
CLIENT_CORE = 1  # load generators and this process


@dataclass
class Row:
    """One line of the table. ``figure`` is compared with ``target`` by ``better``
    ("higher" or "lower"); ``reference`` is measured in the same run and ``ratio`` is
    figure / reference, with its own target where the issue sets one. The ratio is
    better the way the figure is (``ratio_better`` defaults to ``better``: a latency
    over a reference latency is better lower) unless the row says otherwise."""

    key: str
    path: str
    figure: float
    unit: str
    target: float
    better: str
    reference: float | None = None
    reference_name: str = ""
    ratio_target: float | None = None
    ratio_better: str = ""  # "" : as ``better``
    also_ok: bool = True  # a further condition of the row's target (see its extra)
    extra: dict | None = None

    def __post_init__(self) -> None:
        self.ratio_better = self.ratio_better or self.better

    @property
    def ratio(self) -> float | None:
        if self.reference in (None, 0):
            return None
        return self.figure / self.reference

    def meets(self) -> bool:
        ok = self.figure >= self.target if self.better == "higher" else self.figure <= self.target
        if self.ratio_target is not None and self.ratio is not None:
            ok &= (self.ratio >= self.ratio_target if self.ratio_better == "higher"
                   else self.ratio <= self.ratio_target)
        return bool(ok and self.also_ok)

    def as_json(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "status": "pass" if self.meets() else "short"}


def pin(core: int) -> None:
    """Pin this process to ``core`` when the machine has more than one."""
    if (os.cpu_count() or 1) > 1 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})


def unpin() -> None:
    """Let this process run on every core again."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))


def taskset(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if (os.cpu_count() or 1) > 1 else []


def every_core() -> list[str]:
    """A child free to run on every core, though this process is pinned (``pin``)."""
    n = os.cpu_count() or 1
    return ["taskset", "-c", f"0-{n - 1}"] if n > 1 else []


def serve(tmp: Path, *args: str) -> ServeProcess:
    """``phasewatch serve`` on free ports, pinned to SERVER_CORE."""
    return ServeProcess(tmp, *args, prefix=taskset(SERVER_CORE)).start()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def scrape(port: int, timeout: float = 30) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        return r.read().decode()


def total(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    out = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name):len(name) + 1] not in ("{", " "):
            continue
        head, _, val = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            out += float(val)
    return out


def wait_for(port: int, name: str, want: float, timeout: float = 120, **labels) -> float:
    """Poll /metrics until ``name`` reaches ``want``; returns the time it did."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if total(scrape(port), name, **labels) >= want:
            return time.perf_counter()
        time.sleep(0.002)
    raise RuntimeError(f"{name}{labels} did not reach {want} in {timeout} s")


class Baseline:
    """bench/baseline_exporter.py as a process pinned to SERVER_CORE."""

    def __enter__(self) -> Baseline:
        self.proc = subprocess.Popen(
            [*taskset(SERVER_CORE), sys.executable, str(ROOT / "bench/baseline_exporter.py")],
            stdout=subprocess.PIPE, text=True, cwd=ROOT)
        line = self.proc.stdout.readline()
        m = re.search(r"gRPC on :(\d+) metrics on :(\d+)", line)
        if not m:
            terminate(self.proc)
            raise RuntimeError(f"the baseline did not start: {line!r}")
        self.grpc_port, self.http_port = int(m[1]), int(m[2])
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        terminate(self.proc)
