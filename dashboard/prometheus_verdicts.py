"""The verdict banner's rows from Prometheus's answers: the pods' votes on the phase and
the resource (``phasewatch_bottleneck_info``), the cause they name (its ``cause`` label),
the engine's own state the exporters scraped (``phasewatch_engine_*``) and the ceilings
an achieved rate went over. Pure functions of the query results, unit-tested on samples.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

from phasewatch.dashboard.frames import KEYS, class_text
from phasewatch.dashboard.theme import PHASES
from phasewatch.roofline.bottleneck import IMBALANCE_QUEUE
from phasewatch.roofline.cause import CAUSES
from phasewatch.roofline.slo_verdict import lead, rank
from phasewatch.roofline.verdict import LEVERS, headline, phase_name

# Causes found in the records whatever the engine publishes.
FROM_RECORDS = ("prefill_interference", "frontend", "imbalance")
CEILING_WORDS = {"flops": "FLOP/s", "bandwidth": "memory bandwidth"}


def _known(x) -> bool:
    return x is not None and not math.isnan(x)


def _pct(x: float) -> str:
    """As the exporter's cause sentences write a share: "100%"."""
    return f"{min(x, 1.0):.0%}"


def engine_sentence(state: dict, range_text: str, pods: int = 1, after: str = "") -> str:
    """The engine's state in words with numbers, from what is there of ``kv_usage``
    (the fullest pod's), ``running``, ``waiting`` and ``preemptions`` (in the range):
    "KV cache 100% full, 6 waiting, 14 running, 32 preemptions in 60 s"; "" for none.
    ``after``: the title it follows; after "KV cache full" the cache is not named again
    ("100% usage, 6 waiting, ...")."""
    parts = []
    if _known(state.get("kv_usage")):
        usage = _pct(state["kv_usage"])
        if "KV cache" in after:
            parts.append(f"{usage} usage" + (" on the fullest pod" if pods > 1 else ""))
        else:
            whose = "the fullest pod's KV cache" if pods > 1 else "KV cache"
            parts.append(f"{whose} {usage} full")
    parts += [f"{state[k]:.0f} {k}" for k in ("waiting", "running") if _known(state.get(k))]
    if _known(state.get("preemptions")) and round(state["preemptions"]) > 0:
        parts.append(f"{state['preemptions']:.0f} preemptions in {range_text}")
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


def _engine_state(r: dict, key) -> dict[tuple, dict]:
    state: dict[tuple, dict] = defaultdict(dict)
    for k, v in _by_key(r.get("engine_kv", ()), key).items():
        state[k]["kv_usage"] = v
    for k, v in _by_key(r.get("engine_preemptions", ()), key).items():
        state[k]["preemptions"] = v
    for k, states in _by_key(r.get("engine_requests", ()), key, "state").items():
        state[k].update(states)
    return state


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
    return (f"queue {shares[busy]:.0%} of request time on {busy} while {calm} queues "
            f"{shares[calm]:.0%}")


def slo_figures(r: dict, key) -> dict[tuple, dict]:
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
            objectives[name] = {"objective_seconds": limit if _known(limit) else None,
                                **({"by_prompt_class": classes} if classes else {}),
                                "met": met, "missed": miss,
                                "unknown": counts.get("unknown", 0), "attainment": met / total,
                                "missed_share": miss / total,
                                "missed_by_phase": dict(missed[k][name])}
        if objectives:
            out[k] = {"requests": max(o["met"] + o["missed"] + o["unknown"]
                                      for o in objectives.values()),
                      "objectives": objectives, "ranked_by": "time_share",
                      "goodput": goodput.get(k, math.nan)}
    return out


def slo_kpis(slo: dict, request_rate: float | None) -> dict:
    """One label set's ``slo_figures`` as KPI columns (``frames.SLO_FIGURES``)."""
    good = slo["goodput"]
    out = {"goodput": good,
           "good_ratio": good / request_rate if request_rate and _known(good) else math.nan}
    for name, o in slo["objectives"].items():
        out |= {f"{name}_objective": o["objective_seconds"], f"{name}_attainment":
                o["attainment"], f"{name}_met": o["met"], f"{name}_missed": o["missed"],
                f"{name}_classes": class_text(o.get("by_prompt_class"))}
    return out


def slo_lead(slo: dict | None, figures: dict) -> str:
    """The sentence an exporter's verdict starts with when objectives are set
    (``slo_verdict.lead``), over the range: which objective was missed and the phase that
    broke most of its misses, or that every objective was met."""
    if not slo:
        return ""
    slo = {**slo, "objectives": {k: dict(v) for k, v in slo["objectives"].items()}}
    shares = {p: figures[f"{p}_share"] for p in PHASES if _known(figures.get(f"{p}_share"))}
    return lead(slo, rank(slo, shares))


def verdict_rows(r: dict, kpis: dict, key, range_text: str,
                 slo: dict[tuple, dict] | None = None) -> list[dict]:
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
        sentence = engine_sentence(engine.get(k, {}), range_text, total,
                                   CAUSES[cause].title if cause else "")
        lead_text = slo_lead((slo or {}).get(k), kpis.get(k, {}))
        rows.append(_with_words(row, int(cause_n), kpis.get(k, {}), sentence, routing,
                                lead_text))
    return rows


def _with_words(row: dict, cause_n: int, figures: dict, sentence: str,
                routing: str | None = None, lead_text: str = "") -> dict:
    """The row's cause sentence (the cause's title and the engine's state, where it is
    on Prometheus; for an imbalance, ``routing``: the pods' queue shares), its whole
    text, and the figures the banner's chips show."""
    cause, phase = row["cause"], row["phase"]
    backed = bool(sentence) and cause not in FROM_RECORDS  # the engine's state is evidence
    state = ""
    if cause == "imbalance":
        cause_text = f"{CAUSES[cause].title}: {routing}"
        if sentence:
            state = f" Engine state: {sentence}."
    elif cause:
        cause_text = CAUSES[cause].title + (f": {sentence}" if backed else "")
        if sentence and not backed:  # beside the cause, not behind it
            state = f" Engine state: {sentence}."
    else:
        cause_text = f"Engine state: {sentence}" if sentence else ""
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
            "engine_scraped": bool(sentence),
            "text": " ".join(filter(None, (lead_text, f"{cause_text}." if cause_text else "",
                                           text))),
            **{f"{p}_share": figures.get(f"{p}_share") for p in PHASES},
            "mbu": figures.get("mbu"), "mfu": figures.get("mfu")}
