"""Queueing figures for the levers' predictions (``lever_effects``): the mean wait of
open arrivals at c servers.

Erlang C is the M/M/c queue's probability of waiting; the predictions use it as a
stand-in for M/G/c (an engine's service times are not exponential), which is the usual
first approximation (the Allen-Cunneen correction scales the wait by the squared
coefficients of variation; with none measured, M/M/c stands).
"""

from __future__ import annotations


def erlang_c_wait(servers: int, arrival: float, service: float) -> float | None:
    """Mean wait in an M/M/c queue with ``servers`` servers, ``arrival`` requests a second
    and a mean ``service`` in seconds; None at or over capacity. Erlang B by its
    recursion (no load^c / c! to overflow at thousands of slots), then C from B."""
    load = arrival * service
    if servers < 1 or load >= servers:
        return None
    b = 1.0
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    c = b / (1.0 - load / servers * (1.0 - b))
    return c * service / (servers - load)
