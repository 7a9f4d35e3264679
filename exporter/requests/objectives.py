"""Latency objectives (SLOs) and goodput: each request met, missed or unknown, exactly.

Objectives are given as ``vllm bench serve --goodput`` takes them: ``KEY:VALUE`` pairs,
comma- or space-separated, values in milliseconds (``ttft:500,tpot:50`` or
``ttft:500 e2el:8000``). A key may name a prompt-length class, ``KEY@CLASS:VALUE`` with
CLASS one of ``buckets.PROMPT_CLASSES``' labels (the TTFT histogram's ``prompt_class``:
0-256, 257-1k, 1k-4k, 4k-16k, 16k-64k, 64k+): it replaces that objective for requests
whose prompt falls in the class (``ttft:500,ttft@4k-16k:3000``: 3 s for 4k-16k-token
prompts, 500 ms for the others and for prompts of unknown length); without a plain value
for the key, the objective is set for that class only. Keys:

* ``ttft``  time to first token (first token - arrival; ``phases``' ttft);
* ``tpot``  time per output token after the first, (last token - first token) /
  (output tokens - 1); a request with at most one output token has TPOT 0 for goodput,
  as vLLM's ``calculate_metrics`` regards it;
* ``itl``   inter-token latency (not in vLLM's goodput): met when *every* gap between
  consecutive streamed emissions of the request is within the objective; a request with
  at most one output token has no gap and meets it; one with more tokens but no emission
  times (not streamed, or sent as one chunk) is unknown;
* ``e2el``  end-to-end latency as vLLM's benchmark measures it (its ``latency``): arrival
  to the last token; to the finish when the last token's time is unknown (an answer that
  was not streamed ends at its finish). ``e2e`` is accepted for it.

A request meets an objective when its value is at most the objective (vLLM: ``slo >=
value``); a request whose value is unknown (no first-token time, unknown output tokens)
is ``unknown`` for that objective, never met. A *good* request met every objective set
(DistServe's goodput, vLLM's ``request_goodput`` = good requests / duration).

``judge`` does it for a whole batch with numpy, from the batch's columns and the phases
``split_phases`` derived; for each miss it names the phase that took the largest part:
of the TTFT (preprocess, queue, prefill, kv_transfer) for a TTFT miss, ``decode`` for a
TPOT or ITL miss, of the whole request (those and decode) for an e2el miss; ``unknown``
when none of those phases is known.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from phasewatch.requests.buckets import PROMPT_CLASSES
from phasewatch.requests.phases import Phases
from phasewatch.requests.record import RequestBatch

OBJECTIVES = ("ttft", "tpot", "itl", "e2el")
ALIASES = {"e2e": "e2el"}
OUTCOMES = ("met", "missed", "unknown")
MET, MISSED, UNKNOWN = range(3)
TTFT_PHASES = ("preprocess", "queue", "prefill", "kv_transfer")
E2E_PHASES = (*TTFT_PHASES, "decode")
MISS_PHASES = (*E2E_PHASES, "unknown")
_DECODE = MISS_PHASES.index("decode")
_NO_PHASE = MISS_PHASES.index("unknown")
CLASSES = tuple(label for _, label in PROMPT_CLASSES)  # prompt_class_codes' order
FORM = ("KEY:VALUE pairs, comma- or space-separated, KEY one of ttft, tpot, itl, e2el, "
        "VALUE milliseconds (as vllm bench serve --goodput), e.g. ttft:500,tpot:50; "
        "KEY@CLASS:VALUE for one prompt-length class, e.g. ttft@4k-16k:3000")


@dataclass(frozen=True)
class Objectives:
    """Thresholds in seconds; None: not set. ``by_class``: the prompt-length classes'
    overrides, (objective, class, seconds) in OBJECTIVES then CLASSES order."""

    ttft: float | None = None
    tpot: float | None = None
    itl: float | None = None
    e2el: float | None = None
    by_class: tuple[tuple[str, str, float], ...] = ()

    def __post_init__(self) -> None:  # one order, so equal objectives compare equal
        object.__setattr__(self, "by_class", tuple(sorted(
            self.by_class, key=lambda x: (OBJECTIVES.index(x[0]), CLASSES.index(x[1])))))

    def __bool__(self) -> bool:
        return bool(self.by_class) or any(v is not None for v in self.seconds().values())

    def seconds(self) -> dict[str, float | None]:
        """The plain objectives (every class's but the overridden)."""
        return {k: getattr(self, k) for k in OBJECTIVES}

    def set(self) -> dict[str, float]:
        """The plain objectives set, in seconds."""
        return {k: v for k, v in self.seconds().items() if v is not None}

    def overrides(self, name: str) -> dict[str, float]:
        """Objective ``name``'s seconds per prompt class where a class overrides it."""
        return {c: v for k, c, v in self.by_class if k == name}

    def judged(self) -> list[str]:
        """The objectives set for some request: plain or for a class."""
        return [k for k in OBJECTIVES if getattr(self, k) is not None or self.overrides(k)]

    def array(self) -> np.ndarray:
        """[len(OBJECTIVES)] seconds of the plain objectives, NaN where not set."""
        return np.array([np.nan if v is None else v for v in self.seconds().values()])

    def class_array(self) -> np.ndarray:
        """[len(CLASSES) + 1, len(OBJECTIVES)] seconds per ``prompt_class_codes`` code (the
        last row: unknown prompt length, the plain ones), NaN where not set."""
        out = np.tile(self.array(), (len(CLASSES) + 1, 1))
        for k, c, v in self.by_class:
            out[CLASSES.index(c), OBJECTIVES.index(k)] = v
        return out

    def text(self) -> str:
        """As the flag takes them (milliseconds)."""
        return ",".join([*(f"{k}:{v * 1000:g}" for k, v in self.set().items()),
                         *(f"{k}@{c}:{v * 1000:g}" for k, c, v in self.by_class)])


def parse_objectives(text: str) -> Objectives:
    """``ttft:500,tpot:50,ttft@4k-16k:3000`` (or space-separated) -> ``Objectives``;
    ValueError naming the bad pair and the form otherwise. Empty: no objectives."""
    if not isinstance(text, str):
        raise ValueError(f"{text!r} is not a string of {FORM}")
    found: dict[str, float] = {}
    by_class: dict[tuple[str, str], float] = {}
    for pair in filter(None, re.split(r"[,\s]+", text.strip())):
        key, sep, value = pair.partition(":")
        key, at, cls = key.strip().lower().partition("@")
        if not sep:
            raise ValueError(f"{pair!r} has no colon: {FORM}")
        name = ALIASES.get(key, key)
        if name not in OBJECTIVES:
            raise ValueError(f"{pair!r}: unknown objective {key!r}; {FORM}")
        if at and cls not in CLASSES:
            raise ValueError(f"{pair!r}: unknown prompt class {cls!r}; CLASS is one of "
                             f"{', '.join(CLASSES)} (prompt tokens, as the prompt_class label)")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"{pair!r}: {value!r} is not a number of milliseconds; "
                             f"{FORM}") from None
        if not math.isfinite(ms) or ms < 0:
            raise ValueError(f"{pair!r}: the value must be a finite, non-negative number "
                             "of milliseconds")
        if at:
            if (name, cls) in by_class:
                raise ValueError(f"{pair!r}: {name}@{cls} is given twice")
            by_class[(name, cls)] = ms / 1000
            continue
        if name in found:
            raise ValueError(f"{pair!r}: {name} is given twice")
        found[name] = ms / 1000
    return Objectives(**found, by_class=tuple((k, c, v) for (k, c), v in by_class.items()))


@dataclass
class ObjectivesByModel:
    """The objectives of each model label: its own (a ``[[models]]`` table's ``slo``) or
    the global ones (``--slo``)."""

    default: Objectives = field(default_factory=Objectives)
    by_model: dict[str, Objectives] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.default) or any(self.by_model.values())

    def for_model(self, model: str) -> Objectives:
        return self.by_model.get(model, self.default)


@dataclass
class Judged:
    """One batch judged against per-row objectives (rows as the batch's)."""

    outcome: np.ndarray  # int8 [rows, objectives]: MET, MISSED, UNKNOWN; -1 not set
    good: np.ndarray  # bool [rows]: every objective set met (False without any set)
    phase: np.ndarray  # int8 [rows, objectives]: index into MISS_PHASES; -1 not missed


def values(batch: RequestBatch, ph: Phases, itl: bool = True) -> np.ndarray:
    """[rows, objectives] seconds of each request for each objective (NaN: unknown), as
    the module docstring defines them; ``itl`` False leaves the ITL column NaN (no pass
    over the token gaps)."""
    n = len(batch)
    want_itl = itl
    out_tok = batch.output_tokens
    short = (out_tok >= 0) & (out_tok <= 1)  # vLLM: output_len <= 1 -> TPOT 0
    tpot = np.where(short, 0.0, np.where(out_tok > 1, ph.tpot, np.nan))
    itl = np.full(n, np.nan)
    counts = batch.gap_counts
    has = counts > 0
    if want_itl and has.any():
        starts = (np.cumsum(counts) - counts)[has]
        gaps = np.asarray(batch.token_gaps, dtype=np.float64)
        itl[has] = np.maximum.reduceat(gaps, starts)
    itl = np.where(short & ~has, 0.0, itl)
    to_last = ph.ttft + ph.decode
    e2el = np.where(np.isnan(to_last) & (batch.last_token == 0), ph.e2e, to_last)
    return np.stack([ph.ttft, tpot, itl, e2el], axis=1)


def _largest(parts: list[np.ndarray]) -> np.ndarray:
    """Per row, the index of the largest known part; ``_NO_PHASE`` when none is known."""
    stacked = np.stack(parts, axis=1)
    known = ~np.isnan(stacked)
    pick = np.argmax(np.where(known, stacked, -np.inf), axis=1)
    return np.where(known.any(axis=1), pick, _NO_PHASE)


def judge(batch: RequestBatch, ph: Phases, thresholds: np.ndarray) -> Judged:
    """Each row against its thresholds ([rows, objectives] seconds, NaN: not set)."""
    is_set = ~np.isnan(thresholds)
    v = values(batch, ph, itl=bool(is_set[:, OBJECTIVES.index("itl")].any()))
    with np.errstate(invalid="ignore"):
        met = v <= thresholds
    outcome = np.where(np.isnan(v), UNKNOWN, np.where(met, MET, MISSED))
    outcome = np.where(is_set, outcome, -1).astype(np.int8)
    good = is_set.any(axis=1) & ((outcome == MET) | ~is_set).all(axis=1)
    missed = outcome == MISSED
    phase = np.full(v.shape, -1, dtype=np.int8)
    if missed.any():
        ttft_part = _largest([getattr(ph, p) for p in TTFT_PHASES])
        e2e_part = _largest([getattr(ph, p) for p in E2E_PHASES])
        by_objective = {"ttft": ttft_part, "tpot": _DECODE, "itl": _DECODE, "e2el": e2e_part}
        for j, name in enumerate(OBJECTIVES):
            phase[:, j] = np.where(missed[:, j], by_objective[name], -1)
    return Judged(outcome, good, phase)
