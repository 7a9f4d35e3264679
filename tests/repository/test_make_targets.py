"""What `make demo` and `make test` install, read from make's own dry run (`make -n`) on
a copy of the Makefile, with the stamps of each step made by hand: nothing is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import require_binary
from tests.support import ROOT

DEV = "pip install --quiet -e '.[dev]'"
RUN = "pip install --quiet -e ."


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    require_binary("make", "the Makefile is what `make demo` and `make test` run")
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / ".venv").mkdir()
    old = time.time() - 60  # the stamps below are newer than pyproject.toml
    os.utime(tmp_path / "pyproject.toml", (old, old))
    return tmp_path


def dry_run(where: Path, target: str) -> list[str]:
    """The commands ``make TARGET`` would run, one a line (none is run)."""
    # as a user's shell runs it: under `make test` the parent's MAKELEVEL and MAKEFLAGS
    # made this make print "Entering directory" lines around its own
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")}
    out = subprocess.run(["make", "-n", target], cwd=where, capture_output=True, text=True,
                         timeout=60, check=True, env=env).stdout
    return out.splitlines()


def installs(lines: list[str]) -> list[str]:
    """The installs of phasewatch itself into .venv among ``lines``."""
    return [line for line in lines if line.startswith(".venv/bin/python -m pip install")
            and " -e " in line]


def test_the_demo_installs_the_package_alone_and_test_adds_the_dev_extras(checkout):
    """Issue 37: `make demo` installed pytest, atheris, hadolint and the rest of the dev
    extras to run a demo. Fresh: the demo installs `-e .` only; after it, `make test`
    still installs the dev extras; after `make test`, the demo installs nothing more."""
    fresh = dry_run(checkout, "demo")
    assert [RUN in line for line in installs(fresh)] == [True], fresh
    assert not any(DEV in line for line in fresh)
    assert fresh[-1].startswith(".venv/bin/phasewatch demo")

    (checkout / ".venv" / ".installed-run").touch()  # what `make demo` leaves
    assert installs(dry_run(checkout, "demo")) == []
    after_demo = installs(dry_run(checkout, "test"))
    assert len(after_demo) == 1 and DEV in after_demo[0], after_demo

    (checkout / ".venv" / ".installed").touch()  # what `make test` leaves: both stamps
    assert installs(dry_run(checkout, "demo")) == []
    assert installs(dry_run(checkout, "test")) == []


def test_installing_the_dev_extras_stamps_the_demo_too(checkout):
    """The dev install's recipe touches both stamps, so that a `make demo` after `make
    test` on a fresh clone finds its own stamp."""
    lines = dry_run(checkout, ".venv/.installed")
    assert any(DEV in line for line in lines)
    assert lines[-1].split() == ["touch", ".venv/.installed", ".venv/.installed-run"], lines
