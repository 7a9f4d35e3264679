"""What a ``phasewatch serve`` log says of its own stalls, short enough for a failure
message that CI prints only a part of: the lines of ``exporter/app_loops`` that say the
process ran late or an update took long, and each thread dump ``--stall-dump`` wrote
(``ServeProcess`` passes STALL_DUMP): the roofline loop's, or that of an ingest call held
in flight, every busy thread by its innermost frames."""

from __future__ import annotations

import re

# seconds without a roofline tick before the tests' phasewatch dumps its threads: over
# the 2 s a tick is noticed late (app_loops.STALL_NOTICE), under the 10 s an engine's
# OTLP exporter waits for an answer
STALL_DUMP = "6"
# app_loops' own words for a late tick or an update that ran late (its seconds: group 1)
RAN_LATE = re.compile(r"phasewatch ran ([\d.]+) s late")
LATE = re.compile(rf"^.*(?:{RAN_LATE.pattern}|the roofline update took).*$", re.M)
# faulthandler's own header (the roofline loop's watchdog), or app_loops' line before the
# stacks of a held ingest call
DUMP = re.compile(r"Timeout \((?P<after>[^)]*)\)!|an ingest call has been in flight for "
                  r"(?P<held>[\d.]+) s[^\n]*")
FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def _frames(block: str, depth: int) -> str:
    """A thread's innermost ``depth`` frames as func (file:line), innermost first."""
    out = []
    for line in block.splitlines():
        m = FRAME.match(line)
        if m:
            out.append(f"{m['func']} ({m['file'].rsplit('/', 2)[-1]}:{m['line']})")
    return " < ".join(out[:depth])


def stall_report(log: str, depth: int = 4, limit: int = 3000) -> str:
    """The log's late lines, then each dump's threads (idle ones, waiting in
    threading's wait or a grpc worker's queue, left out), cut at ``limit`` characters;
    "" where the log says nothing of a stall."""
    lines = [m[0].split("phasewatch ", 1)[-1].strip() for m in LATE.finditer(log)]
    heads = list(DUMP.finditer(log))
    for n, head in enumerate(heads, 1):
        rest = log[head.end():heads[n].start() if n < len(heads) else len(log)]
        busy = []
        for thread in re.split(r"\n(?:Current thread|Thread) 0x", rest)[:16]:
            frames = _frames(thread, depth)
            if frames and not frames.startswith(("wait (threading.py", "_worker (thread.py")):
                busy.append(frames)
        why = (f"after {head['after']}" if head["after"] else
               f"an ingest call in flight {head['held']} s")
        lines.append(f"dump {n} {why}: " + " | ".join(busy))
    return "\n".join(lines)[:limit]
