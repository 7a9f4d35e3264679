"""``Family``: one metric family as a scrape shows it, what every stage's families
(``request_families``, ``self_families``, ``roofline_families``, ``tap_families``) are."""

from __future__ import annotations

from typing import NamedTuple

from phasewatch.requests.buckets import BucketSet

SERIES_LABELS = ("model", "engine")  # then pod, source where those flags are on
NATIVE_SUFFIX = "_native"


class Family(NamedTuple):
    """One metric family, as a scrape shows it."""

    name: str  # a counter's with _total
    type: str  # counter, gauge, histogram
    help: str
    labels: tuple[str, ...] = ()  # after the label set's labels where per_series
    per_series: bool = False
    buckets: BucketSet | None = None
    native: bool = False  # also <name>_native, a native histogram (protobuf scrapes)
    needs: str = ""  # what it is published with ("": always)

    @property
    def family(self) -> str:
        """The family name without a counter's ``_total``."""
        return self.name.removesuffix("_total") if self.type == "counter" else self.name

    @property
    def native_name(self) -> str:
        return self.name + NATIVE_SUFFIX

    def label_names(self, series: tuple[str, ...] = SERIES_LABELS) -> list[str]:
        """Its label names, after ``series`` (the label set's names) where per_series."""
        return [*series, *self.labels] if self.per_series else list(self.labels)
