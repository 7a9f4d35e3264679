"""Prometheus exposition of the GPU's own counters beside the estimate (issue 39).

Reads each roofline result's ``gpu`` (a ``gpu_check.GpuCheck``: the counters over the
estimate's range for the model's GPUs, the estimate's shares beside them, what they say of
the verdict) and the sources' reading counts, at every scrape::

    phasewatch_gpu_dram_active_ratio{model="Llama-3.1-8B",engine="vllm",gpu_source="dcgm"} 0.042
    phasewatch_gpu_tensor_active_ratio{model="Llama-3.1-8B",engine="vllm",gpu_source="dcgm"} 0.003
    phasewatch_gpu_estimated_active_ratio{model="Llama-3.1-8B",engine="vllm",counter="dram"} 0.030
    phasewatch_gpu_estimate_over_measured_ratio{model="Llama-3.1-8B",engine="vllm",counter="dram"} 0.71
    phasewatch_gpu_counted_gpus{model="Llama-3.1-8B",engine="vllm",gpu_source="dcgm"} 1
    phasewatch_gpu_check_info{model="Llama-3.1-8B",engine="vllm",outcome="idle"} 1
    phasewatch_gpu_counter_reads_total{gpu_source="dcgm",result="ok"} 120

Names, HELP texts and labels are the catalog's.
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from phasewatch import catalog as c
from phasewatch.roofline.gpu_watch import GpuWatch


class GpuCollector(Collector):
    """``results``: the roofline's results now (each with ``labels`` and ``gpu``);
    ``names``: the label set's names."""

    def __init__(self, watch: GpuWatch, results: Callable[[], list],
                 names: Callable[[], tuple[str, ...]]):
        self._watch, self._results, self._names = watch, results, names

    def collect(self) -> Iterator[Metric]:
        labels = list(self._names())
        activity = {field: _gauge(f, labels) for field, f in c.ACTIVITY.items()}
        estimated = _gauge(c.GPU_ESTIMATED, labels)
        over = _gauge(c.GPU_ESTIMATE_OVER_MEASURED, labels)
        counted = _gauge(c.GPU_COUNTED, labels)
        check = _gauge(c.GPU_CHECK, labels)
        for r in self._results():
            found = r.gpu
            if found is None:
                continue
            cmp, key = found.comparison, list(r.labels)
            source = cmp.counters.source
            for field, fam in activity.items():
                value = getattr(cmp.counters.mean, field)
                if value is not None:
                    fam.add_metric([*key, source], value)
            for counter, est, ratio in (("dram", cmp.dram_estimated, cmp.dram_ratio),
                                        ("tensor", cmp.tensor_estimated, cmp.tensor_ratio)):
                if est is not None:
                    estimated.add_metric([*key, counter], est)
                if ratio is not None:
                    over.add_metric([*key, counter], ratio)
            counted.add_metric([*key, source], float(len(cmp.counters.gpus)))
            check.add_metric([*key, found.outcome], 1.0)
        yield from (*activity.values(), estimated, over, counted, check)
        reads = CounterMetricFamily(c.GPU_COUNTER_READS.family, c.GPU_COUNTER_READS.help,
                                    labels=list(c.GPU_COUNTER_READS.labels))
        for source, result, n in self._watch.reads():
            reads.add_metric([source, result], float(n))
        yield reads


def _gauge(f: c.Family, labels: list[str]) -> Metric:
    return GaugeMetricFamily(f.family, f.help, labels=f.label_names(tuple(labels)))
