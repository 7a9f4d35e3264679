"""The metric catalog (exporter/catalog/) is what phasewatch publishes, and everything
that names a metric reads it.

* the generated reference page is current (the Grafana JSON and the rule files are held
  to their generators by test_grafana.py and test_rules.py, which run them with
  ``--check``; not repeated here);
* every family on a live /metrics page (the golden test's input, with the in-process tap
  on) is in the catalog with the same type, HELP text and label names in order, and
  buckets; every catalog family is on it (the tap's need ``--tap-upstream``, on here);
* the generators and the dashboard's PromQL spell no metric name: they refer to the
  catalog, and every name in them and in what they generate is a catalog name.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

from phasewatch import catalog
from phasewatch.aggregation.aggregate import HISTOGRAMS
from phasewatch.app import Exporter
from phasewatch.config import ServeConfig
from phasewatch.protocol import exposition_pb2 as pb
from phasewatch.publish import exposition
from phasewatch.tap import TapConfig
from tests.publish import test_golden_metrics as golden
from tests.support import ROOT

NAME = re.compile(r"\b(?:phasewatch|gen_ai)_[a-z0-9_]+")
TYPES = {pb.COUNTER: "counter", pb.GAUGE: "gauge", pb.HISTOGRAM: "histogram"}
USERS = ("grafana/generate.py", "deploy/prometheus/generate_rules.py", "dashboard/queries.py")
GENERATED = ("grafana/dashboards/phasewatch.json", "deploy/prometheus/rules/*.yml",
             "deploy/kubernetes/monitoring/prometheusrule.yaml")


def test_the_reference_page_is_current():
    assert catalog.REFERENCE.read_text() == catalog.reference(), (
        "docs/metrics-reference.md is stale: python -m phasewatch.catalog")


def test_names_are_unique_and_counters_end_in_total():
    assert len(catalog.BY_NAME) == len(catalog.ALL)
    for f in catalog.ALL:
        assert (f.type == "counter") == f.name.endswith("_total"), f.name
        assert (f.buckets is not None) == (f.type == "histogram"), f.name


def test_the_aggregators_histograms_have_the_catalogs_buckets():
    assert set(catalog.HISTOGRAMS) == {spec.key for spec in HISTOGRAMS}
    for spec in HISTOGRAMS:
        f = catalog.HISTOGRAMS[spec.key]
        assert f.buckets == spec.buckets, f.name
        assert f.labels == ((spec.sub_label,) if spec.sub_label else ()), f.name
        assert f.native == (spec.native is not None), f.name


@pytest.fixture(scope="module")
def page() -> list:
    """The protobuf page (it keeps every family's label order) of the golden test's
    exporter, with the in-process tap configured so its families are there too."""
    ex = golden._exporter()
    tapped = Exporter(ServeConfig(grpc_port=0, http_port=0, otlp_grpc_port=0,
                                  otlp_http_port=0,
                                  tap=TapConfig(port=0, upstream="http://127.0.0.1:9")))
    try:
        body, _ = ex.metrics_page.render(golden.ACCEPT["protobuf"])
        tap_body, _ = tapped.metrics_page.render(golden.ACCEPT["protobuf"])
    finally:
        tapped.stop(0)
    fams = exposition.read_delimited(body)
    have = {f.name for f in fams}
    return fams + [f for f in exposition.read_delimited(tap_body) if f.name not in have]


def test_every_family_on_the_page_is_the_catalogs(page):
    checked = 0
    for fam in page:
        if not NAME.match(fam.name):
            continue  # process_*, python_*: prometheus_client's own
        native = fam.name.endswith(catalog.NATIVE_SUFFIX)
        f = catalog.BY_NAME.get(fam.name.removesuffix(catalog.NATIVE_SUFFIX) if native
                                else fam.name)
        assert f is not None, f"{fam.name} is published but not in the catalog"
        assert TYPES[fam.type] == f.type, fam.name
        assert fam.help == (f.help + (" Native histogram (schema 4)." if native else "")), \
            fam.name
        assert not native or f.native, fam.name
        if fam.metric:
            labels = [p.name for p in fam.metric[0].label]
            assert labels == f.label_names(), fam.name
            if f.type == "histogram" and not native:
                bounds = tuple(b.upper_bound for b in fam.metric[0].histogram.bucket)
                assert bounds == f.buckets.bounds, fam.name
            checked += 1
    assert checked >= 40  # most families have samples on the golden input


def test_every_catalog_family_is_on_the_page(page):
    names = {f.name for f in page}
    for f in catalog.ALL:
        if f.needs and f.needs != catalog.TAP_NEEDS:
            continue  # not configured on this page
        assert f.name in names, f"{f.name} is in the catalog but not published"
        if f.native:
            assert f.native_name in names, f.native_name


def _string_literals(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string literal in the file but its docstring."""
    toks = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    first = next(t for t in toks if t.type not in (tokenize.COMMENT, tokenize.NL))
    return [(t.start[0], t.string) for t in toks
            if t.type == tokenize.STRING and t is not first]


@pytest.mark.parametrize("user", USERS)
def test_users_refer_to_the_catalog_not_to_literal_names(user):
    path = ROOT / user
    spelled = [(line, n) for line, s in _string_literals(path) for n in NAME.findall(s)]
    assert not spelled, f"{user} spells metric names; use phasewatch.catalog: {spelled}"
    unknown = set(NAME.findall(path.read_text())) - catalog.names()
    assert not unknown, f"{user} names metrics the catalog does not have: {unknown}"


def test_what_the_generators_wrote_names_only_catalog_metrics():
    files = [p for pattern in GENERATED for p in sorted(ROOT.glob(pattern))]
    assert len(files) >= 4
    for p in files:
        unknown = set(NAME.findall(p.read_text())) - catalog.names()
        assert not unknown, f"{p.relative_to(ROOT)}: {unknown}"
