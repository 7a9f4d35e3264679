"""``make bench`` sets each row against the run committed with docs/benchmarks.md
(``bench/last_run.json``) and flags a ratio that fell by more than 15 % (issue 41: the
OTLP ingest's ratio fell from 0.36-0.40 to 0.25 over several issues, and no run said
so)."""

from __future__ import annotations

import json

from bench import last_run
from bench.common import Row


def _row(key: str, figure: float, reference: float | None, better: str = "higher",
         ratio_better: str = "") -> Row:
    return Row(key, key.replace("_", " "), figure, "x/s", 1.0, better, reference,
               ratio_better=ratio_better)


def test_a_ratio_that_fell_past_fifteen_percent_is_flagged_and_a_figure_is_only_shown(
        tmp_path):
    then = {"when": "2026-11-29T07:00:00Z", "machine": {}, "rows": [
        {"key": "otlp", "path": "otlp", "figure": 55_000.0, "ratio": 0.40},
        {"key": "http", "path": "http", "figure": 50_000.0, "ratio": 0.36},
        {"key": "render", "path": "render", "figure": 20.0, "ratio": 0.20},
        {"key": "record", "path": "record", "figure": 1.5, "ratio": None}]}
    rows = [_row("otlp", 47_000.0, 188_000.0),  # 0.25: fell 37 %
            _row("http", 45_000.0, 140_000.0),  # 0.32: 11 % under, within
            _row("render", 30.0, 100.0, "lower"),  # 0.30 where lower is better
            _row("record", 3.0, None, "lower"),  # a figure alone: shown, not judged
            _row("new_row", 1.0, 2.0)]  # not in the committed run
    changes = {c.key: c for c in last_run.compare(rows, then)}
    assert set(changes) == {"otlp", "http", "render", "record"}
    assert changes["otlp"].fell and not changes["http"].fell
    assert changes["render"].fell  # 0.20 -> 0.30 of the reference's time
    assert not changes["record"].fell and not changes["record"].judged
    text = last_run.report(list(changes.values()), then)
    assert "2 ratio(s) fell by more than 15%: otlp, render" in text
    assert text.count("FELL") == 2
    assert last_run.compare(rows, None) == []
    assert "no committed run" in last_run.report([], None)
    # --record commits a run's rows as the next one's to compare with
    results = {"when": "now", "machine": {"cores": 2},
               "rows": [r.as_json() for r in rows]}
    path = tmp_path / "last_run.json"
    last_run.record(results, path)
    again = last_run.compare(rows, json.loads(path.read_text()))
    assert again and not any(c.fell for c in again)


def test_the_committed_run_has_every_row_make_bench_makes():
    """The committed run is a whole ``make bench``: each section's rows are in it."""
    committed = last_run.load()
    assert committed is not None, "bench/last_run.json: record a run (make bench --record)"
    keys = {r["key"] for r in committed["rows"]}
    for key in ("export_gaps", "otlp_grpc", "otlp_http", "vs_baseline", "tap_chunks_per_core"):
        assert any(k.startswith(key) for k in keys), (key, sorted(keys))


def test_a_latencys_ratio_is_better_lower_unless_the_row_says_otherwise():
    """The estimator's p95 over its window copy, the tap's added TTFT over the relay's:
    a latency against a reference latency. Run 7's estimator ratio went 31 -> 25 (faster)
    and was flagged as fallen while the default read every ratio as better higher."""
    then = {"when": "t", "rows": [{"key": "estimator", "path": "e", "figure": 216.0,
                                   "ratio": 31.35}]}
    faster = last_run.compare([_row("estimator", 172.0, 6.75, "lower")], then)[0]
    slower = last_run.compare([_row("estimator", 300.0, 6.75, "lower")], then)[0]
    assert not faster.fell and faster.relative > 1.0
    assert slower.fell
    assert _row("x", 1.0, 2.0, "lower").ratio_better == "lower"
    assert _row("x", 1.0, 2.0, "lower", ratio_better="higher").ratio_better == "higher"
