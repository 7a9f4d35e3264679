"""Prometheus exposition of the roofline estimates and the verdict.

Reads ``BottleneckMonitor.results()`` (computed on a timer) at every scrape.
Sample exposition::

    phasewatch_achieved_bandwidth_bytes_per_second{model="Llama-3.1-8B",engine="vllm",phase="decode"} 2.21e+12
    phasewatch_bandwidth_utilization_ratio{model="Llama-3.1-8B",engine="vllm",phase="decode"} 0.66
    phasewatch_peak_bandwidth_bytes_per_second{model="Llama-3.1-8B",engine="vllm",ceiling="datasheet"} 3.35e+12
    phasewatch_phase_time_share_ratio{model="Llama-3.1-8B",engine="vllm",phase="decode"} 0.98
    phasewatch_bottleneck_info{model="Llama-3.1-8B",engine="vllm",phase="decode",resource="memory_bandwidth",cause="compute_saturated"} 1.0
    phasewatch_engine_kv_cache_usage_ratio{model="Llama-3.1-8B",engine="vllm"} 1.0
    phasewatch_engine_requests{model="Llama-3.1-8B",engine="vllm",state="waiting"} 6.0
    phasewatch_engine_preemptions_total{model="Llama-3.1-8B",engine="vllm"} 32.0
    phasewatch_roofline_ceiling_exceeded_ratio{model="Llama-3.1-8B",engine="vllm",phase="prefill",ceiling="flops"} 1.84
    phasewatch_roofline_inputs_info{model="Llama-3.1-8B",engine="vllm",input="decode_steps",origin="token_gaps"} 1.0

Names, HELP texts and labels are the catalog's (``phasewatch.catalog``).
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from phasewatch import catalog as c
from phasewatch.aggregation.aggregate import Aggregator
from phasewatch.publish.lever_metrics import lever_families
from phasewatch.roofline.bottleneck import BottleneckMonitor


class RooflineCollector(Collector):
    def __init__(self, monitor: BottleneckMonitor, aggregator: Aggregator):
        self._monitor = monitor
        self._agg = aggregator

    def collect(self) -> Iterator[Metric]:
        results = self._monitor.results()
        labels = list(self._agg.labels.names)
        for attr, f in c.PHASE_ESTIMATES.items():
            fam = _family(f, labels)
            for r in results:
                for phase in ("prefill", "decode"):
                    p = getattr(r.estimate, phase)
                    value = getattr(p, attr) if p is not None else None
                    if value is not None:
                        fam.add_metric([*r.labels, phase], float(value))
            yield fam
        yield from self._peaks(results, labels)
        share = _family(c.PHASE_TIME_SHARE, labels)
        batch = _family(c.DECODE_BATCH_SIZE, labels)
        info = _family(c.BOTTLENECK_INFO, labels)
        confidence = _family(c.BOTTLENECK_CONFIDENCE, labels)
        inputs = _family(c.ROOFLINE_INPUTS, labels)
        for r in results:
            for phase, v in (r.estimate.phase_time_share or {}).items():
                share.add_metric([*r.labels, phase], v)
            if r.estimate.decode_batch_size is not None:
                batch.add_metric([*r.labels], r.estimate.decode_batch_size)
            if r.verdict is not None:
                cause = r.verdict.cause.name if r.verdict.cause is not None else "none"
                info.add_metric([*r.labels, r.verdict.phase, r.verdict.resource, cause], 1.0)
                confidence.add_metric([*r.labels], r.verdict.confidence)
            for key, source in r.estimate.inputs.items():
                inputs.add_metric([*r.labels, key, source.label], 1.0)
        yield from (share, batch, info, confidence, inputs)
        yield from self._engine_state(results, labels)
        yield self._no_roofline(labels)
        yield from lever_families(results, labels)

    @staticmethod
    def _peaks(results, labels: list[str]) -> Iterator[Metric]:
        bw = _family(c.PEAK_BANDWIDTH, labels)
        fl = _family(c.PEAK_FLOPS, labels)
        for r in results:
            d = r.deployment
            if d is None:
                continue
            bw.add_metric([*r.labels, "datasheet"], d.peak_bandwidth)
            bw.add_metric([*r.labels, "achievable"], d.hardware.achievable_bandwidth)
            if d.peak_flops:  # none for a compute dtype the profile did not measure
                fl.add_metric([*r.labels, "datasheet"], d.peak_flops)
                fl.add_metric([*r.labels, "achievable"],
                              d.hardware.achievable_flops(d.compute_dtype))
        yield from (bw, fl)

    @staticmethod
    def _engine_state(results, labels: list[str]) -> Iterator[Metric]:
        """The engine's own state from its newest scrape (--engine-metrics-url), under
        phasewatch's labels and one name for every engine; and the ceilings an achieved
        rate went over."""
        kv = _family(c.ENGINE_KV_CACHE_USAGE, labels)
        requests = _family(c.ENGINE_REQUESTS, labels)
        preempt = _family(c.ENGINE_PREEMPTIONS, labels)
        capacity = _family(c.ENGINE_KV_CACHE_CAPACITY, labels)
        exceeded = _family(c.CEILING_EXCEEDED, labels)
        for r in results:
            # the tap's own label set (engine="tap": requests no engine span joined) is no
            # engine: the engine's figures go under the engine's label sets only
            s = r.engine_sample if r.engine != "tap" else None
            if s is not None:
                if s.kv_usage is not None:
                    kv.add_metric(list(r.labels), s.kv_usage)
                for state, v in (("running", s.running), ("waiting", s.waiting)):
                    if v is not None:
                        requests.add_metric([*r.labels, state], v)
                if s.preemptions is not None:
                    preempt.add_metric(list(r.labels), s.preemptions)
                if s.kv_capacity_tokens is not None:
                    capacity.add_metric(list(r.labels), s.kv_capacity_tokens)
            for phase in ("prefill", "decode"):
                p = getattr(r.estimate, phase)
                for what, ratio in (p.ceiling_exceeded.items() if p is not None else ()):
                    exceeded.add_metric([*r.labels, phase, what], ratio)
        yield from (kv, requests, preempt, capacity, exceeded)

    def _no_roofline(self, labels: list[str]) -> Metric:
        fam = _family(c.NO_ROOFLINE_REQUESTS, labels)
        snap = self._agg.snapshot()
        requests = snap.counters["requests"].sum(axis=1)
        for i, key in enumerate(snap.label_sets[:len(requests)]):
            if self._monitor.deployments.for_model(key[0]) is None and requests[i]:
                fam.add_metric(list(key), float(requests[i]))
        return fam


def _family(f: c.Family, labels: list[str]) -> Metric:
    """An empty family of ``f`` with the label set's ``labels`` first."""
    kind = CounterMetricFamily if f.type == "counter" else GaugeMetricFamily
    return kind(f.family, f.help, labels=f.label_names(tuple(labels)))
