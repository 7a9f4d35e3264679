"""``hostpressure``: what the kernel's counters say of a stretch phasewatch was not
scheduled, read from a /proc and a cgroup tree laid out as Linux lays them out (v2
unified, v2 beside v1, v1 alone, nothing), then from this machine's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from phasewatch.hostpressure import HostCounters, HostPressure, explain


def _psi(some_us: int) -> str:
    return (f"some avg10=1.00 avg60=0.50 avg300=0.10 total={some_us}\n"
            "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")


def _tree(tmp: Path, cgroup: str, files: dict[str, str]) -> HostPressure:
    proc, root = tmp / "proc", tmp / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self/cgroup").write_text(cgroup)
    (proc / "stat").write_text("cpu  100 0 50 900 3 0 1 250 0 0\ncpu0 50 0 25 450 1 0 0 125 0 0\n")
    for name, text in files.items():
        path = root / name if not name.startswith("proc/") else tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return HostPressure(proc, root)


def _set(tmp: Path, name: str, text: str) -> None:
    (tmp / "cgroup" / name if not name.startswith("proc/") else tmp / name).write_text(text)


def test_cgroup_v2_throttling_and_pressure_of_the_pods_own_cgroup(tmp_path):
    """A sidecar whose CPU limit is spent: its cgroup's cpu.stat and cpu.pressure (not
    the host's) say so, in seconds."""
    pod = "kubepods/burstable/pod1/ctr"
    host = _tree(tmp_path, f"0::/{pod}\n", {
        f"{pod}/cpu.stat": "usage_usec 5000000\nnr_throttled 10\nthrottled_usec 2000000\n",
        f"{pod}/cpu.pressure": _psi(1_000_000), f"{pod}/memory.pressure": _psi(0),
        f"{pod}/io.pressure": _psi(0), "proc/pressure/cpu": _psi(99_000_000)})
    before = host.read()
    assert before.throttled == pytest.approx(2.0) and before.cpu_wait == pytest.approx(1.0)
    _set(tmp_path, f"{pod}/cpu.stat", "usage_usec 5100000\nthrottled_usec 20100000\n")
    _set(tmp_path, f"{pod}/cpu.pressure", _psi(19_500_000))
    said = explain(before, host.read())
    assert said.startswith("over it its cgroup's CPU limit throttled it for 18.1 s; "
                           "tasks waited for a CPU 18.5 s of it (pressure)"), said
    assert "memory" not in said and "I/O" not in said


def test_cgroup_v1_throttled_time_in_nanoseconds_and_the_hosts_pressure(tmp_path):
    host = _tree(tmp_path, "4:memory:/x\n1:cpu,cpuacct:/job\n0::/\n", {
        "cpu,cpuacct/job/cpu.stat": "nr_periods 5\nnr_throttled 1\nthrottled_time 0\n",
        "proc/pressure/cpu": _psi(0), "proc/pressure/memory": _psi(0),
        "proc/pressure/io": _psi(0)})
    before = host.read()
    assert before.throttled == 0.0 and before.memory_wait == 0.0
    _set(tmp_path, "cpu,cpuacct/job/cpu.stat", "nr_throttled 9\nthrottled_time 3500000000\n")
    _set(tmp_path, "proc/pressure/memory", _psi(7_250_000))
    said = explain(before, host.read())
    assert said == ("over it its cgroup's CPU limit throttled it for 3.5 s; tasks waited "
                    "for memory 7.2 s of it (pressure)"), said


def test_nothing_moved_means_stopped_or_paused(tmp_path):
    """SIGSTOP or a paused VM: no throttling, no task waiting; that is said, since it
    rules contention out."""
    host = _tree(tmp_path, "0::/\n", {"cpu.stat": "throttled_usec 0\n",
                                      "cpu.pressure": _psi(5), "memory.pressure": _psi(5),
                                      "io.pressure": _psi(5)})
    reading = host.read()
    said = explain(reading, reading)
    assert said == ("over it no CPU limit throttled it, none waited for a CPU, none waited "
                    "for memory, none waited for I/O: the process was stopped or its "
                    "machine paused"), said


def test_steal_and_major_faults(tmp_path):
    host = _tree(tmp_path, "0::/\n", {})
    before = host.read()
    assert before.throttled is None and before.cpu_wait is None  # published nowhere
    assert before.steal == pytest.approx(250 / 100, rel=0.2)  # USER_HZ, 100 nearly always
    after = HostCounters(steal=before.steal + 4.0, major_faults=(before.major_faults or 0) + 37)
    said = explain(HostCounters(steal=before.steal, major_faults=before.major_faults or 0), after)
    assert said == ("over it 37 of its pages were read back from disk (major faults); the "
                    "hypervisor gave 4.0 CPU-seconds to other guests (steal)"), said


def test_a_host_that_publishes_nothing_adds_nothing(tmp_path):
    host = HostPressure(tmp_path / "none", tmp_path / "none")
    reading = host.read()
    assert (reading.throttled, reading.cpu_wait, reading.steal) == (None, None, None)
    assert explain(HostCounters(), HostCounters()) == ""


def test_garbage_in_the_files_reads_as_unpublished(tmp_path):
    host = _tree(tmp_path, "0::/\n", {"cpu.stat": "throttled_usec lots\n",
                                      "cpu.pressure": "some total=x\n"})
    reading = host.read()
    assert reading.throttled is None and reading.cpu_wait is None


def test_this_machines_counters_read_without_error():
    """Whatever this host publishes reads as numbers that only grow."""
    host = HostPressure()
    a = host.read()
    sum(i * i for i in range(200_000))
    b = host.read()
    for field in ("throttled", "cpu_wait", "memory_wait", "io_wait", "major_faults", "steal"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None), field
        assert x is None or y >= x, field
    assert isinstance(explain(a, b), str)
