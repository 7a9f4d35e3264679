"""The Prometheus rules: generated files are fresh, `promtool check rules` passes on each,
and `promtool test rules` runs the TTFT-regression unit tests against them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import require_binary
from tests.support import ROOT

PROM = ROOT / "deploy" / "prometheus"


@pytest.mark.parametrize("generator", ["generate_rules.py", "rule_tests.py"])
def test_generated_files_are_fresh(generator):
    r = subprocess.run([sys.executable, str(PROM / generator), "--check"],
                       capture_output=True, text=True, cwd=PROM.parents[1])
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("rules", sorted((PROM / "rules").glob("*.yml")), ids=lambda p: p.name)
def test_promtool_check_rules(rules):
    promtool = require_binary("promtool", "it checks the rule files")
    r = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("case", sorted((PROM / "tests").glob("*.test.yml")),
                         ids=lambda p: p.name)
def test_promtool_unit_tests(case):
    promtool = require_binary("promtool", "it runs the rules' unit tests")
    r = subprocess.run([promtool, "test", "rules", case.name], capture_output=True, text=True,
                       cwd=case.parent, timeout=300)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
