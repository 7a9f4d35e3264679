"""``phasewatch tap --workers N`` (issue 30): N processes on the one port, each a whole
tap; the parent sums their counts on ``--metrics-port`` and in its stop line, starts a
worker that died again, and stops them all on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from http.client import HTTPConnection

import pytest

from tests.conftest import Scrape, terminate, wait_for
from tests.tap.test_tap import MODEL, FakeServer, post, requests_of


@pytest.fixture
def fake():
    server = FakeServer().start()
    yield server
    server.stop()


def start_tap(fake, exporter, tmp_path, *extra: str):
    log = tmp_path / "tap.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "phasewatch.cli", "tap", "--upstream",
             f"http://127.0.0.1:{fake.port}", "--port", "0", "--metrics-port", "0",
             "--target", f"127.0.0.1:{exporter.grpc_port}", *extra],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    found = wait_for(lambda: re.search(
        r"tap on http://127.0.0.1:(\d+) .*\((?:pid \d+), (\d+) workers: ([\d, ]+)\)\n"
        r".*counts on http://127.0.0.1:(\d+)/metrics", log.read_text(), re.S), timeout=60)
    if not found:
        terminate(proc)
        pytest.fail(log.read_text())
    pids = [int(p) for p in found[3].split(", ")]
    return proc, log, int(found[1]), int(found[4]), pids


def tap_counts(metrics_port: int) -> Scrape:
    conn = HTTPConnection("127.0.0.1", metrics_port, timeout=10)
    conn.request("GET", "/metrics")
    return Scrape(conn.getresponse().read().decode())


def completed(metrics_port: int) -> float:
    return tap_counts(metrics_port).value("phasewatch_tap_requests_total",
                                          outcome="completed") or 0.0


def test_two_workers_share_the_port_and_their_counts_are_summed(fake, exporter, tmp_path):
    proc, log, port, metrics, pids = start_tap(fake, exporter, tmp_path, "--workers", "2")
    try:
        assert len(set(pids)) == 2 and os.getpid() not in pids
        n = 40
        for _ in range(n):  # a connection each: the kernel spreads them over the workers
            status, _, _ = post(port, {"model": MODEL, "stream": True, "max_tokens": 2})
            assert status == 200
        assert wait_for(lambda: len(requests_of(exporter)) == n, timeout=20), \
            len(requests_of(exporter))
        # the parent's /metrics: the workers' counts summed (each reports every second)
        assert wait_for(lambda: completed(metrics) == n, timeout=10), tap_counts(metrics).text
    finally:
        terminate(proc, timeout=60)
    text = log.read_text()
    assert proc.returncode == 0, text
    line = re.search(r"phasewatch tap stopped \(2 workers, completed by each: (\d+), (\d+)\): "
                     r"requests: completed (\d+);.*records_accepted (\d+)", text)
    assert line, text
    each = [int(line[1]), int(line[2])]
    assert sum(each) == int(line[3]) == int(line[4]) == n, text
    assert min(each) > 0, f"one worker served all {n} connections: {each}"
    for pid in pids:  # no worker left behind
        assert wait_for(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), timeout=10), pid


def test_a_worker_that_dies_is_started_again_and_its_counts_stay(fake, exporter, tmp_path):
    proc, log, port, metrics, pids = start_tap(fake, exporter, tmp_path, "--workers", "2")
    try:
        for _ in range(10):
            assert post(port, {"model": MODEL, "stream": True, "max_tokens": 2})[0] == 200
        assert wait_for(lambda: completed(metrics) == 10, timeout=10)
        # the records reach the exporter in batches: a worker killed with SIGKILL loses
        # the ones it had not sent yet (no process can flush on SIGKILL), so it dies once
        # they are in (the tracker's CI killed it between its count and its send)
        assert wait_for(lambda: len(requests_of(exporter)) == 10, timeout=20), \
            len(requests_of(exporter))
        os.kill(pids[0], signal.SIGKILL)
        assert wait_for(lambda: "exited (code -9); starting another" in log.read_text(),
                        timeout=30), log.read_text()
        time.sleep(0.5)
        for _ in range(10):  # served by the one left and the new one
            assert post(port, {"model": MODEL, "stream": True, "max_tokens": 2})[0] == 200
        # the dead worker's last report stays in the sum (it reported every second, and
        # had served its share before that)
        assert wait_for(lambda: completed(metrics) == 20, timeout=10), tap_counts(metrics).text
        assert wait_for(lambda: len(requests_of(exporter)) == 20, timeout=20), \
            len(requests_of(exporter))
    finally:
        terminate(proc, timeout=60)
    assert proc.returncode == 0, log.read_text()


def test_workers_is_read_from_the_environment_and_must_be_positive(tmp_path):
    from phasewatch.cli import build_parser

    args = build_parser().parse_args(["tap", "--upstream", "http://127.0.0.1:1"])
    assert args.workers == 1
    env = {**os.environ, "PHASEWATCH_TAP_WORKERS": "3"}
    out = subprocess.run([sys.executable, "-c", "from phasewatch.cli import build_parser; "
                          "print(build_parser().parse_args(['tap', '--upstream', "
                          "'http://x:1']).workers)"], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "3", out.stderr
    bad = subprocess.run([sys.executable, "-m", "phasewatch.cli", "tap", "--upstream",
                          "http://127.0.0.1:1", "--workers", "0"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--workers: must be a whole number of at least 1" in \
        bad.stderr, bad.stderr
    # a bad value in the environment is told as the variable's
    env["PHASEWATCH_TAP_WORKERS"] = "abc"
    bad = subprocess.run([sys.executable, "-m", "phasewatch.cli", "tap", "--upstream",
                          "http://127.0.0.1:1"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and ("got 'abc' (from $PHASEWATCH_TAP_WORKERS)"
                                    in bad.stderr), bad.stderr


def test_a_sigterm_to_the_whole_group_stops_every_worker_cleanly(fake, exporter, tmp_path):
    """GNU timeout and systemd's control-group kill send SIGTERM to every process: each
    worker lets its streams finish and reports its last counts, and the parent starts
    none again."""
    proc, log, port, _, pids = start_tap(fake, exporter, tmp_path, "--workers", "2")
    try:
        for _ in range(6):
            assert post(port, {"model": MODEL, "stream": True, "max_tokens": 2})[0] == 200
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    finally:
        terminate(proc, timeout=60)
    text = log.read_text()
    assert proc.returncode == 0, text
    assert "starting another" not in text, text
    assert re.search(r"phasewatch tap stopped \(2 workers, completed by each: \d+, \d+\): "
                     r"requests: completed 6;", text), text
    for pid in pids:
        assert wait_for(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), timeout=10), pid
