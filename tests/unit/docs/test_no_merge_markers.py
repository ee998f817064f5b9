"""No tracked text file keeps a merge's conflict markers (a conflict resolved by committing the
file as it stood would otherwise pass every other check of a Markdown file)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MARKER = re.compile(r"^(<{7}|>{7})( |$)|^={7}$", re.M)


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "*.md", "*.py", "*.toml", "*.sh", "*.json"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    return [ROOT / f for f in out.stdout.splitlines()]


def test_no_conflict_markers():
    found = []
    for path in _tracked():
        if not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        text = path.read_text(errors="replace")
        for m in MARKER.finditer(text):
            found.append(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}")
    assert not found, "merge conflict markers left in: " + ", ".join(found)
