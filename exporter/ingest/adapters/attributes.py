"""Typed reads of span attributes: a latency in seconds, a token count, a text, a finish
reason. A value of the wrong type or out of range raises ``Rejected`` with the reason
the receiver counts (``bad_attribute_type``, ``bad_attribute_value``,
``negative_duration``, ``negative_token_count``); an absent one is None (or "")."""

from __future__ import annotations

import math

from phasewatch.ingest.adapters.contract import Rejected

NS = 1_000_000_000
MAX_COUNT = 2**53  # token counts exact in float64 (the vectorised path) and int64
MAX_LATENCY_S = 1e8  # ~3 years: longer is not a latency (and could overflow int64 ns)


def seconds(attrs: dict, key: str) -> float | None:
    """A latency attribute in seconds: a finite, non-negative number, or absent."""
    v = attrs.get(key)
    if type(v) is float and 0.0 <= v <= MAX_LATENCY_S:  # the usual case, checked first
        return v
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise Rejected("bad_attribute_type", f"{key} must be a number, got {type(v).__name__}")
    if isinstance(v, int) and abs(v) > 1e300:  # past float range
        raise Rejected("bad_attribute_value", f"{key} is out of range")
    if not math.isfinite(v):
        raise Rejected("bad_attribute_value", f"{key} is {v}")
    if v < 0:
        raise Rejected("negative_duration", f"{key} = {v}")
    if v > MAX_LATENCY_S:
        raise Rejected("bad_attribute_value", f"{key} = {v} s is out of range")
    return float(v)


def count(attrs: dict, *keys: str) -> int | None:
    """A token count from the first of ``keys`` present: a non-negative integer."""
    for key in keys:
        v = attrs.get(key)
        if v is None:
            continue
        if type(v) is int and 0 <= v < MAX_COUNT:  # the usual case, checked first
            return v
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise Rejected("bad_attribute_type",
                           f"{key} must be an integer, got {type(v).__name__}")
        if v < 0:
            raise Rejected("negative_token_count", f"{key} = {v}")
        if v >= MAX_COUNT:
            raise Rejected("bad_attribute_value", f"{key} = {v} is out of range")
        return v
    return None


def text(attrs: dict, *keys: str) -> str:
    for key in keys:
        v = attrs.get(key)
        if isinstance(v, str) and v:
            return v
    return ""


def first_reason(value) -> str:
    """A finish reason from a string, a list of strings, or a JSON list in a string."""
    if isinstance(value, list):
        return str(value[0]) if value else ""
    if isinstance(value, str) and value.startswith("["):
        import json

        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            return value
        return str(parsed[0]) if isinstance(parsed, list) and parsed else ""
    return value if isinstance(value, str) else ""


def after(t: int | None, s: float | None) -> int | None:
    """``t`` (ns) plus ``s`` seconds, or None when either is unknown."""
    if t is None or s is None:
        return None
    return t + round(s * NS)
