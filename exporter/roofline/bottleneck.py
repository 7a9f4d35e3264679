"""Roofline estimates and verdicts per (model, engine), refreshed on a timer.

``BottleneckMonitor.update()`` reads the rolling window's columns (a copy), runs
the estimator for every label set whose model has a deployment, folds in the
engine's own counters where configured, and decides the verdict with hysteresis
against the previous one. Readers (the Prometheus collector, the JSON API) take
``results()``; nothing here runs on the ingest path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from phasewatch.aggregation.columns import WindowColumns
from phasewatch.aggregation.labels import LabelSets
from phasewatch.aggregation.window import RollingWindow
from phasewatch.roofline import cause_text, ceiling
from phasewatch.roofline.cause import (
    BUSY,
    Cause,
    busy_share,
    diagnose,
)
from phasewatch.roofline.deployments import Deployments
from phasewatch.roofline.engine_metrics import EngineMetricsSource, EngineRates, EngineSample
from phasewatch.roofline.engine_view import (
    with_cached_share,
    with_engine_counters,
    with_engine_steps,
    with_recompute,
)
from phasewatch.roofline.estimate import (
    LOOKBACK_SPANS,
    Deployment,
    PhaseEstimate,
    RooflineEstimate,
    estimate,
)
from phasewatch.roofline.gpu_check import GpuCheck
from phasewatch.roofline.gpu_verdict import for_verdict
from phasewatch.roofline.gpu_watch import GpuWatch
from phasewatch.roofline.inputs import InputSource, unavailable
from phasewatch.roofline.intervals import decode_shared_with_prefill, decode_slowdown
from phasewatch.roofline.lever_effects import Outlook, outlook
from phasewatch.roofline.slo_verdict import Attainment, DecodeSharing, attainment
from phasewatch.roofline.verdict import Verdict, decide

log = logging.getLogger("phasewatch")
ANY_MODEL = "*"  # key of an engine scraped for every model (no --model given)
IMBALANCE_QUEUE = (0.3, 0.05)  # a pod's queue share over the first, another's under the
# second: the same model's requests queue on one replica while another has room
TRAIL = 60  # operating points kept per label set, for the dashboard's roofline trail


@dataclass
class Result:
    model: str
    engine: str
    labels: tuple  # the label set's values, in LabelSets.names order
    deployment: Deployment | None
    estimate: RooflineEstimate
    verdict: Verdict | None
    trail: list[dict] = field(default_factory=list)
    engine_state: dict | None = None  # the engine's own state over the window, if scraped
    engine_sample: EngineSample | None = None  # its newest scrape, if fresh
    gpu: GpuCheck | None = None  # the GPU's own counters over the range, where read
    outlook: Outlook | None = None  # the fitted step and the levers' predicted effects


class BottleneckMonitor:
    def __init__(self, window: RollingWindow, labels: LabelSets, deployments: Deployments,
                 engines: dict[str, EngineMetricsSource] | None = None,
                 window_seconds: float = 30.0,
                 clock=time.time, gpus: GpuWatch | None = None):
        self._window, self._labels, self.deployments = window, labels, deployments
        self._engines = engines or {}
        self.gpus = gpus  # the GPU counters' sources (--gpu-metrics-url, --gpu-nvml)
        self.window_seconds = window_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._results: list[Result] = []
        self._verdicts: dict[tuple[str, str], Verdict] = {}
        self._trails: dict[tuple[str, str], deque] = {}
        self._warned: set[tuple[str, str]] = set()  # (engine URL, note) logged once
        self._cause_candidates: dict[tuple, str | None] = {}  # a new cause seen once
        self.updated_at: float | None = None

    def engine_sources(self) -> list[EngineMetricsSource]:
        """The engines' /metrics sources, one per URL (the exporter scrapes each)."""
        return list({id(s): s for s in self._engines.values()}.values())

    def update(self) -> list[Result]:
        cols = self._window.columns(LOOKBACK_SPANS * self.window_seconds)
        steps = self._window.steps(LOOKBACK_SPANS * self.window_seconds)
        pairs = self._labels.pairs()
        results = []
        ls = cols.ls
        fresh = cols.t >= self._clock() - self.window_seconds  # ingested inside the window
        for i in np.flatnonzero(np.bincount(ls)).tolist():  # (the label sets present)
            key = pairs[i]
            model, engine = key[:2]
            sel = ls == i
            if not (sel & fresh).any():  # no request in the window: no verdict to give,
                self._verdicts.pop(key, None)  # only older ones read for the lookback
                continue
            # one label set (a sidecar beside its engine): its columns are the window's
            mine = cols if sel.all() else cols.where(sel)
            dep = self.deployments.for_model(model)
            source = self._engine_for(model, dep)
            rates = source.rates(self.window_seconds) if source else None
            cached = rates.cached_prompt_share if rates is not None else None
            if cached is not None:
                mine = with_cached_share(mine, cached)
            own = steps.ls == i
            est = estimate(mine, dep, self.window_seconds, model, engine,
                           steps.where(own) if own.any() else None,
                           rates.client_prefill_seconds(mine.ttft) if rates else None)
            if est is None:
                continue
            est = self._with_engine(est, dep, mine, source, rates, cached)
            verdict = self._verdict(key, est, dep, mine, rates, fresh[sel])
            gpu = for_verdict(self.gpus, model, est, dep, mine, verdict)
            trail = self._trails.setdefault(key, deque(maxlen=TRAIL))
            point = _operating_point(est, self._clock())
            if point:
                trail.append(point)
            results.append(Result(model, engine, key, dep, est, verdict, list(trail),
                                  rates.state() if rates is not None else None,
                                  source.latest(self.window_seconds) if source else None,
                                  gpu, outlook(est, dep, mine, rates, verdict)))
        imbalance(results, self._labels.names)
        for r in results:
            if r.verdict is not None:
                self._verdicts[r.labels] = r.verdict
        with self._lock:
            self._results = results
            self.updated_at = self._clock()
        return results

    def _with_engine(self, est: RooflineEstimate, dep: Deployment | None, mine: WindowColumns,
                     source: EngineMetricsSource | None, rates: EngineRates | None,
                     cached: float | None) -> RooflineEstimate:
        """The estimate with what the engine's own /metrics add (recomputed prefills, its
        counters, its prefix cache) or the note that no fresh scrape is there."""
        if dep is not None and rates is not None:
            preempted = None
            if source is not None:
                lo, hi = est.range_start, est.range_end
                preempted = source.increase("preemptions", lo, hi)
                est = with_engine_steps(est, dep, source.increase("steps", lo, hi), preempted)
            est = with_recompute(est, dep, rates, mine, preempted)
            est = with_engine_counters(est, dep, rates)
            if cached is not None:
                est.inputs["cached_tokens"] = InputSource(
                    "engine_prefix_cache",
                    f"{cached:.1%} of prompt tokens ({rates.cached_share_source})")
            self._warn_flat(source, rates)
        if source is not None and rates is None:
            est.inputs["engine_state"] = unavailable(
                f"no fresh scrape of {source.url} ({source.last_error or 'waiting'})"
                "; the cause comes from the records")
        return est

    def _verdict(self, key: tuple, est: RooflineEstimate, dep: Deployment | None,
                 mine: WindowColumns, rates: EngineRates | None,
                 fresh: np.ndarray) -> Verdict | None:
        """The label set's verdict: decided against its previous one, its cause held
        while the evidence stays (``_hold_cause``), an idle engine told so, a model the
        figures cannot fit said first."""
        wrong = ceiling.model_mismatch(est, dep) if dep is not None else None
        self._warn_ceilings(key, est, dep, wrong)
        previous = self._verdicts.get(key)
        busy = busy_share(mine, est.range_start, est.range_end)
        verdict = decide(est, dep, previous, lambda phase, m=mine, e=est, d=dep, r=rates,
                         b=busy, p=previous: diagnose(phase, e, d, m, r, busy=b,
                                                      held=_held(p, phase)),
                         slo=self._objectives(key, mine, fresh,
                                             (est.range_start, est.range_end)))
        if verdict is not None:
            self._hold_cause(key, verdict, previous)
            _tell_idle(verdict, busy)
            if wrong is not None:  # before all else: every figure rests on the model
                verdict.evidence = replace(verdict.evidence, model_mismatch=wrong)
                if wrong not in verdict.text:  # a held cause keeps the text it had
                    verdict.prepend(f"{wrong}.")
        return verdict

    def _objectives(self, key: tuple, mine: WindowColumns, fresh: np.ndarray,
                    bounds: tuple[float, float]) -> Attainment | None:
        """The label set's objectives over the window's requests
        (``slo_verdict.attainment``), with what the records tell of the decodes over the
        estimate's range (``bounds``); None without objectives."""
        objectives = self._window.objectives
        if objectives is None:
            return None
        first, last = mine.first_token_at, mine.last_token_at
        with np.errstate(divide="ignore", invalid="ignore"):
            tpot = np.where(mine.steps > 0, (last - first) / mine.steps, np.nan)
        decode = DecodeSharing(tpot[fresh], decode_shared_with_prefill(mine)[fresh],
                               decode_slowdown(mine, *bounds))
        return attainment(objectives(key), mine.slo_outcome[fresh],
                          mine.slo_phase[fresh], decode)

    def _hold_cause(self, key: tuple, verdict: Verdict, previous: Verdict | None) -> None:
        """Hysteresis for the cause, as the phase has it: on the same phase, a new cause
        must be found on two updates in a row before it replaces the previous one (a
        records-only cause near a threshold would otherwise flip every refresh)."""
        old = previous.cause if previous is not None and previous.phase == verdict.phase \
            else None
        new = verdict.cause
        if old is None or (new is not None and new.name == old.name):
            self._cause_candidates.pop(key, None)
            return
        name = new.name if new is not None else None
        if self._cause_candidates.get(key) == name:  # the second time in a row: it holds
            self._cause_candidates.pop(key, None)
            return
        self._cause_candidates[key] = name
        verdict.cause, verdict.resource = old, previous.resource
        verdict.levers, verdict.text = previous.levers, previous.text
        if previous.lead and previous.text.startswith(previous.lead):  # today's figures
            verdict.text = previous.text[len(previous.lead):].lstrip()
        verdict.prepend("")

    def _engine_for(self, model: str, dep: Deployment | None) -> EngineMetricsSource | None:
        """The engine scraped for ``model``: its deployment's, else one configured for
        any model (``--engine-metrics-url`` without ``--model``)."""
        found = self._engines.get(dep.served_name) if dep is not None else None
        return found or self._engines.get(model) or self._engines.get(ANY_MODEL)

    def _warn_ceilings(self, key: tuple, est: RooflineEstimate, dep: Deployment | None,
                       wrong: str | None) -> None:
        """An exceeded ceiling, or the engine's FLOP count far from the configured model's
        cost: said once per label set in the log, and in the estimate's inputs, with
        what the evidence points to (``ceiling.blame``: the model first)."""
        for phase in ("prefill", "decode"):
            p = getattr(est, phase)
            for what, ratio in (p.ceiling_exceeded.items() if p is not None else ()):
                found = ceiling.blame(est, dep, phase, what, ratio)
                est.inputs[f"{what}_ceiling"] = InputSource("below_achieved", found.text)
                if (key, phase, what) not in self._warned:
                    self._warned.add((key, phase, what))
                    log.warning("%s: %s; no %s utilization is published", key[0],
                                found.text, phase)
        if wrong is not None and (key, "model") not in self._warned:
            self._warned.add((key, "model"))
            log.warning("%s: %s", key[0], wrong)

    def _warn_flat(self, source: EngineMetricsSource, rates: EngineRates) -> None:
        for what in rates.flat:
            if (source.url, what) not in self._warned:
                self._warned.add((source.url, what))
                log.warning("engine metrics %s: the %s counter stays at 0 while requests "
                            "finish; the roofline infers %s instead (start vLLM with "
                            "--enable-mfu-metrics to use its own counts)", source.url, what,
                            what)

    def results(self) -> list[Result]:
        with self._lock:
            return list(self._results)


def _held(previous: Verdict | None, phase: str) -> str | None:
    """The cause the verdict on ``phase`` holds now (its thresholds move in its favour)."""
    if previous is None or previous.phase != phase or previous.cause is None:
        return None
    return previous.cause.name


def _operating_point(est: RooflineEstimate, at: float) -> dict | None:
    point = {"at": at}
    for name in ("prefill", "decode"):
        p: PhaseEstimate | None = getattr(est, name)
        if p is not None:
            point[name] = {"arithmetic_intensity": p.arithmetic_intensity,
                           "achieved_flops_per_second": p.achieved_flops_per_second}
    return point if len(point) > 1 else None


def _tell_idle(verdict: Verdict, busy: float | None) -> None:
    """How busy the engine was is evidence; an engine idle most of the window with no
    cause is told so first, and offered no lever (none buys speed it does not need).
    Requests that spend most of their time queued are demand the service does not meet,
    however little the records show in prefill or decode (a window a load change
    straddles, a limit in front of the engine): never "nothing to fix"; nor are requests
    that miss their latency objectives (a verdict ranked by misses). The sentence goes
    after the objectives' one (``Verdict.prepend``)."""
    if busy is None:
        return
    verdict.evidence = replace(verdict.evidence, busy_share=busy)
    # say first that nothing needs fixing
    missing = verdict.evidence.ranked_by_misses
    if verdict.cause is None and busy < BUSY and verdict.phase != "queue" and not missing:
        verdict.prepend(f"Nothing to fix: the engine had a request in prefill or decode only "
                        f"{busy:.0%} of the window, so it is mostly idle and faster hardware "
                        f"or tuning buys little.")
        verdict.evidence = replace(verdict.evidence, idle=True)
        verdict.levers = ()


def imbalance(results: list[Result], names: tuple[str, ...]) -> None:
    """Across the pods of one (model, engine[, source]): where some pods' requests queue
    (queue share over ``IMBALANCE_QUEUE[0]``) while another pod's barely do (under
    ``IMBALANCE_QUEUE[1]``), the queueing pods' verdicts get the cause ``imbalance``:
    routing, not capacity, is what to fix. Needs the pod label (a central exporter with
    --pod-label); a no-op otherwise."""
    if "pod" not in names:
        return
    at = names.index("pod")
    groups: dict[tuple, list[Result]] = {}
    for r in results:
        if r.verdict is not None and r.estimate.phase_time_share:
            groups.setdefault(r.labels[:at] + r.labels[at + 1:], []).append(r)
    for members in groups.values():
        if len(members) < 2:
            continue
        share = {r.labels[at]: r.estimate.phase_time_share.get("queue", 0.0) for r in members}
        calm = min(share, key=share.get)
        if share[calm] >= IMBALANCE_QUEUE[1]:
            continue
        for r in members:
            pod = r.labels[at]
            if share[pod] <= IMBALANCE_QUEUE[0] or r.verdict.phase != "queue":
                continue
            v, old = r.verdict, r.verdict.cause
            text = v.text
            if old is not None:  # the cause it replaces, before or after the verdict's text
                text = text.replace(f"{old.text}. ", "").replace(f" {old.text}.", "")
            v.cause = Cause("imbalance", cause_text.imbalance(pod, share[pod], calm, share[calm]),
                            "records", {"queue_share_by_pod": share})
            v.resource, v.levers = "capacity", v.cause.levers
            v.text = text
            v.prepend(f"{v.cause.text}.")
