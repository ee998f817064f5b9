"""One name, one meaning (docs/design.md, "Package order"): no two moeflow modules share a
name, and no module is named like a package, except the role names below, which mean the same
thing in every package that has them."""

from __future__ import annotations

import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3] / "moeflow"

ROLE_NAMES = {
    "base": "the interface of its package (a registry's abstract class)",
    "strategy": "the ExpertStrategy of its strategy package (moeflow/strategies/<name>/)",
}


def name_clashes(root: Path) -> dict[str, list[str]]:
    """``name -> [paths]`` for every module or package name used more than once under
    ``root`` (``__init__`` left out; role names allowed)."""
    seen = collections.defaultdict(list)
    for f in root.rglob("*.py"):
        if f.name != "__init__.py":
            seen[f.stem].append(str(f.relative_to(root.parent)))
    for d in root.rglob("*"):
        if d.is_dir() and (d / "__init__.py").is_file():
            seen[d.name].append(str(d.relative_to(root.parent)) + "/")
    return {n: sorted(p) for n, p in seen.items() if len(p) > 1 and n not in ROLE_NAMES}


def test_the_check_finds_a_clash(tmp_path):
    pkg = tmp_path / "moeflow"
    for path in ("__init__.py", "a/__init__.py", "a/layer.py", "b/__init__.py", "b/layer.py",
                 "c/__init__.py", "c/a.py", "a/base.py", "b/base.py"):
        (pkg / path).parent.mkdir(parents=True, exist_ok=True)
        (pkg / path).write_text("")
    assert name_clashes(pkg) == {"layer": ["moeflow/a/layer.py", "moeflow/b/layer.py"],
                                 "a": ["moeflow/a/", "moeflow/c/a.py"]}


def test_no_two_modules_share_a_name():
    clashes = name_clashes(ROOT)
    assert not clashes, ("module names used twice (rename one so that each name says one "
                         f"thing, or add a role name with its meaning): {clashes}")
