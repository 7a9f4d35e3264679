"""Every family, by section, in the order /metrics shows them (``SECTIONS``), and the
lookups made of them: ``ALL``, ``BY_NAME``, ``names()``."""

from __future__ import annotations

from phasewatch.catalog.family import Family
from phasewatch.catalog.gpu_families import GPU, GPU_COUNTER_READS
from phasewatch.catalog.lever_families import LEVERS
from phasewatch.catalog.request_families import COUNTERS, HISTOGRAMS, SLO
from phasewatch.catalog.roofline_families import ENGINE_STATE, NO_ROOFLINE_REQUESTS, ROOFLINE
from phasewatch.catalog.self_families import (
    BUILD_INFO,
    EXPORTER_GAUGES,
    SCRAPE,
    SELF_COUNTERS,
)
from phasewatch.catalog.tap_families import TAP

SECTIONS: dict[str, tuple[Family, ...]] = {
    "Requests": (*HISTOGRAMS.values(), *COUNTERS.values()),
    "Latency objectives (goodput)": SLO,
    "The exporter itself": (*SELF_COUNTERS, *EXPORTER_GAUGES),
    "Roofline and verdict": ROOFLINE,
    "The engine's own state and the ceilings": (*ENGINE_STATE, NO_ROOFLINE_REQUESTS),
    "The GPU's own counters": (*GPU, GPU_COUNTER_READS),
    "The step model and the levers' predicted effects": LEVERS,
    "The stream tap": tuple(TAP.values()),
    "Build": (BUILD_INFO,),
    "The scrape": SCRAPE,
}
ALL: tuple[Family, ...] = tuple(f for fams in SECTIONS.values() for f in fams)
BY_NAME: dict[str, Family] = {f.name: f for f in ALL}


def names() -> set[str]:
    """Every name a query may use: the families', a histogram's ``_bucket``, ``_count``
    and ``_sum`` and its native family's."""
    out = set()
    for f in ALL:
        out.add(f.name)
        if f.type == "histogram":
            out.update(f.name + s for s in ("_bucket", "_count", "_sum"))
            if f.native:
                out.add(f.native_name)
    return out
