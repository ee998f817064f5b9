"""README.md is the landing page: short, its set-up commands are the ones CI runs, its layer
example runs, and every local link it has resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
README = (ROOT / "README.md").read_text()


def test_readme_is_a_landing_page():
    assert len(README.splitlines()) < 250, "move depth to docs/ (docs/guide.md)"


def test_the_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    command = ci.split("&&", 1)[1].strip() if ci.startswith("cd ") else ci
    assert command in README, f"README lacks CI's test command {command!r}"
    assert "pip install torch==2.13.0 && pip install -e . && moeflow train" in README


def test_minimal_layer_example_runs():
    code = re.search(r"## A minimal layer\n\n```python\n(.*?)```", README, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})


def test_local_links_resolve():
    for doc in [ROOT / "README.md", ROOT / "docs" / "guide.md", ROOT / "docs" / "results" / "README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)\)", doc.read_text()):
            if "://" in target or "=" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} -> {target}"
