"""The JSON API under ``/api/v1/``: each handler takes the query string and answers a dict.

* ``summary``: the rolling window per label set (``RollingWindow.summarize``'s figures);
* ``bench``: the same window laid out as ``vllm bench serve`` prints a run;
* ``requests``: the newest requests with their phases;
* ``roofline``: each label set's deployment, estimate, verdict and trail
  (``roofline_json``);
* ``history``: the summary's figures sampled at every roofline update;
* ``status``: ports, label sets, pending joins and the ingest counters.

``http_server`` serves them; ``phasewatch.app`` builds a ``JsonApi`` over its parts.
"""

from __future__ import annotations

from collections.abc import Callable

from phasewatch.publish import benchtext
from phasewatch.roofline.verdict_text import achievable_source
from phasewatch.transport.http_server import MAX_RECENT, ApiError, query_number


def roofline_json(r, names: tuple[str, ...] = ("model", "engine", "pod")) -> dict:
    """One ``bottleneck.Result`` for the JSON API: deployment, estimate, verdict, trail."""
    d = r.deployment
    deployment = None if d is None else {
        "served_name": d.served_name, "model": d.model.name, "model_source": d.model_source,
        "hardware": d.hardware.name, "hardware_source": d.hardware_source,
        "gpus": d.hardware.gpus, "tensor_parallel": d.tensor_parallel,
        "weight_dtype": d.model.weight_dtype, "kv_dtype": d.model.kv_dtype,
        "compute_dtype": d.compute_dtype,
        # the peaks are the datasheet's, or, for a part the catalog lacks, calibrate's
        "peak_source": "datasheet" if d.hardware.datasheet else "calibrated",
        "peak_bandwidth_bytes_per_second": d.peak_bandwidth,
        "peak_flops_per_second": d.peak_flops,
        "achievable_bandwidth_bytes_per_second": d.hardware.achievable_bandwidth,
        "achievable_flops_per_second": d.hardware.achievable_flops(d.compute_dtype),
        "achievable_source": achievable_source(d),
        "ridge_flops_per_byte": d.ridge}
    v = r.verdict
    c = v.cause if v is not None else None
    verdict = None if v is None else {
        "phase": v.phase, "resource": v.resource, "confidence": v.confidence,
        "confidence_level": v.confidence_level, "headline": v.headline, "text": v.text,
        "levers": list(v.levers), "evidence": v.evidence.as_dict(),
        # engine: from the engine's spans (or the tap's joined to them); client: from a
        # stream tap's records alone (phases ttft and decode)
        "view": v.view,
        # why: from the engine's own state (engine_metrics) or the records alone
        "cause": None if c is None else c.name,
        "cause_detail": None if c is None else {
            "name": c.name, "text": c.text, "source": c.source, "evidence": c.evidence}}
    more = dict(zip(names[2:], r.labels[2:], strict=False))  # pod, source where labelled
    return {"model": r.model, "engine": r.engine, **more, "configured": d is not None,
            "deployment": deployment, "estimate": r.estimate.as_dict(), "verdict": verdict,
            "engine_state": r.engine_state, "trail": r.trail,
            # the GPU's own counters over the range beside the estimate (where read)
            **({"gpu": r.gpu.summary()} if r.gpu is not None else {}),
            # the step model fitted over the range and the levers' predicted effects
            **(r.outlook.as_dict() if r.outlook is not None else {})}


def bench_json(summary) -> dict:
    """A ``WindowSummary`` as ``vllm bench serve`` prints a run, per label set."""
    out = []
    for s in summary.series:
        figures = {"requests": s.requests, "duration_s": s.covered_seconds,
                   "prompt_tokens": s.prompt_tokens, "output_tokens": s.output_tokens,
                   **{k: q.as_dict() for k, q in (("ttft", s.ttft), ("tpot", s.tpot),
                                                  ("itl", s.itl), ("e2e", s.e2e))}}
        if s.slo is not None:  # vLLM prints goodput only with --goodput
            figures["good_requests"] = s.slo.good_requests
        who = "/".join(v for v in (s.model, s.engine, s.more.get("pod"), s.more.get("source"))
                       if v)
        out.append({"model": s.model, "engine": s.engine,
                    **{k: s.more[k] for k in ("pod", "source") if k in s.more},
                    "figures": figures,
                    "text": benchtext.render(
                        f"phasewatch {who}, last {s.covered_seconds:.0f} s", figures)})
    return {"window_seconds": summary.window_seconds, "models": out}


class JsonApi:
    """The handlers over an exporter's parts: its ``aggregator`` (window and label
    sets), ``model_names``, ``monitor``, ``history`` and ``config``; ``status`` gives the
    fields of /api/v1/status that only the running exporter knows (ports, pending joins,
    counters)."""

    def __init__(self, aggregator, model_names, monitor, history, config,
                 status: Callable[[], dict], clock):
        self._agg, self._names, self._monitor = aggregator, model_names, monitor
        self._history, self._config, self._status, self._clock = history, config, status, clock

    def routes(self) -> dict[str, Callable[[dict], dict]]:
        return {"/api/v1/summary": self.summary, "/api/v1/requests": self.requests,
                "/api/v1/status": self.status, "/api/v1/roofline": self.roofline,
                "/api/v1/history": self.history, "/api/v1/bench": self.bench}

    def _window(self, qs: dict):
        window = self._agg.window
        seconds = query_number(qs, "window", window.seconds, 1, window.seconds)
        labels = self._agg.labels
        return window.summarize(labels.pairs(), seconds, labels.names)

    def summary(self, qs: dict) -> dict:
        return self._window(qs).as_dict()

    def bench(self, qs: dict) -> dict:
        """The window as ``vllm bench serve`` prints a run, per (model, engine)."""
        return bench_json(self._window(qs))

    def requests(self, qs: dict) -> dict:
        limit = int(query_number(qs, "limit", 200, 1, MAX_RECENT))
        model = self._model_query(qs)
        labels = self._agg.labels
        rows = self._agg.window.recent(labels.pairs(), limit, model, labels.names)
        return {"requests": rows}

    def _model_query(self, qs: dict) -> str | None:
        """``?model=``: any name of a configured model (its alias, its Hugging Face id)
        asks for that model's label, as a request carrying the name is labelled."""
        model = qs.get("model", [None])[0]
        return None if model is None else self._names(model)

    def roofline(self, qs: dict) -> dict:
        model = self._model_query(qs)
        out = []
        for r in self._monitor.results():
            if model is not None and r.model != model:
                continue
            out.append(roofline_json(r, self._agg.labels.names))
        m = self._monitor
        return {"window_seconds": m.window_seconds, "updated_at": m.updated_at,
                "models": out}

    def history(self, qs: dict) -> dict:
        # asking for more than is kept is fine: the answer holds what there is
        span = self._config.roofline_interval * self._config.history_points
        seconds = query_number(qs, "seconds", span, 1, 7 * 86400)
        now = self._clock()
        return {"interval_seconds": self._config.roofline_interval,
                "series": self._history.series(now - seconds)}

    def status(self, qs: dict) -> dict:
        if qs:
            raise ApiError("/api/v1/status takes no parameters")
        return self._status()
