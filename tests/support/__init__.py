"""What the tests share besides conftest.py's fixtures: real components they start
(``serve`` a ``phasewatch serve`` process, ``prom`` a Prometheus, ``browser`` headless
Chromium, ``faultproxy``, ``collector_ring``), what they feed (``flood``, ``certs``,
``fuzz_targets``, ``fuzz_atheris``), and the paths they read.

The tests live one folder down, by stage (``tests/<stage>/test_*.py``); ``ROOT`` and
``FIXTURES`` here are the one place a path is built from where a file lies.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository."""

FIXTURES = ROOT / "tests" / "fixtures"
"""Committed inputs: engine pages and spans, golden pages, model configs, recordings."""
