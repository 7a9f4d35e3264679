"""The step model fitted online and the levers' predicted effects (issue 40), as
``phasewatch.publish.lever_metrics`` publishes them (``LEVERS``)."""

from __future__ import annotations

from phasewatch.catalog.family import Family


def _lever(name: str, doc: str, *labels: str) -> Family:
    return Family(name, "gauge", doc, labels, True)


STEP_MODEL_COST = _lever(
    "phasewatch_step_model_cost_seconds",
    "Fitted engine step cost by term: base (per step), per_prefill_token, per_kv_token (per "
    "KV token read).", "term")
STEP_MODEL_ERROR = _lever(
    "phasewatch_step_model_error_ratio",
    "|fitted - measured| / measured step over the requests the step model was fitted on, "
    "by quantile.", "quantile")
STEP_MODEL_REQUESTS = _lever(
    "phasewatch_step_model_fitted_requests",
    "Decoding requests the step model was fitted on (none where the fit was rejected).")
LEVER_PREDICTION = _lever(
    "phasewatch_lever_prediction",
    "A figure now and as predicted with the verdict's lever pulled to the setting (from the "
    "step model).", "lever", "setting", "figure", "when")
LEVER_PREDICTION_REACH = _lever(
    "phasewatch_lever_prediction_reach_ratio",
    "How far a lever's prediction reaches past the range the step model was fitted on (1: "
    "inside it).", "lever", "setting")
LEVERS = (STEP_MODEL_COST, STEP_MODEL_ERROR, STEP_MODEL_REQUESTS, LEVER_PREDICTION,
          LEVER_PREDICTION_REACH)
