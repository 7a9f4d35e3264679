"""Prometheus exposition of the step model and the levers' predicted effects (issue 40),
from each roofline result's ``outlook`` (``lever_effects.Outlook``)::

    phasewatch_step_model_cost_seconds{model="Llama-3.1-8B",engine="vllm",term="base"} 0.0068
    phasewatch_step_model_error_ratio{model="Llama-3.1-8B",engine="vllm",quantile="0.5"} 0.006
    phasewatch_step_model_fitted_requests{model="Llama-3.1-8B",engine="vllm"} 164
    phasewatch_lever_prediction{model="Llama-3.1-8B",engine="vllm",lever="concurrency_limit",setting="--max-num-seqs 96",figure="tpot_seconds",when="predicted"} 0.022
    phasewatch_lever_prediction_reach_ratio{model="Llama-3.1-8B",engine="vllm",lever="concurrency_limit",setting="--max-num-seqs 96"} 1.4

Names, HELP texts and labels are the catalog's.
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from phasewatch import catalog as c

TERMS = ("base", "per_prefill_token", "per_kv_token")


def lever_families(results, labels: list[str]) -> Iterator[Metric]:
    """The families of every result's outlook (the roofline collector yields them)."""
    cost, error, fitted, prediction, reach = (
        GaugeMetricFamily(f.family, f.help, labels=f.label_names(tuple(labels)))
        for f in c.LEVERS)
    for r in results:
        out = r.outlook
        if out is None:
            continue
        key = list(r.labels)
        fit = out.fit
        if fit is not None and not fit.rejected:
            for term in TERMS:
                cost.add_metric([*key, term], getattr(fit, term))
            error.add_metric([*key, "0.5"], fit.error_median)
            error.add_metric([*key, "0.9"], fit.error_p90)
            fitted.add_metric(key, float(fit.requests))
        for p in out.predictions:
            for when, figures in (("now", p.now), ("predicted", p.predicted)):
                for figure, value in figures.items():
                    prediction.add_metric([*key, p.lever, p.setting, figure, when],
                                          float(value))
            reach.add_metric([*key, p.lever, p.setting], p.reach)
    yield from (cost, error, fitted, prediction, reach)
