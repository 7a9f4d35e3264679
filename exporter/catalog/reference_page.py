"""The reference page, docs/metrics-reference.md: every family of the catalog, by
section (``python -m phasewatch.catalog`` writes it; ``--check`` fails when it is stale)."""

from __future__ import annotations

import sys
from pathlib import Path

from phasewatch.catalog.family import SERIES_LABELS
from phasewatch.catalog.request_families import HISTOGRAMS
from phasewatch.catalog.sections import SECTIONS
from phasewatch.requests.buckets import BucketSet

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "metrics-reference.md"


def _bounds(b: BucketSet) -> str:
    return ", ".join(f"{x:g}" for x in b.bounds)


def reference() -> str:
    """docs/metrics-reference.md: every family, from this catalog."""
    series = ", ".join(SERIES_LABELS)
    lines = [
        "# Metrics reference",
        "",
        "Generated from `exporter/catalog/` by `python -m phasewatch.catalog`; do not edit",
        "(tests/publish/test_catalog.py fails when it is stale). What the figures mean, how",
        "they are derived and what each label value says: [Phases and metrics](metrics.md).",
        "",
        f"*label set*: {series}; then `pod` with `--pod-label true` and `source` with",
        "`--source-label true`. Counters are listed by the name Prometheus stores (with",
        "`_total`). A histogram marked *native* has a second family, `<name>_native`, a",
        "native histogram on protobuf scrapes. `prompt_class` is left out with",
        "`--prompt-class-label false`, and `--classic-buckets coarse` keeps the 1-2-5",
        "bounds of each bucket set and its top one.",
    ]
    for title, families in SECTIONS.items():
        lines += ["", f"## {title}", ""]
        shared = {f.needs for f in families}
        if len(shared) == 1 and "" not in shared:  # said once for the section
            lines += [f"With {shared.pop()}.", ""]
            families = [f._replace(needs="") for f in families]
        lines += ["| metric | type | labels | help |", "|---|---|---|---|"]
        for f in families:
            labels = ", ".join((["*label set*"] if f.per_series else []) + list(f.labels))
            kind = f.type + (", native" if f.native else "")
            doc = f.help.replace("|", "\\|")
            if f.needs:
                doc += f" *With {f.needs}.*"
            lines.append(f"| `{f.name}` | {kind} | {labels or '-'} | {doc} |")
    lines += ["", "## Histogram buckets", "", "| metric | buckets (`le`) |", "|---|---|"]
    for f in HISTOGRAMS.values():
        lines.append(f"| `{f.name}` | {_bounds(f.buckets)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = reference()
    if "--check" in args:
        if not REFERENCE.exists() or REFERENCE.read_text() != text:
            print(f"stale: {REFERENCE}; run python -m phasewatch.catalog")
            return 1
        return 0
    REFERENCE.write_text(text)
    print(f"wrote {REFERENCE}")
    return 0

