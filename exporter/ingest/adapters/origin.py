"""What a request row takes from its span itself, not from the span's attributes.

The traceparent the request came with (a stream tap's, so the trace join can pair the
tap's record with it), whether it came through a tap (the tap's tracestate member),
the pod that sent it (a central exporter's ``pod`` label) and the requests it stands for
when its trace was sampled (the tracestate's ``ot=th``, else ``--trace-sample-ratio``:
``requests.sampling``). Every adapter's batch gets these columns as it is built
(``span_columns``).
"""

from __future__ import annotations

import numpy as np

from phasewatch.requests.record import TAP_TRACESTATE_KEY, BatchBuilder
from phasewatch.requests.sampling import TraceSampling

POD_ATTRIBUTES = ("k8s.pod.name", "service.instance.id")


def pod_of(resource: dict) -> str:
    """The pod a span came from: the first of ``POD_ATTRIBUTES`` its resource has."""
    found = (resource.get(key) for key in POD_ATTRIBUTES)
    return next((v for v in found if isinstance(v, str) and v), "")


def parent_key(span) -> str:
    """``record.RequestRecord.trace_parent`` of a request span: its trace and parent span
    ("" for a root span, which no tap's traceparent preceded)."""
    parent = span.parent_span_id
    if len(parent) != 8 or not any(parent):
        return ""
    return f"{span.trace_id.hex()}-{parent.hex()}"


def tapped(span) -> bool:
    """The span's tracestate has the stream tap's member (``record.TAP_TRACESTATE_KEY``): it
    inherited it from the traceparent the tap sent, so the tap's record is coming."""
    state = span.trace_state
    return bool(state) and any(m.split("=", 1)[0].strip() == TAP_TRACESTATE_KEY
                               for m in state.split(","))


def span_columns(builder: BatchBuilder, spans: list, pods: bool,
                 sampling: TraceSampling | None = None, adapter=None) -> BatchBuilder:
    """``builder`` with the columns rows take from their spans (``spans[i]`` is row
    ``i``'s): trace_parent, tapped, with ``pods`` (the sink has a pod label) pod, and with
    ``sampling`` the weight (absent: 1, as when no span says it was sampled). An
    ``adapter`` whose ``CAPABILITIES.source`` is its own (the tap's spans) gives its rows
    that side and its own ``join_key``, and they are not engine rows that came through a
    tap."""
    source = None if adapter is None else adapter.CAPABILITIES.source
    keys = [(adapter.join_key if source is not None else parent_key)(s) for s in spans]
    builder.text(trace_parent=keys)  # the string table grows only when a span has a parent
    if source is not None:
        builder.columns(source=np.full(len(spans), source, dtype=np.int8))
    elif any(keys):
        builder.columns(tapped=[bool(k) and tapped(s)
                                for k, s in zip(keys, spans, strict=True)])
    if pods:
        builder.text(pod=[pod_of(s.resource) for s in spans])
    weights = None if sampling is None else sampling.weights(
        [s.trace_state for s in spans], configured=source is None)
    if weights is not None:
        builder.columns(weight=weights)
    return builder
