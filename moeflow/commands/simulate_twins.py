"""``moeflow simulate layer --measured FILE``: each predicted row's measured twin.

FILE is the JSON ``--out`` of one of three measurements, told apart by its keys:

* ``moeflow bench layer`` (``results``): the ``ep`` rows, matched by the config's name; the
  row's ``codec`` / ``codec_backward`` (absent in older files: ``none``) must be ``--codec`` /
  ``--codec-backward``'s, and the tokens and widths the command's;
* ``moeflow bench parm`` (``rows`` with ``fits``; Parm Section V's Table III grid): the
  ``parm:baseline`` / ``parm:s1`` / ``parm:s2`` / ``parm:s2-aas`` rows, matched by the layer
  (tokens, widths, experts, top-k, capacity factor, activation) and the layout (N_MP, N_EP,
  N_ESP, ESP placement, nodes x ranks per node) to one grid row, whose ``step_ms`` of that
  schedule is the twin;
* ``moeflow bench hecate`` (``rows`` with ``options``; HECATE Section 5's skewed loads): the
  ``fssdp:static`` (``fssdp static``), ``fssdp:sparse`` (``fssdp alg1``, or ``fssdp alg1 rm``
  with ``rematerialize``: Algorithm 1 with the bench's ``t`` and ``m``) and ``ep`` rows, at the
  skew ``--zipf S`` (the bench row's ``zipf_s``).

A Parm or FSSDP row without a twin in such a file is refused, naming every field in which the
nearest measured row differs and the flag that sets it here. The routing of those rows is the
measured run's: both benches build their router from the config alone and never change it
(bench hecate: skewed once, no ``--drift``), so :func:`routing` plans the expert ids their
routers pick on their inputs (``case_routing`` of :mod:`moeflow.cases.parm_grid` /
:mod:`moeflow.cases.skewed`), as ``--routing bench`` does for bench layer.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass, fields

from moeflow.config import MoEConfig

PARM_LABELS = {"baseline": "baseline", "s1": "s1", "s2": "s2", "s2-aas": "s2-aas"}
_DEFAULT_ACTIVATION = {f.name: f.default for f in fields(MoEConfig)}["activation"]


@dataclass
class Measured:
    """A ``--measured`` file: ``kind`` is ``layer``, ``parm`` or ``hecate``."""

    kind: str
    path: str
    data: dict

    @property
    def command(self) -> str:
        return {"layer": "moeflow bench layer", "parm": "moeflow bench parm",
                "hecate": "moeflow bench hecate"}[self.kind]

    def layout(self) -> dict:
        """world, nodes, ranks_per_node from the bench's ``topology`` (its world Topology)."""
        m = re.search(r"world=(\d+), nodes=(\d+)x(\d+)", self.data.get("topology", ""))
        if not m:
            raise SystemExit(f"moeflow simulate layer: --measured {self.path}: its topology "
                             f"{self.data.get('topology')!r} does not give the world and the "
                             f"nodes; rerun `{self.command} --out`")
        world, nodes, per = (int(v) for v in m.groups())
        return {"world": world, "nodes": nodes, "ranks_per_node": per}


def load(path: str | None) -> Measured | None:
    """Read and classify ``--measured``'s file (None without one)."""
    if not path:
        return None
    with open(path) as f:
        data = json.load(f)
    if "speedup_fine_over_bigmac" in data:
        raise SystemExit(f"moeflow simulate layer: --measured {path} is a `bench bigmac` file: "
                         "predict it with `moeflow simulate bigmac` and bench bigmac's "
                         "arguments, --measured FILE")
    if "results" in data:
        return Measured("layer", path, data)
    if "rows" in data and "fits" in data:
        return Measured("parm", path, data)
    if "rows" in data and "options" in data:
        return Measured("hecate", path, data)
    raise SystemExit(f"moeflow simulate layer: --measured {path} is not the --out JSON of "
                     "`moeflow bench layer`, `bench parm` or `bench hecate`")


def check_variants(measured: Measured | None, names: list[str]) -> None:
    """Refuse a Parm / HECATE file when no variant would take its rows."""
    if measured is None:
        return
    if measured.kind == "parm" and not any(n.startswith("parm:") for n in names):
        raise SystemExit(f"moeflow simulate layer: --measured {measured.path} holds `bench "
                         "parm` rows, which are the twins of Parm's variants: add --compare "
                         "parm:baseline,parm:s1,parm:s2")
    if measured.kind == "hecate" and not any(n.startswith("fssdp:") for n in names):
        raise SystemExit(f"moeflow simulate layer: --measured {measured.path} holds `bench "
                         "hecate` rows, which are the twins of the FSSDP variants: add "
                         "--compare fssdp:static,fssdp:sparse")


def routing(args: argparse.Namespace, case, spec, measured: Measured | None):
    """``(routing, how)`` of the measured run for a Parm / HECATE file, else None (the caller
    plans bench layer's or the sample the flags ask for)."""
    if measured is None or measured.kind == "layer":
        return None
    if measured.kind == "hecate":
        opts = measured.data["options"]
        if opts.get("drift", 0):
            raise SystemExit(f"moeflow simulate layer: --measured {measured.path}: bench "
                             f"hecate ran with --drift {opts['drift']} (the loads move between "
                             "steps), which one routing cannot stand for; measure with --drift "
                             "0")
        if args.zipf is None or args.router_trace is not None or args.routing is not None:
            raise SystemExit(f"moeflow simulate layer: --measured {measured.path} (bench "
                             "hecate): give --zipf S, the skew of the bench rows to compare "
                             f"(the file has {_zipfs(measured)}), and no --routing / "
                             "--router-trace: the routing is bench hecate's own router at S")
        from moeflow.cases.skewed import case_routing

        return (case_routing(args.tokens, args.d_model, args.d_expert, case.num_experts,
                             case.top_k, args.zipf, spec.world),
                f"bench hecate, zipf {args.zipf}")
    if args.zipf is not None or args.router_trace is not None or args.routing == "uniform":
        return None                                      # the flags choose another routing
    from moeflow.cases.parm_grid import case_routing

    return (case_routing(args.tokens, args.d_model, case.num_experts, case.top_k,
                         case.capacity_factor, spec.world, args.mp), "bench parm")


def _zipfs(measured: Measured) -> list:
    return list(dict.fromkeys(r["zipf_s"] for r in measured.data["rows"]))


def _same(a, b) -> bool:
    def num(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if num(a) and num(b):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


def _nearest(measured: Measured, want: dict, rows: list[dict], what: str) -> dict:
    """The row of ``rows`` equal to ``want`` (field -> (value here, flag)) in every field, or
    SystemExit naming each field in which the nearest rows (the fewest fields apart, at most
    three) differ."""
    diffs = []
    for row in rows:
        diff = [(k, row.get(k), v, flag) for k, (v, flag) in want.items()
                if not _same(row.get(k), v)]
        if not diff:
            return row
        diffs.append(diff)
    if not diffs:
        raise SystemExit(f"moeflow simulate layer: --measured {measured.path} has no "
                         f"{measured.command} row for {what}")
    fewest = min(len(d) for d in diffs)
    near = list(dict.fromkeys(
        "; ".join(f"{k} (measured {m!r}, here {v!r}: {flag})" for k, m, v, flag in d)
        for d in diffs if len(d) == fewest))[:3]
    raise SystemExit(
        f"moeflow simulate layer: --measured {measured.path} has no {measured.command} row "
        f"for {what}: the nearest " + ("differs in " if len(near) == 1 else
                                       f"{len(near)} differ in ")
        + " | ".join(near) + ". Give simulate layer the bench command's values")


def _layout_want(spec) -> dict:
    return {"world": (spec.world, "--nodes x --ranks-per-node (or --nproc, --local-size)"),
            "nodes": (spec.nodes, "--nodes (or --nproc / --local-size)"),
            "ranks_per_node": (spec.ranks_per_node, "--ranks-per-node (or --local-size)")}


def _layer_want(args: argparse.Namespace, case) -> dict:
    custom = " (with --custom-layer)"
    return {"tokens_per_rank": (args.tokens, "--tokens"),
            "d_model": (args.d_model, "--d-model"), "d_expert": (args.d_expert, "--d-expert"),
            "num_experts": (case.num_experts, "--num-experts" + custom),
            "top_k": (case.top_k, "--top-k" + custom),
            "capacity_factor": (case.capacity_factor, "--capacity-factor" + custom
                                + ", 0: dropless"),
            "activation": (case.activation, "--activation" + custom)}


def parm_twin(args: argparse.Namespace, case, spec, sched: str, measured: Measured) -> dict:
    """The bench parm grid row of this layer and layout, and its ``sched`` step."""
    ep = args.ep_size if args.ep_size is not None else spec.world // args.esp
    want = {**_layer_want(args, case), **_layout_want(spec),
            "n_mp": (args.mp, "--mp"), "n_ep": (ep, "--ep-size"), "n_esp": (args.esp, "--esp"),
            "esp_in_node": (args.esp_placement == "esp-in-node", "--esp-placement")}
    lay = measured.layout()
    rows = [{"activation": _DEFAULT_ACTIVATION, **lay, **r} for r in measured.data["rows"]]
    row = _nearest(measured, want, rows, f"parm:{sched} of config {case.name}")
    if sched not in row["step_ms"]:
        raise SystemExit(f"moeflow simulate layer: --measured {measured.path}: the bench "
                         f"parm row has no {sched} step (it has {sorted(row['step_ms'])})")
    return {"measured_step_ms": row["step_ms"][PARM_LABELS[sched]],
            "measured_world": lay["world"], "measured_variant": f"bench parm {sched}"}


def hecate_twin(args: argparse.Namespace, case, spec, variant: str, measured: Measured,
                fssdp=None) -> dict | None:
    """The bench hecate row of this layer, skew and variant (``ep`` rows: None where the file
    has no ``ep`` row); ``fssdp``: the row's FSSDPSpec (``--fssdp``)."""
    opts = measured.data["options"]
    lay = measured.layout()
    label = "ep"
    want = {**_layer_want(args, case), **_layout_want(spec),
            "zipf_s": (args.zipf, "--zipf")}
    if variant == "fssdp:static":
        label = "fssdp static"
    elif variant == "fssdp:sparse":
        fs = fssdp
        m = fs.memory_capacity
        if m is None:                    # the layer's default: the experts a rank owns
            m = case.num_experts // spec.world
        label = "fssdp alg1 rm" if fs.rematerialize else "fssdp alg1"
        want.update(t=(fs.overlap_degree, "--fssdp overlap_degree"),
                    m=(m, "--fssdp memory_capacity"))
    base = {"tokens_per_rank": opts["tokens"], "d_model": opts["d_model"],
            "d_expert": opts["d_expert"],
            "num_experts": opts["experts_per_rank"] * lay["world"], "top_k": opts["top_k"],
            "capacity_factor": None, "activation": _DEFAULT_ACTIVATION, "t": opts["t"],
            "m": opts["m"], **lay}
    # the layer's fields from the options (a row's own tokens_per_rank is its loads per rank)
    rows = [{**r, **base} for r in measured.data["rows"] if r["variant"] == label]
    if not rows:
        if variant == "ep":
            return None
        raise SystemExit(f"moeflow simulate layer: --measured {measured.path} has no "
                         f"{label!r} rows ({variant}); run bench hecate with that variant in "
                         "--variants")
    row = _nearest(measured, want, rows, f"{variant} of config {case.name}")
    return {"measured_step_ms": row["step_ms"], "measured_world": lay["world"],
            "measured_variant": f"bench hecate {label}"}


def twin(args: argparse.Namespace, res: dict, case, spec, measured: Measured | None,
         fssdp=None) -> dict | None:
    """The measured fields of one predicted row (None: no twin); ``fssdp``: an FSSDP row's
    FSSDPSpec."""
    if measured is None:
        return None
    variant = res["variant"]
    if measured.kind == "layer":
        rows = {r["name"]: r for r in measured.data["results"]}
        if variant != "ep" or case.name not in rows:
            return None
        m = rows[case.name]
        for name, here, flag in (("codec", args.codec, "--codec"),
                                 ("codec_backward", args.codec_backward, "--codec-backward"),
                                 ("tokens_per_rank", args.tokens, "--tokens"),
                                 ("d_model", args.d_model, "--d-model"),
                                 ("d_expert", args.d_expert, "--d-expert"),
                                 ("num_experts", case.num_experts, "--num-experts")):
            got = m.get(name, {"codec": "none", "codec_backward": False}.get(name))
            if got != here:
                raise SystemExit(f"moeflow simulate layer: --measured {measured.path}: row "
                                 f"{case.name} was measured with {name}={got!r}, here "
                                 f"{here!r} ({flag}); give the bench layer command's "
                                 "arguments")
        return {"measured_step_ms": m["step_ms"], "measured_world": m["world_size"]}
    if measured.kind == "parm":
        if not variant.startswith("parm:"):
            return None
        return parm_twin(args, case, spec, variant.split(":", 1)[1], measured)
    if variant.startswith("fssdp:") or variant == "ep":
        return hecate_twin(args, case, spec, variant, measured, fssdp)
    return None
