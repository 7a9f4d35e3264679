"""What the rolling window says about each label set: figures, not the API's JSON.

``RollingWindow.summarize`` returns a ``WindowSummary``; the JSON API
(``phasewatch.publish.api``) and the bench layout read its fields, and ``as_dict()`` is
its JSON form (``/api/v1/summary``, ``RollingWindow.summary()``, the history).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from phasewatch.requests.buckets import (
    PROMPT_CLASS_RANGES,
    PROMPT_CLASSES,
    WINDOW_INDEX,
    prompt_class_codes,
)
from phasewatch.requests.objectives import OBJECTIVES, OUTCOMES, Objectives

QUANTILES = (0.5, 0.9, 0.95, 0.99)


def whole(x) -> int | float:
    """A count as an int where it is whole (every request counted once), else the float a
    sampled request's weight made it (an estimate of the requests it stands for)."""
    x = float(x)
    return int(x) if x.is_integer() else x


@dataclass(frozen=True)
class Quantiles:
    """Mean, p50/p90/p95/p99 and count of some values (None where there are none)."""

    mean: float | None
    p50: float | None
    p90: float | None
    p95: float | None
    p99: float | None
    count: int

    @classmethod
    def of(cls, values: np.ndarray) -> Quantiles:
        """Of the known values: numpy's linear interpolation, as ``vllm bench serve``'s
        ``np.percentile``."""
        v = values[~np.isnan(values)]
        if v.size == 0:
            return cls(None, None, None, None, None, 0)
        return cls(float(v.mean()), *(float(x) for x in np.quantile(v, QUANTILES)),
                   int(v.size))

    @classmethod
    def binned(cls, counts: np.ndarray, total_seconds: float) -> Quantiles:
        """From the window's log-linear bins (each the bin's geometric middle), with the
        exact mean from the gaps' summed seconds."""
        total = int(counts.sum())
        if total == 0:
            return cls(None, None, None, None, None, 0)
        cum = np.cumsum(counts)
        lo, hi = WINDOW_INDEX.bounds()
        qs = []
        for q in QUANTILES:
            b = int(np.searchsorted(cum, q * total, side="left"))
            b = min(max(b, 1), len(lo)) - 1  # under/overflow bins read as the range's ends
            qs.append(float(math.sqrt(lo[b] * hi[b])))  # geometric middle
        return cls(float(total_seconds / total), *qs, total)

    def as_dict(self) -> dict:
        return {"mean": self.mean, "p50": self.p50, "p90": self.p90, "p95": self.p95,
                "p99": self.p99, "count": self.count}


@dataclass(frozen=True)
class PromptClassFigures:
    """TTFT and prefill seconds per uncached prompt token of one prompt-length class."""

    prompt_class: str
    min_tokens: int
    max_tokens: int
    ttft: Quantiles
    prefill_seconds_per_token: Quantiles

    def as_dict(self) -> dict:
        return {"prompt_class": self.prompt_class, "min_tokens": self.min_tokens,
                "max_tokens": self.max_tokens, "ttft_seconds": self.ttft.as_dict(),
                "prefill_seconds_per_token": self.prefill_seconds_per_token.as_dict()}


def by_prompt_class(ring: dict, sel: np.ndarray) -> list[PromptClassFigures]:
    """Per prompt-length class, so a TTFT rise from longer prompts is told apart from a
    slower prefill."""
    codes = prompt_class_codes(ring["prompt"][sel])
    ttft, prefill, uncached = ring["ttft"][sel], ring["prefill"][sel], ring["uncached"][sel]
    with np.errstate(divide="ignore", invalid="ignore"):
        per_token = np.where(uncached > 0, prefill / uncached, np.nan)
    out = []
    for code, (_, label) in enumerate(PROMPT_CLASSES):
        mine = codes == code
        if mine.any():
            lo, hi = PROMPT_CLASS_RANGES[label]
            out.append(PromptClassFigures(label, lo, hi, Quantiles.of(ttft[mine]),
                                          Quantiles.of(per_token[mine])))
    return out


@dataclass(frozen=True)
class ObjectiveFigures:
    """One objective over the window: requests that met it, missed it, or whose value
    was unknown; attainment = met / all three. ``seconds`` is the plain objective (None
    where only prompt classes have one), ``by_prompt_class`` the classes' overrides."""

    objective: str
    seconds: float | None
    met: int | float  # weighted as the counters (``whole``)
    missed: int | float
    unknown: int | float
    by_prompt_class: dict[str, float] = field(default_factory=dict)

    @property
    def attainment(self) -> float | None:
        total = self.met + self.missed + self.unknown
        return self.met / total if total else None

    def as_dict(self) -> dict:
        return {"objective_seconds": self.seconds,
                **({"by_prompt_class": dict(self.by_prompt_class)}
                   if self.by_prompt_class else {}),
                "met": self.met, "missed": self.missed, "unknown": self.unknown,
                "attainment": self.attainment}


@dataclass(frozen=True)
class SloFigures:
    """Goodput over the window: requests that met every objective set, per second of the
    window's covered time (the request rate's duration), and each objective's figures."""

    good_requests: int | float  # weighted as the counters (``whole``)
    goodput: float  # good requests per second
    good_ratio: float | None  # good / requests
    objectives: list[ObjectiveFigures]

    @classmethod
    def of(cls, objectives: Objectives, flags, covered: float, requests: float
           ) -> SloFigures | None:
        """From the window's summed flags (good, then met/missed/unknown per objective,
        ``aggregation.slo.window_columns``); None when the label set has no objectives."""
        if not objectives:
            return None
        flags = [whole(x) for x in flags]
        per = []
        judged = objectives.judged()
        for i, name in enumerate(OBJECTIVES):
            if name in judged:
                o = 1 + i * len(OUTCOMES)
                per.append(ObjectiveFigures(name, getattr(objectives, name),
                                            *flags[o:o + len(OUTCOMES)],
                                            objectives.overrides(name)))
        good = flags[0]
        return cls(good, good / max(float(covered), 1e-9),
                   good / requests if requests else None, per)

    def as_dict(self) -> dict:
        return {"good_requests": self.good_requests, "goodput": self.goodput,
                "good_ratio": self.good_ratio,
                "objectives": {o.objective: o.as_dict() for o in self.objectives}}


@dataclass(frozen=True)
class SeriesSummary:
    """One label set over the window."""

    model: str
    engine: str
    more: dict[str, str]  # the label set's other labels (pod, source) where it has them
    covered_seconds: float
    # weighted: a request whose trace was sampled counts 1/p (``whole``), as on /metrics
    requests: int | float
    prompt_tokens: int | float
    output_tokens: int | float
    ttft: Quantiles
    tpot: Quantiles
    e2e: Quantiles
    e2e_to_last_token: Quantiles  # vLLM's e2e: arrival to the last token
    itl: Quantiles  # pooled gaps, from the window's bins
    # each gap spread over the tokens of the emission ending it (multi-token chunks);
    # percentiles: phasewatch_inter_token_latency_per_token_seconds
    itl_per_token_mean: float | None
    itl_per_token_count: int
    phase_time_share: dict[str, float | None]
    ttft_by_prompt_class: list[PromptClassFigures]
    sampled_requests: int  # the ring's requests behind the quantiles
    received_requests: int | None = None  # requests as received, each once (None: requests)
    slo: SloFigures | None = None  # with objectives (--slo) for the label set's model

    def trace_sampling(self) -> dict | None:
        """Where requests were weighted (their traces sampled): the requests received and
        their share of the requests they stand for; None where every one counted once."""
        got = self.received_requests
        if got is None or got == self.requests:
            return None
        return {"received_requests": got,
                "sampled_share": got / self.requests if self.requests else None}

    @property
    def request_rate(self) -> float:
        return self.requests / self.covered_seconds

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.covered_seconds

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.covered_seconds

    def as_dict(self) -> dict:
        return {
            "model": self.model, "engine": self.engine, **self.more,
            "covered_seconds": self.covered_seconds,
            "requests_in_window": self.requests,
            "prompt_tokens_in_window": self.prompt_tokens,
            "output_tokens_in_window": self.output_tokens,
            "request_rate": self.request_rate,
            "prompt_tokens_per_second": self.prompt_tokens_per_second,
            "output_tokens_per_second": self.output_tokens_per_second,
            "ttft_seconds": self.ttft.as_dict(), "tpot_seconds": self.tpot.as_dict(),
            "e2e_seconds": self.e2e.as_dict(),
            "e2e_to_last_token_seconds": self.e2e_to_last_token.as_dict(),
            "itl_seconds": self.itl.as_dict(),
            "itl_per_token_seconds": {"mean": self.itl_per_token_mean,
                                      "count": self.itl_per_token_count},
            "phase_time_share": self.phase_time_share,
            "ttft_by_prompt_class": [c.as_dict() for c in self.ttft_by_prompt_class],
            "sampled_requests": self.sampled_requests,
            **({"trace_sampling": self.trace_sampling()} if self.trace_sampling() else {}),
            **({"slo": self.slo.as_dict()} if self.slo is not None else {}),
        }


@dataclass(frozen=True)
class WindowSummary:
    """Every label set with requests in the window."""

    window_seconds: float
    covered_seconds: float  # the longest a label set's requests cover
    generated_at: float
    ring_capacity: int
    series: list[SeriesSummary]

    def as_dict(self) -> dict:
        return {"window_seconds": self.window_seconds, "covered_seconds": self.covered_seconds,
                "generated_at": self.generated_at, "ring_capacity": self.ring_capacity,
                "models": [s.as_dict() for s in self.series]}
