"""``make bench``: every performance target of phasewatch, each beside a reference
measured in the same run, as a table and as ``bench/results.json``.

Servers run alone on one core (SERVER_CORE), load generators and this process on
the other; the machine is shared and noisy, so compare ratios, not absolute times.
Rows (module: what it measures):

* ingest: phasewatch Export (with and without token gaps), OTLP/gRPC and OTLP/HTTP
  from the OpenTelemetry SDK's exporters, and phasewatch against the baseline
  exporter (bench/baseline_exporter.py) per server CPU-second; SGLang's span trees
  (trace levels 3 and 1: spans/s and requests/s, the join of roots and stage spans);
* client: record() on the serving thread (exporter up, and down), and a request's
  finish -> visible in /metrics;
* surfaces: /metrics render (text, and protobuf with native histograms: render time and
  series added), the roofline estimator, exporter memory under load;
* dashboard_refresh: a dashboard refresh's server time;
* tap: what ``phasewatch tap`` adds, beside the same load sent to the server directly
  (phases alternating): TTFT p50/p99 and chunk latency p99 at 64 streams, chunks/s per
  tap CPU-second (beside a bare aiohttp relay), the tap's peak RSS.

Each row is then set against the last run committed with docs/benchmarks.md
(``bench/last_run.py``): a ratio that fell by more than 15 % is flagged.

    python -m bench.run [--only KEY[,KEY...]] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from bench import last_run
from bench.common import CLIENT_CORE, ROOT, Row, pin


def _rows(module: str, function: str, *args) -> list[Row]:
    """``bench.MODULE.FUNCTION(*args)``, imported when its section runs: a section needs
    only its own dependencies (``--only tap`` runs where Dash and plotly are absent, as
    on the GPU machine ``make gpu-check`` runs on)."""
    import importlib

    return getattr(importlib.import_module(f"bench.{module}"), function)(*args)


def _export_rows() -> list[Row]:
    import numpy as np

    return _rows("ingest", "export_rows", np.random.default_rng(0))


SECTIONS = {
    "export": _export_rows,
    "otlp": lambda: _rows("ingest", "otlp_rows"),
    "sglang": lambda: _rows("ingest", "sglang_rows"),
    "record": lambda: _rows("client", "record_rows"),
    "visible": lambda: [_rows("client", "visibility_row")],
    "render": lambda: _rows("surfaces", "render_row"),
    "estimator": lambda: _rows("surfaces", "estimator_rows"),
    "dashboard": lambda: [_rows("dashboard_refresh", "dashboard_row")],
    "memory": lambda: [_rows("surfaces", "memory_row")],
    "tap": lambda: _rows("tap", "tap_rows"),
}


def _fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}" if unit != "ratio" else f"{v:.2f}"


def table(rows: list[Row]) -> str:
    head = (f"{'row':57s} {'figure':>12s} {'unit':>11s} {'target':>10s} "
            f"{'reference':>12s} {'ratio':>7s} {'ratio tgt':>9s}  status")
    lines = [head, "-" * len(head)]
    for r in rows:
        sign = ">=" if r.better == "higher" else "<="
        rsign = ">=" if r.ratio_better == "higher" else "<="
        target = f"{sign} {_fmt(r.target)}" if r.target else "-"
        ratio_target = f"{rsign} {r.ratio_target:g}" if r.ratio_target is not None else "-"
        lines.append(f"{r.path:57s} {_fmt(r.figure):>12s} {r.unit:>11s} {target:>10s} "
                     f"{_fmt(r.reference):>12s} {_fmt(r.ratio, 'ratio'):>7s} "
                     f"{ratio_target:>9s}  {'pass' if r.meets() else 'SHORT'}")
    lines.append("")
    lines.append("references:")
    for r in rows:
        if r.reference_name:
            lines.append(f"  {r.path}: {r.reference_name}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated sections: "
                        + ", ".join(SECTIONS))
    parser.add_argument("--record", action="store_true", help="commit this run as the "
                        "one later runs compare with (bench/last_run.json)")
    args = parser.parse_args(argv)
    wanted = [s for s in args.only.split(",") if s] or list(SECTIONS)
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {', '.join(sorted(unknown))}; "
                     f"choose from {', '.join(SECTIONS)}")
    pin(CLIENT_CORE)
    started = time.monotonic()
    rows: list[Row] = []
    timings = {}
    for name in wanted:
        t = time.monotonic()
        print(f"[bench] {name} ...", flush=True)
        rows.extend(SECTIONS[name]())
        timings[name] = round(time.monotonic() - t, 1)
    print()
    print(table(rows))
    last = last_run.load()
    changes = last_run.compare(rows, last)
    print()
    print(last_run.report(changes, last))
    out = ROOT / "bench" / "results.json"
    results = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine()},
        "seconds": round(time.monotonic() - started, 1), "section_seconds": timings,
        "rows": [r.as_json() for r in rows],
        "fell_since_committed_run": [c.key for c in changes if c.fell]}
    out.write_text(json.dumps(results, indent=2))
    if args.record:
        last_run.record(results)
    print(f"\nwrote {out.relative_to(ROOT)} in {time.monotonic() - started:.0f} s; "
          f"{sum(not r.meets() for r in rows)} row(s) short; "
          f"{sum(c.fell for c in changes)} ratio(s) fell since the committed run"
          + ("; recorded as the committed run" if args.record else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
