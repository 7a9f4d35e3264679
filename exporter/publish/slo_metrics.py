"""Prometheus exposition of the latency objectives: requests met, missed or unknown per
objective, good requests, misses by phase, and the objectives themselves.

Reads ``Aggregator.slo`` (``phasewatch.aggregation.slo``) at every scrape; nothing at
all without objectives (``--slo``), so the page is unchanged then. Sample exposition::

    phasewatch_slo_requests_total{model="Llama-3.1-8B",engine="vllm",objective="ttft",outcome="missed"} 12.0
    phasewatch_slo_good_requests_total{model="Llama-3.1-8B",engine="vllm"} 388.0
    phasewatch_slo_missed_requests_total{model="Llama-3.1-8B",engine="vllm",objective="ttft",phase="queue"} 9.0
    phasewatch_slo_objective_seconds{model="Llama-3.1-8B",engine="vllm",objective="ttft",prompt_class=""} 0.5
    phasewatch_slo_objective_seconds{model="Llama-3.1-8B",engine="vllm",objective="ttft",prompt_class="4k-16k"} 3.0

The objective's plain value has an empty ``prompt_class`` (Prometheus reads it as no
label); a prompt-length class's override (``--slo ttft@4k-16k:3000``) its class.
Names, HELP texts and labels are the catalog's (``phasewatch.catalog``).
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from phasewatch import catalog as c
from phasewatch.aggregation.aggregate import Aggregator
from phasewatch.requests.objectives import (
    E2E_PHASES,
    MISS_PHASES,
    OBJECTIVES,
    OUTCOMES,
    TTFT_PHASES,
)

# the phases a miss of each objective can be put down to
MISS_PHASES_OF = {"ttft": (*TTFT_PHASES, "unknown"), "tpot": ("decode",),
                  "itl": ("decode",), "e2el": (*E2E_PHASES, "unknown")}


def _family(f: c.Family, labels: list[str]) -> Metric:
    names = f.label_names(tuple(labels))
    if f.type == "counter":
        return CounterMetricFamily(f.family, f.help, labels=names)
    return GaugeMetricFamily(f.name, f.help, labels=names)


class SloCollector(Collector):
    def __init__(self, aggregator: Aggregator):
        self._agg = aggregator

    def collect(self) -> Iterator[Metric]:
        if self._agg.slo is None:
            return
        snap = self._agg.slo.snapshot()
        pairs = self._agg.labels.pairs()
        labels = list(self._agg.labels.names)
        requests = _family(c.SLO_REQUESTS, labels)
        good = _family(c.SLO_GOOD_REQUESTS, labels)
        missed = _family(c.SLO_MISSED_REQUESTS, labels)
        objective = _family(c.SLO_OBJECTIVE, labels)
        for i in snap.rows():
            key = list(pairs[i])
            good.add_metric(key, float(snap.good[i]))
            objectives = snap.objectives(i)
            judged = objectives.judged()
            for k, name in enumerate(OBJECTIVES):
                if name not in judged:
                    continue
                seconds = getattr(objectives, name)
                if seconds is not None:
                    objective.add_metric([*key, name, ""], seconds)
                for cls, over in objectives.overrides(name).items():
                    objective.add_metric([*key, name, cls], over)
                for o, outcome in enumerate(OUTCOMES):
                    requests.add_metric([*key, name, outcome], float(snap.outcomes[i, k, o]))
                for phase in MISS_PHASES_OF[name]:
                    missed.add_metric([*key, name, phase],
                                      float(snap.missed[i, k, MISS_PHASES.index(phase)]))
        yield from (requests, good, missed, objective)
