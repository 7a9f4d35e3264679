"""``phasewatch serve`` as a real process on free ports, for tests that need its memory,
its signals or its restarts: the bound ports are read from its log. It dumps its
threads' stacks into that log when its roofline loop stalls (``--stall-dump``;
``tests.support.stalls`` reads them)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import terminate
from tests.engines.serve_ports import FREE, PATTERNS
from tests.support.stalls import STALL_DUMP


class ServeProcess:
    """Start with ``start()``; ``args`` are added after free-port flags (a later flag wins,
    so fixed ports can be passed to restart on the same ones)."""

    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None,
                 prefix: list[str] | None = None):
        """``prefix``: words run before the command (``taskset -c 0`` in the benchmark)."""
        self.args, self.tmp, self.prefix = list(args), Path(tmp), list(prefix or [])
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}
        self.log_path = self.tmp / f"serve-{time.monotonic_ns()}.log"

    def start(self, timeout: float = 30.0) -> ServeProcess:
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "phasewatch.cli", "serve", *FREE,
             "--stall-dump", STALL_DUMP, *self.args],
            stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=self.tmp)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_path.read_text()
            found = {k: re.search(p, text) for k, p in PATTERNS.items()}
            if all(found.values()):
                self.ports = {k: int(m[1]) for k, m in found.items()}
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"phasewatch serve did not start:\n{self.log_path.read_text()}")

    def __getattr__(self, name: str) -> int:
        if name in PATTERNS:
            return self.ports[name]
        raise AttributeError(name)

    def status(self) -> dict[str, int]:
        """VmRSS and VmHWM (peak resident) of the process, in bytes (Linux)."""
        out = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
        return out

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        terminate(self.proc)
        if not self.log.closed:
            self.log.close()

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
