"""The packages that hold registries (routers, codecs, all-to-all algorithms, schedulers) and
moeflow.config do not import each other: config validates names through moeflow.registry, and
the registries raise moeflow.errors.ConfigError. Checked on the import statements of the source
(module level and inside functions), following moeflow-internal imports transitively."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REGISTRY_PACKAGES = ["moeflow.routing", "moeflow.comm.codecs", "moeflow.comm.alltoall",
                     "moeflow.schedule"]


def _file(mod: str) -> Path | None:
    p = ROOT / Path(*mod.split("."))
    for f in (p / "__init__.py", p.with_suffix(".py")):
        if f.is_file():
            return f
    return None


def _imports(mod: str) -> set[str]:
    """moeflow modules that ``mod`` imports anywhere in its source (the parent packages of each,
    except the top-level ``moeflow`` facade, which imports everything on purpose)."""
    f = _file(mod)
    pkg = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                                + ([base] if base else []))
            names = [f"{base}.{a.name}" if _file(f"{base}.{a.name}") else base
                     for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            found |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)
                      if parts[0] == "moeflow" and _file(".".join(parts[:i]))}
    return found


def _closure(start: list[str]) -> set[str]:
    seen, todo = set(), list(start)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += _imports(m)
    return seen


def _modules(pkg: str) -> list[str]:
    base = ROOT / Path(*pkg.split("."))
    return [pkg + "".join(f".{p}" for p in f.relative_to(base).with_suffix("").parts
                          if p != "__init__") for f in base.rglob("*.py")]


def test_config_imports_no_registry_package():
    reached = _closure(["moeflow.config"])
    bad = sorted(m for m in reached if any(m == p or m.startswith(p + ".")
                                           for p in REGISTRY_PACKAGES))
    assert not bad, f"moeflow.config imports {bad}; look names up with moeflow.registry.registry"


def test_registry_packages_do_not_import_config():
    for pkg in REGISTRY_PACKAGES:
        reached = _closure(_modules(pkg))
        assert "moeflow.config" not in reached, \
            f"{pkg} reaches moeflow.config; import ConfigError from moeflow.errors"


def test_each_registry_package_imports_first_in_a_fresh_interpreter():
    code = ("import importlib, sys\n"
            "for m in sys.argv[1:]: importlib.import_module(m)\n"
            "from moeflow.config import ConfigError, MoEConfig\n"
            "from moeflow.errors import ConfigError as E\n"
            "assert ConfigError is E\n"
            "MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2, codec='zfp')\n"
            "print('ok')")
    for order in (REGISTRY_PACKAGES, REGISTRY_PACKAGES[::-1], ["moeflow.registry"]):
        out = subprocess.run([sys.executable, "-c", code, *order], cwd=ROOT, text=True,
                             capture_output=True, env={"PYTHONPATH": str(ROOT)})
        assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_balance_loss_names_agree():
    from moeflow import config
    from moeflow.routing import losses

    assert config.BALANCE_LOSSES == losses.BALANCE_LOSSES
