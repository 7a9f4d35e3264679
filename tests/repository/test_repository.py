"""Repository hygiene: what the tracked files say about themselves."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.support import ROOT

# Notes kept outside the repository, which a reader of the code cannot open. Code cites
# public sources (a project's file and symbol, a datasheet, a paper) or the repo's docs/.
OUTSIDE_NOTES = re.compile(r"\b(?:product|references)\.md\b", re.IGNORECASE)


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             timeout=60, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git work tree: {e}")
    return [p for p in out.decode("utf-8", "surrogateescape").split("\0") if p]


def test_no_citation_of_notes_outside_the_repository():
    hits = []
    for rel in tracked_files():
        if rel.startswith("tests/fixtures/"):
            continue
        path = ROOT / rel
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if OUTSIDE_NOTES.search(line):
                hits.append(f"{rel}:{n}: {line.strip()[:120]}")
    assert not hits, ("cite the public source or the docs/ page instead of notes kept "
                      "outside the repository:\n" + "\n".join(hits))


IMPORTS_BY_FOLDER = re.compile(r"^\s*(?:from|import)\s+(?:exporter|dashboard)\b|"
                               r"-m\"?,?\s*\"?(?:exporter|dashboard)\.", re.M)


def test_code_imports_the_one_installed_name():
    """The installed code is `phasewatch` (exporter/ and dashboard/ are its folders, mapped
    in pyproject.toml): an import by folder name works only from the repository root and
    would load a second copy of every module beside the installed one."""
    hits = []
    for rel in tracked_files():
        if not rel.endswith((".py", ".md")) or rel.endswith("_pb2.py"):
            continue
        text = (ROOT / rel).read_text(encoding="utf-8", errors="replace")
        hits += [f"{rel}: {m[0].strip()}" for m in IMPORTS_BY_FOLDER.finditer(text)]
    assert not hits, "\n".join(hits)


def test_every_package_folder_is_installed():
    """pyproject.toml lists every folder with an __init__.py under its import name, so a
    new subpackage cannot be left out of the wheel."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = config["package-dir"]
    assert mapping == {"phasewatch": "exporter", "phasewatch.dashboard": "dashboard"}
    found = set()
    for name, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            sub = ".".join(rel.parts)
            if name == "phasewatch" and rel.parts[:1] == ("dashboard",):
                continue
            found.add(f"{name}.{sub}" if sub else name)
    assert set(config["packages"]) == found
