"""Timed measurements within a bound, for ``phasewatch calibrate``: best-of runs, the
ladder of matmul sizes each dtype climbs while it fits in its seconds, and the lines that
say how far it is and how long each took."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

# Each dtype's matmuls stop after about this many seconds (``--matmul-seconds``): torch's
# 16-bit matmul on an AVX2 CPU (no 16-bit units) ran 2048x2048 at 0.28 (bf16) and 0.25
# (fp16) GFLOP/s, over a minute a product and six products a dtype: a default run took
# 8 min 47 s (issue 37), 15 min on a busy 2-core machine, for figures the fp32 one then
# replaces (``calibrate._cpu_half_floor``). Bounded, the same run takes 8 to 27 s.
MATMUL_SECONDS = 10.0
PROBE_N = 256  # the first, smallest size of every dtype's ladder of sizes
# Timed runs at PROBE_N, the best kept: a 256x256 fp32 product takes under a millisecond
# here, and its first runs came out at 20-50 GFLOP/s against 90 a few runs later.
PROBE_RUNS = 3
# A next size's time is predicted as the last one's x (its FLOPs ratio) x this margin:
# the rate of a slow path may fall with size (torch's fp16 on an AVX2 CPU: 1.25 GFLOP/s
# at 512, 0.71 at 1024, 0.25 at 2048).
PREDICTION_MARGIN = 2.0


class Progress(Protocol):
    """Where calibrate says how far it is."""

    def step(self, what: str, done: int, total: int, best: float) -> None:
        """``done`` of ``total`` runs of ``what`` (0 while it probes sizes); ``best`` so
        far, bytes/s or FLOP/s."""

    def say(self, line: str) -> None:
        """A line of its own: the plan, each measurement done and how long it took."""


class Silent:
    """Progress that says nothing (``calibrate``'s default, as a library)."""

    def step(self, what: str, done: int, total: int, best: float) -> None:
        pass

    def say(self, line: str) -> None:
        pass


@dataclass
class MatmulRun:
    """One dtype's matmul measurement and what it cost."""

    flops: float  # best FLOP/s at ``n``
    n: int  # the size the figure was measured at
    runs: int  # timed runs at ``n``
    matmuls: int  # every product computed: warm-ups and the smaller sizes too
    seconds: float
    bounded: str = ""  # why the size or the runs are fewer than asked; "" if they are not
    rates: dict[int, float] = field(default_factory=dict)  # FLOP/s at each size tried

    def as_dict(self) -> dict:
        return {"n": self.n, "runs": self.runs, "matmuls": self.matmuls,
                "seconds": round(self.seconds, 3),
                **({"bounded": self.bounded} if self.bounded else {})}


def sizes(n_max: int) -> list[int]:
    """The ladder of sizes a dtype climbs: PROBE_N, doubling, up to ``n_max``."""
    out = [min(n_max, PROBE_N)]
    while out[-1] < n_max:
        out.append(min(2 * out[-1], n_max))
    return out


def max_matmuls(n_max: int, repeats: int) -> int:
    """The most products ``measure_matmul`` computes: a warm-up and a run per size (the
    first size PROBE_RUNS runs), and the rest of the repeats at the top one."""
    return 2 * len(sizes(n_max)) + PROBE_RUNS - 1 + repeats - 1


def gflops(v: float) -> str:
    return f"{v / 1e9:.3g} GFLOP/s"


def measure_matmul(what: str, n_max: int, repeats: int, seconds: float,
                   product: Callable[[int], Callable[[], object]],
                   timed: Callable[[Callable[[], object]], float], progress: Progress,
                   probe_stop: Callable[[int, float], str] | None = None,
                   clock: Callable[[], float] = time.perf_counter) -> MatmulRun:
    """Best FLOP/s of ``n x n`` products (2 n^3 FLOPs each), within about ``seconds``.

    The sizes climb from PROBE_N (a warm-up and a timed run each) while the next one's
    warm-up and run are predicted to fit, then the top size repeats up to ``repeats``
    runs while they fit: a slow dtype is measured smaller or fewer times, and
    ``bounded`` says so. ``product(n)`` makes one product's function, ``timed(fn)`` times
    one call; ``probe_stop(n, rate)``, a reason to stop after the first size ("" to go on).
    """
    t0, matmuls, rates, bounded = clock(), 0, {}, ""
    ladder = sizes(n_max)
    for i, n in enumerate(ladder):
        fn = product(n)
        fn()  # warm up: kernels chosen, threads started, pages touched
        tries = PROBE_RUNS if i == 0 else 1  # the probe may decide alone: not on one run
        t = min(timed(fn) for _ in range(tries))
        matmuls += 1 + tries
        rates[n] = 2 * n**3 / t
        progress.step(what, 0, repeats, rates[n])
        if i == 0 and probe_stop and (bounded := probe_stop(n, rates[n])):
            return MatmulRun(rates[n], n, 1, matmuls, clock() - t0, bounded, rates)
        if i + 1 == len(ladder):
            break
        nxt = ladder[i + 1]
        predicted = t * (nxt / n) ** 3 * PREDICTION_MARGIN
        if clock() - t0 + 2 * predicted > seconds:
            bounded = (f"{n}x{n}, not {n_max}x{n_max}: {nxt}x{nxt} was predicted at "
                       f"{predicted:.3g} s a product ({gflops(rates[n])} at {n}x{n}), "
                       f"past the {seconds:g} s bound (--matmul-seconds)")
            break
    best, runs = t, 1
    progress.step(what, runs, repeats, 2 * n**3 / best)
    while runs < repeats:
        if clock() - t0 + t > seconds:
            bounded = "; ".join(filter(None, [bounded, (
                f"best of {runs} runs, not {repeats}: the {seconds:g} s bound "
                "(--matmul-seconds)")]))
            break
        t = timed(fn)
        matmuls, runs, best = matmuls + 1, runs + 1, min(best, t)
        progress.step(what, runs, repeats, 2 * n**3 / best)
    return MatmulRun(2 * n**3 / best, n, runs, matmuls, clock() - t0, bounded, rates)


def best_of(what: str, repeats: int, run: Callable[[], float], progress: Progress) -> float:
    best = 0.0
    for i in range(repeats):
        best = max(best, run())
        progress.step(what, i + 1, repeats, best)
    return best


def _bar(what: str, done: int, total: int, best: float) -> str:
    unit, scale = ("GB/s", 1e9) if what == "bandwidth" else ("TFLOP/s", 1e12)
    bar = "#" * done + "." * (total - done)
    return f"{what:<12} [{bar}] {done}/{total}  best {best / scale:,.3f} {unit}"


def measured_line(what: str, done: int, total: int, best: float, seconds: float,
                  run: MatmulRun | None = None) -> str:
    """One measurement done: its figure, its size, how long it took, and why it was
    bounded where it was."""
    where = f" at {run.n}x{run.n}" if run else ""
    note = f": {run.bounded}" if run and run.bounded else ""
    return f"{_bar(what, done, total, best)}{where} in {seconds:.1f} s{note}"


class StderrProgress:
    """On stderr: a line for the plan and for each measurement done (how long it took);
    on a terminal, the running measurement's bar redrawn in place as well."""

    def step(self, what: str, done: int, total: int, best: float) -> None:
        if sys.stderr.isatty():
            sys.stderr.write("\r\x1b[K" + _bar(what, done, total, best))
            sys.stderr.flush()

    def say(self, line: str) -> None:
        sys.stderr.write(("\r\x1b[K" if sys.stderr.isatty() else "") + line + "\n")
        sys.stderr.flush()


stderr_progress = StderrProgress()
