"""What the adapters consult besides the span: ``AdapterContext`` (how to name a span's
model, the trace parts and sampling state the receiver shares with them) and
``ParallelSamples`` (a parallel-sampling request's sequences told apart from separate
requests)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from phasewatch.requests.sampling import TraceSampling


class ParallelSamples:
    """The request spans seen lately, to tell the sequences of one parallel-sampling
    request apart from separate requests. Bounded.

    vLLM answers a request with ``n`` > 1 with n ``llm_request`` spans, one per sequence,
    each in a trace of its own, all with the request's ``gen_ai.request.id``, its
    arrival as start time and the whole prompt's token count, and (vLLM 0.32, measured)
    ``gen_ai.request.n`` = 1 on each: only that shared (id, arrival, prompt) marks them.
    They may arrive in different exports. The first sequence seen carries the prompt;
    the others are marked ``prompt_shared``. The newest ``capacity`` keys are kept: a
    sequence arriving after that many other requests counts its prompt again.
    """

    def __init__(self, capacity: int = 65536):
        self._capacity = capacity
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._lock = threading.Lock()

    def shared(self, keys: list[tuple]) -> list[bool]:
        """For each (request id, arrival ns, prompt tokens): was it seen before?"""
        out = []
        with self._lock:
            seen = self._seen
            for key in keys:
                if key in seen:
                    seen.move_to_end(key)
                    out.append(True)
                else:
                    seen[key] = None
                    out.append(False)
            while len(seen) > self._capacity:
                seen.popitem(last=False)
        return out


@dataclass
class AdapterContext:
    """Configuration the adapters consult: how to name the model of a span.

    The model is, in order: the span's own ``gen_ai.response.model`` /
    ``gen_ai.request.model``; the resource's ``service.name`` looked up in
    ``service_models`` (``--otlp-model-map svc=model,...``); ``default_model``
    (``--default-model``, else the one configured roofline model); the resource's
    ``service.name`` unless it is the SDK's ``unknown_service`` placeholder; else
    ``unknown``. vLLM V1 sets no model attribute, so one of the later rules names it.
    """

    default_model: str = ""
    service_models: dict[str, str] = field(default_factory=dict)
    trace_parts: object = None  # adapters.traces.TraceParts, set by the receiver
    # fill the pod column (``span_columns``): the receiver's sink has a pod label
    pods: bool = False
    samples: ParallelSamples = field(default_factory=ParallelSamples)
    # each request's weight from its trace's sampling (``span_columns``)
    sampling: TraceSampling = field(default_factory=TraceSampling)

    def model_for(self, span, attribute_model: str = "") -> str:
        if attribute_model:
            return attribute_model
        service = span.resource.get("service.name")
        service = service if isinstance(service, str) else ""
        if service in self.service_models:
            return self.service_models[service]
        if self.default_model:
            return self.default_model
        if service and not service.startswith("unknown_service"):
            return service
        return "unknown"
