"""The serving process's heap (``phasewatch.heap``): what one roofline tick frees, the
next reuses, instead of faulting in fresh pages (issue 41: the tick's time)."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.support import ROOT

# a tick's shape: a dozen 1 MiB arrays alive at once, then freed (the roofline's are
# 0.8-3.2 MB at 100,000 requests); the page faults of twenty such ticks, after three
TICKS = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from phasewatch.heap import keep_freed_pages

    kept = keep_freed_pages() if sys.argv[1] == "keep" else None

    def tick():
        arrays = [np.ones(1 << 17) for _ in range(12)]
        return sum(float(a[-1]) for a in arrays)

    for _ in range(3):
        tick()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        tick()
    print(kept, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
""")


def _ticks(mode: str, **env: str) -> tuple[str, float]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")
             and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", TICKS, mode], capture_output=True, text=True,
                         env={**clean, **env}, cwd=ROOT, timeout=60, check=True).stdout.split()
    return out[0], float(out[1])


def _glibc() -> bool:
    import ctypes

    try:
        ctypes.CDLL(None).mallopt  # noqa: B018 (its presence is the question)
    except AttributeError:
        return False
    return True


@pytest.fixture(autouse=True)
def _needs_glibc():
    if not _glibc():
        if os.environ.get("CI") == "true":
            pytest.fail("CI's image has no glibc mallopt: phasewatch.heap cannot be shown")
        pytest.skip("this C library has no mallopt (not glibc): phasewatch.heap leaves it")


def test_freed_pages_are_reused_by_the_next_tick():
    kept, faults = _ticks("keep")
    assert kept == "True"
    assert faults < 50, f"{faults} page faults a tick with the pages kept"
    # without it glibc gives the tick's 12 MiB back and faults it in again: ~3,072 pages
    plain, faults = _ticks("plain")
    assert plain == "None"
    assert faults > 1000, f"only {faults} page faults a tick with glibc's own thresholds"


def test_malloc_tuned_from_the_environment_is_left_as_set():
    kept, faults = _ticks("keep", MALLOC_TRIM_THRESHOLD_="1")
    assert kept == "False"
    assert faults > 1000  # the user's trim threshold (give back at once) stands


def test_serve_keeps_freed_pages(tmp_path):
    from tests.support.serve import ServeProcess

    serve = ServeProcess(tmp_path, "--log-level", "debug").start()
    try:
        log = serve.log_path.read_text()
    finally:
        serve.stop()
    assert "heap: freed pages kept for reuse (mmap threshold 32 MiB, trim threshold " \
        "128 MiB)" in log
