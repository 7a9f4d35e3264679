"""The verdict banner's rows from Prometheus's answers: the pods' votes on the phase and
the resource (``phasewatch_bottleneck_info``), the cause they name (its ``cause`` label),
the engine's own state the exporters scraped (``phasewatch_engine_*``) and the ceilings
an achieved rate went over. Pure functions of the query results, unit-tested on samples.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, replace

from phasewatch.dashboard.frames import KEYS, class_text
from phasewatch.dashboard.theme import PHASES
from phasewatch.roofline import cause_text as words
from phasewatch.roofline.bottleneck import IMBALANCE_QUEUE
from phasewatch.roofline.cause import CAUSES
from phasewatch.roofline.slo_verdict import Attainment, ObjectiveAttainment, lead, rank
from phasewatch.roofline.verdict import LEVERS
from phasewatch.roofline.verdict_text import headline, phase_name

# Causes found in the records whatever the engine publishes.
FROM_RECORDS = ("prefill_interference", "frontend", "imbalance")
# The engine's gauges each engine-backed cause's sentence says (``cause_sentence``); the
# rest of the engine's state follows it as "Engine state: ..."
SAID = {"kv_cache": ("kv_usage", "preemptions"),
        "preemption_recompute": ("kv_usage", "preemptions"),
        "concurrency_limit": ("kv_usage", "running")}
CEILING_WORDS = {"flops": "FLOP/s", "bandwidth": "memory bandwidth"}


def _known(x) -> bool:
    return x is not None and not math.isnan(x)


def _pct(x: float) -> str:
    """As the exporter's cause sentences write a share: "100%"."""
    return f"{min(x, 1.0):.0%}"


@dataclass(frozen=True)
class EngineGauges:
    """The engine's gauges Prometheus holds for one label set over the range
    (``phasewatch_engine_*``): KV-cache usage (the fullest pod's, 0..1), requests waiting
    and running, preemptions in the range. None (or NaN, as Prometheus answers) where
    not known. Not ``roofline.engine_state.EngineState``: that is a window's figures
    (means, maxima, shares of the time), these are the gauges as Prometheus answers them."""

    kv_usage: float | None = None
    waiting: float | None = None
    running: float | None = None
    preemptions: float | None = None

    def without(self, names: tuple[str, ...]) -> EngineGauges:
        """These gauges less ``names`` (the ones a cause's sentence already says)."""
        return replace(self, **dict.fromkeys(names))


def cause_sentence(cause: str, state: EngineGauges, range_text: str) -> str | None:
    """The exporter's sentence for an engine-backed ``cause`` (``roofline.cause_text``,
    the code its verdict writes it with) from the engine's gauges Prometheus holds:
    ``kv_usage`` (the fullest pod's), ``running``, ``preemptions`` in the range; None
    where they do not back it."""
    usage = min(state.kv_usage, 1.0) if _known(state.kv_usage) else None
    pre = state.preemptions if _known(state.preemptions) else 0.0
    pre = pre if round(pre) > 0 else 0.0
    if cause == "kv_cache" and (pre > 0 or usage is not None):
        return words.kv_cache(pre, range_text, usage)
    if cause == "preemption_recompute" and pre > 0:
        return words.preemption_recompute(pre, range_text, usage)
    if cause == "concurrency_limit" and _known(state.running):
        return words.slot_limit(state.running, usage)
    return None


def engine_sentence(state: EngineGauges, range_text: str, pods: int = 1,
                    after: str = "") -> str:
    """The engine's state in words with numbers, from what is there of ``kv_usage``
    (the fullest pod's), ``running``, ``waiting`` and ``preemptions`` (in the range):
    "KV cache 100% full, 6 waiting, 14 running, 32 preemptions in 60 s"; "" for none.
    ``after``: the cause's title it follows, if any (the text then reads on)."""
    parts = []
    if _known(state.kv_usage):
        whose = "the fullest pod's KV cache" if pods > 1 else "KV cache"
        parts.append(f"{whose} {_pct(state.kv_usage)} full")
    parts += [f"{n:.0f} {k}" for k, n in (("waiting", state.waiting),
                                          ("running", state.running)) if _known(n)]
    if _known(state.preemptions) and round(state.preemptions) > 0:
        parts.append(f"{state.preemptions:.0f} preemptions in {range_text}")
    text = ", ".join(parts)
    # a sentence of its own starts with a capital; after a title's colon it reads on
    return text if after else text[:1].upper() + text[1:]


def ceiling_sentence(phase: str, ceiling: str, ratio: float) -> str:
    """Through Prometheus the evidence ``roofline.ceiling.blame`` weighs is not at hand:
    the inputs in its order, the model first."""
    return (f"{phase_name(phase)} achieved {ratio:.2f}x its {CEILING_WORDS.get(ceiling, ceiling)}"
            " ceiling, which no hardware does, so no utilization is given: the engine most "
            "likely serves a smaller model than the one configured (check --model or "
            "--hf-config), else the compute dtype or the GPU count is wrong, else the "
            "ceiling (the exporter's log says which).")


def _by_key(rows, key, field: str | None = None) -> dict:
    """{label set: value}, or {label set: {metric[field]: value}} with ``field``."""
    out: dict = defaultdict(dict) if field else {}
    for metric, v in rows:
        k = tuple(key(metric).values())
        if field:
            out[k][metric.get(field, "")] = v
        else:
            out[k] = v
    return out


def _engine_state(r: dict, key) -> dict[tuple, EngineGauges]:
    """The engine's gauges by label set, from the answers to ``engine_kv``,
    ``engine_preemptions`` and ``engine_requests`` (by its ``state`` label)."""
    kv = _by_key(r.get("engine_kv", ()), key)
    preemptions = _by_key(r.get("engine_preemptions", ()), key)
    requests = _by_key(r.get("engine_requests", ()), key, "state")
    return {k: EngineGauges(kv_usage=kv.get(k), waiting=requests.get(k, {}).get("waiting"),
                            running=requests.get(k, {}).get("running"),
                            preemptions=preemptions.get(k))
            for k in {*kv, *preemptions, *requests}}


def queue_by_pod(r: dict, key) -> dict[tuple, dict[str, float]]:
    """Per label set with two pods or more, each pod's share of request time in the
    queue, from the mean request per pod (``PHASE_MEAN``)."""
    means: dict[tuple, dict[str, dict]] = defaultdict(lambda: defaultdict(dict))
    for metric, v in r.get("mean", ()):
        pod = key(metric, pod=True)["pod"]
        if _known(v) and pod:
            means[tuple(key(metric).values())][pod][metric.get("phase", "")] = v
    out = {}
    for k, pods in means.items():
        shares = {pod: phases.get("queue", 0.0) / sum(phases.values())
                  for pod, phases in pods.items() if sum(phases.values()) > 0}
        if len(shares) >= 2:
            out[k] = shares
    return out


def imbalance_sentence(shares: dict[str, float]) -> str | None:
    """The exporter's imbalance rule (``bottleneck.imbalance``) over the pods Prometheus
    scrapes: one pod queueing over ``IMBALANCE_QUEUE[0]`` of request time while another
    stays under ``IMBALANCE_QUEUE[1]``; each sidecar sees its own pod only."""
    busy, calm = max(shares, key=shares.get), min(shares, key=shares.get)
    if shares[busy] <= IMBALANCE_QUEUE[0] or shares[calm] >= IMBALANCE_QUEUE[1]:
        return None
    return words.imbalance(busy, shares[busy], calm, shares[calm])


def slo_figures(r: dict, key) -> dict[tuple, Attainment]:
    """Per label set with objectives, the figures ``slo_verdict.attainment`` gives an
    exporter's window, from the exporters' counters over the range (``SLO_*`` queries):
    requests met/missed/unknown per objective, its thresholds (plain and per prompt
    class) and the misses by the phase that broke them; ``goodput`` beside them. An
    objective without a published threshold is left out."""
    outcomes: dict[tuple, dict] = defaultdict(lambda: defaultdict(dict))
    for metric, v in r.get("slo_outcomes", ()):
        if _known(v):
            outcomes[tuple(key(metric).values())][metric.get("objective", "")][
                metric.get("outcome", "")] = round(v)
    missed: dict[tuple, dict] = defaultdict(lambda: defaultdict(dict))
    for metric, v in r.get("slo_missed", ()):
        if _known(v) and round(v) > 0:
            missed[tuple(key(metric).values())][metric.get("objective", "")][
                metric.get("phase", "")] = round(v)
    seconds = _by_key(r.get("slo_objective", ()), key, "objective")
    by_class: dict[tuple, dict] = defaultdict(lambda: defaultdict(dict))
    for metric, v in r.get("slo_class_objective", ()):
        if _known(v):
            by_class[tuple(key(metric).values())][metric.get("objective", "")][
                metric.get("prompt_class", "")] = v
    goodput = _by_key(r.get("slo_goodput", ()), key)
    out = {}
    for k, per in outcomes.items():
        objectives = {}
        for name, counts in per.items():
            total = sum(counts.values())
            limit = seconds.get(k, {}).get(name)
            classes = dict(by_class[k][name])
            if not total or not (_known(limit) or classes):
                continue
            met, miss = counts.get("met", 0), counts.get("missed", 0)
            objectives[name] = ObjectiveAttainment(
                limit if _known(limit) else None, met, miss, counts.get("unknown", 0),
                met / total, miss / total, dict(missed[k][name]), classes)
        if objectives:
            out[k] = Attainment(max(o.met + o.missed + o.unknown
                                    for o in objectives.values()),
                                objectives, goodput=goodput.get(k, math.nan))
    return out


def slo_kpis(slo: Attainment, request_rate: float | None) -> dict:
    """One label set's ``slo_figures`` as KPI columns (``frames.SLO_FIGURES``)."""
    good = slo.goodput
    out = {"goodput": good,
           "good_ratio": good / request_rate if request_rate and _known(good) else math.nan}
    for name, o in slo.objectives.items():
        out |= {f"{name}_objective": o.objective_seconds, f"{name}_attainment":
                o.attainment, f"{name}_met": o.met, f"{name}_missed": o.missed,
                f"{name}_classes": class_text(o.by_prompt_class)}
    return out


def slo_lead(slo: Attainment | None, figures: dict) -> str:
    """The sentence an exporter's verdict starts with when objectives are set
    (``slo_verdict.lead``), over the range: which objective was missed and the phase that
    broke most of its misses, or that every objective was met."""
    if not slo:
        return ""
    slo = replace(slo)  # rank fills in its ranking: on a copy
    shares = {p: figures[f"{p}_share"] for p in PHASES if _known(figures.get(f"{p}_share"))}
    return lead(slo, rank(slo, shares))


def verdict_rows(r: dict, kpis: dict, key, range_text: str,
                 slo: dict[tuple, Attainment] | None = None) -> list[dict]:
    """Rows of VERDICT_COLUMNS: per label set, the (phase, resource) most pods report,
    the cause most of those name, and the engine's state behind it."""
    votes: dict[tuple, Counter] = defaultdict(Counter)
    for metric, n in r["votes"]:
        votes[tuple(key(metric).values())][(metric["phase"], metric["resource"])] += n
    causes: dict[tuple, Counter] = defaultdict(Counter)
    for metric, n in r.get("causes", ()):
        cause = metric.get("cause") or "none"
        if cause in CAUSES:  # "none", or a name this dashboard does not know
            causes[(tuple(key(metric).values()), metric["phase"], metric["resource"])][
                cause] += n
    reporting = _by_key(r["reporting"], key)
    confidence = _by_key(r["confidence"], key)
    engine = _engine_state(r, key)
    by_pod = queue_by_pod(r, key)
    exceeded: dict[tuple, list] = defaultdict(list)
    for metric, ratio in r.get("ceiling_exceeded", ()):
        if _known(ratio) and ratio > 1:
            exceeded[tuple(key(metric).values())].append(
                (metric.get("phase", ""), metric.get("ceiling", ""), ratio))
    rows = []
    for k, options in votes.items():
        n, phase, resource = max((n, p, res) for (p, res), n in options.items())
        named = causes.get((k, phase, resource), Counter())
        cause_n, cause = max(((m, c) for c, m in named.items()), default=(n, None))
        # routing, not capacity: what no single sidecar can see. Whatever most pods report:
        # two calm pods outvote the one that queues, yet the pods differ, and a pod
        # queueing most of its request time is the one users wait on
        routing = imbalance_sentence(by_pod[k]) if k in by_pod else None
        if routing:
            phase, resource, cause = "queue", "capacity", "imbalance"
            # the pods whose own verdict is the queue
            n = cause_n = sum(c for (p, _), c in options.items() if p == "queue")
        total = int(reporting.get(k, n))
        row = {**dict(zip(KEYS, k, strict=True)), "phase": phase, "resource": resource,
               "headline": headline(phase, resource, cause), "cause": cause or "",
               "confidence": confidence.get(k, math.nan), "agreeing": int(n),
               "reporting": total, "ceiling_exceeded": tuple(sorted(exceeded.get(k, ()))),
               "levers": (CAUSES[cause].levers if cause and CAUSES[cause].levers
                          else LEVERS.get((phase, resource), ()))}
        lead_text = slo_lead((slo or {}).get(k), kpis.get(k, {}))
        cause_words = _cause_words(cause, engine.get(k, EngineGauges()), range_text, total, routing)
        rows.append(_with_words(row, int(cause_n), kpis.get(k, {}), *cause_words, lead_text))
    return rows


def _cause_words(cause: str | None, engine: EngineGauges, range_text: str, pods: int,
                 routing: str | None) -> tuple[str, str, bool, bool]:
    """(the cause's sentence, the engine's state beside it, whether the engine's state
    backs the cause, whether there is any). The cause's sentence is the exporter's
    (``cause_sentence``; an imbalance's, ``routing``); without its figures its title."""
    title = CAUSES[cause].title if cause else ""
    everything = engine_sentence(engine, range_text, pods, title)
    backed_by = cause_sentence(cause, engine, range_text) if cause else None
    if backed_by is not None:
        said = SAID[cause]
        rest = engine_sentence(engine.without(said), range_text, pods, title)
        return backed_by, f" Engine state: {rest}." if rest else "", True, True
    state = f" Engine state: {everything}." if everything else ""
    if cause == "imbalance" and routing:
        return routing, state, False, bool(everything)
    if cause == "frontend":
        return words.FRONTEND, state, False, bool(everything)
    if cause:  # beside the cause, not behind it
        return title, state, False, bool(everything)
    return (f"Engine state: {everything}" if everything else "", "", False,
            bool(everything))


def _with_words(row: dict, cause_n: int, figures: dict, cause_text: str, state: str,
                backed: bool, scraped: bool, lead_text: str = "") -> dict:
    """The row with its cause sentence (``_cause_words``), its whole text, and the
    figures the banner's chips show."""
    cause, phase = row["cause"], row["phase"]
    source = "engine_metrics" if backed else "records" if cause else ""
    share = figures.get(f"{phase}_share", math.nan)
    text = f"{phase_name(phase)} takes {share:.0%} of request time." if _known(share) else ""
    if row["reporting"] > 1:
        text += (f" {cause_n if cause else row['agreeing']} of {row['reporting']} pods "
                 "report this verdict.")
    over = {(p, c) for p, c, _ in row["ceiling_exceeded"]}
    for label, name, at in (("Decode MBU", "mbu", ("decode", "bandwidth")),
                            ("Prefill MFU", "mfu", ("prefill", "flops"))):
        if _known(figures.get(name)) and figures[name] <= 1 and at not in over:
            text += f" {label} {figures[name]:.0%}."
    text += "".join(f" {ceiling_sentence(*e)}" for e in row["ceiling_exceeded"]) + state
    text = text.strip() or row["headline"] + "."
    return {**row, "cause_text": cause_text, "cause_source": source,
            "engine_scraped": scraped,
            "text": " ".join(filter(None, (lead_text, f"{cause_text}." if cause_text else "",
                                           text))),
            **{f"{p}_share": figures.get(f"{p}_share") for p in PHASES},
            "mbu": figures.get("mbu"), "mfu": figures.get("mfu")}
