"""Trace sampling: the probability a request's span was kept with, and so its weight.

Production trace pipelines keep a share of traces (llm-d's guide: 10 %). A kept request
then stands for 1 / p requests (its *adjusted count*): request and token counters add
that weight, latency histograms keep each request as one sample.

Where p comes from, first that applies:

1. The span's own W3C ``tracestate``, as OpenTelemetry's "TraceState: Probability
   Sampling" specifies it (opentelemetry-specification
   ``specification/trace/tracestate-probability-sampling.md``,
   https://opentelemetry.io/docs/specs/otel/trace/tracestate-probability-sampling/): the
   ``ot`` member's ``th`` sub-key is the rejection threshold T, 1 to 14 hex digits padded
   with trailing zeros to 14 (56 bits). A span is kept when its 56-bit randomness (``rv``,
   else the trace id's last 7 bytes) is at least T, so p = (2^56 - T) / 2^56:
   ``th:0`` 100 %, ``th:8`` 50 %, ``th:c`` 25 %, ``th:e668`` 10 % (0.0999756). The
   tracestate is ``,``-separated ``key=value`` members (``phasewatch=tap``, vendors'); the
   ``ot`` value ``;``-separated ``key:value`` sub-keys (``rv:``, others). The same reading
   as the Collector's ``pkg/sampling`` (``TValueToThreshold``: at most 14 hex digits,
   right-padded) and the Python SDK's ``_sampling_experimental`` (``_parse_th``), which
   writes it (``composite_sampler(composable_traceid_ratio_based(r))``).
2. The configured ratio (``--trace-sample-ratio``), for samplers that write no ``th``
   (the Collector's ``probabilistic_sampler`` in hash-seed mode, the SDK's classic
   ``TraceIdRatioBased``).
3. Else 1: the request was not sampled, or nothing says how.

A ``th`` that is not 1 to 14 hex digits is ignored (``bad_threshold``), and so is one whose
p is below ``MIN_PROBABILITY`` (``threshold_out_of_range``): one such span would add
millions to a counter (2^56 at most) and swamp every real request in float64. Either is
counted by reason; the span's request keeps the configured ratio's weight (else 1).
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Sequence

import numpy as np

THRESHOLD_BITS = 56
MAX_ADJUSTED = float(1 << THRESHOLD_BITS)
# below this a weight (over a million requests per span) is a fault, not a sampler an LLM
# server is run with: at a thousand requests a second it keeps one trace in 17 minutes
MIN_PROBABILITY = 1e-6
_HEX = re.compile(r"[0-9a-fA-F]{1,14}")  # no sign, no 0x, no underscores (int() takes them)


def threshold_probability(th: str) -> float:
    """The sampling probability of a ``th`` value; ValueError when it is not 1 to 14 hex
    digits."""
    if not _HEX.fullmatch(th):
        raise ValueError(f"th must be 1 to 14 hex digits, got {th[:32]!r}")
    threshold = int(th, 16) << (4 * (14 - len(th)))
    return (MAX_ADJUSTED - threshold) / MAX_ADJUSTED


def ot_threshold(trace_state: str) -> str | None:
    """The ``th`` sub-key of the tracestate's ``ot`` member (the first of each), None
    when there is none."""
    for member in trace_state.split(","):
        key, sep, value = member.strip().partition("=")
        if sep and key == "ot":
            for sub in value.split(";"):
                name, colon, v = sub.partition(":")
                if colon and name == "th":
                    return v
            return None
    return None


def probability(trace_state: str) -> tuple[float | None, str]:
    """(p, "") from the tracestate's ``ot=th``; (None, "") without one; (None, reason)
    for one that cannot be used (module docstring)."""
    th = ot_threshold(trace_state) if "th:" in trace_state else None
    if th is None:
        return None, ""
    try:
        p = threshold_probability(th)
    except ValueError:
        return None, "bad_threshold"
    if p < MIN_PROBABILITY:
        return None, "threshold_out_of_range"
    return p, ""


def check_ratio(ratio: float) -> float:
    """A configured sampling ratio, 0 < ratio <= 1 (at least ``MIN_PROBABILITY``)."""
    if not MIN_PROBABILITY <= ratio <= 1:
        raise ValueError(f"a sampling ratio must be in [{MIN_PROBABILITY:g}, 1], got {ratio!r}")
    return float(ratio)


class TraceSampling:
    """Request spans' weights (``weights``): 1 / their ``th``'s probability, else 1 /
    ``ratio`` (``--trace-sample-ratio``). Thresholds it could not use are counted by
    reason until ``take_ignored`` hands them on (the OTLP ingest counts them)."""

    def __init__(self, ratio: float = 1.0):
        self.ratio = check_ratio(ratio)
        self._ignored: Counter = Counter()
        self._lock = threading.Lock()

    def weights(self, trace_states: Sequence[str], configured: bool = True
                ) -> np.ndarray | None:
        """One weight per span (from its tracestate); None when every one is 1. Without
        ``configured`` a span with no threshold weighs 1, not 1/--trace-sample-ratio: a
        stream tap's record stands for one request, whatever its trace was sampled at
        (a sampler after the tap, writing its ``th``, still counts)."""
        default = 1.0 / self.ratio if configured else 1.0
        if not any("th:" in s for s in trace_states):  # the usual case: no threshold
            return None if default == 1.0 else np.full(len(trace_states), default)
        out = np.full(len(trace_states), default)
        ignored: Counter = Counter()
        for i, state in enumerate(trace_states):
            if "th:" in state:
                p, reason = probability(state)
                if p is not None:
                    out[i] = 1.0 / p
                elif reason:
                    ignored[reason] += 1
        if ignored:
            with self._lock:
                self._ignored.update(ignored)
        return out

    def take_ignored(self) -> Counter:
        """Thresholds ignored since the last call, by reason."""
        with self._lock:
            out, self._ignored = self._ignored, Counter()
        return out
