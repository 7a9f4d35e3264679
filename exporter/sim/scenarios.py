"""Named simulator scenarios: each a model x hardware x engine configuration x workload.

Each states which phase it is built to stress; tests check the simulator agrees. Each
comes with the latency objectives (``slo``, as ``--slo`` takes them) its kind of service
would be held to, which ``phasewatch demo`` gives its exporter (and changes on a scenario
switch) unless ``--slo`` is given: interactive chat's TTFT 500 ms and TPOT 50 ms, which
``chat``, ``long_generation`` and ``tiny_batch`` meet while ``overload`` misses TTFT in
the queue and ``api_bound`` in preprocess; RAG over long retrieved contexts allows a
TTFT of 2 s and a TPOT of 150 ms (its short answers share steps with 24k-token prefills),
which ``rag`` meets.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from phasewatch.requests.objectives import Objectives, parse_objectives
from phasewatch.roofline import catalog
from phasewatch.sim.engine import EngineConfig, SimEngine
from phasewatch.sim.workload import Lengths, Workload

CHAT_SLO = "ttft:500,tpot:50"  # interactive chat's objectives (module docstring)


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    workload: Workload
    engine: EngineConfig = field(default_factory=EngineConfig)
    model: str = "Llama-3.1-8B"
    hardware: str = "H100-SXM"
    gpus: int = 1
    slo: str = CHAT_SLO  # latency objectives, as --slo takes them

    @property
    def objectives(self) -> Objectives:
        return parse_objectives(self.slo)

    def build(self, seed: int = 0, model: str | None = None, hardware: str | None = None,
              gpus: int | None = None, rate_scale: float = 1.0, name: str = "sim"
              ) -> SimEngine:
        """An engine for this scenario; model/hardware/gpus override the defaults. ``name``
        prefixes request ids; its part before any "-" is the engine label."""
        wl = self.workload
        if rate_scale != 1.0:
            wl = (replace(wl, rate=wl.rate * rate_scale) if wl.rate else
                  replace(wl, concurrency=max(1, round(wl.concurrency * rate_scale))))
        return SimEngine(catalog.model(model or self.model),
                         catalog.hardware(hardware or self.hardware, gpus or self.gpus),
                         self.engine, wl, seed=seed, name=name)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("chat", "Interactive chat: ~1k-token prompts with 30% prefix-cache hits, ~250 "
             "output tokens, Poisson arrivals at a comfortable load. Mostly decode time.",
             Workload(Lengths(1000, 0.8, 16, 16384), Lengths(250, 0.6, 2, 2048), rate=6.0,
                      prefix_hit_probability=0.3)),
    # One pipeline sending them back to back keeps the engine busy prefilling (~1.3
    # requests/s, ~40 in a 30 s window: enough to judge the objectives). Poisson arrivals
    # at 0.25 req/s left it idle 87 % of the time ("nothing to fix", objectives never
    # judged); at 0.8 req/s decode, waiting behind 8192-token prefill chunks, rivals
    # prefill (47 % and 41 % of request time) and the verdict would flip between them.
    Scenario("rag", "Long-prompt RAG: ~24k-token retrieved contexts, short answers, one "
             "pipeline sending them back to back. Most request time is prefill "
             "(compute-bound), and the engine is busy.",
             Workload(Lengths(24000, 0.2, 8000, 65536), Lengths(12, 0.3, 4, 64),
                      concurrency=1),
             slo="ttft:2000,tpot:150"),
    Scenario("long_generation", "Long generation: short prompts, ~2k output tokens, 32 users "
             "in a closed loop. Decode (memory-bandwidth-bound) dominates.",
             Workload(Lengths(200, 0.5, 16, 2048), Lengths(2000, 0.3, 256, 8192),
                      concurrency=32)),
    Scenario("overload", "Overload: arrivals well above capacity with at most 64 running "
             "sequences; requests pile up and queue time dominates.",
             Workload(Lengths(1500, 0.5, 64, 8192), Lengths(300, 0.5, 8, 2048), rate=40.0),
             EngineConfig(max_num_seqs=64)),
    Scenario("tiny_batch", "Tiny batches: two users, short prompts and answers, eager mode "
             "(no CUDA graphs, ~8 ms of launch overhead per step). Far below both ceilings.",
             Workload(Lengths(64, 0.3, 8, 512), Lengths(32, 0.3, 2, 128), concurrency=2),
             EngineConfig(step_overhead=0.008)),
    Scenario("api_bound", "CPU-bound API server: heavy chat templates and multimodal inputs "
             "take 0.5 s to preprocess before the engine's queue, at a light load with short "
             "answers. The engine is idle; preprocess dominates TTFT and request time.",
             Workload(Lengths(800, 0.5, 16, 4096), Lengths(40, 0.3, 4, 128), rate=4.0),
             EngineConfig(preprocess=0.5)),
)}


def scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; choose one of "
                         f"{', '.join(SCENARIOS)}") from None
