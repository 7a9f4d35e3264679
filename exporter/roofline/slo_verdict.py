"""The verdict with latency objectives: the phase that breaks the most misses.

With objectives (``--slo``) the verdict's first question is whether requests met them.
``attainment`` reads the window's per-request outcomes and, for each miss, the phase that
broke it (``requests.objectives.judge``: the largest part of the TTFT for a TTFT miss,
decode for a TPOT or ITL miss, the largest of the whole request for an e2el miss, the
one function the counters use too, stored per row in the rolling window). ``rank``
then names the phase:

* with at least ``MIN_REQUESTS`` judged requests in the window and an objective missed
  by at least ``MATERIAL_MISS`` of them, the phase that broke the most misses of such
  objectives (a request missing two objectives counts once for each), before the
  time-share rule; a verdict already ranked by misses stays so while the share is at
  least ``MATERIAL_MISS - MISS_HYSTERESIS``, and another phase must break
  ``HYSTERESIS`` more of the misses to replace it;
* otherwise None: the time-share rule decides, and ``lead`` says the objectives were met.

The figures go to ``verdict.evidence.slo``; ``lead`` is the sentence the verdict's
text starts with.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass, field

import numpy as np

from phasewatch.requests.objectives import MET, MISS_PHASES, MISSED, OBJECTIVES, UNKNOWN, Objectives
from phasewatch.roofline.cause import Cause
from phasewatch.roofline.intervals import SlowdownFit

MIN_REQUESTS = 20  # judged requests in the window before objectives rank the phase
MATERIAL_MISS = 0.05  # an objective missed by this share of requests ranks by misses
MISS_HYSTERESIS = 0.02  # a verdict ranked by misses keeps it down to 3 %
WHERE = {"preprocess": "preprocess", "queue": "the queue", "prefill": "prefill",
         "kv_transfer": "the KV transfer", "decode": "decode"}


@dataclass(frozen=True)
class WithoutPrefill:
    """The TPOT misses weighed without the prefill chunks beside their decode steps
    (``_without_prefill``)."""

    misses_weighed: int
    would_meet_without_prefill: float | None
    slowdown: float
    tpot_without_prefill: float
    tpot_sharing_every_step: float
    decode_shared_missed: float | None  # mean share of decode beside prefills, misses
    decode_shared_met: float | None  # the same for the requests that met it


@dataclass(frozen=True)
class ObjectiveAttainment:
    """One objective's requests over the window: met, missed, unknown, and the misses by
    the phase that broke them."""

    objective_seconds: float | None  # None where only prompt classes set it
    met: int
    missed: int
    unknown: int
    attainment: float
    missed_share: float
    missed_by_phase: dict[str, int]
    by_prompt_class: dict[str, float] = field(default_factory=dict)
    without_prefill: WithoutPrefill | None = None

    def as_dict(self) -> dict:
        """The JSON API's ``evidence.slo.objectives.<name>``."""
        return {"objective_seconds": self.objective_seconds,
                **({"by_prompt_class": dict(self.by_prompt_class)}
                   if self.by_prompt_class else {}),
                "met": self.met, "missed": self.missed, "unknown": self.unknown,
                "attainment": self.attainment, "missed_share": self.missed_share,
                "missed_by_phase": dict(self.missed_by_phase),
                **({"without_prefill": asdict(self.without_prefill)}
                   if self.without_prefill is not None else {})}


@dataclass
class Attainment:
    """The objectives over the window (``attainment``); ``rank`` fills ``ranked_by``,
    ``missed_by_phase`` (each phase's share of the misses ranked) and ``phase``."""

    requests: int  # judged
    objectives: dict[str, ObjectiveAttainment]
    ranked_by: str = "time_share"  # or "misses"
    missed_by_phase: dict[str, float] | None = None
    phase: str | None = None
    goodput: float | None = None  # requests/s that met every objective, where known

    def as_dict(self) -> dict:
        """The JSON API's ``evidence.slo``."""
        return {"requests": self.requests,
                "objectives": {k: o.as_dict() for k, o in self.objectives.items()},
                "ranked_by": self.ranked_by, "min_requests": MIN_REQUESTS,
                "material_miss_share": MATERIAL_MISS,
                **({"missed_by_phase": self.missed_by_phase}
                   if self.missed_by_phase is not None else {}),
                **({"phase": self.phase} if self.phase is not None else {})}


def objective_name(name: str, fig: ObjectiveAttainment) -> str:
    """"TTFT 500 ms", "TTFT 500 ms (3000 ms for 4k-16k prompts)" with a prompt class's
    override, "TTFT 3000 ms for 4k-16k prompts" with only that."""
    seconds, by_class = fig.objective_seconds, fig.by_prompt_class
    classes = ", ".join(f"{v * 1000:g} ms for {c}" for c, v in by_class.items())
    if seconds is None:
        return f"{name.upper()} {classes} prompts"
    return f"{name.upper()} {seconds * 1000:g} ms" + (f" ({classes} prompts)" if classes
                                                      else "")


@dataclass(frozen=True)
class DecodeSharing:
    """What the records tell of the window's decodes: per request its TPOT and the share
    of its decode spent beside other requests' prefills
    (``intervals.decode_shared_with_prefill``), and the window's fit of one on the other
    (``intervals.decode_slowdown``)."""

    tpot: np.ndarray
    shared: np.ndarray
    fit: SlowdownFit | None

    def where(self, rows: np.ndarray) -> DecodeSharing:
        return DecodeSharing(self.tpot[rows], self.shared[rows], self.fit)


def attainment(objectives: Objectives, outcome: np.ndarray, phase: np.ndarray,
               decode: DecodeSharing | None = None) -> Attainment | None:
    """The window's figures per objective set: ``outcome`` and ``phase`` are the window's
    ``slo_outcome`` / ``slo_phase`` rows ([requests, objectives]). ``decode``, where the
    records tell it (``DecodeSharing``): the TPOT objective's figures then say how many
    misses prefill interference made. None without objectives or judged requests."""
    judged = (outcome >= 0).any(axis=1) if outcome.size else np.zeros(0, bool)
    n = int(judged.sum())
    if not objectives or not n:
        return None
    per = {}
    for name in objectives.judged():
        j = OBJECTIVES.index(name)
        o = outcome[judged, j]
        total = int((o >= 0).sum())
        if not total:
            continue
        missed = o == MISSED
        by_phase = np.bincount(phase[judged, j][missed], minlength=len(MISS_PHASES))
        without = (_without_prefill(o, decode.where(judged), getattr(objectives, name))
                   if name == "tpot" and decode is not None else None)
        per[name] = ObjectiveAttainment(
            getattr(objectives, name), int((o == MET).sum()), int(missed.sum()),
            int((o == UNKNOWN).sum()), float((o == MET).sum() / total),
            float(missed.sum() / total),
            {p: int(c) for p, c in zip(MISS_PHASES, by_phase.tolist(), strict=True) if c},
            objectives.overrides(name) or {}, without)
    return Attainment(n, per)


MIN_TOLD = 5  # TPOT misses the fit can weigh before anything is said of them
MOSTLY = 0.5  # of those, the share that must have met it without interference
# ... or, where a straight line undercounts the cost of sharing (a long prefill chunk
# stalls a step whatever the share), the misses' decode spent beside prefills at least
# BESIDE_RATIO x and BESIDE_MARGIN more than the decode of the requests that met it
BESIDE_RATIO = 2.0
BESIDE_MARGIN = 0.2


def _without_prefill(outcome: np.ndarray, decode: DecodeSharing, seconds: float | None
                     ) -> WithoutPrefill | None:
    """What the TPOT misses would have been without the prefill chunks beside their decode
    steps: each request's TPOT less the fitted cost of sharing (``intervals.decode_slowdown``:
    TPOT = a + b x share), against the objective."""
    fit = decode.fit
    if fit is None or seconds is None or fit.slowdown <= 1:
        return None
    shared, tpot = decode.shared, decode.tpot
    missed = (outcome == MISSED) & ~np.isnan(shared) & ~np.isnan(tpot)
    slope = fit.tpot_sharing_every_step - fit.tpot_without_prefill
    alone = tpot[missed] - slope * shared[missed]
    met = (outcome == MET) & ~np.isnan(shared)
    return WithoutPrefill(
        int(missed.sum()), float((alone <= seconds).mean()) if alone.size else None,
        fit.slowdown, fit.tpot_without_prefill, fit.tpot_sharing_every_step,
        float(shared[missed].mean()) if missed.any() else None,
        float(shared[met].mean()) if met.any() else None)


def interference_told(fig: ObjectiveAttainment) -> str:
    """The TPOT misses put down to prefill interference, in words; "" when the records
    do not show it."""
    w = fig.without_prefill
    if w is None or w.misses_weighed < MIN_TOLD:
        return ""
    if (w.would_meet_without_prefill or 0) >= MOSTLY:
        return (f"{w.would_meet_without_prefill:.0%} of those would have met it without "
                "the prefill chunks sharing their decode steps")
    missed, met = w.decode_shared_missed or 0.0, w.decode_shared_met or 0.0
    if missed >= BESIDE_RATIO * met and missed >= met + BESIDE_MARGIN:
        return (f"they decoded beside other requests' prefill chunks {missed:.0%} of the "
                f"time, against {met:.0%} for the requests that met it")
    return ""


def interference_cause(slo: Attainment | None, phase: str) -> Cause | None:
    """With decode ranked by TPOT misses that prefill chunks made (``interference_told``),
    the cause is prefill interference, whatever share of decode time the sharing takes
    overall (``cause.INTERFERENCE_LOST`` judges a decode without objectives); None
    otherwise."""
    fig = slo.objectives.get("tpot") if slo is not None else None
    if phase != "decode" or slo is None or slo.phase != "decode" or fig is None or \
            fig.missed_share < MATERIAL_MISS or not interference_told(fig):
        return None
    w = fig.without_prefill
    return Cause("prefill_interference",
                 f"Prefill interference: a decode step shared with prefill takes "
                 f"{w.slowdown:.1f}x one that is not (TPOT "
                 f"{w.tpot_sharing_every_step * 1e3:.1f} ms vs "
                 f"{w.tpot_without_prefill * 1e3:.1f} ms), and the requests that missed "
                 f"their TPOT spent {w.decode_shared_missed:.0%} of their decode beside "
                 f"prefills against {w.decode_shared_met or 0:.0%} for those that met it",
                 "records", {"tpot_objective": asdict(w)})


def rank(slo: Attainment | None, shares: Collection[str], previous=None,
         hysteresis: float = 0.05) -> str | None:
    """The phase that broke the most misses of the materially missed objectives, or None
    (module docstring); ``shares``, the phases the label set reports. Fills ``slo``'s
    ``missed_by_phase`` (shares of those misses), ``ranked_by`` and ``phase``."""
    if slo is None or slo.requests < MIN_REQUESTS:
        return None
    was = previous is not None and previous.evidence.ranked_by_misses
    bar = MATERIAL_MISS - (MISS_HYSTERESIS if was else 0.0)
    counts: dict[str, int] = {}
    for fig in slo.objectives.values():
        if fig.missed_share >= bar:
            for p, c in fig.missed_by_phase.items():
                if p in shares:  # a known phase this label set reports
                    counts[p] = counts.get(p, 0) + c
    total = sum(counts.values())
    if not total:
        return None
    share = {p: c / total for p, c in counts.items()}
    slo.missed_by_phase = share
    phase = max(share, key=share.get)
    if was and previous.phase in share and phase != previous.phase and (
            share[phase] < share[previous.phase] + hysteresis):
        phase = previous.phase
    slo.ranked_by, slo.phase = "misses", phase
    return phase


def lead(slo: Attainment | None, phase: str | None) -> str:
    """The sentence the verdict starts with: the misses the phase broke, or that every
    objective was met; "" with too few requests."""
    if slo is None or slo.requests < MIN_REQUESTS:
        return ""
    per = slo.objectives
    if slo.ranked_by != "misses":
        missed = [k for k, f in per.items() if f.missed_share >= MATERIAL_MISS]
        if missed:  # missed, but the phase that broke it is unknown
            return " ".join(f"{f.missed_share:.0%} of requests missed "
                            f"{objective_name(k, f)}." for k, f in
                            per.items() if k in missed)
        return "All objectives met: " + ", ".join(
            f"{objective_name(k, f)} by {_floor_pct(f.attainment)}"
            + (f" ({f.unknown / max(1, f.met + f.missed + f.unknown):.0%} "
               "unknown)" if f.unknown else "")
            for k, f in per.items()) + "."
    # the objective whose misses this phase broke most
    name = max(per, key=lambda k: per[k].missed_by_phase.get(phase, 0))
    f = per[name]
    head = (f"{f.missed_share:.0%} of requests missed "
            f"{objective_name(name, f)}")
    if name in ("tpot", "itl"):
        told = interference_told(f)
        text = f"{head}: their decode steps were too slow" + (f"; {told}." if told else ".")
    else:
        of = f.missed_by_phase.get(phase, 0) / max(1, f.missed)
        part = "it" if name == "ttft" else "the request"
        text = f"{head}; {of:.0%} of those spent most of {part} in {WHERE[phase]}."
    others = [k for k, g in per.items()
              if k != name and g.missed_share >= MATERIAL_MISS]
    for k in others:
        g = per[k]
        top = max(g.missed_by_phase, key=g.missed_by_phase.get)
        text += (f" {g.missed_share:.0%} missed {objective_name(k, g)}"
                 + (f", mostly in {WHERE[top]}." if top in WHERE else "."))
    return text


def _floor_pct(x: float) -> str:
    """A share rounded down (99.7 % met is "99%", not "100%")."""
    return f"{np.floor(x * 100 + 1e-9):.0f}%"
