"""docs/design.md: its plug-in example runs, and nothing points at a DESIGN.md that the
repository does not have."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "design.md"


def _example() -> str:
    text = DOC.read_text()
    start = text.index("An example that registers one part of each kind")
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


@pytest.fixture
def restored_registries():
    """The example registers parts process-wide; remove them afterwards so that tests which
    list the registered names (tests/unit/core/test_config.py) see only the built-in ones."""
    from moeflow.registry import PACKAGES, registry

    before = {kind: dict(registry(kind)) for kind in PACKAGES}
    yield
    for kind, parts in before.items():
        reg = registry(kind)
        reg.clear()
        reg.update(parts)


def test_plug_in_example_runs(restored_registries):
    namespace: dict = {"__name__": "design_example"}
    exec(compile(_example(), str(DOC), "exec"), namespace)
    import moeflow as mf
    from moeflow.schedule import SCHEDULERS

    layer = namespace["layer"]
    assert isinstance(layer.router, mf.Router) and layer.router.name == "example-hash"
    assert layer.codec.name == "example-half" and layer.algo.name == "example-direct"
    assert "example-reverse" in SCHEDULERS


def test_no_dangling_design_references():
    files = [ROOT / "README.md", *ROOT.glob("moeflow/**/*.py"), *ROOT.glob("docs/**/*.md")]
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in files
           for i, line in enumerate(p.read_text().splitlines(), 1) if "DESIGN.md" in line]
    assert not bad, f"references to a DESIGN.md the repository does not have: {bad}"


def test_modules_named_in_the_layout_exist():
    text = DOC.read_text()
    block = text[text.index("## Package layout"):text.index("## The path of a token")]
    for name in re.findall(r"^  ([a-z_]+(?:\.py|/))", block, re.M):
        assert (ROOT / "moeflow" / name).exists(), name
    for path in re.findall(r"`((?:moeflow|tests|docs)/[\w/]+\.(?:py|md))`", text):
        assert (ROOT / path).exists(), path
