"""Repository hygiene: what the tracked files say about themselves."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

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
