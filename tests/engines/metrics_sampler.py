"""The test's own samples of vLLM's ``/metrics``, read by a process of its own.

The verdict runs compare phasewatch's figures with vLLM's counters over phasewatch's
range, reading those counters from these samples at the range's two ends. On a loaded
2-core host, a sampler thread inside the pytest process left gaps of 4-7 s between
samples while each read took under 0.4 s and a sleeping process beside it was on time:
the pytest process (its gRPC relay, its garbage collector over a heap of a thousand
tests) was not running the thread. A process of its own reads on time whenever the host
lets anything run.

``python -m tests.engines.metrics_sampler URL DIR [INTERVAL]`` writes, until SIGTERM:
``samples.jsonl`` (``[stamp, sent, received, values]`` a line, the stamp halfway between
the request and the answer), ``errors.txt`` (a failed read a line) and, on the way out,
``page-<moment>.txt``: the first page, the last, and those at the most waiting requests
and at the fullest KV cache. ``Sampler`` (in the parent) starts it and reads them back.
"""

from __future__ import annotations

import bisect
import itertools
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

# vLLM series sampled (summed over label sets)
SAMPLED = ("vllm:estimated_flops_per_gpu_total", "vllm:estimated_read_bytes_per_gpu_total",
           "vllm:estimated_write_bytes_per_gpu_total", "vllm:num_preemptions_total",
           "vllm:num_requests_running", "vllm:num_requests_waiting",
           "vllm:kv_cache_usage_perc", "vllm:request_success_total",
           "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
           "vllm:iteration_tokens_total_count",  # the engine's steps (any phase)
           "vllm:prefix_cache_hits_total")
# A read of vLLM's /metrics on loopback answers in milliseconds; one that has not in 2 s
# is given up and the next read follows on a new connection, so that one stuck read does
# not leave a gap in the samples as long as its timeout.
READ_TIMEOUT = 2.0
# the pages kept: moment name -> (series whose highest value picks the page)
PEAKS = {"most_waiting": "vllm:num_requests_waiting", "fullest": "vllm:kv_cache_usage_perc"}


def page_values(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in SAMPLED:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def value_at(samples: list, name: str, t: float) -> float:
    """A series' value at ``t`` from (time, values) samples, linearly between the samples
    around it (the first or last value outside them)."""
    times = [s[0] for s in samples]
    i = bisect.bisect_left(times, t)
    if i == 0:
        return samples[0][1].get(name, 0.0)
    if i >= len(times):
        return samples[-1][1].get(name, 0.0)
    (t0, a), (t1, b) = samples[i - 1], samples[i]
    va, vb = a.get(name, 0.0), b.get(name, 0.0)
    return va + (vb - va) * (t - t0) / (t1 - t0)


def _sample(url: str, out: Path, interval: float, stop: threading.Event) -> None:
    """The child's loop: nothing but ``stop`` ends it (a read that fails, however, is
    written down and the next one follows)."""
    pages: dict[str, str] = {}
    best: dict[str, float] = {}
    with open(out / "samples.jsonl", "a") as samples, open(out / "errors.txt", "a") as errors:
        while not stop.is_set():
            sent = time.time()
            try:
                with urllib.request.urlopen(url, timeout=READ_TIMEOUT) as r:
                    text = r.read().decode()
                values = page_values(text)
            except Exception as e:  # every failure is written down
                errors.write(f"{sent:.3f} {type(e).__name__}: {e}"[:200].replace("\n", " ")
                             + "\n")
                errors.flush()
            else:
                got = time.time()
                samples.write(json.dumps([(sent + got) / 2, sent, got, values]) + "\n")
                samples.flush()
                pages.setdefault("first", text)
                pages["last"] = text
                for moment, key in PEAKS.items():
                    if values.get(key, 0.0) > best.get(key, -1.0):
                        best[key] = values.get(key, 0.0)
                        pages[moment] = text
            stop.wait(interval)
    for moment, text in pages.items():
        (out / f"page-{moment}.txt").write_text(text)


class Sampler:
    """vLLM's /metrics every ``interval`` seconds, read by a child process (the module
    docstring); after ``stop``: ``samples`` ((stamp, values) pairs), ``reads`` ((sent,
    received) of each), ``pages`` and ``errors``."""

    def __init__(self, url: str, out: Path, interval: float = 0.5):
        self.url, self.out, self.interval = url, out, interval
        self.samples: list[tuple[float, dict]] = []
        self.reads: list[tuple[float, float]] = []
        self.pages: dict[str, str] = {}
        self.errors: list[str] = []
        self._proc: subprocess.Popen | None = None

    def start(self) -> Sampler:
        self.out.mkdir(parents=True, exist_ok=True)
        # a directory used before (``verdict_runs.main`` runs slot_limit and slot_limit_16
        # in one: the same workload and serial) keeps no samples of an earlier run, whose
        # end-to-start gap read as a 76-145 s stall and ran every run again
        for old in [self.out / "samples.jsonl", self.out / "errors.txt",
                    *self.out.glob("page-*.txt")]:
            old.unlink(missing_ok=True)
        root = Path(__file__).resolve().parents[2]
        with open(self.out / "stderr.txt", "w") as stderr:  # the child keeps its own copy
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tests.engines.metrics_sampler", self.url,
                 str(self.out), str(self.interval)], cwd=root, stdout=subprocess.DEVNULL,
                stderr=stderr)
        return self

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
            self._proc = None
        self._load()

    def _load(self) -> None:
        path = self.out / "samples.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()
                if line.endswith("]")] if path.exists() else []
        self.samples = [(r[0], r[3]) for r in rows]
        self.reads = [(r[1], r[2]) for r in rows]
        errors = self.out / "errors.txt"
        self.errors = errors.read_text().splitlines() if errors.exists() else []
        stderr = (self.out / "stderr.txt").read_text().strip()
        if stderr:  # the child itself failed: say so beside the reads that did
            self.errors.append("sampler process: " + stderr[-300:])
        self.pages = {p.stem.removeprefix("page-"): p.read_text()
                      for p in self.out.glob("page-*.txt")}

    def coverage(self, lo: float, hi: float) -> dict:
        """How well the samples cover [lo, hi]: a sample at or before lo and at or after
        hi; the gaps ``increase`` interpolates over, the one around lo and the one around
        hi (``edge_gap_s``, the wider: a counter's increase over the range is read at its
        two ends only, so a gap inside it costs that figure nothing); the widest gap over
        the range; the slowest read; and the reads that failed."""
        times = [t for t, _ in self.samples]
        inside = [t for t in times if lo <= t <= hi]
        before = [t for t in times if t <= lo]
        after = [t for t in times if t >= hi]
        edges = ([before[-1]] if before else []) + inside + ([after[0]] if after else [])
        gaps = [b - a for a, b in itertools.pairwise(edges)]

        def around(t: float) -> float | None:
            i = bisect.bisect_left(times, t)
            if i < len(times) and times[i] == t:
                return 0.0
            return times[i] - times[i - 1] if 0 < i < len(times) else None

        ends = [around(lo), around(hi)]
        return {"samples": len(inside), "bracketed": bool(before and after),
                "edge_gap_s": (round(max(ends), 3) if None not in ends else None),
                "max_gap_s": round(max(gaps), 3) if gaps else None,
                "slowest_read_s": round(max((b - a for a, b in self.reads), default=0.0), 3),
                "errors": len(self.errors),
                "first_errors": self.errors[:3]}

    def widest_gap(self) -> float:
        """The longest time between two samples over the whole run (the range's own is
        in ``coverage``): where the sampler's process or vLLM's server stalled."""
        times = [t for t, _ in self.samples]
        return round(max((b - a for a, b in itertools.pairwise(times)), default=0.0), 3)

    def at(self, name: str, t: float, stamp: str = "mid") -> float:
        """The series' value at ``t``, each sample stamped halfway through its read
        (``mid``), or at the moment its request was sent or its answer received."""
        return value_at(self.stamped(stamp), name, t)

    def stamped(self, stamp: str) -> list[tuple[float, dict]]:
        """The samples, each at its read's ``mid``, ``sent`` or ``received`` moment."""
        if stamp == "mid":
            return self.samples
        which = {"sent": 0, "received": 1}[stamp]
        return [(read[which], values)
                for read, (_, values) in zip(self.reads, self.samples, strict=True)]

    def increase(self, name: str, lo: float, hi: float) -> float:
        return self.at(name, hi) - self.at(name, lo)

    def increase_bounds(self, name: str, lo: float, hi: float) -> tuple[float, float]:
        """The least and most a counter can have grown over [lo, hi] as ``increase`` reads
        it (linearly between samples), when each page holds the counters at some moment
        of its read, unknown within it (vLLM's server renders it when its event loop
        gets to the request: seconds after it was sent, on a starved host). A counter
        only grows, so its interpolated value at a moment is highest with every sample
        at its read's start and lowest with every one at its end (the interpolation
        through ordered points falls as any of them moves later)."""
        return (self.at(name, hi, "received") - self.at(name, lo, "sent"),
                self.at(name, hi, "sent") - self.at(name, lo, "received"))

    def during(self, name: str, lo: float, hi: float) -> list[float]:
        return [v.get(name, 0.0) for t, v in self.samples if lo <= t <= hi]


def main(argv: list[str]) -> int:
    url, out = argv[0], Path(argv[1])
    interval = float(argv[2]) if len(argv) > 2 else 0.5
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    worker = threading.Thread(target=_sample, args=(url, out, interval, stop))
    worker.start()
    while worker.is_alive():  # the main thread takes the signal
        worker.join(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
