"""Each row of a ``make bench`` run against the last run committed with its write-up in
docs/benchmarks.md (``bench/last_run.json``): a ratio to the same-run reference that
fell by more than ``FELL`` is flagged. The ratios are what carry between runs on a
shared, noisy machine (the absolute figures move with the host, the references with
them); a figure without a reference is shown beside the last one, not judged.

``python -m bench.run --record`` writes the run just made as the committed one (after
its figures go into docs/benchmarks.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bench.common import ROOT, Row

PATH = ROOT / "bench" / "last_run.json"
FELL = 0.15  # a ratio this much worse than the committed run's is flagged


@dataclass(frozen=True)
class Change:
    key: str
    path: str
    then: float
    now: float
    judged: bool  # a ratio (judged), or a figure without a reference (shown)
    better: str

    @property
    def relative(self) -> float:
        """now over then, the way ``better`` points: under 1 is worse."""
        if self.then == 0 or self.now == 0:
            return 1.0
        return self.now / self.then if self.better == "higher" else self.then / self.now

    @property
    def fell(self) -> bool:
        return self.judged and self.relative < 1.0 - FELL


def load(path: Path = PATH) -> dict | None:
    """The committed run, or None where none is (a first run)."""
    return json.loads(path.read_text()) if path.exists() else None


def compare(rows: list[Row], last: dict | None) -> list[Change]:
    """Each row of this run that the committed run has too, by its key."""
    if not last:
        return []
    then = {r["key"]: r for r in last.get("rows", ())}
    out = []
    for r in rows:
        old = then.get(r.key)
        if old is None:
            continue
        if r.ratio is not None and old.get("ratio"):
            out.append(Change(r.key, r.path, float(old["ratio"]), r.ratio, True,
                              r.ratio_better))
        elif old.get("figure"):
            out.append(Change(r.key, r.path, float(old["figure"]), r.figure, False, r.better))
    return out


def report(changes: list[Change], last: dict | None) -> str:
    if not last:
        return f"no committed run to compare with ({PATH.relative_to(ROOT)})"
    lines = [f"against the committed run of {last.get('when', '?')} "
             f"({PATH.relative_to(ROOT)}; docs/benchmarks.md):"]
    for c in changes:
        what = "ratio " if c.judged else "figure"
        flag = "  FELL" if c.fell else ""
        lines.append(f"  {c.path:57s} {what} {c.then:>10.4g} -> {c.now:>10.4g} "
                     f"({c.relative - 1.0:+.0%}){flag}")
    fell = [c for c in changes if c.fell]
    lines.append(f"{len(fell)} ratio(s) fell by more than {FELL:.0%}" + (
        ": " + ", ".join(c.key for c in fell) if fell else ""))
    return "\n".join(lines)


def record(results: dict, path: Path = PATH) -> None:
    """Commit this run's rows (key, path, figure, ratio) as the one to compare with."""
    path.write_text(json.dumps({
        "when": results["when"], "machine": results["machine"],
        "rows": [{k: r[k] for k in ("key", "path", "figure", "ratio")}
                 for r in results["rows"]]}, indent=1) + "\n")
