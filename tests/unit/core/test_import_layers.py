"""The package's layers, checked on the import statements of the source (module level and inside
functions), following moeflow-internal imports transitively:

- the packages that hold registries (routers, codecs, all-to-all algorithms, schedulers) and
  moeflow.config do not import each other: config validates names through moeflow.registry,
  and the registries raise moeflow.errors.ConfigError; config does not reach the integrations;
- no import circle among moeflow modules;
- only the command layer (moeflow.bench, moeflow.commands, moeflow.cli) imports the benchmarks
  and the commands, and the package never imports the paper benchmarks and peer harnesses in
  benchmarks/ (the CLI finds them by path); the simulate commands use moeflow.cases, not the
  benchmarks' code; moeflow/bench (the generic harness) stays under 2.5k lines;
- the measurement core moeflow.measure imports nothing above it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
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


def _ancestors(mod: str) -> set[str]:
    parts = mod.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _graph(pkg: str = "moeflow") -> dict[str, set[str]]:
    """Module -> the moeflow modules it imports. A module's own parent packages are left out:
    importing a sibling runs the parent's ``__init__``, which may gather its submodules (the
    usual package layout), and that is no circle of the code."""
    return {m: _imports(m) - _ancestors(m) - {"moeflow"} for m in _modules(pkg)}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


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


def test_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_circle():
    cycles = _cycles(_graph())
    assert not cycles, ("import circles among moeflow modules (move the shared piece into a "
                        "module below both): " + "; ".join(" <-> ".join(c) for c in cycles))


TOP_LAYER = ("moeflow.bench", "moeflow.commands", "moeflow.cli")


def _in(mod: str, pkgs) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in pkgs)


def test_only_the_command_layer_imports_bench_and_commands():
    bad = sorted(f"{m} -> {t}" for m, targets in _graph().items() if not _in(m, TOP_LAYER)
                 for t in targets if _in(t, ("moeflow.bench", "moeflow.commands")))
    assert not bad, ("modules below the command layer import the benchmarks or the commands "
                     f"(move what they need below, e.g. into moeflow.measure): {bad}")


def test_package_never_imports_the_peer_harnesses():
    bad = []
    for mod in _modules("moeflow"):
        for node in ast.walk(ast.parse(_file(mod).read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{mod} -> {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert not bad, f"the package imports the peer harnesses under benchmarks/: {bad}"


MEASURE_MAY_USE = ("moeflow.measure", "moeflow.errors", "moeflow.registry", "moeflow.devices")


def test_measure_imports_nothing_above_it():
    reached = _closure(_modules("moeflow.measure")) - {"moeflow"}
    bad = sorted(m for m in reached if not _in(m, MEASURE_MAY_USE))
    assert not bad, (f"moeflow.measure reaches {bad}; it may use only torch, numpy, the standard "
                     f"library and {', '.join(MEASURE_MAY_USE[1:])}")


def test_config_does_not_reach_the_integrations():
    reached = _closure(["moeflow.config"])
    bad = sorted(m for m in reached if _in(m, ("moeflow.integrations",)))
    assert not bad, f"moeflow.config reaches {bad}; the integrations build on config, not back"


# the step simulator models the library's own task graphs (schedulers, dispatch planning) from
# measured fits (moeflow.measure); it is below the command layer and never runs a benchmark.
# Parm's and HECATE's sizes come from the library's own code (the layout arithmetic of
# moeflow.topology, moeflow.strategies.parm, HECATE's placement and spAG / spRS volumes)
# and BigMac's widths from the layer's own MoEConfig and moeflow.experts.structure
SIMULATE_MAY_IMPORT = ("moeflow.simulate", "moeflow.measure", "moeflow.schedule",
                       "moeflow.dispatch", "moeflow.errors", "moeflow.registry",
                       "moeflow.topology", "moeflow.strategies.parm", "moeflow.strategies.fssdp",
                       "moeflow.comm.sparse", "moeflow.comm.alltoall.phases",
                       "moeflow.config", "moeflow.experts.structure")


def test_simulate_imports_only_the_model_inputs():
    bad = sorted(f"{m} -> {t}" for m in _modules("moeflow.simulate")
                 for t in _imports(m) - _ancestors(m) - {"moeflow"}
                 if not _in(t, SIMULATE_MAY_IMPORT)       # a package above one (its __init__)
                 and not any(p.startswith(t + ".") for p in SIMULATE_MAY_IMPORT))
    assert not bad, (f"moeflow.simulate imports {bad}; it may import only "
                     f"{', '.join(SIMULATE_MAY_IMPORT[1:])} (never moeflow.bench or "
                     "moeflow.commands: what it needs from them belongs in moeflow.measure)")
    reached = _closure(_modules("moeflow.simulate"))
    assert not any(_in(m, ("moeflow.bench", "moeflow.commands")) for m in reached)


def test_simulate_commands_plan_from_the_cases_not_the_benchmarks():
    sims = [m for m in _modules("moeflow.commands") if m.rpartition(".")[2].startswith("simulate")]
    reached = _closure(sims)
    bad = sorted(m for m in reached if _in(m, ("moeflow.bench",))
                 and m not in ("moeflow.bench", "moeflow.bench.a2a_count"))   # "counting"
    assert not bad, (f"moeflow simulate reaches {bad}; the configs, inputs and routing it shares "
                     "with a benchmark belong in moeflow.cases")


def test_bench_harness_stays_small():
    lines = sum(len(f.read_text().splitlines()) for f in (ROOT / "moeflow" / "bench").glob("*.py"))
    assert lines < 2500, (f"moeflow/bench has {lines} lines; a paper's reproduction belongs in "
                          "benchmarks/<paper>/ (registered by its commands.py)")

