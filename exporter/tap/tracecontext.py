"""W3C trace context: the ``traceparent`` and ``tracestate`` the tap sends upstream."""

from __future__ import annotations

import secrets

from phasewatch.requests.record import TAP_TRACESTATE_KEY

TRACESTATE_MEMBER = f"{TAP_TRACESTATE_KEY}=tap"
MAX_TRACESTATE_MEMBERS = 32  # W3C trace context


def trace_headers(incoming: str | None, states: list[str] | None = None) -> tuple[str, str]:
    """The ``traceparent`` and ``tracestate`` sent upstream (W3C trace context).

    traceparent: a new span in the caller's trace, or in a new trace when the caller
    sent none (or one that does not parse: then its tracestate is dropped too).
    tracestate: the tap's member (``phasewatch=tap``) first, then the caller's members
    in their order (an older ``phasewatch`` member removed, at most 32 in all). An
    engine's span inherits its parent's tracestate (vLLM's and SGLang's OpenTelemetry
    SDK do), so the exporter knows, from the span alone, that a tap's record of the
    request is coming and waits for it."""
    parts = (incoming or "").strip().split("-")
    trace = parts[1] if (len(parts) == 4 and len(parts[1]) == 32
                         and _hex(parts[1]) and parts[1] != "0" * 32) else None
    flags = parts[3] if trace and len(parts[3]) == 2 and _hex(parts[3]) else "01"
    parent = f"00-{trace or secrets.token_hex(16)}-{secrets.token_hex(8)}-{flags}"
    members = [m.strip() for h in (states or ()) if trace for m in h.split(",")]
    theirs = [m for m in members if m and m.split("=", 1)[0].strip() != TAP_TRACESTATE_KEY]
    return parent, ",".join([TRACESTATE_MEMBER, *theirs[:MAX_TRACESTATE_MEMBERS - 1]])


def _hex(s: str) -> bool:
    try:
        int(s, 16)
    except ValueError:
        return False
    return True


def caller_span(incoming: str | None, sent: str) -> str:
    """The span id of the client's ``traceparent`` when the tap's ``sent`` one continues
    its trace (the tap's span is then that span's child), else ""."""
    parts = (incoming or "").strip().split("-")
    return parts[2].lower() if (len(parts) == 4 and sent.split("-")[1].lower() == parts[1].lower()
                                and len(parts[2]) == 16 and _hex(parts[2])
                                and parts[2] != "0" * 16) else ""
