"""docs/ cites its recorded results by path: every local link in a document resolves, and every
concrete `docs/results/...` path named in a document's prose (outside command blocks, whose
`--out` targets may be runs not made yet) exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOCS = sorted((ROOT / "docs").rglob("*.md"))
PATH = re.compile(r"docs/results/[A-Za-z0-9_./-]+")


def _prose(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def test_local_links_in_docs_resolve():
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)\)", _prose(doc.read_text())):
            if "://" in target or "=" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} -> {target}"


def test_results_named_in_prose_exist():
    for doc in DOCS:
        prose = _prose(doc.read_text())
        for m in PATH.finditer(prose):
            path = m.group(0).rstrip(".")
            if prose[m.end():m.end() + 1] in "${*[" or path.endswith(("-", "_", "/")):
                continue  # a pattern: the command block beside it names the files
            assert (ROOT / path).exists(), f"{doc.relative_to(ROOT)} names missing {path}"
