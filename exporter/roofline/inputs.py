"""Where each of the roofline estimate's inputs came from.

``RooflineEstimate.inputs`` maps an input (``decode_steps``, ``flops``, ``phases``, ...)
to its ``InputSource``: a bounded ``label``, the ``origin`` label of
``phasewatch_roofline_inputs_info``, and where there is more to say the ``detail`` in
prose. The JSON API shows a source as one string, ``"label: detail"`` (``str()``,
in ``RooflineEstimate.as_dict``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InputSource:
    """One input's origin: ``label`` for the metric, ``detail`` for a person."""

    label: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.label}: {self.detail}" if self.detail else self.label


def unavailable(why: str) -> InputSource:
    """An input the estimate could not make, and why."""
    return InputSource("unavailable", why)


Inputs = dict[str, InputSource]  # an estimate's inputs, by name
ENGINE_COUNTERS = InputSource("engine_counters")
# inputs["phases"] where the window holds the client's view alone (a tap's records)
CLIENT_VIEW = InputSource("client_view", "time to first token (preprocess, queue and "
                          "prefill undivided) and decode, from a stream tap's records; "
                          "no engine spans")
CLIENT_PREFILL = InputSource("arrival_to_first_token", "the client's view has no "
                             "scheduling time, so the prefill interval holds the queue and "
                             "the front end too; its MFU is a lower bound")
ENGINE_PREFILL = InputSource("engine_mean_prefill", "the client's view has no scheduling "
                             "time: each request's prefill is the engine's own mean prefill "
                             "time (its /metrics) before its first token")
CLIENT_CACHED = InputSource("unknown", "the server did not say how many prompt tokens its "
                            "prefix cache served; every prompt token counted as computed")
FLAT_COUNTER = InputSource("inferred", "the engine's estimated_*_per_gpu_total counter did "
                           "not move while requests finished (vLLM exposes it at 0 unless "
                           "started with --enable-mfu-metrics)")
