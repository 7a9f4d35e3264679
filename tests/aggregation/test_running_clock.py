"""The joins' clock stands still while the exporter does not run (``RunningClock``): a
tap's row that waited through a stall of the whole process is not declared alone before
the engine's exports, queued or retried through the same stall, get in. The stall is
read from the gaps between the clock's own readings (a beat of its own every 0.1 s)."""

from __future__ import annotations

import threading
import time

import pytest

from phasewatch.aggregation.running_clock import RunningClock
from tests.aggregation.test_tapjoin import (
    PRIMER,
    Clock,
    engine_batch,
    engine_record,
    fresh,
    outcomes,
    requests,
    tap_batch,
    tap_record,
)


def beat(clock: RunningClock, plain: Clock, seconds: float) -> None:
    """The process running for ``seconds``: the beat reads the clock every 0.1 s."""
    for _ in range(round(seconds / 0.1)):
        plain.t += 0.1
        clock()


def beating(clock: RunningClock) -> threading.Event:
    """The clock's beat on a thread, as the exporter's loops run it; set to stop it."""
    stop = threading.Event()
    threading.Thread(target=clock.run, args=(stop,), daemon=True).start()
    return stop


def test_while_the_process_runs_the_clock_is_the_plain_one():
    plain = Clock()
    clock = RunningClock(plain)
    beat(clock, plain, 30.0)
    assert clock() == pytest.approx(plain.t) and clock.stalled == 0.0


def test_a_stall_is_taken_out_once_whoever_reads_first():
    plain = Clock()
    clock = RunningClock(plain)
    beat(clock, plain, 2.0)
    plain.t += 28.8  # nothing of the process ran: no reading
    first, second = clock(), clock()
    assert clock.stalled == pytest.approx(28.7) and clock.longest == pytest.approx(28.7)
    assert first == second == pytest.approx(plain.t - 28.7)  # moved one beat, not 28.8 s
    beat(clock, plain, 1.0)
    assert clock() == pytest.approx(plain.t - 28.7)


def test_the_time_before_the_beat_starts_is_no_stall():
    plain = Clock()
    clock = RunningClock(plain, beat=0.05)
    plain.t += 5.0  # made, then started later (the exporter's start)
    stop = beating(clock)
    try:
        assert clock() == pytest.approx(plain.t) and clock.stalled == 0.0
    finally:
        stop.set()


def test_a_gap_no_longer_than_the_beat_is_refused():
    with pytest.raises(ValueError, match="longer than the beat"):
        RunningClock(beat=1.0, gap=1.0)


def test_a_tap_row_that_waited_through_a_stall_still_joins_its_engine_side():
    plain = Clock()
    clock = RunningClock(plain)
    agg, join = fresh(clock)  # a 10 s wait for the other side
    join.ingest(engine_batch(engine_record(key=PRIMER, request_id="primer")), "otlp_grpc")
    join.ingest(tap_batch(tap_record()), "grpc")
    beat(clock, plain, 2.0)
    plain.t += 28.8  # the whole process stalled; the engine's export waited in the queue
    assert join.sweep() == 0  # the sweep after the stall: 2.1 s of running time waited
    join.ingest(engine_batch(engine_record()), "otlp_grpc")
    (row,) = requests(agg)
    assert row["source"] == "joined" and outcomes(agg) == {"joined": 1}


def test_a_tap_row_still_waits_only_its_time_of_the_process_running():
    plain = Clock()
    clock = RunningClock(plain)
    agg, join = fresh(clock)
    join.ingest(engine_batch(engine_record(key=PRIMER, request_id="primer")), "otlp_grpc")
    join.ingest(tap_batch(tap_record()), "grpc")
    plain.t += 28.8
    assert join.sweep() == 0
    beat(clock, plain, 9.8)
    assert join.sweep() == 0
    beat(clock, plain, 0.3)  # 10 s of running time: alone
    assert join.sweep() == 1 and outcomes(agg) == {"tap_only": 1}


def test_the_beat_keeps_the_clock_with_the_plain_one_on_a_real_process():
    clock = RunningClock(beat=0.02, gap=0.5)
    stop = beating(clock)
    try:
        began, plain = clock(), time.monotonic()
        done = threading.Event()
        threading.Thread(target=lambda: (time.sleep(0.3), done.set()), daemon=True).start()
        done.wait(5)
        assert clock() - began == pytest.approx(time.monotonic() - plain, abs=0.05)
        assert clock.stalled == 0.0
    finally:
        stop.set()
