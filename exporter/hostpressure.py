"""What the host says of a stretch in which phasewatch was not scheduled.

A late roofline tick (``app_loops``) says only that the process got no CPU. The kernel
counts why, and these counters are read before and after the stretch:

- **CPU limit**: the time this process's cgroup was throttled by its quota
  (``cpu.max``; v2 ``cpu.stat`` ``throttled_usec``, v1 ``throttled_time``): a sidecar
  whose ``limits.cpu`` is spent in the first part of each 100 ms period waits out the
  rest of it, every period;
- **pressure** (PSI): wall time in which some runnable task of the cgroup (or, where
  the cgroup publishes none, of the host) waited for a CPU, for memory (reclaim,
  swap-in, refaults) or for I/O; ``some ... total=`` in microseconds;
- this process's **major page faults** (its pages read back from disk);
- **steal**: CPU time the hypervisor gave other guests (``/proc/stat``).

Each counter the host does not publish is None and left out of the sentence.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

NOTICEABLE = 0.1  # seconds of a counter below which it is not worth a word

try:
    _TICK = float(os.sysconf("SC_CLK_TCK"))
except (ValueError, OSError, AttributeError):  # not POSIX
    _TICK = 100.0


@dataclass(frozen=True)
class HostCounters:
    """Cumulative counters at one moment, in seconds (faults: a count); None: not
    published here."""

    throttled: float | None = None
    cpu_wait: float | None = None
    memory_wait: float | None = None
    io_wait: float | None = None
    major_faults: int | None = None
    steal: float | None = None


def _text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _field(text: str | None, key: str) -> float | None:
    """The number after ``key`` on a ``key value`` line (cpu.stat)."""
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return float(value)
            except ValueError:
                return None
    return None


def _some_total(text: str | None) -> float | None:
    """PSI's ``some ... total=MICROSECONDS`` line, in seconds."""
    for line in (text or "").splitlines():
        if line.startswith("some "):
            for part in line.split():
                if part.startswith("total="):
                    try:
                        return int(part[6:]) / 1e6
                    except ValueError:
                        return None
    return None


class HostPressure:
    """Reads ``HostCounters`` for this process: its cgroup's files under ``cgroup_root``
    (v2 unified, v2 beside v1 at ``unified/``, or v1's ``cpu`` controller), the host's
    under ``proc``. Where the process's own cgroup path is not visible there (a
    container with a cgroup namespace shows ``/``), the root of the hierarchy is
    read, which is then the container's."""

    def __init__(self, proc: str | Path = "/proc", cgroup_root: str | Path = "/sys/fs/cgroup"):
        self._proc, root = Path(proc), Path(cgroup_root)
        v2, v1 = "", ""
        for line in (_text(self._proc / "self/cgroup") or "").splitlines():
            hierarchy, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            if hierarchy == "0" and controllers == "":
                v2 = path
            elif "cpu" in controllers.split(","):
                v1 = path
        self._stat: tuple[Path, str, float] | None = None  # cpu.stat, its key, its unit
        self._pressure: Path | None = None  # the cgroup's directory with *.pressure
        for base in (root, root / "unified"):
            for d in (base / v2.lstrip("/"), base):
                if self._stat is None and \
                        _field(_text(d / "cpu.stat"), "throttled_usec") is not None:
                    self._stat = (d / "cpu.stat", "throttled_usec", 1e-6)
                if (d / "cpu.pressure").is_file() and self._pressure is None:
                    self._pressure = d
        if self._stat is None:
            for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                for d in (root / name / v1.lstrip("/"), root / name):
                    if _field(_text(d / "cpu.stat"), "throttled_time") is not None:
                        self._stat = (d / "cpu.stat", "throttled_time", 1e-9)
                        break
                if self._stat is not None:
                    break

    def _wait(self, resource_name: str) -> float | None:
        if self._pressure is not None:
            found = _some_total(_text(self._pressure / f"{resource_name}.pressure"))
            if found is not None:
                return found
        return _some_total(_text(self._proc / "pressure" / resource_name))

    def _steal(self) -> float | None:
        first = (_text(self._proc / "stat") or "").split("\n", 1)[0].split()
        if len(first) < 9 or first[0] != "cpu":
            return None
        try:
            return int(first[8]) / _TICK
        except ValueError:
            return None

    def read(self) -> HostCounters:
        throttled = None
        if self._stat is not None:
            path, key, unit = self._stat
            value = _field(_text(path), key)
            throttled = None if value is None else value * unit
        try:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        except (OSError, ValueError):
            faults = None
        return HostCounters(throttled, self._wait("cpu"), self._wait("memory"),
                            self._wait("io"), faults, self._steal())


def _delta(before: float | None, after: float | None) -> float | None:
    if before is None or after is None:
        return None
    return max(after - before, 0)


def explain(before: HostCounters, after: HostCounters) -> str:
    """What the counters say of the stretch between two readings, as a clause for a log
    line ("" where the host publishes none of them): each one that moved, or that none
    did (then neither a CPU limit nor contention held the process: it was stopped, or
    its VM paused)."""
    throttled = _delta(before.throttled, after.throttled)
    waits = {what: _delta(getattr(before, f), getattr(after, f))
             for what, f in (("a CPU", "cpu_wait"), ("memory", "memory_wait"),
                             ("I/O", "io_wait"))}
    faults = _delta(before.major_faults, after.major_faults)
    steal = _delta(before.steal, after.steal)
    said, quiet = [], []
    if throttled is not None and throttled >= NOTICEABLE:
        said.append(f"its cgroup's CPU limit throttled it for {throttled:.1f} s")
    elif throttled is not None:
        quiet.append("no CPU limit throttled it")
    for what, seconds in waits.items():
        if seconds is None:
            continue
        if seconds >= NOTICEABLE:
            said.append(f"tasks waited for {what} {seconds:.1f} s of it (pressure)")
        else:
            quiet.append(f"none waited for {what}")
    if faults:
        said.append(f"{int(faults)} of its pages were read back from disk (major faults)")
    if steal is not None and steal >= NOTICEABLE:
        said.append(f"the hypervisor gave {steal:.1f} CPU-seconds to other guests (steal)")
    if said:
        return "over it " + "; ".join(said)
    if quiet:
        return ("over it " + ", ".join(quiet) + ": the process was stopped or its machine "
                "paused")
    return ""
