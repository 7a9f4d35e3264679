"""The GPU's own counters beside the estimate (``GPU``), as
``phasewatch.publish.gpu_metrics`` publishes them, and the readings of the counters'
sources (``GPU_COUNTER_READS``, a self-counter): with ``--gpu-metrics-url`` (a
dcgm-exporter's page) or ``--gpu-nvml`` (NVML GPM)."""

from __future__ import annotations

from phasewatch.catalog.family import Family

GPU_NEEDS = "--gpu-metrics-url or --gpu-nvml true"


def _gpu(name: str, doc: str, *labels: str) -> Family:
    return Family(name, "gauge", doc, labels, True, needs=GPU_NEEDS)


# the counters' means over the estimate's range, for the model's GPUs (gpu_counters
# field -> family); ``gpu_source`` is dcgm (a dcgm-exporter's page) or nvml (NVML GPM)
ACTIVITY: dict[str, Family] = {
    "dram_active": _gpu("phasewatch_gpu_dram_active_ratio",
                        "Share of cycles the GPUs' device-memory interface was busy, mean "
                        "over the estimate's range (DCGM_FI_PROF_DRAM_ACTIVE, NVML GPM "
                        "DRAM_BW_UTIL): cycles, not bytes.", "gpu_source"),
    "tensor_active": _gpu("phasewatch_gpu_tensor_active_ratio",
                          "Share of cycles any tensor pipe was busy, mean over the "
                          "estimate's range (DCGM_FI_PROF_PIPE_TENSOR_ACTIVE, NVML GPM "
                          "ANY_TENSOR_UTIL).", "gpu_source"),
    "sm_active": _gpu("phasewatch_gpu_sm_active_ratio",
                      "Share of cycles an SM had a warp resident, mean over the SMs and the "
                      "estimate's range (DCGM_FI_PROF_SM_ACTIVE, NVML GPM SM_UTIL).",
                      "gpu_source"),
    "gr_engine_active": _gpu("phasewatch_gpu_engine_active_ratio",
                             "Share of time the graphics/compute engine had work, mean over "
                             "the estimate's range (DCGM_FI_PROF_GR_ENGINE_ACTIVE, NVML GPM "
                             "GRAPHICS_UTIL).", "gpu_source"),
}
GPU_ESTIMATED = _gpu("phasewatch_gpu_estimated_active_ratio",
                     "The estimate's traffic (dram) or work (tensor) over the range, as a "
                     "share of the datasheet bandwidth or dense peak x GPUs: what the "
                     "counter beside it reads at the least.", "counter")
GPU_ESTIMATE_OVER_MEASURED = _gpu("phasewatch_gpu_estimate_over_measured_ratio",
                                  "Estimated over measured activity (dram, tensor): at most "
                                  "1 when the configured model, dtype and GPU count are "
                                  "right; 1.1 or more says they are not.", "counter")
GPU_COUNTED = _gpu("phasewatch_gpu_counted_gpus",
                   "GPUs (or MIG instances) whose counters the means are over.", "gpu_source")
GPU_CHECK = _gpu("phasewatch_gpu_check_info",
                 "1 for what the GPU's counters say of the verdict: overstated (the estimate "
                 "exceeds them), idle (the GPU idle while the engine had work), confirmed, "
                 "not_confirmed, unchecked.", "outcome")
GPU = (*ACTIVITY.values(), GPU_ESTIMATED, GPU_ESTIMATE_OVER_MEASURED, GPU_COUNTED, GPU_CHECK)

# the sources' readings: a self-counter (no label set)
GPU_COUNTER_READS = Family(
    "phasewatch_gpu_counter_reads_total", "counter",
    "Readings of the GPU counters' sources (gpu_source dcgm or nvml), by result: ok, or why "
    "none came (unreachable, http_error, too_large, unparsable, no_dcgm_families, "
    "out_of_range; no_pynvml, library_not_found, driver_not_loaded, no_permission, no_gpu, "
    "gpm_not_supported, nvml_error).", ("gpu_source", "result"), needs=GPU_NEEDS)
