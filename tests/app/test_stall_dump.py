"""--stall-dump: a roofline loop that has not come round for that long gets every
thread's stack written to stderr, once per stall, by faulthandler's watchdog, which
runs while a thread holds the interpreter (the case no Python-level watchdog can
report). Each case runs in a process of its own: faulthandler's timer is per process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.support import ROOT
from tests.support.stalls import stall_report

# The roofline loop of a real ``Loops`` (the exporter's own), ticking every 0.1 s with
# --stall-dump 0.5, whose third update is held (argv[1]); the process ends two ticks
# after it.
SCRIPT = textwrap.dedent("""
    import re, sys, threading, time
    from phasewatch import app_loops
    from phasewatch.selfstats import SelfStats

    hold = sys.argv[1]
    ticks = []

    def holding_the_interpreter():
        # catastrophic backtracking: re's matcher never lets the interpreter go
        re.match(r"(a+)+$", "a" * 27 + "b")

    def update():
        ticks.append(time.monotonic())
        if len(ticks) == 3:
            if hold == "interpreter":
                holding_the_interpreter()
            elif hold == "sleep":
                time.sleep(1.5)

    def oldest_call():  # an ingest call held from the third tick to the fifth
        return 9.0 if hold == "call" and 3 <= len(ticks) < 5 else 0.0

    stop = threading.Event()
    loops = app_loops.Loops(stop, SelfStats(), time.time, 0.1, update, (), (),
                            stall_dump=float(sys.argv[2]), oldest_call=oldest_call)
    loops.start()
    deadline = time.monotonic() + 60
    while len(ticks) < 5 and time.monotonic() < deadline:  # two ticks after the held one
        time.sleep(0.01)
    stop.set()
    loops.join(5)
    print("ticks", len(ticks), flush=True)
""")


def _run(hold: str, stall_dump: float = 0.5) -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT, hold, str(stall_dump)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr + done.stdout


def test_a_thread_holding_the_interpreter_is_named_in_the_dump():
    out = _run("interpreter")
    assert out.count("Timeout (") == 1, out  # one stall, one dump
    dump = out[out.index("Timeout ("):]
    # the holder's own frames, under the roofline loop's
    assert 'in holding_the_interpreter' in dump and "in _tick" in dump, dump
    assert "re/__init__.py" in dump or "re.py" in dump, dump


def test_a_slow_update_is_dumped_once_and_the_loop_goes_on():
    out = _run("sleep")
    assert out.count("Timeout (") == 1, out
    ticks = int(out.split("ticks")[1].split()[0])
    assert ticks == 5, out  # came round after the stall


def test_a_loop_on_time_dumps_nothing_and_zero_is_off():
    assert "Timeout (" not in _run("none")
    assert "Timeout (" not in _run("sleep", stall_dump=0.0)


def test_the_tests_read_a_dump_as_the_busy_threads_innermost_frames():
    """``tests.support.stalls.stall_report``, which the real-engine tests' failure
    messages carry, on a real dump: the thread holding the interpreter by its frames,
    the idle ones left out."""
    report = stall_report(_run("interpreter"))
    assert "\ndump 1 after 0:00:00.6" in "\n" + report, report
    assert "holding_the_interpreter (<string>:" in report and "_tick (app_loops.py:" in report
    assert "_sweep_loop" not in report, report  # waiting: left out
    assert stall_report("nothing late here\n") == ""
    late = "12:00:01 WARNING phasewatch ran 28.8 s late (a 1 s roofline tick): this process"
    assert stall_report(late) == "ran 28.8 s late (a 1 s roofline tick): this process"


def test_an_ingest_call_held_in_flight_is_dumped_once_while_the_loop_runs():
    """A receiver's call held past --stall-dump (Admission.oldest_call_seconds) while
    the roofline loop goes on: said and dumped once for the stretch, read back by the
    tests' report."""
    out = _run("call")
    assert out.count("an ingest call has been in flight for 9.0 s") == 1, out
    assert "Timeout (" not in out, out
    report = stall_report(out)
    assert report.startswith("dump 1 an ingest call in flight 9.0 s: "), report
    assert "_dump_a_held_call (app_loops.py:" in report, report
