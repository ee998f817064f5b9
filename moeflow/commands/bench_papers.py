"""The paper benchmarks of ``moeflow bench``: found by path in the source checkout.

The reproductions of the papers' experiments (HECATE, Parm, SMILE, BigMac, DeepSeek-V3's
node-limited routing, the end-to-end training runs) live in ``benchmarks/<paper>/`` beside the
package, not in it: the library never imports them. Each paper's folder has a ``commands.py``
whose ``register_bench(bsub)`` adds its ``moeflow bench NAME`` subcommands; this module finds
those folders in the checkout this moeflow runs from, puts the checkout's root on ``sys.path``
(spawned ranks inherit it, so they import the same modules) and calls each registration.

Installed without a checkout, ``moeflow bench hecate`` fails with a message saying where the
paper benchmarks live (:class:`BenchChoices`) instead of argparse's bare "invalid choice".
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Mapping
from pathlib import Path

CHECKOUT_ROOT = Path(__file__).resolve().parents[2]


def benchmarks_dir(root: Path | None = None) -> Path | None:
    """``benchmarks/`` of the source checkout holding this moeflow, or None when moeflow runs
    from an installed copy (no ``benchmarks/__init__.py`` beside the package)."""
    folder = (root or CHECKOUT_ROOT) / "benchmarks"
    return folder if (folder / "__init__.py").is_file() else None


def paper_folders(root: Path | None = None) -> list[str]:
    """The paper folders of ``benchmarks/`` that register subcommands (have ``commands.py``),
    sorted by name; [] outside a checkout."""
    folder = benchmarks_dir(root)
    if folder is None:
        return []
    return sorted(p.name for p in folder.iterdir() if (p / "commands.py").is_file()
                  and (p / "__init__.py").is_file())


def import_from_checkout(module: str, root: Path | None = None):
    """``benchmarks.<...>`` of the checkout at ``root``, imported by its path (the root goes on
    ``sys.path`` first, so that ranks spawned later import the same module)."""
    root = root or CHECKOUT_ROOT
    if benchmarks_dir(root) is None:
        raise SystemExit(f"moeflow bench: {module} is a paper benchmark of the source checkout "
                         f"(benchmarks/ beside the package), and there is none under {root}; "
                         "run it from a clone of the moeflow repository")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(module)


def register_paper_benchmarks(bsub, root: Path | None = None) -> list[str]:
    """Call ``register_bench(bsub)`` of every ``benchmarks/<paper>/commands.py``; returns the
    papers registered."""
    papers = paper_folders(root)
    for paper in papers:
        import_from_checkout(f"benchmarks.{paper}.commands", root).register_bench(bsub)
    return papers


class _BenchNames(Mapping):
    """The subcommands by name (a view of the parser map); without a checkout every name passes
    argparse's choice check, so that :meth:`BenchChoices.__call__` can say where the paper
    benchmarks are."""

    def __init__(self, parsers: dict):
        self._parsers = parsers

    def __getitem__(self, name):
        return self._parsers[name]

    def __iter__(self):
        return iter(self._parsers)

    def __len__(self) -> int:
        return len(self._parsers)

    def __contains__(self, name) -> bool:
        return name in self._parsers or benchmarks_dir() is None


class BenchChoices(argparse._SubParsersAction):
    """``moeflow bench``'s subcommands: an unknown name, when moeflow runs without its source
    checkout, says that the paper benchmarks live there (argparse alone says "invalid
    choice")."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.choices = _BenchNames(self._name_parser_map)

    def __call__(self, parser, namespace, values, option_string=None):
        name = values[0]
        if name not in self._name_parser_map and benchmarks_dir() is None:
            raise argparse.ArgumentError(
                self, f"{name!r} is not a benchmark of the installed package "
                      f"({', '.join(sorted(self._name_parser_map))}); the paper benchmarks "
                      "(hecate, parm, smile, bigmac, group-limited, recompute, ...) live in the "
                      "source checkout's benchmarks/ folder, not in the package: run "
                      "`moeflow bench NAME` from a clone of the moeflow repository")
        return super().__call__(parser, namespace, values, option_string)
