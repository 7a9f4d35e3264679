"""SGLang 0.5.23's own request traces, driven with a known ground truth.

Run with the SGLang engine-fixtures virtualenv (``make engine-fixtures``).

What runs is SGLang's code, unmodified (sglang/srt/observability/):

* ``process_tracing_init(endpoint, None, trace_modules="request")`` and
  ``trace_set_thread_info(label, ...)`` as ``http_server.py`` (tokenizer: "Tokenizer",
  "PrefillTokenizer", "DecodeTokenizer") and ``scheduler.py`` ("Scheduler",
  "Prefill Scheduler", "Decode Scheduler", tp_rank 0, pp_rank 0) call them, each role on
  a thread of its own (its own native thread id, so its own thread span), all in one
  process (real SGLang runs them as processes: one exporter each; here one exporter
  carries all of them).
* ``APIServerReqTimeStats`` (the tokenizer manager's): ``init_trace_ctx``,
  ``set_created_time``, ``set_tokenize_finish_time``, ``set_api_server_dispatch_time`` /
  ``..._finish_time``, ``set_first_token_time``, ``set_last_time`` and
  ``set_finished_time(span_attrs=...)`` with the span attributes built by
  ``TokenizerManager.convert_to_span_attrs`` (its source, compiled from
  tokenizer_manager.py: importing that module needs a CUDA torch runtime).
* The time stats cross to the scheduler as SGLang sends them: pickled
  (``__getstate__`` / ``__setstate__``, the trace context travels as a W3C carrier),
  then ``SchedulerReqTimeStats.new_from_obj`` and the scheduler's setters in the order
  scheduler.py, schedule_batch.py, batch_result_processor.py and disaggregation/
  {prefill,decode}.py call them.

What this script supplies: the request stream and a small seeded scheduler (batching,
chunked prefill at a 512-token budget, one token per decode step, the disaggregated
bootstrap / KV transfer), and the clocks: ``time`` as req_time_stats.py and trace.py see
it, per thread (perf_counter of the simulated timeline; time.time() = WALL0 + it, plus a
fixed per-process calibration offset, as ``calibrate_time_diff`` measures it).

``python sglang_spans.py [OUT_DIR]`` writes OUT_DIR/<mode>-level<N>/<protocol>/NNN.pb,
OUT_DIR/truth.json and OUT_DIR/README.md.
"""

from __future__ import annotations
import __future__

import argparse
import ast
import datetime
import json
import os
import pickle
import random
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
SGLANG_VERSION = "0.5.23"
SEED = 523
WALL0 = 1_793_613_600.0     # 2026-11-02T10:00:00Z: time.time() at perf_counter() == PERF0
PERF0 = 91_234.5            # perf_counter() at t = 0
# calibrate_time_diff() in each process reads time.time() - perf_counter(): the two
# reads are not simultaneous, so each process's offset differs by some microseconds
CALIBRATION_US = {"tokenizer": 0, "scheduler": 23, "prefill_tokenizer": 0,
                  "decode_tokenizer": 5, "prefill_scheduler": 17, "decode_scheduler": 41}
TOKEN_BUDGET = 512
MAX_RUNNING = 6
MODEL = "fixture-model"


# ---- clocks ------------------------------------------------------------------------------
class Clock:
    """``time`` as SGLang's observability modules see it: per thread, a simulated
    perf_counter() and the wall clock it implies through that thread's process offset."""

    def __init__(self):
        self._local = threading.local()

    def set(self, us: int, role: str | None = None) -> None:
        self._local.us = us
        if role is not None:
            self._local.role = role

    def _us(self) -> int:
        return getattr(self._local, "us", 0)

    def _offset(self) -> float:
        return CALIBRATION_US.get(getattr(self._local, "role", "tokenizer"), 0) / 1e6

    def perf_counter(self) -> float:
        return PERF0 + self._us() / 1e6

    def time(self) -> float:
        return WALL0 + self._us() / 1e6 + self._offset()

    def time_ns(self) -> int:
        return round(self.time() * 1e9)

    def monotonic(self) -> float:
        return self.perf_counter()

    def __getattr__(self, name):  # anything else from the real module
        import time
        return getattr(time, name)


def perf(us: int) -> float:
    return PERF0 + us / 1e6


# ---- the scenario ------------------------------------------------------------------------
@dataclass
class Spec:
    rid: str
    arrival_us: int
    prompt: int
    out: int
    finish: str = "stop"          # stop | length | abort (client, mid-decode)
    cached: int = 0
    max_new_tokens: int | None = 128
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    n: int = 1
    bootstrap_room: int | None = None
    traceparent: str | None = None
    note: str = ""


@dataclass
class Timeline:
    """Every instant the drivers stamp, in us after t = 0 (simulated perf_counter)."""
    spec: Spec
    role: str = "unified"
    created: int = 0
    tokenize_done: int = 0
    dispatch: int = 0
    dispatch_done: int = 0
    recv: int = 0
    bootstrap_queue: int = 0     # prefill: bootstrap queue entry; decode: prealloc entry
    bootstrap_done: int = 0
    transfer_queue: int = 0      # decode: transfer queue entry; prefill: kv send start
    wait_queue: int = 0
    forward: int = 0
    chunks: list = field(default_factory=list)   # non-final chunk finish times
    prefill_done: int = 0
    kv_done: int = 0             # prefill: KV transfer finished
    prebuilt: int = 0            # decode: fake output (first token from prefill)
    decode_steps: list = field(default_factory=list)  # decode step finish times
    completion: int = 0
    outputs: list = field(default_factory=list)  # tokenizer handles output at (us, tokens)
    finished_at: int = 0         # tokenizer handles the final output
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: dict | None = None


def _rid(rng: random.Random) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(32))


def scenario(rng: random.Random, mode: str) -> list[Spec]:
    specs: list[Spec] = []
    t = 0

    def add(**kw):
        nonlocal t
        t += kw.pop("gap_us", rng.randint(3_000, 30_000))
        room = rng.getrandbits(63) if mode == "disagg" else None
        specs.append(Spec(rid=_rid(rng), arrival_us=t, bootstrap_room=room, **kw))

    for _ in range(2):
        add(prompt=rng.randint(20, 400), out=rng.randint(4, 30))
    add(prompt=40, out=1, finish="length", max_new_tokens=1, note="1-token output")
    add(prompt=50, out=2, note="2-token output")
    add(prompt=100, out=32, finish="length", max_new_tokens=32, note="long output")
    add(prompt=300, cached=256, out=8, note="prefix-cache hit: 256 of 300 prompt tokens")
    add(prompt=1200, out=6, note="chunked prefill over three steps (budget 512)")
    add(prompt=60, out=12, temperature=0.0, top_p=1.0, max_new_tokens=None,
        note="greedy, no max_new_tokens: those attributes absent")
    add(prompt=64, out=40, finish="abort", note="client abort after 5 tokens")
    add(prompt=80, out=9, top_k=20, traceparent=(
        f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-01"),
        note="W3C traceparent from the client: root has a parent")
    for _ in range(3):
        add(prompt=rng.randint(30, 250), out=rng.randint(2, 20), gap_us=rng.randint(100, 900),
            note="burst (queues)")
    return specs


ABORT_AFTER = 5


def simulate(specs: list[Spec], rng: random.Random, mode: str) -> list[Timeline]:
    """A step scheduler: prefill then decode, at most MAX_RUNNING running, a token budget
    per step. For "disagg", a prefill server (prefill + KV transfer) and a decode server
    (prealloc, wait for the KV, prebuilt first token, decode steps)."""
    lines: list[Timeline] = []
    by_rid = {}
    for sp in specs:
        roles = ["unified"] if mode == "unified" else ["prefill", "decode"]
        for role in roles:
            tl = Timeline(spec=sp, role=role)
            # the router fans a disaggregated request out to both servers at once
            tl.created = sp.arrival_us + (rng.randint(20, 150) if role == "decode" else 0)
            tl.tokenize_done = tl.created + rng.randint(300, 2_500)
            tl.dispatch = tl.tokenize_done + rng.randint(10, 60)
            tl.dispatch_done = tl.dispatch + rng.randint(30, 200)
            tl.recv = tl.dispatch_done + rng.randint(50, 400)
            lines.append(tl)
            by_rid[(sp.rid, role)] = tl

    def run_prefill_server(items: list[Timeline], disagg: bool):
        """Prefill (unified or the prefill server). Fills wait_queue, forward, chunks,
        prefill_done; unified also decodes (returns decode work)."""
        for tl in items:
            if disagg:
                tl.bootstrap_queue = tl.recv + rng.randint(50, 300)        # prefill_prepare
                tl.bootstrap_done = tl.bootstrap_queue + rng.randint(500, 3_000)
                tl.wait_queue = tl.bootstrap_done + rng.randint(50, 200)
            else:
                tl.wait_queue = tl.recv + rng.randint(100, 600)            # request_process
        waiting = sorted(items, key=lambda x: x.wait_queue)
        running: list[Timeline] = []
        prefilling: dict[int, int] = {}
        t = waiting[0].wait_queue if waiting else 0
        while waiting or running:
            ready = [x for x in waiting if x.wait_queue <= t]
            if not ready and not running:
                t = waiting[0].wait_queue
                continue
            budget = TOKEN_BUDGET
            batch_prefill = []
            for tl in list(ready):
                if len(running) >= MAX_RUNNING or budget <= 0:
                    break
                waiting.remove(tl)
                running.append(tl)
                tl.forward = t
                prefilling[id(tl)] = tl.spec.cached
            for tl in running:
                if id(tl) in prefilling and budget > 0:
                    chunk = min(budget, tl.spec.prompt - prefilling[id(tl)])
                    budget -= chunk
                    prefilling[id(tl)] += chunk
                    batch_prefill.append(tl)
            decoding = [x for x in running if id(x) not in prefilling and not disagg]
            step = 6_000 + 10 * (TOKEN_BUDGET - budget) + 120 * len(decoding) \
                + rng.randint(0, 700)
            end = t + step
            for tl in batch_prefill:
                if prefilling[id(tl)] < tl.spec.prompt:
                    tl.chunks.append(end)
                    continue
                del prefilling[id(tl)]
                tl.prefill_done = end
                tl.completion_tokens = 1
                if disagg:
                    tl.transfer_queue = end + rng.randint(20, 100)
                    tl.kv_done = tl.transfer_queue + rng.randint(800, 4_000)
                    tl.completion = tl.kv_done
                    tl.finish_reason = {"type": "length", "length": 0}
                    running.remove(tl)
                elif tl.spec.out == 1:
                    tl.completion = end
                    tl.finish_reason = _finish(tl.spec, 1)
                    running.remove(tl)
            for tl in decoding:
                tl.decode_steps.append(end)
                tl.completion_tokens += 1
                if (tl.spec.finish == "abort" and tl.completion_tokens >= ABORT_AFTER) \
                        or tl.completion_tokens >= tl.spec.out:
                    tl.completion = end
                    tl.finish_reason = _finish(tl.spec, tl.completion_tokens)
                    running.remove(tl)
            t = end + rng.randint(80, 300)

    if mode == "unified":
        run_prefill_server(lines, disagg=False)
    else:
        pre = [x for x in lines if x.role == "prefill"]
        dec = [x for x in lines if x.role == "decode"]
        run_prefill_server(pre, disagg=True)
        # the decode server: prealloc, bootstrap, wait for the prefill's KV
        for tl in dec:
            p = by_rid[(tl.spec.rid, "prefill")]
            tl.bootstrap_queue = tl.recv + rng.randint(50, 300)            # decode_prepare
            tl.bootstrap_done = tl.bootstrap_queue + rng.randint(300, 2_000)
            tl.transfer_queue = tl.bootstrap_done + rng.randint(50, 200)   # decode_bootstrap
            tl.wait_queue = max(tl.transfer_queue, p.kv_done) + rng.randint(100, 500)
        waiting = sorted(dec, key=lambda x: x.wait_queue)
        running: list[Timeline] = []
        t = waiting[0].wait_queue
        while waiting or running:
            ready = [x for x in waiting if x.wait_queue <= t]
            if not ready and not running:
                t = waiting[0].wait_queue
                continue
            prebuilt = []
            for tl in ready:
                if len(running) >= MAX_RUNNING:
                    break
                waiting.remove(tl)
                tl.forward = t
                prebuilt.append(tl)
            decoding = list(running)
            end = t + 5_000 + 150 * len(decoding) + rng.randint(0, 600)
            for tl in prebuilt:  # the prebuilt batch: the prefill's first token, no compute
                tl.prebuilt = t + rng.randint(200, 800)
                tl.completion_tokens = 1
                running.append(tl)
                if tl.spec.out == 1:
                    tl.completion = tl.prebuilt
                    tl.finish_reason = _finish(tl.spec, 1)
                    running.remove(tl)
            for tl in decoding:
                tl.decode_steps.append(end)
                tl.completion_tokens += 1
                if (tl.spec.finish == "abort" and tl.completion_tokens >= ABORT_AFTER) \
                        or tl.completion_tokens >= tl.spec.out:
                    tl.completion = end
                    tl.finish_reason = _finish(tl.spec, tl.completion_tokens)
                    running.remove(tl)
            t = end + rng.randint(80, 300)

    # the tokenizer handles each output a little later (detokenizer hop, event loop)
    for tl in lines:
        emits = []
        if tl.role == "decode":
            emits.append((tl.prebuilt, 1))
        else:
            emits.append((tl.prefill_done if tl.role == "unified" else tl.kv_done, 1))
        if tl.role != "prefill":
            emits.extend((s, 1) for s in tl.decode_steps)
        last = 0
        for s, n in emits:
            at = max(s + rng.randint(150, 1_200), last + 30)
            if rng.random() < 0.1:
                at += rng.randint(3_000, 8_000)   # a busy event loop
            tl.outputs.append((at, n))
            last = at
        tl.finished_at = tl.outputs[-1][0]
        tl.cached_tokens = tl.spec.cached if tl.role != "decode" else 0
    return lines


def _finish(sp: Spec, tokens: int) -> dict:
    if sp.finish == "abort":
        return {"type": "abort", "message": "client disconnected"}
    if sp.finish == "length":
        return {"type": "length", "length": tokens}
    return {"type": "stop", "matched": 2}


# ---- SGLang's own attribute builder -----------------------------------------------------
def convert_to_span_attrs_fn():
    """``TokenizerManager.convert_to_span_attrs``, compiled from SGLang's own source
    (tokenizer_manager.py imports CUDA-only modules, so the function is taken alone)."""
    import importlib.util

    from sglang.srt.observability.trace import SpanAttributes

    # the file alone, not imported (find_spec does not run it)
    path = Path(importlib.util.find_spec("sglang.srt.managers.tokenizer_manager").origin)
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "TokenizerManager":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "convert_to_span_attrs":
                    mod = ast.Module(body=[fn], type_ignores=[])
                    code = compile(mod, str(path), "exec", dont_inherit=True,
                                   flags=__future__.annotations.compiler_flag)

                    class BatchEmbeddingOutput:  # the one name its body tests against
                        pass

                    ns = {"SpanAttributes": SpanAttributes, "json": json,
                          "BatchEmbeddingOutput": BatchEmbeddingOutput}
                    exec(code, ns)
                    return ns["convert_to_span_attrs"], fn.lineno
    raise RuntimeError("convert_to_span_attrs not found in tokenizer_manager.py")


# ---- the driver ---------------------------------------------------------------------------
def drive(mode: str, endpoint: str) -> dict:
    import sglang.srt.observability.req_time_stats as rts
    import sglang.srt.observability.trace as trace_mod
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.observability.req_time_stats import (
        APIServerReqTimeStats,
        SchedulerReqTimeStats,
    )
    from sglang.srt.observability.trace import process_tracing_init, trace_set_thread_info

    clock = Clock()
    rts.time = clock          # req_time_stats.py: time.perf_counter(), time.time()
    trace_mod.time = clock    # trace.py: time.time_ns() (get_cur_time_ns), id seed
    clock.set(0, "tokenizer")
    rts.calibrate_time_diff()
    convert_to_span_attrs, _ = convert_to_span_attrs_fn()
    tm_self = SimpleNamespace(enable_trace=True, served_model_name=MODEL)

    # as http_server.py / scheduler.py: one provider per process (here: one)
    process_tracing_init(endpoint, None, trace_modules="request")
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    rng = random.Random(f"{SEED}-{mode}")
    specs = scenario(rng, mode)
    lines = simulate(specs, rng, mode)

    roles = (["tokenizer", "scheduler"] if mode == "unified" else
             ["prefill_tokenizer", "decode_tokenizer", "prefill_scheduler",
              "decode_scheduler"])
    labels = {"tokenizer": ("Tokenizer", None), "scheduler": ("Scheduler", (0, None, 0)),
              "prefill_tokenizer": ("PrefillTokenizer", None),
              "decode_tokenizer": ("DecodeTokenizer", None),
              "prefill_scheduler": ("Prefill Scheduler", (0, None, 0)),
              "decode_scheduler": ("Decode Scheduler", (0, None, 0))}
    pools = {r: ThreadPoolExecutor(1, thread_name_prefix=r) for r in roles}

    def on(role: str, us: int, fn) -> None:
        def call():
            clock.set(us, role)
            fn()
        pools[role].submit(call).result()

    for r in roles:
        label, ranks = labels[r]
        if ranks is None:
            on(r, 0, lambda label=label: trace_set_thread_info(label))
        else:
            on(r, 0, lambda label=label, ranks=ranks: trace_set_thread_info(label, *ranks))

    mode_of = {"unified": DisaggregationMode.NULL, "prefill": DisaggregationMode.PREFILL,
               "decode": DisaggregationMode.DECODE}
    events = []  # (us, order, role, fn)
    seq = 0

    def ev(us, role, fn):
        nonlocal seq
        events.append((us, seq, role, fn))
        seq += 1

    for tl in lines:
        sp = tl.spec
        tok = "tokenizer" if tl.role == "unified" else f"{tl.role}_tokenizer"
        sch = "scheduler" if tl.role == "unified" else f"{tl.role}_scheduler"
        st: dict = {}
        params = {"max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature,
                  "top_p": sp.top_p, "top_k": sp.top_k, "n": sp.n}
        state = SimpleNamespace(obj=SimpleNamespace(rid=sp.rid, sampling_params=params,
                                                    stream=True))

        def created(tl=tl, st=st, sp=sp):
            # tokenizer_manager.py: _init_req_state
            ts = APIServerReqTimeStats(disagg_mode=mode_of[tl.role])
            header = {"traceparent": sp.traceparent} if sp.traceparent else None
            ts.init_trace_ctx(sp.rid, sp.bootstrap_room, header)
            ts.set_created_time(perf(tl.created))
            st["api"] = ts

        def dispatch(tl=tl, st=st):
            ts = st["api"]
            ts.set_api_server_dispatch_time(perf(tl.dispatch))
            st["wire"] = pickle.dumps(ts)   # the tokenized request goes out over ZMQ
            ts.set_api_server_dispatch_finish_time(perf(tl.dispatch_done))

        def recv(st=st):
            # schedule_batch.py Req.__init__: new_from_obj + set_scheduler_recv_time
            s = SchedulerReqTimeStats.new_from_obj(pickle.loads(st["wire"]))
            s.set_scheduler_recv_time()
            st["sched"] = s

        ev(tl.created, tok, created)
        ev(tl.tokenize_done, tok, lambda st=st, tl=tl:
           st["api"].set_tokenize_finish_time(perf(tl.tokenize_done)))
        ev(tl.dispatch, tok, dispatch)
        ev(tl.recv, sch, recv)
        S = lambda st=st: st["sched"]  # noqa: E731
        if tl.role == "prefill":
            ev(tl.bootstrap_queue, sch, lambda S=S, t=tl.bootstrap_queue:
               S().set_prefill_bootstrap_queue_entry_time(perf(t)))
            ev(tl.bootstrap_done, sch, lambda S=S, t=tl.bootstrap_done:
               S().set_bootstrap_done_time(perf(t)))
        if tl.role == "decode":
            ev(tl.bootstrap_queue, sch, lambda S=S, t=tl.bootstrap_queue:
               S().set_decode_prealloc_queue_entry_time(perf(t)))
            ev(tl.bootstrap_done, sch, lambda S=S, t=tl.bootstrap_done:
               S().set_bootstrap_done_time(perf(t)))
            ev(tl.transfer_queue, sch, lambda S=S, t=tl.transfer_queue:
               S().set_decode_transfer_queue_entry_time(perf(t)))
        ev(tl.wait_queue, sch, lambda S=S, t=tl.wait_queue: S().set_wait_queue_entry_time(
            perf(t)))
        ev(tl.forward, sch, lambda S=S, t=tl.forward: S().set_forward_entry_time(perf(t)))
        for c in tl.chunks:
            ev(c, sch, lambda S=S, c=c: S().set_last_chunked_prefill_finish_time(perf(c)))
        if tl.role != "decode":
            ev(tl.prefill_done, sch, lambda S=S, t=tl.prefill_done:
               S().set_prefill_finished_time(perf(t)))
        if tl.role == "prefill":
            ev(tl.transfer_queue, sch, lambda S=S, t=tl.transfer_queue:
               S().set_prefill_transfer_queue_entry_time(perf(t)))
            ev(tl.kv_done, sch, lambda S=S, t=tl.kv_done:
               S().set_prefill_kv_transfer_finish_time(perf(t)))
        if tl.role == "decode":
            ev(tl.prebuilt, sch, lambda S=S, t=tl.prebuilt:
               S().set_decode_prebuilt_finish_time(perf(t)))
        for d in tl.decode_steps:
            ev(d, sch, lambda S=S, d=d: S().set_last_decode_finish_time(perf(d)))
        ev(tl.completion, sch, lambda S=S: S().set_completion_time())

        # the tokenizer's side of each output (tokenizer_manager.py _handle_batch_output)
        n_out = len(tl.outputs)
        for k, (at, _n) in enumerate(tl.outputs):
            final = k == n_out - 1

            def out(st=st, at=at, k=k, final=final, tl=tl, state=state):
                ts = st["api"]
                first_output_time = None
                if ts.first_token_time == 0.0:
                    first_output_time = perf(at)
                    ts.set_first_token_time(ts=first_output_time)
                    ts.set_last_time(ts=first_output_time)
                elif k > 0:
                    ts.set_last_time(perf(at))
                if not final:
                    return
                if tl.finish_reason and tl.finish_reason["type"] == "abort":
                    # _handle_abort_req: finished, no span attributes
                    ts.set_finished_time()
                    return
                recv_obj = SimpleNamespace(
                    completion_tokens=[tl.completion_tokens], prompt_tokens=[tl.spec.prompt],
                    cached_tokens=[tl.cached_tokens], finished_reasons=[tl.finish_reason])
                attrs = convert_to_span_attrs(tm_self, state, recv_obj, 0)
                ts.set_finished_time(ts=first_output_time, span_attrs=attrs)

            ev(at, tok, out)

    for us, _, role, fn in sorted(events, key=lambda e: (e[0], e[1])):
        on(role, us, fn)
    assert provider.force_flush(30_000)
    for p in pools.values():
        p.shutdown()
    return {"lines": lines}


def truth_of(lines) -> dict:
    reqs: dict[str, dict] = {}
    for tl in lines:
        sp = tl.spec
        r = reqs.setdefault(sp.rid, {
            "note": sp.note, "arrival_us": sp.arrival_us, "prompt_tokens": sp.prompt,
            "cached_prompt_tokens": sp.cached, "bootstrap_room": sp.bootstrap_room,
            "traceparent": sp.traceparent, "max_new_tokens": sp.max_new_tokens,
            "finish": sp.finish, "roles": {}})
        wall = lambda us, role: (WALL0 + us / 1e6  # noqa: E731
                                 + CALIBRATION_US[role] / 1e6)
        tok = "tokenizer" if tl.role == "unified" else f"{tl.role}_tokenizer"
        first = tl.outputs[0][0]
        api = {  # the root's gen_ai.latency.* from these (req_time_stats.py)
            "ttft_s": (first - tl.created) / 1e6,
            "e2e_s": (tl.finished_at - tl.created) / 1e6,
            "decode_s": (tl.finished_at - first) / 1e6,
            "prefill_s": (first - tl.dispatch_done) / 1e6,
            "inference_s": (tl.finished_at - tl.dispatch_done) / 1e6}
        if tl.finish_reason and tl.finish_reason["type"] == "abort":
            # set_finished_time() with no ts: the abort is handled at the last output
            pass
        r["roles"][tl.role] = {
            "created_us": tl.created, "created_unix_s": wall(tl.created, tok),
            "tokenize_done_us": tl.tokenize_done, "dispatch_us": tl.dispatch,
            "dispatch_done_us": tl.dispatch_done, "scheduler_recv_us": tl.recv,
            "bootstrap_queue_us": tl.bootstrap_queue or None,
            "bootstrap_done_us": tl.bootstrap_done or None,
            "transfer_queue_us": tl.transfer_queue or None,
            "wait_queue_us": tl.wait_queue, "forward_us": tl.forward,
            "chunk_done_us": tl.chunks, "prefill_done_us": tl.prefill_done or None,
            "kv_transfer_done_us": tl.kv_done or None, "prebuilt_us": tl.prebuilt or None,
            "decode_step_us": tl.decode_steps, "completion_us": tl.completion,
            "tokenizer_output_us": [a for a, _ in tl.outputs],
            "finished_us": tl.finished_at,
            "completion_tokens": tl.completion_tokens, "cached_tokens": tl.cached_tokens,
            "finish_reason": tl.finish_reason,
            "exact": {
                **api,
                "queue_s": ((tl.forward - tl.wait_queue) / 1e6),
                "prefill_forward_s": ((tl.prefill_done - tl.forward) / 1e6
                                      if tl.role != "decode" else None),
                # pooled ITL: the decode_loop spans, one per decode step
                "itl_sum_s": sum((b - a) / 1e6 for a, b in zip(
                    [tl.prebuilt if tl.role == "decode" else tl.prefill_done,
                     *tl.decode_steps], tl.decode_steps, strict=False)),
                "decode_steps": len(tl.decode_steps),
            }}
    return reqs


def span_key(name: str) -> str:
    """A span's name without the host / thread id / rank parts of a thread span's."""
    if " Req " in name:
        return "<root>"
    if "(host:" in name:
        return "<thread> " + re.sub(r"\s*(\[[^]]*\]\s*)*\(host:.*$", "", name)
    return name


def spans_per_request(spans: list[dict]) -> dict:
    """Spans under each root (by parent links), by name: rid -> role -> counts."""
    by_id = {sp["span_id"]: sp for sp in spans}
    roots = {sp["span_id"]: sp for sp in spans if " Req " in sp["name"]}

    def root_of(sp):
        seen = 0
        while sp is not None and sp["span_id"] not in roots and seen < 100:
            sp = by_id.get(sp["parent_span_id"])
            seen += 1
        return sp["span_id"] if sp is not None and sp["span_id"] in roots else None

    counts: dict[str, dict[str, int]] = {rid: {} for rid in roots}
    for sp in spans:
        r = root_of(sp)
        if r is not None:
            key = span_key(sp["name"])
            counts[r][key] = counts[r].get(key, 0) + 1
    out: dict[str, dict] = {}
    for sid, root in roots.items():
        role = root["name"].split(" Req ")[0] or "unified"
        out.setdefault(root["attributes"]["rid"], {})[role] = {
            "total": sum(counts[sid].values()), "by_name": dict(sorted(counts[sid].items()))}
    return out


def _child(args) -> None:
    os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = args.protocol
    os.environ["SGLANG_TRACE_LEVEL"] = str(args.level)
    os.environ.pop("OTEL_SERVICE_NAME", None)
    result = drive(args.mode, args.endpoint)
    with open(args.result, "w") as f:
        json.dump({"truth": truth_of(result["lines"])}, f)


SETS = [("unified", 3), ("unified", 1), ("disagg", 3), ("disagg", 1)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=str(
        HERE.parent / "fixtures" / "otlp" / "engines" / "sglang-0.5.23"))
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--protocol")
    ap.add_argument("--endpoint")
    ap.add_argument("--mode")
    ap.add_argument("--level", type=int)
    ap.add_argument("--result")
    args = ap.parse_args()
    if args.child:
        _child(args)
        return

    from capture import capture, fixture_json, require_version  # the script's folder

    version = require_version("sglang", SGLANG_VERSION)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    truth = {"engine": "sglang", "version": version,
             "seed": SEED, "wall0": WALL0, "perf0": PERF0,
             "calibration_offset_us": CALIBRATION_US, "sets": {}}
    for mode, level in SETS:
        name = f"{mode}-level{level}"
        results = capture(__file__, out / name, ["--mode", mode, "--level", str(level)],
                          links_and_events=True)
        g, h = results["grpc"], results["http"]
        if g["truth"] != h["truth"]:
            raise SystemExit(f"{name}: the two protocol runs fed different truths")
        def strip(spans):  # ids and thread ids (pid) differ between the two runs
            out = []
            for sp in spans:
                sp = {k: v for k, v in sp.items()
                      if k not in ("trace_id", "span_id", "parent_span_id")}
                sp["name"] = re.sub(r"pid:\d+", "pid", sp["name"])
                sp["attributes"] = {k: v for k, v in sp["attributes"].items() if k != "pid"}
                out.append(json.dumps(sp, sort_keys=True))
            return sorted(out)

        if strip(g["spans"]) != strip(h["spans"]):
            raise SystemExit(f"{name}: grpc and http spans differ")
        counts = spans_per_request(g["spans"])
        for rid, r in g["truth"].items():
            for role, rr in r["roles"].items():
                label = role
                roots = [sp for sp in g["spans"] if " Req " in sp["name"]
                         and sp["attributes"].get("rid") == rid
                         and (sp["name"].split(" Req ")[0] or "unified") == label]
                rr["sglang_root"] = [{k: sp[k] for k in ("name", "start", "end", "kind",
                                                         "attributes", "parent_span_id")}
                                     for sp in roots]
                rr["spans"] = counts.get(rid, {}).get(label)
        truth["sets"][name] = {
            "mode": mode, "trace_level": level, "requests": g["truth"],
            "span_names": sorted({span_key(sp["name"]) for sp in g["spans"]}),
            "spans_total": len(g["spans"]),
            "exports": {"grpc": g["exports"], "http": h["exports"]}}
    (out / "truth.json").write_text(fixture_json(truth, records_inline=True))
    write_readme(out, truth)
    print(json.dumps({k: (v["spans_total"], v["exports"]) for k, v in truth["sets"].items()}))


def write_readme(out: Path, truth: dict) -> None:
    import inspect

    import sglang
    from sglang.srt.observability import req_time_stats, trace

    root = Path(sglang.__file__).parent.parent

    def w(obj) -> str:
        return (f"{Path(inspect.getsourcefile(obj)).relative_to(root)}:"
                f"{inspect.getsourcelines(obj)[1]}")

    _, conv_line = convert_to_span_attrs_fn()
    A = req_time_stats.APIServerReqTimeStats
    S = req_time_stats.SchedulerReqTimeStats
    def line_of(obj, needle: str) -> str:
        src, start = inspect.getsourcelines(obj)
        for i, line in enumerate(src):
            if needle in line:
                return f"{Path(inspect.getsourcefile(obj)).relative_to(root)}:{start + i}"
        raise RuntimeError(f"{needle!r} not in {obj}")

    conv = A.convert_to_gen_ai_span_attrs
    formulas = "\n".join(f"- {a}: `{f}` ({line_of(o, n)})" for a, f, o, n in (
        ("root span", '"{role} Req {rid[:8]}" (role "" when unified), attributes rid and '
         "module (+ bootstrap_room), started at created_time",
         trace.TraceReqContext.trace_req_start, 'name=f"{role} Req'),
        ("`gen_ai.latency.time_to_first_token`", "first_token_time - created_time", conv,
         "self.first_token_time - self.created_time"),
        ("`gen_ai.latency.e2e`", "finished_time - created_time", conv,
         "self.finished_time - self.created_time"),
        ("`gen_ai.latency.time_in_model_decode`", "finished_time - first_token_time", conv,
         "self.finished_time - self.first_token_time"),
        ("`gen_ai.latency.time_in_model_inference`",
         "finished_time - api_server_dispatch_finish_time", conv,
         "self.finished_time - self.api_server_dispatch_finish_time"),
        ("`gen_ai.latency.time_in_model_prefill`",
         "first_token_time - api_server_dispatch_finish_time (holds the scheduler's queue)",
         conv, "self.first_token_time - self.api_server_dispatch_finish_time"),
        ("root end", "finished_time (the tokenizer handling the final output)",
         trace.TraceReqContext.trace_req_finish, "self.root_span.end"),
        ("stage spans", "trace_slice(stage, start, end) on the scheduler's clock, "
         "converted with its own time.time() - perf_counter() offset",
         req_time_stats.ReqTimeStatsBase.trace_slice, "convert_time_to_realtime_ns(start"),
        ("`decode_loop`", "one per decode step, from the previous step (or the prefill's "
         "end / the prebuilt first token), attribute decode_ct", S.set_last_decode_finish_time,
         'attrs = {"decode_ct"'),
        ("no `gen_ai.usage.*` / `gen_ai.request.id` on an aborted request",
         "the abort path calls set_finished_time() without span_attrs", A.set_finished_time,
         "attrs = dict(span_attrs) if span_attrs else {}")))
    lines = []
    for name, s in sorted(truth["sets"].items()):  # as truth.json lists them
        lines.append(f"- `{name}`: {len(s['requests'])} requests, {s['spans_total']} spans, "
                     f"{s['exports']['grpc']} export request(s) per protocol")
    text = f"""# SGLang {truth['version']}: its own request traces

Generated {datetime.date.today().isoformat()} by `tests/engines/sglang_spans.py`
(`make engine-fixtures`), seed {SEED}. Regenerating gives the same `truth.json`.

## What ran (SGLang's code, unmodified; no GPU, no model)

- `process_tracing_init` ({w(trace.process_tracing_init)}) and `trace_set_thread_info`
  ({w(trace.trace_set_thread_info)}) per role, as http_server.py and scheduler.py call
  them; the exporter from `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (`grpc`, `http/protobuf`);
  trace level from `SGLANG_TRACE_LEVEL` (3, the default, and 1).
- The tokenizer manager's `APIServerReqTimeStats` ({w(A)}): `init_trace_ctx`,
  `set_created_time` (root span + `tokenize`), `set_tokenize_finish_time`,
  `set_api_server_dispatch_time` / `set_api_server_dispatch_finish_time`,
  `set_first_token_time`, `set_finished_time` ({w(A.set_finished_time)}), whose
  `convert_to_gen_ai_span_attrs` ({w(A.convert_to_gen_ai_span_attrs)}) computes the
  root's latencies; the usage/request attributes come from
  `TokenizerManager.convert_to_span_attrs` (sglang/srt/managers/tokenizer_manager.py:{conv_line},
  compiled from its source).
- The scheduler's `SchedulerReqTimeStats` ({w(S)}), built by `new_from_obj` from the
  pickled tokenizer stats, and its setters in the order the scheduler calls them:
  `set_scheduler_recv_time`, `set_wait_queue_entry_time`, `set_forward_entry_time`,
  `set_last_chunked_prefill_finish_time`, `set_prefill_finished_time`,
  `set_last_decode_finish_time`, `set_completion_time`; disaggregated prefill adds
  `set_prefill_bootstrap_queue_entry_time`, `set_bootstrap_done_time`,
  `set_prefill_transfer_queue_entry_time`, `set_prefill_kv_transfer_finish_time`;
  decode `set_decode_prealloc_queue_entry_time`, `set_decode_transfer_queue_entry_time`,
  `set_decode_prebuilt_finish_time`.

Roles run on threads of one process (one exporter); real SGLang runs the tokenizer and
each scheduler as processes, each with its own exporter and the same resource.
`time` as these modules see it is the simulated timeline: perf_counter() = {PERF0} +
t, time.time() = {WALL0} (2026-11-02T10:00:00Z) + t + a per-process calibration offset
({dict(sorted(truth['calibration_offset_us'].items()))} us).

## SGLang's formulas

{formulas}

## What the spans look like

All kind INTERNAL, scope `sglang server`, resource `service.name` = `sglang` (no
`--otlp-service-name` / `OTEL_SERVICE_NAME`) + `telemetry.sdk.*`, `service.instance.id`.
Trace ids are 64-bit (`TraceCustomIdGenerator`: the upper 8 bytes are zero) unless the
request carried a W3C `traceparent`, whose trace it joins (the root's parent is then the
client's span; in disaggregated mode both roles' roots then share that trace). Per role:
the root `"{{role}} Req {{rid[:8]}}"`; under it one thread span per process that handled the
request (`Tokenizer(host:… | pid:…)`, `Scheduler [TP 0]  [PP 0] (host:… | pid:…)`, with
`Prefill`/`Decode` prefixes when disaggregated); stage spans under their thread span
(`chunked_prefill` under `prefill_forward`), each first-level stage linked (span link) to
the previous one, across processes too. Level 1 keeps only level-1 stages (`tokenize`,
`prefill_waiting`, `prefill_forward`, the disaggregated bootstrap/transfer stages,
`decode_waiting`, `decode_forward`); level 3 adds `api_server_dispatch`,
`request_process`, `chunked_prefill`, `fake_output` and one `decode_loop` per decode step.
In unified mode there is no `decode_waiting`/`decode_forward`: their only caller,
`set_last_scheduled_time`, is not called anywhere in 0.5.23. Span counts per request and
role are in `truth.json` (`spans`).

## Files

- `<mode>-level<N>/grpc/NNN.pb`, `<mode>-level<N>/http/NNN.pb` (+ `.http.json`): the
  `ExportTraceServiceRequest` bytes as sent.
- `truth.json`: per set, per rid, per role: every instant fed (us after t = 0), the
  exact durations, SGLang's own root span (name, times, attributes) and its span count
  by name.

## Sets

{chr(10).join(lines)}

## Regenerate

    make engine-fixtures
"""
    (out / "README.md").write_text(text)


if __name__ == "__main__":
    main()
