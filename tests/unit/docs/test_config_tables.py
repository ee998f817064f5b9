"""docs/guide.md's configuration tables list every field of ``MoEConfig``, ``ModelConfig`` and
``TrainConfig`` (and no field that does not exist), so the reference cannot fall behind the
dataclasses."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from moeflow.config import ModelConfig, MoEConfig, TrainConfig

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "guide.md"


def table_fields(text: str, intro: str) -> set[str]:
    """The backticked names in the first column of the table after the line starting with
    ``intro`` (e.g. "`MoEConfig` fields")."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(intro))
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    names: set[str] = set()
    for row in rows[2:]:                              # past the header and its rule
        first = row.split("|")[1]
        names |= set(re.findall(r"`([a-z_][a-z0-9_]*)`", first))
    return names


@pytest.mark.parametrize("cls", [MoEConfig, ModelConfig, TrainConfig], ids=lambda c: c.__name__)
def test_guide_table_lists_every_field(cls):
    listed = table_fields(GUIDE.read_text(), f"`{cls.__name__}`")
    fields = {f.name for f in dataclasses.fields(cls)}
    assert not fields - listed, f"docs/guide.md's {cls.__name__} table misses {fields - listed}"
    assert not listed - fields, f"docs/guide.md's {cls.__name__} table names {listed - fields}"


def test_table_reader_sees_a_missing_field():
    text = "`Cfg` fields:\n\n| field | meaning |\n|---|---|\n| `a`, `b` | x |\n| `c` | y |\n\n"
    assert table_fields(text, "`Cfg`") == {"a", "b", "c"}
    assert table_fields(text.replace("| `c` | y |\n", ""), "`Cfg`") == {"a", "b"}
