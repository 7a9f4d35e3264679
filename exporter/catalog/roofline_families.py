"""The roofline's and the verdict's families (``ROOFLINE``, ``PHASE_ESTIMATES``), and the
engine's own state beside them (``ENGINE_STATE``), as ``phasewatch.publish.roofline_metrics``
publishes them."""

from __future__ import annotations

from phasewatch.catalog.family import Family


# ---- the roofline and the verdict (phasewatch.publish.roofline_metrics) -----------------
def _roof(name: str, doc: str, *labels: str, kind: str = "gauge", needs: str = "") -> Family:
    return Family(name, kind, doc, labels, True, needs=needs)


ACHIEVED_BANDWIDTH = _roof("phasewatch_achieved_bandwidth_bytes_per_second",
                           "Bytes/s the phase moved over its busy time in the rolling window.",
                           "phase")
ACHIEVED_FLOPS = _roof("phasewatch_achieved_flops_per_second",
                       "FLOP/s the phase performed over its busy time in the rolling window.",
                       "phase")
BANDWIDTH_UTILIZATION = _roof("phasewatch_bandwidth_utilization_ratio",
                              "MBU: achieved bytes/s over the datasheet peak bandwidth x GPUs.",
                              "phase")
FLOPS_UTILIZATION = _roof("phasewatch_flops_utilization_ratio",
                          "MFU: achieved FLOP/s over the datasheet dense peak x GPUs.", "phase")
ARITHMETIC_INTENSITY = _roof("phasewatch_arithmetic_intensity_flops_per_byte",
                             "The phase's operating point on the roofline: FLOPs per byte "
                             "moved.", "phase")
PEAK_BANDWIDTH = _roof("phasewatch_peak_bandwidth_bytes_per_second",
                       "Memory bandwidth ceiling of the hardware x GPUs, datasheet or "
                       "achievable.", "ceiling")
PEAK_FLOPS = _roof("phasewatch_peak_flops_per_second",
                   "Dense FLOP/s ceiling of the hardware x GPUs at the compute dtype, "
                   "datasheet or achievable.", "ceiling")
PHASE_TIME_SHARE = _roof("phasewatch_phase_time_share_ratio",
                         "Share of request time spent in each phase (preprocess, queue, "
                         "prefill, kv_transfer, decode) over the rolling window.", "phase")
DECODE_BATCH_SIZE = _roof("phasewatch_decode_batch_size",
                          "Estimated mean number of sequences decoding together while decode "
                          "runs.")
BOTTLENECK_INFO = _roof("phasewatch_bottleneck_info",
                        "1 for the current verdict: its phase, the resource that limits it "
                        "and the cause.", "phase", "resource", "cause")
BOTTLENECK_CONFIDENCE = _roof("phasewatch_bottleneck_confidence_ratio",
                              "Confidence of the verdict, 0..1.")
ROOFLINE_INPUTS = _roof("phasewatch_roofline_inputs_info",
                        "1 per input of the estimate, by where it came from.", "input", "origin")
ENGINE_KV_CACHE_USAGE = _roof("phasewatch_engine_kv_cache_usage_ratio",
                              "KV-cache usage the engine reports, 0..1 (vLLM "
                              "kv_cache_usage_perc, SGLang token_usage).")
ENGINE_REQUESTS = _roof("phasewatch_engine_requests",
                        "Requests the engine reports running or waiting.", "state")
ENGINE_PREEMPTIONS = _roof("phasewatch_engine_preemptions_total",
                           "Preemptions the engine has counted since it started (vLLM "
                           "num_preemptions, SGLang retracted requests).", kind="counter")
ENGINE_KV_CACHE_CAPACITY = _roof("phasewatch_engine_kv_cache_capacity_tokens",
                                 "Tokens the engine's KV cache holds (vLLM blocks x block "
                                 "size, SGLang max_total_num_tokens).")
CEILING_EXCEEDED = _roof("phasewatch_roofline_ceiling_exceeded_ratio",
                         "Achieved over the configured ceiling, only where above 1 (the "
                         "ceiling is then wrong).", "phase", "ceiling")
NO_ROOFLINE_REQUESTS = _roof("phasewatch_no_roofline_requests_total",
                             "Accepted requests of models with no roofline configured: latency "
                             "metrics only.", kind="counter")
# the gauges of each phase's estimate, by the PhaseEstimate attribute they show
PHASE_ESTIMATES: dict[str, Family] = {
    "achieved_bytes_per_second": ACHIEVED_BANDWIDTH,
    "achieved_flops_per_second": ACHIEVED_FLOPS,
    "bandwidth_utilization": BANDWIDTH_UTILIZATION,
    "flops_utilization": FLOPS_UTILIZATION,
    "arithmetic_intensity": ARITHMETIC_INTENSITY}
ROOFLINE = (*PHASE_ESTIMATES.values(), PEAK_BANDWIDTH, PEAK_FLOPS, PHASE_TIME_SHARE,
            DECODE_BATCH_SIZE, BOTTLENECK_INFO, BOTTLENECK_CONFIDENCE, ROOFLINE_INPUTS)
ENGINE_STATE = (ENGINE_KV_CACHE_USAGE, ENGINE_REQUESTS, ENGINE_PREEMPTIONS,
                ENGINE_KV_CACHE_CAPACITY, CEILING_EXCEEDED)
