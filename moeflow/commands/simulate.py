"""``moeflow simulate layer``: predict ``moeflow bench layer``'s table from measured fits.

Takes exactly ``bench layer``'s arguments (:func:`moeflow.commands.bench.add_layer_args`), so
every predicted row has a measured twin, plus the models: ``--links`` / ``--compute`` (the JSON
of ``moeflow bench links`` / ``bench compute``) or ``--profile NAME`` (a datasheet,
:mod:`moeflow.measure.profiles`), and the layout ``--nodes x --ranks-per-node`` (default: one
node of ``--nproc`` ranks, the world ``bench layer --nproc`` runs). The simulator itself is
:mod:`moeflow.simulate` (ScheMoE Section 4's lanes on every rank).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

import torch

from moeflow.bench.layer import case_routing, cases_for
from moeflow.commands.bench import add_layer_args
from moeflow.commands.common import run_meta
from moeflow.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("simulate", help="predict a step from measured fits (no ranks started)")
    ssub = p.add_subparsers(dest="simulate", required=True, metavar="WHAT")
    layer = ssub.add_parser("layer", help="predict `moeflow bench layer` (same arguments) from "
                                          "link and compute fits or a hardware profile")
    add_layer_args(layer)
    g = layer.add_argument_group("the models and the layout")
    g.add_argument("--links", default=None, metavar="JSON",
                   help="link fits from `moeflow bench links --out` (default: the profile's)")
    g.add_argument("--compute", default=None, metavar="JSON",
                   help="compute fits from `moeflow bench compute --out` (default: the "
                        "profile's)")
    g.add_argument("--profile", default=None, metavar="NAME",
                   help="a hardware profile (file or built-in name, e.g. schemoe-32gpu) for "
                        "what --links / --compute do not give")
    g.add_argument("--nodes", type=int, default=1, help="nodes of the simulated layout")
    g.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per node (default: --nproc, so nodes x ranks = bench layer's "
                        "world)")
    g.add_argument("--routing", default=None, choices=("bench", "uniform"),
                   help="bench (default): plan the expert ids each rank's router picks on "
                        "`bench layer`'s inputs, so the bytes and loads are the measured run's; "
                        "uniform: the expectation, tokens x top_k spread evenly over experts")
    skew = g.add_mutually_exclusive_group()
    skew.add_argument("--zipf", type=float, default=None, metavar="S",
                      help="skewed loads: plan a routing sample whose expert popularity is "
                           "Zipf(S), p_e ~ rank_e^-S, ranks shuffled as `bench hecate` does "
                           "(0: uniform draws)")
    skew.add_argument("--router-trace", default=None, metavar="FILE[:RUN[:LAYER]]",
                      help="skewed loads: plan a routing sample drawn from a trained router's "
                           "tokens per expert, the JSON of `python -m moeflow.bench.router_load "
                           "--out` (run RUN, MoE layer LAYER, after training; default 0:0)")
    g.add_argument("--routing-seed", type=int, default=0,
                   help="seed of the --zipf / --router-trace routing sample (default 0)")
    # --codec is bench layer's (its --compare flag), here applied to every row, as --a2a is
    g.add_argument("--codec-backward", action="store_true",
                   help="MoEConfig.codec_backward: with --codec NAME (every row's codec: its "
                        "encode / decode as the C / D tasks, timed by the `codec:NAME` fit of "
                        "`bench compute --codecs NAME`, and its bytes on the wire from the "
                        "codec's size function), compress the backward's payloads too")
    g.add_argument("--comm-lanes", default="thread", choices=("thread", "link"),
                   help="thread (default, the library): one communication thread runs every "
                        "collective in issue order; link: a lane per link class (intra, inter), "
                        "so the phases of successive hierarchical all-to-alls overlap")
    v = layer.add_argument_group(
        "variants: --compare A,B,... predicts every row under each (side by side, with the "
        "ratio to the first)",
        "ep (plain expert parallelism, the default); parm:baseline, parm:s1, parm:s2, "
        "parm:s2-aas (Parm's schedules on the --mp / --esp layout); fssdp:static, fssdp:sparse "
        "(HECATE's placement, --fssdp options); a2a:NAME, codec:NAME (expert parallelism "
        "with that all-to-all or codec). --compare tutel / moeflow-fixed (bench layer's peers) "
        "are not modelled")
    v.add_argument("--mp", type=int, default=1, help="Parm variants: the MP (tensor-parallel) "
                                                     "group size")
    v.add_argument("--esp", type=int, default=1, help="Parm variants: the ESP group size")
    v.add_argument("--ep-size", type=int, default=None,
                   help="Parm variants: the EP group size (default: ranks / --esp, as "
                        "`moeflow train`)")
    v.add_argument("--esp-placement", default="esp-in-node", choices=("esp-in-node",
                                                                       "ep-in-node"),
                   help="Parm variants: which groups sit inside a node (Section IV-A)")
    v.add_argument("--fssdp", default="{}", metavar="JSON",
                   help='FSSDP variants: MoEConfig.fssdp fields the model reads, e.g. '
                        '\'{"overlap_degree": 4, "memory_capacity": 1, "rematerialize": true}\' '
                        "(t and m as counts; materialize comes from the variant)")
    g.add_argument("--measured", default=None, metavar="JSON",
                   help="a `moeflow bench layer --out` file of the same arguments: adds the "
                        "measured step and the ratio predicted / measured per row")
    g.add_argument("--gantt", default=None, metavar="PREFIX",
                   help="write PREFIX-<config>.png: rank 0's predicted 7r tasks per lane, drawn "
                        "as `bench schedule --gantt` draws measured ones")
    layer.set_defaults(func=run_simulate_layer)


def _specs(args: argparse.Namespace):
    from moeflow.schedule import SCHEDULERS
    from moeflow.simulate import LayerSpec

    if args.codec.startswith("auto"):
        raise SystemExit(f"moeflow simulate layer: --codec {args.codec} (tuned at run time) is "
                         "not modelled; name a codec (none, fp16, int8, zfp, ...)")
    for name in ("tokens", "d_model", "d_expert", "nodes"):
        if getattr(args, name) < 1:
            raise SystemExit(f"moeflow simulate layer: --{name.replace('_', '-')} "
                             f"{getattr(args, name)} must be >= 1")
    per = args.ranks_per_node
    if per is None:       # bench layer's --local-size (ranks per emulated node), else --nproc
        per = args.nproc if args.local_size is None else args.local_size
    if args.local_size is not None and per != args.local_size:
        raise SystemExit(f"moeflow simulate layer: --local-size {args.local_size} and "
                         f"--ranks-per-node {per} disagree; give one of them")
    if args.local_size is not None and args.nodes == 1:      # bench layer's emulated nodes
        if args.nproc % args.local_size:
            raise SystemExit(f"moeflow simulate layer: --local-size {args.local_size} does not "
                             f"divide --nproc {args.nproc}; give ranks per node that divide it")
        args.nodes = args.nproc // args.local_size
    if per < 1:
        raise SystemExit(f"moeflow simulate layer: --ranks-per-node {per} must be >= 1")
    schedules = args.schedules.split(",")
    for s in schedules:
        if s not in SCHEDULERS:
            raise SystemExit(f"moeflow simulate layer: --schedules has {s!r}; choose from "
                             f"{', '.join(sorted(SCHEDULERS))}")
    algorithms = tuple(args.algorithms.split(","))     # bench layer's rows, config@algorithm
    if args.a2a != "auto":                 # --a2a (bench layer's --compare flag) for every row
        if algorithms != ("direct",):
            raise SystemExit("moeflow simulate layer: give --algorithms or --a2a, not both")
        algorithms = (args.a2a,)
    # capacity_padding="auto" trims on CPU and pads on CUDA (auto: where bench layer would run;
    # a CUDA run is predicted without a GPU here, so "cuda" is not checked for one)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    out = []
    for case in cases_for(schedules, args.pipeline_degree, algorithms):
        if case.num_experts % (args.nodes * per):
            raise SystemExit(f"moeflow simulate layer: bench layer's config {case.name} has "
                             f"{case.num_experts} experts, which do not divide among --nodes "
                             f"{args.nodes} x --ranks-per-node {per} ranks (bench layer could "
                             "not run this layout either); choose a layout whose ranks divide "
                             f"{case.num_experts}")
        try:
            out.append((case, LayerSpec(
                tokens=args.tokens, d_model=args.d_model, d_expert=args.d_expert,
                num_experts=case.num_experts, top_k=case.top_k,
                capacity_factor=case.capacity_factor, activation=case.activation,
                schedule=case.schedule, pipeline_degree=case.pipeline_degree, a2a=case.a2a,
                nodes=args.nodes, ranks_per_node=per,
                trim_padding=not cuda, comm_lanes=args.comm_lanes, codec=args.codec,
                codec_backward=args.codec_backward)))
        except ConfigError as e:
            raise SystemExit(f"moeflow simulate layer: config {case.name}: {e}") from None
    return out


PEERS = ("tutel", "moeflow-fixed", "deepspeed")
VARIANTS = ("ep", "parm:baseline", "parm:s1", "parm:s2", "parm:s2-aas", "fssdp:static",
            "fssdp:sparse")


def variants(args: argparse.Namespace) -> list[str]:
    """The ``--compare`` variants (default: ``ep``), each checked."""
    from moeflow.registry import registry

    if args.compare is None:
        return ["ep"]
    out = [v.strip() for v in args.compare.split(",") if v.strip()]
    for v in out:
        if v in PEERS:
            raise SystemExit(f"moeflow simulate layer: --compare {v} (a peer's layer) is not "
                             "modelled; compare moeflow's own variants: "
                             f"{', '.join(VARIANTS)}, a2a:NAME, codec:NAME")
        kind, _, name = v.partition(":")
        ok = (v in VARIANTS or (kind == "a2a" and name) or
              (kind == "codec" and name in registry("codec")))
        if not ok:
            raise SystemExit(f"moeflow simulate layer: --compare has {v!r}; choose from "
                             f"{', '.join(VARIANTS)}, a2a:NAME, codec:NAME (a registered codec)")
    if len(set(out)) != len(out):
        raise SystemExit(f"moeflow simulate layer: --compare {args.compare} names a variant "
                         "twice")
    return out


def _parm_spec(args: argparse.Namespace, case, spec, sched: str):
    from moeflow.simulate.parm import ParmSpec

    if spec.pipeline_degree > 1 or spec.codec != "none":
        raise SystemExit(f"moeflow simulate layer: --compare parm:{sched}: the Parm model runs "
                         f"one chunk without codecs, and row {case.name} has pipeline_degree "
                         f"{spec.pipeline_degree}, codec {spec.codec}; give --schedules "
                         "sequential and --codec none")
    ep = args.ep_size if args.ep_size is not None else spec.world // args.esp
    try:
        return ParmSpec(tokens=spec.tokens, d_model=spec.d_model, d_expert=spec.d_expert,
                        num_experts=spec.num_experts, top_k=spec.top_k,
                        capacity_factor=spec.capacity_factor, mp=args.mp, ep=ep, esp=args.esp,
                        esp_in_node=args.esp_placement == "esp-in-node",
                        schedule=sched.split("-")[0], saa=sched != "s2-aas",
                        activation=spec.activation, nodes=spec.nodes,
                        ranks_per_node=spec.ranks_per_node)
    except ConfigError as e:
        raise SystemExit(f"moeflow simulate layer: --compare parm:{sched}: {e} (flags --mp, "
                         "--esp, --ep-size, --esp-placement)") from None


def _fssdp_spec(args: argparse.Namespace, mode: str):
    from moeflow.simulate.fssdp import FSSDPSpec

    try:
        opts = json.loads(args.fssdp)
    except json.JSONDecodeError as e:
        raise SystemExit(f"moeflow simulate layer: --fssdp {args.fssdp!r} is not JSON: {e}")
    known = {"overlap_degree", "memory_capacity", "rematerialize"}
    extra = set(opts) - known
    if extra:
        raise SystemExit(f"moeflow simulate layer: --fssdp has {sorted(extra)}, which the "
                         f"model does not read; give only {sorted(known)} (materialize comes "
                         "from the variant, fssdp:static or fssdp:sparse)")
    try:
        return FSSDPSpec(materialize=mode, **opts)
    except (ConfigError, TypeError) as e:
        raise SystemExit(f"moeflow simulate layer: --fssdp: {e}") from None


def simulate_variant(args: argparse.Namespace, costs, case, spec, variant: str,
                     routing) -> dict:
    """One row: ``spec`` (the bench layer case) under ``variant``."""
    from dataclasses import replace

    from moeflow.simulate import simulate_layer
    from moeflow.simulate.parm import simulate_parm

    kind, _, name = variant.partition(":")
    try:
        if kind == "parm":
            pspec = _parm_spec(args, case, spec, name)
            # the MP ranks hold one batch: each MP group gates its first rank's sample
            mp_routing = None if routing is None else [routing[r - r % pspec.mp]
                                                       for r in range(spec.world)]
            return simulate_parm(pspec, costs, mp_routing)
        if kind == "fssdp":
            return simulate_layer(spec, costs, routing, _fssdp_spec(args, name))
        if kind in ("a2a", "codec"):
            return simulate_layer(replace(spec, **{kind: name}), costs, routing)
        return simulate_layer(spec, costs, routing)
    except ConfigError as e:
        raise SystemExit(f"moeflow simulate layer: --compare {variant}, row {case.name}: "
                         f"{e}") from None


def _routing(args: argparse.Namespace, case, spec) -> tuple[list | None, str]:
    """The routing sample to plan (None: the uniform expectation) and how it was made."""
    from moeflow.simulate.loads import sample_routing, trace_popularity, zipf_popularity

    skewed = args.zipf is not None or args.router_trace is not None
    if skewed and args.routing is not None:
        raise SystemExit("moeflow simulate layer: --routing and --zipf / --router-trace both "
                         "choose the routing; give one")
    try:
        if args.zipf is not None:
            pop, how = zipf_popularity(spec.num_experts, args.zipf), f"zipf {args.zipf}"
        elif args.router_trace is not None:
            pop, how = trace_popularity(args.router_trace, spec.num_experts)
            how = f"router trace {how}"
        elif args.routing == "uniform":
            return None, "uniform"
        else:
            return (case_routing(case, spec.world, args.tokens, args.d_model, args.d_expert),
                    "bench")
        return (sample_routing(pop, spec.world, spec.tokens, spec.top_k, args.routing_seed),
                f"{how}, seed {args.routing_seed}")
    except ConfigError as e:
        raise SystemExit(f"moeflow simulate layer: {e}") from None


def _gantt(result: dict, path: str, title: str) -> None:
    from moeflow.schedule.executor import TaskRecord
    from moeflow.schedule.tasks import Task
    from moeflow.schedule.trace import gantt_png

    recs = []
    for t in result["tasks"]:
        if t["rank"] == 0 and "^" in t["task"]:
            kind, chunk = t["task"].split("^")
            recs.append(TaskRecord(Task(kind, int(chunk) - 1), t["phase"], t["lane"],
                                   t["start_s"], t["end_s"], t["size"]))
    gantt_png(recs, path, title)


def format_table(rows: list[dict]) -> str:
    ratio = any("ratio_to_first" in r for r in rows)
    width = max([34] + [len(r["name"]) for r in rows])
    head = (f"{'config':<{width}} {'world':>5} {'pred ms':>8} {'fwd ms':>7} {'bwd ms':>7} "
            f"{'comm ms':>8} {'exposed':>8} {'meas ms':>8} {'pred/meas':>9}"
            + (f" {'x first':>7}" if ratio else ""))
    lines = [head, "-" * len(head)]
    for r in rows:
        meas = r.get("measured_step_ms")
        lines.append(f"{r['name']:<{width}} {r['world']:>5} {r['step_s'] * 1e3:>8.2f} "
                     f"{r['forward_s'] * 1e3:>7.2f} {r['backward_s'] * 1e3:>7.2f} "
                     f"{r['comm_s'] * 1e3:>8.2f} {r['exposed_comm_s'] * 1e3:>8.2f} "
                     + (f"{meas:>8.2f} {r['step_s'] * 1e3 / meas:>9.2f}" if meas
                        else f"{'-':>8} {'-':>9}")
                     + (f" {r['ratio_to_first']:>7.3f}" if ratio else ""))
    lines.append("pred: predicted forward+backward of the slowest rank; comm: collective time; "
                 "exposed: the computing lane waiting (step - compute)")
    skew = list(dict.fromkeys(f"{r['name'].split('@')[0]} {r['load_max_over_mean']:.2f}"
                              for r in rows if r.get("load_max_over_mean", 1.0) > 1.0))
    if skew:
        lines.append("heaviest rank's expert rows / mean (" + rows[0]["routing"] + "): "
                     + ", ".join(skew))
    return "\n".join(lines)


def run_simulate_layer(args: argparse.Namespace) -> int:
    from moeflow.measure.profiles import load_profile
    from moeflow.simulate import cost_model

    specs = _specs(args)
    profile = load_profile(args.profile) if args.profile else None
    spec0 = specs[0][1]
    costs = cost_model(args.links, args.compute, profile, spec0.nodes, spec0.ranks_per_node)
    measured = {}
    if args.measured:
        with open(args.measured) as f:
            measured = {r["name"]: r for r in json.load(f)["results"]}
    rows = []
    names = variants(args)
    for case, spec in specs:
        routing, how = _routing(args, case, spec)
        first = None
        for variant in names:
            res = simulate_variant(args, costs, case, spec, variant, routing)
            res["name"] = case.name if names == ["ep"] else f"{case.name}[{variant}]"
            res["case"], res["variant"], res["routing"] = case.name, variant, how
            first = res["step_s"] if first is None else first
            if len(names) > 1:
                res["ratio_to_first"] = res["step_s"] / first
            rows.append(_finish_row(args, res, case, measured))
    print(format_table(rows))
    if len(names) > 1:
        print(f"x first: the row's predicted step over the same config's {names[0]} row")
    if args.mp > 1 and any(n.startswith("parm:") for n in names) and \
            any(not n.startswith("parm:") for n in names):
        print(f"note: the parm rows' MP groups of {args.mp} ranks share one batch of --tokens "
              f"(Parm's replicated MoE input), the other rows give every rank its own: they "
              f"carry {args.mp}x the distinct tokens")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "moeflow " + shlex.join(sys.argv[1:]),
                       "models": costs.source, **run_meta(), "results": rows}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


def _finish_row(args: argparse.Namespace, res: dict, case, measured: dict) -> dict:
    """Notes, the measured twin (matched by the bench layer config's name; only the ``ep``
    variant is what bench layer measures) and the Gantt chart of one row."""
    if not case.grouped_mm:
        res["note"] = ("one matmul per expert in the measured run; simulated with the "
                       "grouped experts' fit")
    if case.name in measured and res["variant"] == "ep":
        m = measured[case.name]
        res["measured_step_ms"] = m["step_ms"]
        res["measured_world"] = m["world_size"]
    if args.gantt and "collectives" not in res:   # Parm's steps are not the 7r tasks drawn
        path = f"{args.gantt}-{res['name']}.png"
        _gantt(res, path, f"predicted {res['name']}")
        res["gantt"] = path
    return res
