"""vLLM 0.33.0's own ``llm_request`` spans, driven with a known ground truth.

Run with the engine-fixtures virtualenv (``make engine-fixtures``); it needs vllm==0.33.0
and the OpenTelemetry SDK and exporters, not the phasewatch package.

What runs is vLLM's code, unmodified:

* ``vllm.tracing.init_tracer("vllm.llm_engine", endpoint)`` as ``AsyncLLM.__init__``
  calls it: vLLM's TracerProvider, BatchSpanProcessor and OTLP exporter, the protocol
  chosen by ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (``grpc`` or ``http/protobuf``).
* ``OutputProcessor(tokenizer=None, log_stats=True, tracing_enabled=True)`` and its
  ``add_request`` (with ``ParentRequest`` fan-out for n > 1, as ``AsyncLLM.add_request``
  does), ``process_outputs(outputs, engine_core_timestamp, iteration_stats)`` (as
  ``AsyncLLM``'s output handler does, with a fresh ``IterationStats()`` per engine step)
  and ``abort_requests`` (a client disconnect). ``do_tracing`` builds and exports the
  span; ``IterationStats`` / ``RequestStateStats`` compute the figures.
* ``PrometheusStatLogger.record(...)`` on each step's ``IterationStats``: what vLLM's
  /metrics would show (its histograms' sums and counts are read back).

What this script supplies is what vLLM's engine core would have sent: the
``EngineCoreRequest`` objects and the per-step ``EngineCoreOutputs`` (tokens, QUEUED /
SCHEDULED / PREEMPTED events with engine monotonic timestamps, ``PrefillStats`` with
prefix-cache hits, finish reasons), from a small seeded step scheduler, and the clocks:
the frontend wall clock that ``IterationStats()`` reads (``time.time`` in
vllm/v1/metrics/stats.py) and that the OTel SDK reads when vLLM ends the span
(``time_ns`` in opentelemetry/sdk/trace/__init__.py) are set to known values for each
step. Nothing of vLLM is replaced.

``python vllm033_spans.py OUT_DIR`` writes OUT_DIR/<scenario>/<protocol>/NNN.pb (+ the
HTTP request line and headers), OUT_DIR/truth.json and OUT_DIR/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import inspect
import json
import os
import random
import tempfile
from copy import copy
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
VLLM_VERSION = "0.33.0"
SEED = 330
# The frontend wall clock at t = 0 (2026-11-02T09:00:00Z) and the engine core's
# time.monotonic() at the same instant (about three days of uptime).
WALL0 = 1_793_610_000.0
MONO0 = 263_417.0
MAX_SEQS = 6            # running sequences per step
TOKEN_BUDGET = 512      # prefill tokens per step (chunked prefill past it)


# ---- what the scenario asks for ---------------------------------------------------------
@dataclass
class Spec:
    rid: str                      # the client's request id (gen_ai.request.id)
    arrival_us: int               # frontend wall clock, us after WALL0
    preprocess_us: int            # arrival -> engine core QUEUED (templating, tokenising, IPC)
    prompt: int
    out: list[int]                # output tokens per sequence (n = len(out))
    finish: list[str]             # "stop" | "length" per sequence
    max_tokens: int | None = None
    temperature: float = 0.7
    top_p: float = 0.95
    cached: int = 0               # prefix-cache hit tokens
    spec_k: int = 1               # max tokens per decode step (speculative decoding)
    preempt_after: int = 0        # preempted once after this many tokens (0 = never)
    preempt_steps: int = 3
    abort_after: int | None = None  # client disconnects after this many tokens reached it
    traceparent: str | None = None
    note: str = ""


@dataclass
class Seq:
    spec: Spec
    index: int
    req_id: str = ""              # vLLM's internal request id
    target: int = 0
    finish: str = "stop"
    queued_us: int = 0
    scheduled_us: int | None = None
    prefilled: int = 0            # prompt tokens computed so far
    tokens: int = 0
    events: list = field(default_factory=list)
    first_output: bool = True
    preempted_at: int | None = None
    preempt_resume_step: int | None = None
    preempted_once: bool = False
    aborted_engine_us: int | None = None
    done: bool = False
    outputs: list = field(default_factory=list)  # (engine step end us, n tokens, frontend us)


def wall(us: int) -> float:
    return WALL0 + us / 1e6


def mono(us: int) -> float:
    return MONO0 + us / 1e6


def _rid(rng: random.Random, prefix="chatcmpl-") -> str:
    return prefix + "".join(rng.choice("0123456789abcdef") for _ in range(24))


def _traceparent(rng: random.Random) -> str:
    return f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-01"


def scenario_main(rng: random.Random) -> list[Spec]:
    specs: list[Spec] = []
    t = 0

    def add(**kw):
        nonlocal t
        t += kw.pop("gap_us", rng.randint(4_000, 40_000))
        kw.setdefault("preprocess_us", rng.randint(1_500, 9_000))
        specs.append(Spec(rid=_rid(rng), arrival_us=t, **kw))

    # ordinary chat requests
    for _ in range(8):
        n_out = rng.randint(4, 40)
        add(prompt=rng.randint(20, 400), out=[n_out], finish=["stop"], max_tokens=256)
    add(prompt=35, out=[1], finish=["length"], max_tokens=1, note="1-token output (max_tokens=1)")
    add(prompt=60, out=[1], finish=["stop"], max_tokens=64, note="1-token output (EOS first)")
    add(prompt=48, out=[2], finish=["stop"], max_tokens=64, note="2-token output")
    add(prompt=120, out=[300], finish=["length"], max_tokens=300, note="long output")
    add(prompt=80, out=[12, 12], finish=["length", "length"], max_tokens=12,
        note="n=2, both sequences end in the same step")
    add(prompt=90, out=[7, 19], finish=["stop", "stop"], max_tokens=64,
        note="n=2, sequences of different lengths")
    add(prompt=200, cached=128, out=[10], finish=["stop"], max_tokens=64,
        note="prefix-cache hit: 128 of 200 prompt tokens")
    add(prompt=1040, cached=1024, out=[6], finish=["stop"], max_tokens=64,
        note="prefix-cache hit: 1024 of 1040 prompt tokens")
    add(prompt=1300, out=[8], finish=["stop"], max_tokens=64,
        note="chunked prefill over three steps (token budget 512)")
    add(prompt=150, out=[30], finish=["stop"], max_tokens=128, preempt_after=10,
        note="preempted after 10 tokens, resumed 3 steps later")
    add(prompt=70, out=[25], finish=["length"], max_tokens=25, spec_k=3,
        note="speculative decoding: up to 3 tokens per step")
    add(prompt=55, out=[9], finish=["stop"], max_tokens=None, temperature=0.0, top_p=1.0,
        note="greedy, no max_tokens: temperature/max_tokens attributes absent")
    add(prompt=300, out=[14], finish=["stop"], max_tokens=64, preprocess_us=150_000,
        note="150 ms between arrival and the engine's queue (templating/tokenising)")
    add(prompt=64, out=[40], finish=["stop"], max_tokens=64, abort_after=3,
        note="client abort after 3 tokens: no span expected")
    add(prompt=64, out=[40], finish=["stop"], max_tokens=64, abort_after=0, gap_us=200,
        note="client abort before any token: no span expected")
    for _ in range(3):
        add(prompt=rng.randint(20, 200), out=[rng.randint(3, 20)], finish=["stop"],
            max_tokens=128, traceparent=_traceparent(rng),
            note="W3C traceparent from the client: span has a parent")
    # a burst: more than MAX_SEQS at once, so some queue
    for _ in range(6):
        add(prompt=rng.randint(30, 250), out=[rng.randint(2, 30)], finish=["stop"],
            max_tokens=128, gap_us=rng.randint(100, 900), note="burst (queues)")
    return specs


def scenario_pause_abort(rng: random.Random) -> list[Spec]:
    """``pause_generation(mode="abort")`` (or shutdown) while one request decodes and one
    waits: vllm/v1/engine/core.py sends each an ABORT output with no events, which goes
    through process_outputs and do_tracing like any finish."""
    return [
        Spec(rid=_rid(rng), arrival_us=0, preprocess_us=2_000, prompt=40, out=[6],
             finish=["stop"], max_tokens=64, note="finishes before the pause"),
        Spec(rid=_rid(rng), arrival_us=1_000, preprocess_us=2_000, prompt=40, out=[500],
             finish=["stop"], max_tokens=600, note="decoding when the engine pauses (abort)"),
        Spec(rid=_rid(rng), arrival_us=2_000, preprocess_us=2_000, prompt=40, out=[500],
             finish=["stop"], max_tokens=600,
             note="still waiting (never scheduled) when the engine pauses (abort)"),
    ]


# ---- clocks -----------------------------------------------------------------------------
class FrontendClock:
    """What the API-server process's clock reads while it handles one engine step."""

    def __init__(self):
        self.wall = WALL0
        self.trace_ns = int(WALL0 * 1e9)

    def time(self) -> float:  # vllm/v1/metrics/stats.py: IterationStats() -> time.time()
        return self.wall

    def time_ns(self) -> int:  # opentelemetry.sdk.trace: Span.end() -> time_ns()
        return self.trace_ns


@contextlib.contextmanager
def frontend_clock(clock: FrontendClock):
    import opentelemetry.sdk.trace as sdk_trace
    import vllm.v1.metrics.stats as stats

    class _Time:  # the ``time`` module as stats.py sees it, wall clock fixed
        def __getattr__(self, name):
            import time
            return getattr(time, name)

        time = staticmethod(clock.time)

    saved = stats.time, sdk_trace.time_ns
    stats.time, sdk_trace.time_ns = _Time(), clock.time_ns
    try:
        yield
    finally:
        stats.time, sdk_trace.time_ns = saved


# ---- the driver (runs in a child process per protocol) ----------------------------------
def tiny_model_dir() -> str:
    """A local Hugging Face config so a real VllmConfig (and PrometheusStatLogger) can be
    built; no weights are loaded."""
    d = tempfile.mkdtemp(prefix="vllm-fixture-model-")
    Path(d, "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 4096,
        "torch_dtype": "float32", "rms_norm_eps": 1e-5}))
    return d


def prometheus_logger():
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    mc = ModelConfig(model=tiny_model_dir(), skip_tokenizer_init=True,
                     served_model_name="fixture-model", dtype="float32")
    return PrometheusStatLogger(VllmConfig(model_config=mc,
                                           device_config=DeviceConfig(device="cpu")), [0])


def prometheus_figures() -> dict:
    from prometheus_client import REGISTRY

    out = {}
    for fam in REGISTRY.collect():
        if not fam.name.startswith("vllm:"):
            continue
        for s in fam.samples:
            if s.name.endswith(("_sum", "_count", "_total")) and s.value:
                labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
                key = s.name + (json.dumps(labels, sort_keys=True) if labels else "")
                out[key] = s.value
    return dict(sorted(out.items()))


def drive(scenario: str, endpoint: str) -> dict:
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.tracing import init_tracer
    from vllm.v1.engine import (
        EngineCoreEvent,
        EngineCoreEventType,
        EngineCoreOutput,
        EngineCoreOutputs,
        EngineCoreRequest,
        FinishReason,
    )
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
    from vllm.v1.engine.parallel_sampling import ParentRequest
    from vllm.v1.metrics.stats import IterationStats, PrefillStats

    prom = prometheus_logger()
    rng = random.Random(f"{SEED}-{scenario}")
    specs = {"main": scenario_main, "pause_abort": scenario_pause_abort}[scenario](rng)
    random.seed(SEED)  # the OTel SDK's RandomIdGenerator draws trace/span ids from here
    # as AsyncLLM.__init__ (vllm/v1/engine/async_llm.py)
    init_tracer("vllm.llm_engine", endpoint)
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    op = OutputProcessor(None, log_stats=True, stream_interval=1, tracing_enabled=True)
    clock = FrontendClock()

    # -- the frontend's side of each request: EngineCoreRequest(s), as AsyncLLM.add_request
    seqs: list[Seq] = []
    by_req: dict[str, Seq] = {}
    requests = {}
    for i, sp in enumerate(specs):
        n = len(sp.out)
        params = SamplingParams(n=n, max_tokens=sp.max_tokens, temperature=sp.temperature,
                                top_p=sp.top_p, output_kind=RequestOutputKind.DELTA)
        prompt_ids = [rng.randrange(3, 250) for _ in range(sp.prompt)]
        req = EngineCoreRequest(
            request_id=f"{sp.rid}-{i:08x}",  # InputProcessor.assign_request_id's shape
            prompt_token_ids=prompt_ids, mm_features=None, sampling_params=params,
            pooling_params=None, arrival_time=wall(sp.arrival_us), lora_request=None,
            cache_salt=None, data_parallel_rank=None,
            trace_headers={"traceparent": sp.traceparent} if sp.traceparent else None,
            external_req_id=sp.rid)
        queue = RequestOutputCollector(params.output_kind, req.request_id)
        children: list[tuple[EngineCoreRequest, ParentRequest | None]] = []
        if n == 1:
            children.append((req, None))
        else:  # fan-out for n > 1, vllm/v1/engine/async_llm.py add_request
            parent = ParentRequest(req)
            for idx in range(n):
                child_id, child_params = parent.get_child_info(idx)
                child = req if idx == n - 1 else copy(req)
                child.request_id = child_id
                child.sampling_params = child_params
                children.append((child, parent))
        for idx, (child, parent) in enumerate(children):
            s = Seq(spec=sp, index=idx, req_id=child.request_id, target=sp.out[idx],
                    finish=sp.finish[idx], queued_us=sp.arrival_us + sp.preprocess_us)
            seqs.append(s)
            by_req[s.req_id] = s
            requests[s.req_id] = (child, parent, idx, queue)

    added: set[str] = set()

    def frontend_add_until(us: int):
        for s in seqs:
            if s.req_id not in added and s.spec.arrival_us <= us:
                child, parent, idx, queue = requests[s.req_id]
                op.add_request(child, None, parent, idx, queue)
                added.add(s.req_id)

    # -- the engine core: a small step scheduler with vLLM's output shapes ------------------
    waiting: list[Seq] = []
    running: list[Seq] = []
    pending = sorted(seqs, key=lambda s: (s.queued_us, s.spec.arrival_us))
    abort_at: dict[str, int] = {}      # req_id -> engine time the abort takes effect
    t = 0
    step = 0
    fe_last = 0
    steps_log = []
    itl_pooled = []
    ttft_obs = []
    finished_stats = []
    pause_after_step = 12 if scenario == "pause_abort" else None
    max_seqs = 1 if scenario == "pause_abort" else MAX_SEQS

    def emit(outputs, end_us, lag_us):
        """Hand one EngineCoreOutputs to the frontend: AsyncLLM's output handler."""
        nonlocal fe_last
        fe = max(end_us + lag_us, fe_last + rng.randint(40, 120))  # in order, after the last
        fe_last = fe
        frontend_add_until(fe)
        eco = EngineCoreOutputs(outputs=outputs, timestamp=mono(end_us))
        clock.wall = wall(fe)
        trace_lag = rng.randint(20, 300)
        clock.trace_ns = round(wall(fe) * 1e9) + trace_lag * 1000
        with frontend_clock(clock):
            stats = IterationStats() if eco.outputs else None
            op.process_outputs(eco.outputs, eco.timestamp, stats)
        if stats is not None:
            prom.record(scheduler_stats=None, iteration_stats=stats, engine_idx=0)
            itl_pooled.extend(stats.inter_token_latencies_iter)
            ttft_obs.extend(stats.time_to_first_tokens_iter)
            for f in stats.finished_requests:
                finished_stats.append({
                    "request_id": f.request_id, "finish_reason": str(f.finish_reason),
                    "e2e_latency": f.e2e_latency, "queued_time": f.queued_time,
                    "prefill_time": f.prefill_time, "decode_time": f.decode_time,
                    "inference_time": f.inference_time,
                    "mean_time_per_output_token": f.mean_time_per_output_token,
                    "num_prompt_tokens": f.num_prompt_tokens,
                    "num_generation_tokens": f.num_generation_tokens,
                    "num_cached_tokens": f.num_cached_tokens,
                    "num_preemptions": f.num_preemptions,
                    "max_tokens_param": f.max_tokens_param})
        for o in outputs:
            s = by_req[o.request_id]
            s.outputs.append((end_us, len(o.new_token_ids), fe, clock.trace_ns))
            if (s.spec.abort_after is not None and s.req_id not in abort_at
                    and s.tokens >= s.spec.abort_after):
                client_abort(s, fe)
        # drain the per-request queues as the generate() tasks would
        for _, _, _, q in requests.values():
            q.get_nowait()
        steps_log.append({"engine_end_us": end_us, "frontend_us": fe, "trace_end_ns":
                          clock.trace_ns, "outputs": len(outputs)})

    def client_abort(s: Seq, fe_us: int):
        """The client disconnects: AsyncLLM.abort -> OutputProcessor.abort_requests; the
        engine core drops the request at its next step after the abort reaches it."""
        aborted = op.abort_requests([s.spec.rid], internal=False)
        for rid in aborted:
            abort_at[rid] = fe_us + 300
        for sib in seqs:
            if sib.spec is s.spec:
                sib.aborted_engine_us = fe_us + 300

    while True:
        # the client may abort a request before any token (abort_after == 0)
        for s in pending:
            if s.spec.abort_after == 0 and s.req_id not in abort_at and s.queued_us <= t:
                frontend_add_until(s.spec.arrival_us)
                client_abort(s, s.spec.arrival_us + s.spec.preprocess_us + 500)
        while pending and pending[0].queued_us <= t:
            s = pending.pop(0)
            s.events.append(EngineCoreEvent.new_event(EngineCoreEventType.QUEUED,
                                                      mono(s.queued_us)))
            waiting.append(s)
        for lst in (waiting, running):
            for s in list(lst):
                if s.req_id in abort_at and abort_at[s.req_id] <= t:
                    lst.remove(s)
                    s.done = True
        if not waiting and not running:
            if not pending:
                break
            t = pending[0].queued_us
            continue
        if pause_after_step is not None and step == pause_after_step:
            # EngineCoreProc.pause_generation(mode="abort"): finish_requests(None,
            # FINISHED_ABORTED) then _send_abort_outputs -> one ABORT output per request,
            # no events, no tokens (vllm/v1/engine/core.py)
            victims = running + waiting
            outs = [EngineCoreOutput(s.req_id, [], finish_reason=FinishReason.ABORT)
                    for s in victims]
            for s in victims:
                s.done = True
                s.finish = "abort"
            emit(outs, t + 150, rng.randint(200, 900))
            break
        start = t
        budget = TOKEN_BUDGET
        work: list[tuple[Seq, int]] = []   # (seq, prefill tokens this step)
        # resume preempted sequences first, then the running ones
        for s in list(running):
            if s.preempted_at is not None:
                continue
            if s.prefilled < s.spec.prompt:
                chunk = min(budget, s.spec.prompt - s.prefilled)
                budget -= chunk
                work.append((s, chunk))
            else:
                work.append((s, 0))
        for s in list(running):
            if s.preempted_at is not None and step >= s.preempt_resume_step:
                s.preempted_at = None
                s.events.append(EngineCoreEvent.new_event(EngineCoreEventType.SCHEDULED,
                                                          mono(start)))
                recompute = min(budget, s.spec.prompt + s.tokens)
                budget -= recompute
                work.append((s, recompute))
        while waiting and len(running) < max_seqs and budget > 0:
            s = waiting.pop(0)
            running.append(s)
            s.scheduled_us = start
            s.events.append(EngineCoreEvent.new_event(EngineCoreEventType.SCHEDULED,
                                                      mono(start)))
            s.prefilled = s.spec.cached
            chunk = min(budget, s.spec.prompt - s.prefilled)
            budget -= chunk
            work.append((s, chunk))
        prefill_tokens = sum(c for _, c in work)
        end = start + 6_000 + 12 * prefill_tokens + 150 * len(work) + rng.randint(0, 800)
        outputs = []
        for s, chunk in work:
            if s.prefilled < s.spec.prompt:
                s.prefilled += chunk
                if s.prefilled < s.spec.prompt:
                    continue  # no partial-prefill outputs
            new = 1 if s.first_output else min(rng.randint(1, s.spec.spec_k),
                                               s.target - s.tokens)
            s.tokens += new
            finish = None
            if s.tokens >= s.target:
                finish = FinishReason.LENGTH if s.finish == "length" else FinishReason.STOP
            prefill_stats = None
            if s.first_output:
                prefill_stats = PrefillStats()
                prefill_stats.set(num_prompt_tokens=s.spec.prompt,
                                  num_local_cached_tokens=s.spec.cached,
                                  num_external_cached_tokens=0)
                prefill_stats.finalize(s.spec.prompt)
                s.first_output = False
            events, s.events = (s.events or None), []
            outputs.append(EngineCoreOutput(
                request_id=s.req_id, new_token_ids=[rng.randrange(3, 250) for _ in range(new)],
                finish_reason=finish, events=events, prefill_stats=prefill_stats,
                trace_headers={"traceparent": s.spec.traceparent} if s.spec.traceparent
                else None))
            if finish is not None:
                running.remove(s)
                s.done = True
            elif (s.spec.preempt_after and not s.preempted_once
                  and s.tokens >= s.spec.preempt_after):
                s.preempted_once = True
                s.preempted_at = end
                s.preempt_resume_step = step + 1 + s.spec.preempt_steps
                s.events.append(EngineCoreEvent.new_event(EngineCoreEventType.PREEMPTED,
                                                          mono(end)))
        step += 1
        if outputs:
            # frontend lag: usually well under a millisecond; every 7th step the API
            # server is busy (GC, a long detokenisation) and handles the step 5-9 ms late
            lag = rng.randint(5_000, 9_000) if step % 7 == 3 else rng.randint(150, 900)
            emit(outputs, end, lag)
        t = end + rng.randint(100, 400)

    assert provider.force_flush(30_000)
    return {"seqs": seqs, "steps": steps_log, "itl_pooled": itl_pooled, "ttft_obs": ttft_obs,
            "finished_stats": finished_stats, "prometheus": prometheus_figures(),
            "aborted": sorted({s.spec.rid for s in seqs if s.aborted_engine_us is not None})}


def truth_of(result: dict) -> dict:
    """The ground truth per request id (as the span carries it), exact integer us of the
    fed clocks, with vLLM's own figures beside it."""
    reqs: dict[str, dict] = {}
    fin = {}
    for f in result["finished_stats"]:
        fin.setdefault(f["request_id"], []).append(f)
    for s in result["seqs"]:
        sp = s.spec
        r = reqs.setdefault(sp.rid, {
            "note": sp.note, "n": len(sp.out), "arrival_wall_s": wall(sp.arrival_us),
            "arrival_us": sp.arrival_us, "queued_engine_us": s.queued_us,
            "prompt_tokens": sp.prompt, "cached_prompt_tokens": sp.cached,
            "max_tokens": sp.max_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
            "traceparent": sp.traceparent,
            "client_aborted": s.aborted_engine_us is not None,
            "span_expected": s.aborted_engine_us is None,
            "sequences": [], "vllm_finished_stats": fin.get(sp.rid, [])})
        outs = s.outputs
        seq = {"index": s.index, "internal_request_id": s.req_id,
               "finish_reason": s.finish if s.aborted_engine_us is None else "abort(client)",
               "output_tokens": sum(n for _, n, _, _ in outs),
               "scheduled_engine_us": s.scheduled_us,
               # one row per engine step that carried an output for this sequence:
               # [engine step end (us), tokens, frontend handled it (us)]
               "steps": [[e, n, fe] for e, n, fe, _ in outs]}
        if outs and s.scheduled_us is not None:
            first, last = outs[0], outs[-1]
            seq.update({
                "first_token_engine_us": first[0], "last_token_engine_us": last[0],
                "first_token_frontend_us": first[2], "finish_frontend_us": last[2],
                "span_end_unix_ns": last[3],
                # exact values from the fed clocks (what vLLM computes, before float error)
                "exact": {
                    "ttft_s": (first[2] - sp.arrival_us) / 1e6,
                    "e2e_s": (last[2] - sp.arrival_us) / 1e6,
                    "queue_s": (s.scheduled_us - s.queued_us) / 1e6,
                    "prefill_s": (first[0] - s.scheduled_us) / 1e6,
                    "decode_s": (last[0] - first[0]) / 1e6,
                    "inference_s": (last[0] - s.scheduled_us) / 1e6,
                    "preprocess_s": (first[2] - sp.arrival_us - (first[0] - s.queued_us)) / 1e6,
                    "frontend_lag_first_s": (first[2] - first[0]) / 1e6,
                    "frontend_lag_last_s": (last[2] - last[0]) / 1e6,
                }})
        r["sequences"].append(seq)
    return reqs


def _child(args) -> None:
    os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = args.protocol
    result = drive(args.scenario, args.endpoint)
    with open(args.result, "w") as f:
        json.dump({"truth": truth_of(result), "itl_pooled": result["itl_pooled"],
                   "ttft_obs": result["ttft_obs"], "prometheus": result["prometheus"],
                   "steps": result["steps"], "aborted": result["aborted"]}, f)


def line_of(obj, needle: str) -> str:
    """file:line of the first line of ``obj``'s source holding ``needle``."""
    import vllm

    root = Path(vllm.__file__).parent.parent
    src, start = inspect.getsourcelines(obj)
    for i, line in enumerate(src):
        if needle in line:
            return f"{Path(inspect.getsourcefile(obj)).relative_to(root)}:{start + i}"
    raise RuntimeError(f"{needle!r} not in {obj}")


def _where(obj) -> str:
    import vllm

    root = Path(vllm.__file__).parent.parent
    src = inspect.getsourcefile(obj)
    line = inspect.getsourcelines(obj)[1]
    return f"{Path(src).relative_to(root)}:{line}"


def write_readme(out: Path, summary: dict) -> None:
    import vllm
    import vllm.tracing
    import vllm.tracing.otel
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import IterationStats

    w = _where
    dt = OutputProcessor.do_tracing
    uo = IterationStats.update_from_output
    formulas = "\n".join(f"- {a}: `{f}` ({line_of(o, n)})" for a, f, o, n in (
        ("span start", "int(arrival_time * 1e9)", dt, "arrival_time_ns ="),
        ("span end", "time_ns() when instrument_manual ends it (no end_time given)",
         vllm.tracing.otel.manual_instrument_otel, "span.end()"),
        ("`gen_ai.latency.time_to_first_token`",
         "first_token_latency = iteration_timestamp of the first output's step - "
         "arrival_time (frontend wall clock)", uo, "first_token_latency = self._time_since"),
        ("`gen_ai.latency.e2e`", "iteration_timestamp - arrival_time (the finishing step, "
         "frontend wall clock)", dt, "e2e_time ="),
        ("`gen_ai.latency.time_in_queue`", "scheduled_ts - queued_ts (engine monotonic)", dt,
         "queued_time ="),
        ("`gen_ai.latency.time_in_model_prefill`", "first_token_ts - scheduled_ts", dt,
         "prefill_time ="),
        ("`gen_ai.latency.time_in_model_decode`", "last_token_ts - first_token_ts", dt,
         "decode_time ="),
        ("`gen_ai.latency.time_in_model_inference`", "last_token_ts - scheduled_ts", dt,
         "inference_time ="),
        ("first/last_token_ts", "engine_core_timestamp of the step (EngineCoreOutputs."
         "timestamp); last_token_ts moves on every output, even one with no tokens", uo,
         "req_stats.last_token_ts = engine_core_timestamp"),
        ("queued_ts / scheduled_ts", "the QUEUED / first SCHEDULED event's timestamp",
         IterationStats.update_from_events, "req_stats.scheduled_ts = event.timestamp"),
        ("`gen_ai.usage.prompt_tokens`", "len(prompt_token_ids), on every sequence's span",
         dt, "prompt_length ="),
        ("`gen_ai.usage.completion_tokens`", "num_generation_tokens (this sequence)", dt,
         "metrics.num_generation_tokens"),
        ("`gen_ai.request.top_p/max_tokens/temperature/n`",
         "set only when truthy; n is the child's (1) for n > 1", dt, "if req_state.top_p"),
        ("no span for a client abort", "abort_requests removes the state; do_tracing runs "
         "only for a finish seen by process_outputs", OutputProcessor.process_outputs,
         "self.do_tracing(")))
    text = f"""# vLLM {importlib.metadata.version('vllm')}: its own `llm_request` spans

Generated {datetime.date.today().isoformat()} by `tests/engines/vllm033_spans.py`
(`make engine-fixtures`), seed {SEED}. Regenerating gives the same `truth.json`; the
`.pb` bytes differ only where the SDK puts the process id (`vllm.process_id`) and the
OTel SDK version in the resource.

## What ran (vLLM's code, unmodified; no GPU, no model weights)

- `init_tracer("vllm.llm_engine", endpoint)` ({w(vllm.tracing.init_tracer)}; the OTel
  backend {w(vllm.tracing.otel.init_otel_tracer)}), as `AsyncLLM.__init__` calls it, with
  `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` = `grpc` and then `http/protobuf`.
- `OutputProcessor.add_request` ({w(OutputProcessor.add_request)}), with the n > 1
  fan-out through `ParentRequest` that `AsyncLLM.add_request` does.
- `OutputProcessor.process_outputs` ({w(OutputProcessor.process_outputs)}) once per
  engine step, with a fresh `IterationStats()` ({w(IterationStats.__init__)}) and the
  step's `EngineCoreOutputs.timestamp` as `engine_core_timestamp`, as AsyncLLM's output
  handler does. It calls `do_tracing` ({w(OutputProcessor.do_tracing)}), which builds the
  span and hands it to `instrument_manual` ({w(vllm.tracing.instrument_manual)}).
- `OutputProcessor.abort_requests` ({w(OutputProcessor.abort_requests)}) for client
  aborts.
- `PrometheusStatLogger.record` ({w(PrometheusStatLogger.record)}) per step, on a real
  `VllmConfig` (a local 2-layer Llama config, no weights); its histograms are in
  `truth.json` under `vllm_prometheus`.

The script plays vLLM's engine core (a seeded step scheduler that sends the
`EngineCoreOutputs` the real one sends: QUEUED/SCHEDULED/PREEMPTED events with
monotonic timestamps, `PrefillStats` with prefix-cache hits, chunked prefill with no
partial outputs, finish reasons) and sets the clocks: `time.time` as
`vllm/v1/metrics/stats.py` reads it and `time_ns` as the OTel SDK reads it when vLLM ends
the span. Frontend wall clock t=0 is {WALL0} (2026-11-02T09:00:00Z), the engine's
monotonic clock reads {MONO0} then.

## vLLM's formulas (what each span field is)

{formulas}

## What the spans look like

One `llm_request` span (kind SERVER, scope `vllm.tracing.otel`, 128-bit trace id)
per finished sequence, a root unless the request carried a W3C `traceparent` (then its
parent is the client's span). An n = 2 request gives two spans with the same
`gen_ai.request.id`, each with the full prompt and `gen_ai.request.n` = 1. No model,
finish reason, cached-token or per-token attributes. Resource: `service.name` =
`unknown_service:python` (no `OTEL_SERVICE_NAME`), `vllm.instrumenting_module_name` =
`vllm.llm_engine`, `vllm.process_id`, `service.instance.id` (random), `telemetry.sdk.*`.
The hostile steps (a frontend busy 5-9 ms on every 7th engine step) make arrival + TTFT +
decode land up to ~7 ms past arrival + e2e for some requests, and before it for others.

## Files

- `<scenario>/grpc/NNN.pb`: the `ExportTraceServiceRequest` bytes each gRPC Export call
  carried.
- `<scenario>/http/NNN.pb` and `NNN.http.json`: each OTLP/HTTP POST's body as sent and
  its request line and headers.
- `truth.json`: per scenario, per request id (`gen_ai.request.id`): the fed ground truth
  in integer microseconds after t=0 (frontend and engine clocks), the exact durations
  those imply, vLLM's own span attributes, its `FinishedRequestStats`, the pooled ITL
  and TTFT observations of its `IterationStats`, and its Prometheus sums and counts.

## Scenarios

{summary_text(summary)}

## Regenerate

    make engine-fixtures
"""
    (out / "README.md").write_text(text)


def summary_text(summary: dict) -> str:
    lines = []
    for name, s in summary.items():
        lines.append(f"- `{name}`: {s['requests']} request ids ({s['aborted']} aborted by "
                     f"the client: no span), {s['spans']} `llm_request` spans, "
                     f"{s['exports']} export request(s) per protocol")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=str(
        HERE.parent / "fixtures" / "otlp" / "engines" / "vllm-0.33.0"))
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--protocol")
    ap.add_argument("--endpoint")
    ap.add_argument("--scenario")
    ap.add_argument("--result")
    args = ap.parse_args()
    if args.child:
        _child(args)
        return

    from capture import capture, fixture_json, require_version  # the script's folder

    version = require_version("vllm", VLLM_VERSION)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    truth = {"engine": "vllm", "version": version, "seed": SEED,
             "wall0": WALL0, "mono0": MONO0, "scenarios": {}}
    summary = {}
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING")
    env.pop("OTEL_SERVICE_NAME", None)
    for scenario in ("main", "pause_abort"):
        results = capture(__file__, out / scenario, ["--scenario", scenario], env)
        g, h = results["grpc"], results["http"]
        if g["truth"] != h["truth"]:
            raise SystemExit(f"{scenario}: the two protocol runs fed different truths")
        span_attrs = {}
        for sp in g["spans"]:
            if sp["name"] == "llm_request":
                span_attrs.setdefault(sp["attributes"]["gen_ai.request.id"], []).append(sp)
        for rid, r in g["truth"].items():
            r["vllm_spans"] = [{k: v for k, v in sp.items() if k in (
                "start", "end", "attributes", "kind", "parent_span_id")}
                for sp in span_attrs.get(rid, [])]
        h_attrs = sorted(json.dumps(sp["attributes"], sort_keys=True) for sp in h["spans"])
        g_attrs = sorted(json.dumps(sp["attributes"], sort_keys=True) for sp in g["spans"])
        if h_attrs != g_attrs:
            raise SystemExit(f"{scenario}: grpc and http spans carry different attributes")
        truth["scenarios"][scenario] = {
            "requests": g["truth"],
            "vllm_iteration_stats": {
                "itl_count": len(g["itl_pooled"]), "itl_sum": sum(g["itl_pooled"]),
                "ttft_count": len(g["ttft_obs"]), "ttft_sum": sum(g["ttft_obs"])},
            "vllm_prometheus": g["prometheus"], "engine_steps": len(g["steps"]),
            "exports": {"grpc": g["exports"], "http": h["exports"]}}
        summary[scenario] = {"requests": len(g["truth"]), "spans": len(g["spans"]),
                             "exports": g["exports"], "aborted": len(g["aborted"])}
    (out / "truth.json").write_text(fixture_json(truth))
    write_readme(out, summary)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
