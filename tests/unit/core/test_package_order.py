"""The package order (docs/design.md, "Package order"): no circle between packages at any level
of the tree, not only between modules. At each package, its children (sub-packages and
modules) are collapsed to single nodes and the imports between them must form no circle: e.g.
``moeflow.dispatch`` importing ``moeflow.comm`` while a module of ``moeflow.comm`` imports
``moeflow.dispatch`` is a circle of packages even when no two modules import each other."""

from __future__ import annotations

from tests.unit.core.test_import_layers import ROOT, _cycles, _graph


def _packages() -> list[str]:
    """Every moeflow package (a folder with ``__init__.py``), ``moeflow`` included."""
    base = ROOT / "moeflow"
    return sorted("moeflow" + "".join(f".{p}" for p in d.relative_to(base).parts)
                  for d in [base, *base.rglob("*")] if (d / "__init__.py").is_file())


def _child(pkg: str, mod: str) -> str | None:
    """The child of ``pkg`` that contains ``mod`` (None outside ``pkg`` or for ``pkg`` itself)."""
    if not mod.startswith(pkg + "."):
        return None
    return pkg + "." + mod[len(pkg) + 1:].split(".")[0]


def package_graph(pkg: str, graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``pkg``'s children -> the children they import (through any module inside them)."""
    out: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        src = _child(pkg, mod)
        if src is None:
            continue
        out.setdefault(src, set())
        for t in targets:
            dst = _child(pkg, t)
            if dst is not None and dst != src:
                out[src].add(dst)
    return out


def test_collapsing_finds_a_package_circle_without_a_module_circle():
    graph = {"moeflow.a.x": {"moeflow.b.y"}, "moeflow.a.z": set(),
             "moeflow.b.y": set(), "moeflow.b.w": {"moeflow.a.z"}}
    assert _cycles(graph) == []
    assert _cycles(package_graph("moeflow", graph)) == [["moeflow.a", "moeflow.b"]]


def test_no_circle_between_packages_at_any_level():
    graph = _graph()
    found = []
    for pkg in _packages():
        found += [" <-> ".join(c) for c in _cycles(package_graph(pkg, graph))]
    assert not found, ("circles between packages (move the shared piece into a package below "
                       "both, see docs/design.md 'Package order'): " + "; ".join(found))


DESIGN = ROOT / "docs" / "design.md"


def drawn_order(text: str) -> list[list[str]]:
    """The rows of docs/design.md's "Package order" drawing, top first."""
    block = text.split("## Package order", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    return [row.split() for row in block.strip().splitlines()]


def test_every_import_goes_down_the_drawn_order():
    rows = drawn_order(DESIGN.read_text())
    level = {name: len(rows) - i for i, row in enumerate(rows) for name in row}
    graph = {k.split(".", 1)[1]: {v.split(".", 1)[1] for v in vs}
             for k, vs in package_graph("moeflow", _graph()).items()}
    drawn = [n for row in rows for n in row]
    assert sorted(drawn) == sorted(set(drawn)) == sorted(graph), (
        "docs/design.md 'Package order' must name every moeflow package and top-level module "
        f"once: missing {sorted(set(graph) - set(drawn))}, extra {sorted(set(drawn) - set(graph))}")
    up = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                if level[b] >= level[a])
    assert not up, f"imports that do not go down docs/design.md's 'Package order': {up}"
