"""Runs a test made once more on a fault of the harness or the host (tests/real: vLLM's
worker died, an export the engine dropped, a stalled host), said again at the end of
the run by ``tests/conftest.py`` whether or not the test then passed: what CI shows
first says it happened."""

from __future__ import annotations

MADE_AGAIN: list[str] = []
SAID = 2500  # characters of each reason kept


def made_again(why: str) -> None:
    """Note a run made once more, and why; printed as it happens too."""
    print(f"\n{why}", flush=True)
    MADE_AGAIN.append(why[:SAID])
