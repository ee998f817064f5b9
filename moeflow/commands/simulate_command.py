"""``moeflow simulate layer``: predict ``moeflow bench layer``'s table from measured fits.

Takes exactly ``bench layer``'s arguments (:func:`moeflow.commands.layer_args.add_layer_args`), so
every predicted row has a measured twin, plus the models: ``--links`` / ``--compute`` (the JSON
of ``moeflow bench links`` / ``bench compute``) or ``--profile NAME`` (a datasheet,
:mod:`moeflow.measure.profiles`), and the layout ``--nodes x --ranks-per-node`` (default: one
node of ``--nproc`` ranks, the world ``bench layer --nproc`` runs). The simulator itself is
:mod:`moeflow.simulate` (ScheMoE Section 4's lanes on every rank). ``--measured`` (a ``bench
layer``, ``bench parm`` or ``bench hecate`` file) puts each row's measured twin beside it
(:mod:`moeflow.commands.simulate_twins`).
"""

from __future__ import annotations

import argparse
import json

import torch

from moeflow.cases.layer_grid import case_routing, cases_for
from moeflow.commands import simulate_twins as twins
from moeflow.commands.layer_args import add_layer_args
from moeflow.commands.simulate_common import (add_model_args, add_out_summary, write_rows,
                                              zipf_routing)
from moeflow.errors import ConfigError



def register(sub) -> None:
    p = sub.add_parser("simulate", help="predict a step from measured fits (no ranks started)")
    ssub = p.add_subparsers(dest="simulate", required=True, metavar="WHAT")
    layer = ssub.add_parser("layer", help="predict `moeflow bench layer` (same arguments) from "
                                          "link and compute fits or a hardware profile")
    add_layer_args(layer)
    g = layer.add_argument_group("the models and the layout")
    add_out_summary(g)
    add_model_args(g)
    g.add_argument("--nodes", type=int, default=1, help="nodes of the simulated layout")
    g.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per node (default: --nproc, so nodes x ranks = bench layer's "
                        "world)")
    g.add_argument("--custom-layer", action="store_true",
                   help="predict one layer of --num-experts, --top-k, --capacity-factor (0: "
                        "dropless) and --activation (bench layer's --compare flags) instead of "
                        "bench layer's configs, e.g. a paper's setting (each further "
                        "--schedules entry adds its row at --pipeline-degree)")
    g.add_argument("--routing", default=None, choices=("bench", "uniform"),
                   help="bench (default): plan the expert ids each rank's router picks on "
                        "`bench layer`'s inputs, so the bytes and loads are the measured run's; "
                        "uniform: the expectation, tokens x top_k spread evenly over experts")
    skew = g.add_mutually_exclusive_group()
    skew.add_argument("--zipf", type=float, default=None, metavar="S",
                      help="skewed loads: plan a routing sample whose expert popularity is "
                           "Zipf(S), p_e ~ rank_e^-S, ranks shuffled as `bench hecate` does "
                           "(0: uniform draws); with a `bench hecate` --measured file: its rows' "
                           "skew, planned on bench hecate's own router at S instead")
    skew.add_argument("--router-trace", default=None, metavar="FILE[:RUN[:LAYER]]",
                      help="skewed loads: plan a routing sample drawn from a trained router's "
                           "tokens per expert, the JSON of `moeflow bench router-load "
                           "--out` (run RUN, MoE layer LAYER, after training; default 0:0)")
    g.add_argument("--routing-seed", type=int, default=0,
                   help="seed of the --zipf / --router-trace routing sample (default 0)")
    # --codec / --codec-backward are bench layer's, applied to every row as bench layer does:
    # encode / decode as the C / D tasks, timed by the `codec:NAME` fit of `bench compute
    # --codecs NAME`, and the bytes on the wire from the codec's size function
    g.add_argument("--comm-lanes", default="thread", choices=("thread", "link"),
                   help="thread (default, the library): one communication thread runs every "
                        "collective in issue order (pipe's two streams, on two process "
                        "groups, at once); link: a lane per link class (intra, inter), "
                        "so the phases of successive hierarchical all-to-alls overlap")
    v = layer.add_argument_group(
        "variants: --compare A,B,... predicts every row under each (side by side, with the "
        "ratio to the first)",
        "ep (plain expert parallelism, the default); parm:baseline, parm:s1, parm:s2, "
        "parm:s2-aas (Parm's schedules on the --mp / --esp layout); fssdp:static, fssdp:sparse "
        "(HECATE's placement, --fssdp options); bigmac (expert parallelism with BigMac's DCCA "
        "structure: descend to --downscale-factor x d_model before the dispatch, ascend after "
        "the combine); a2a:NAME, codec:NAME (expert parallelism with that all-to-all or "
        "codec). --compare tutel / moeflow-fixed (bench layer's peers) are not modelled")
    v.add_argument("--mp", type=int, default=1, help="Parm variants: the MP (tensor-parallel) "
                                                     "group size")
    v.add_argument("--esp", type=int, default=1, help="Parm variants: the ESP group size")
    v.add_argument("--ep-size", type=int, default=None,
                   help="Parm variants: the EP group size (default: ranks / --esp, as "
                        "`moeflow train`)")
    v.add_argument("--esp-placement", default="esp-in-node", choices=("esp-in-node",
                                                                       "ep-in-node"),
                   help="Parm variants: which groups sit inside a node (Section IV-A)")
    v.add_argument("--downscale-factor", type=float, default=None, metavar="R",
                   help="the bigmac variant: BigMac's r (default 0.25, MoEConfig's); its rows "
                        "exchange R x d_model columns and its experts are d_expert / R wide")
    v.add_argument("--fssdp", default="{}", metavar="JSON",
                   help='FSSDP variants: MoEConfig.fssdp fields the model reads, e.g. '
                        '\'{"overlap_degree": 4, "memory_capacity": 1, "rematerialize": true}\' '
                        "(t and m as counts; materialize comes from the variant)")
    g.add_argument("--measured", default=None, metavar="JSON",
                   help="the --out file of `moeflow bench layer` (the ep rows' twins, by "
                        "name), `bench parm` (the parm:* rows') or `bench hecate` (the fssdp:* "
                        "and ep rows', at --zipf S) describing the same layer: adds the "
                        "measured step and the ratio predicted / measured per row; the "
                        "routing is the measured run's")
    g.add_argument("--gantt", default=None, metavar="PREFIX",
                   help="write PREFIX-<config>.png: rank 0's predicted 7r tasks per lane, drawn "
                        "as `bench schedule --gantt` draws measured ones")
    layer.set_defaults(func=run_simulate_layer)
    add_train_parser(ssub)
    from moeflow.commands.simulate_bigmac import add_parser as add_bigmac_parser
    add_bigmac_parser(ssub)


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
    for case in _cases(args, schedules, algorithms):
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
            "fssdp:sparse", "bigmac")


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


def _check_unused(args: argparse.Namespace, names: list[str], layout: bool = True) -> None:
    """Refuse layout (``layout``) / FSSDP flags that no variant reads."""
    if layout and (args.mp > 1 or args.esp > 1 or args.ep_size is not None) and \
            not any(n.startswith("parm:") for n in names):
        raise SystemExit("moeflow simulate: --mp / --esp / --ep-size describe Parm's layout, "
                         "and no variant is a Parm one: add --compare parm:baseline,parm:s1,...")
    if args.fssdp.strip() not in ("", "{}") and not any(n.startswith("fssdp:") for n in names):
        raise SystemExit("moeflow simulate: --fssdp is read by the fssdp variants only: add "
                         "--compare fssdp:static or fssdp:sparse")
    if getattr(args, "downscale_factor", None) is not None and "bigmac" not in names:
        raise SystemExit("moeflow simulate: --downscale-factor is read by the bigmac variant "
                         "only: add --compare bigmac")


def _parm_spec(args: argparse.Namespace, case, spec, sched: str):
    from moeflow.simulate.parm_model import ParmSpec

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
                        ranks_per_node=spec.ranks_per_node, recompute=spec.recompute)
    except ConfigError as e:
        raise SystemExit(f"moeflow simulate layer: --compare parm:{sched}: {e} (flags --mp, "
                         "--esp, --ep-size, --esp-placement)") from None


def _fssdp_spec(args: argparse.Namespace, mode: str):
    from moeflow.simulate.fssdp_model import FSSDPSpec

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
    from moeflow.simulate.parm_model import simulate_parm

    kind, _, name = variant.partition(":")
    try:
        if kind == "parm" and spec.structure == "bigmac":
            raise ConfigError("Parm's schedules are simulated at d_model only; BigMac's "
                              "reduced width under MP / ESP is not modelled: use --compare "
                              "ep, a2a:NAME or codec:NAME with structure='bigmac'")
        if kind == "bigmac":      # BigMac Eq. 2: DCCA around plain expert parallelism
            return simulate_layer(replace(spec, structure="bigmac",
                                          downscale_factor=args.downscale_factor),
                                  costs, routing)
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


def _cases(args: argparse.Namespace, schedules: list[str], algorithms: tuple[str, ...]):
    """bench layer's configs, or with ``--custom-layer`` the one layer its flags describe."""
    from dataclasses import replace

    from moeflow.cases.layer_grid import BenchCase

    if not args.custom_layer:
        return cases_for(schedules, args.pipeline_degree, algorithms, args.num_experts)
    f = None if args.capacity_factor == 0 else args.capacity_factor
    name = (f"custom-e{args.num_experts}-top{args.top_k}-"
            + ("dropless" if f is None else f"cap{f:g}") + f"-{args.activation}")
    base = BenchCase(name, args.num_experts, args.top_k, f, activation=args.activation)
    cases = [base] + [replace(base, name=f"{name}-{s}-r{args.pipeline_degree}", schedule=s,
                              pipeline_degree=args.pipeline_degree)
                      for s in schedules if s != "sequential"]
    if list(algorithms) == ["direct"]:
        return cases
    return [replace(c, name=f"{c.name}@{a}", a2a=a) for a in algorithms for c in cases]


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
    costs = cost_model(args.links, args.compute, profile, spec0.nodes, spec0.ranks_per_node,
                       args.link_model)
    measured = twins.load(args.measured)
    rows = []
    names = variants(args)
    _check_unused(args, names)
    twins.check_variants(measured, names)
    for case, spec in specs:
        routing, how = twins.routing(args, case, spec, measured) or _routing(args, case, spec)
        first = None
        for variant in names:
            res = simulate_variant(args, costs, case, spec, variant, routing)
            res["name"] = case.name if names == ["ep"] else f"{case.name}[{variant}]"
            res["case"], res["variant"], res["routing"] = case.name, variant, how
            first = res["step_s"] if first is None else first
            if len(names) > 1:
                res["ratio_to_first"] = res["step_s"] / first
            fssdp = (_fssdp_spec(args, variant.split(":")[1])
                     if variant.startswith("fssdp:") else None)
            res.update(twins.twin(args, res, case, spec, measured, fssdp) or {})
            rows.append(_finish_row(args, res, case))
    print(format_table(rows))
    if len(names) > 1:
        print(f"x first: the row's predicted step over the same config's {names[0]} row")
    if args.mp > 1 and any(n.startswith("parm:") for n in names) and \
            any(not n.startswith("parm:") for n in names):
        print(f"note: the parm rows' MP groups of {args.mp} ranks share one batch of --tokens "
              f"(Parm's replicated MoE input), the other rows give every rank its own: they "
              f"carry {args.mp}x the distinct tokens")
    return write_rows(args, costs, rows)


def _finish_row(args: argparse.Namespace, res: dict, case) -> dict:
    """Notes, the ratio to the measured twin (:mod:`.simulate_twins`) and the Gantt chart of
    one row."""
    if not case.grouped_mm:
        res["note"] = ("one matmul per expert in the measured run; simulated with the "
                       "grouped experts' fit")
    if res.get("measured_step_ms"):
        res["predicted_over_measured"] = res["step_s"] * 1e3 / res["measured_step_ms"]
    if args.gantt and "collectives" not in res:   # Parm's steps are not the 7r tasks drawn
        path = f"{args.gantt}-{res['name']}.png"
        _gantt(res, path, f"predicted {res['name']}")
        res["gantt"] = path
    return res


# -- moeflow simulate train -----------------------------------------------------------------

def add_train_parser(ssub) -> None:
    """``moeflow simulate train``: ``moeflow train``'s model arguments (``--preset``, ``--set``,
    ``--batch-size``, ``--grad-accum``, ``--recompute``, ``--mp``, ``--esp``, ``--ep-size``,
    ``--esp-placement``, ``--nproc``), the models, and the measured twin (``--measured``)."""
    from moeflow.config import PRESETS, TRAIN_RECOMPUTES, TrainConfig

    p = ssub.add_parser("train", help="predict one `moeflow train` step (every block, every MoE "
                                      "layer, the gradient sync) from fits or a profile")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                   help="model size, as `moeflow train --preset`")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=V",
                   help="override a ModelConfig field, as `moeflow train --set` (the tuner's "
                        "'auto' settings are not modelled: give moe.a2a / moe.schedule / "
                        "moe.pipeline_degree values, else the config's defaults are used)")
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size,
                   help="sequences per data-parallel rank per micro-batch (as `moeflow "
                        "train`)")
    p.add_argument("--grad-accum", type=int, default=TrainConfig.grad_accum,
                   help="micro-batches per optimizer step (as `moeflow train`): the forward "
                        "and backward run N times, the gradient sync and the optimizer once")
    p.add_argument("--recompute", default=TrainConfig.recompute, choices=TRAIN_RECOMPUTES,
                   help="activation recomputation (as `moeflow train`): full reruns every "
                        "block's forward in backward (the MoE all-to-alls re-sent, the counts "
                        "replayed); moe_act reruns the experts inside backward task E")
    p.add_argument("--nproc", type=int, default=2,
                   help="ranks (default 2, as `moeflow train`); the layout is --nodes x "
                        "--ranks-per-node when given")
    g = p.add_argument_group("the models and the layout")
    add_model_args(g)
    g.add_argument("--nodes", type=int, default=1, help="nodes of the simulated layout")
    g.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per node (default: --nproc / --nodes)")
    g.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the run would be: cuda pads capacity buffers "
                        "(capacity_padding='auto')")
    g.add_argument("--dtype", default="fp32", choices=("fp32", "fp16", "bf16"),
                   help="the step's precision: bytes per activation and payload element, and "
                        "the profile's GEMM peak for it (default fp32; the optimizer stays "
                        "fp32, 28 bytes per parameter)")
    g.add_argument("--zipf", type=float, default=None, metavar="S",
                   help="skewed loads: a Zipf(S) routing sample (default: the uniform "
                        "expectation)")
    g.add_argument("--routing-seed", type=int, default=0, help="seed of the --zipf sample")
    g.add_argument("--out", default=None, metavar="JSON", help="write the prediction")
    add_out_summary(g)
    g.add_argument("--measured", default=None, metavar="RUN_DIR",
                   help="the measured twin: a `moeflow train --out RUN_DIR` folder (or its "
                        "metrics.jsonl) of the same arguments (checked against its "
                        "config.json); adds its median step time, min / max, and predicted / "
                        "measured")
    g.add_argument("--skip-steps", type=int, default=2, metavar="K",
                   help="--measured: leave out the log records whose steps start before step "
                        "K + 1 (warm-up; default 2)")
    v = p.add_argument_group("the MoE layers' strategy")
    v.add_argument("--mp", type=int, default=1, help="Parm: MP (tensor-parallel) group size")
    v.add_argument("--esp", type=int, default=1, help="Parm: ESP group size")
    v.add_argument("--ep-size", type=int, default=None,
                   help="Parm: EP group size (default: ranks / --esp)")
    v.add_argument("--esp-placement", default="esp-in-node",
                   choices=("esp-in-node", "ep-in-node"), help="Parm: Section IV-A's case")
    v.add_argument("--fssdp", default="{}", metavar="JSON",
                   help="FSSDP variants: overlap_degree, memory_capacity, rematerialize")
    v.add_argument("--compare", default=None, metavar="A,B,...",
                   help="predict the step with every MoE layer under each variant (ep, "
                        "parm:baseline, parm:s1, parm:s2, parm:s2-aas, fssdp:static, "
                        "fssdp:sparse, a2a:NAME, codec:NAME), with the ratio to the first "
                        "(default: the config's own: placement / parallel_schedule); BigMac: "
                        "--set moe.structure=bigmac")
    from moeflow.commands.simulate_pipeline import add_pipeline_args
    add_pipeline_args(p)
    p.set_defaults(func=run_simulate_train)


def _train_layout(args: argparse.Namespace) -> tuple[int, int]:
    nodes = args.nodes
    per = args.ranks_per_node if args.ranks_per_node is not None else args.nproc // nodes
    if nodes < 1 or per < 1 or (args.ranks_per_node is None and args.nproc % nodes):
        raise SystemExit(f"moeflow simulate train: --nodes {nodes} does not divide --nproc "
                         f"{args.nproc}; give --ranks-per-node")
    return nodes, per


def _config_variant(mcfg, args: argparse.Namespace) -> str:
    """The variant ``moeflow train`` would run: FSSDP, Parm's schedule where the layout has
    MP or ESP (the baseline by default), else expert parallelism."""
    moe = mcfg.moe
    if moe.placement == "fssdp":
        return f"fssdp:{moe.fssdp.materialize}"
    if args.mp > 1 or args.esp > 1:
        if moe.parallel_schedule == "auto":
            raise SystemExit("moeflow simulate train: parallel_schedule='auto' (Algorithm 1 "
                             "per call) is not modelled: --compare parm:s1,parm:s2")
        return f"parm:{moe.parallel_schedule}"
    return "ep"


def run_simulate_train(args: argparse.Namespace) -> int:
    from collections import namedtuple

    from moeflow.commands.common import parse_overrides
    from moeflow.config import ModelConfig, model_preset
    from moeflow.measure.profiles import load_profile
    from moeflow.models.cost import model_cost
    from moeflow.simulate import LayerSpec, cost_model
    from moeflow.simulate.train_model import TrainSpec, simulate_train

    try:
        mcfg = model_preset(args.preset, **parse_overrides(args.overrides, ModelConfig))
    except ConfigError as e:
        raise SystemExit(f"moeflow simulate train: {e}") from None
    block = mcfg.moe_layer_ids()[0] if mcfg.moe_layer_ids() else None
    if block is None:
        raise SystemExit("moeflow simulate train: the model has no MoE block")
    moe = mcfg.moe_config(block)
    for name in ("a2a", "schedule", "pipeline_degree", "codec"):
        if str(getattr(moe, name)).startswith("auto"):
            raise SystemExit(f"moeflow simulate train: {name}={getattr(moe, name)!r} is tuned "
                             f"at run time and not modelled; give --set moe.{name}=VALUE")
    nodes, per = _train_layout(args)
    world = nodes * per
    if args.pp != 1:          # moeflow train --pp: the pipeline model
        return _simulate_pipeline(args, mcfg, nodes, per)
    if args.mp > 1 or args.esp > 1:
        if mcfg.d_ff % args.mp or mcfg.n_heads % args.mp:
            raise SystemExit(f"moeflow simulate train: --mp {args.mp} must divide n_heads "
                             f"{mcfg.n_heads} and d_ff {mcfg.d_ff}")
    names = variants(args) if args.compare is not None else [_config_variant(mcfg, args)]
    if "bigmac" in names:
        raise SystemExit("moeflow simulate train: --compare bigmac is a layer variant; a "
                         "model's structure is its own: give --set moe.structure=bigmac (and "
                         "--set moe.downscale_factor=R) and predict each structure in its own run")
    _check_unused(args, names, layout=False)     # the MP / ESP layout shapes the dense part too
    if (args.mp > 1 or args.esp > 1) and any(not n.startswith("parm:") for n in names):
        raise SystemExit(f"moeflow simulate train: with --mp {args.mp} / --esp {args.esp} the "
                         "MoE layers run Parm's schedules: compare parm:baseline, parm:s1, "
                         "parm:s2, parm:s2-aas")
    profile = load_profile(args.profile) if args.profile else None
    costs = cost_model(args.links, args.compute, profile, nodes, per, args.link_model,
                       args.dtype)
    T = args.batch_size * mcfg.seq_len          # tokens per rank (per MP group with MP)
    if args.grad_accum < 1:
        raise SystemExit(f"moeflow simulate train: --grad-accum {args.grad_accum} must be >= 1")
    # the MoE layers' recomputation: the block's checkpoint, else MoEConfig.recompute (which
    # --recompute moe_act sets in every MoE block, moeflow.trainer.build_config)
    layer_recompute = ("full" if args.recompute == "full" else "moe_act"
                       if "moe_act" in (args.recompute, moe.recompute) else "none")
    try:
        spec = LayerSpec(tokens=T, d_model=mcfg.d_model, d_expert=moe.d_expert,
                         num_experts=moe.num_experts, top_k=moe.top_k,
                         capacity_factor=moe.capacity_factor, activation=moe.activation,
                         schedule=moe.schedule, pipeline_degree=moe.pipeline_degree,
                         a2a=moe.a2a, nodes=nodes, ranks_per_node=per,
                         trim_padding=args.device == "cpu", codec=moe.codec,
                         codec_backward=moe.codec_backward, recompute=layer_recompute,
                         structure=moe.structure, downscale_factor=moe.downscale_factor,
                         dtype=args.dtype)
    except ConfigError as e:
        raise SystemExit(f"moeflow simulate train: the MoE layer: {e}") from None
    routing, how = zipf_routing(args, spec, world, T)
    cost = model_cost(mcfg)
    a = 3 if moe.activation == "swiglu" else 2
    w, hid = spec.width, spec.hidden     # BigMac's experts: rM -> F/r -> rM (Eq. 4)
    bias = ((a - 1) * hid + w) if moe.expert_bias else 0
    experts_total = len(mcfg.moe_layer_ids()) * moe.num_experts * (a * w * hid + bias)
    n_dense = mcfg.n_layers - len(mcfg.moe_layer_ids())
    sharded = mcfg.n_layers * 4 * mcfg.d_model ** 2 + n_dense * 2 * mcfg.d_model * mcfg.d_ff
    dense = cost.params_total - experts_total - sharded + sharded // args.mp
    Case = namedtuple("Case", "name")
    rows, first = [], None
    for variant in names:
        if variant.startswith("parm:"):
            ep = args.ep_size if args.ep_size is not None else world // args.esp
            expert_ranks, dp = ep * args.esp, world // args.mp
        else:
            expert_ranks, dp = world, world
        layer = simulate_variant(args, costs, Case(f"{args.preset}-block{block}"), spec,
                                 variant, routing)
        tspec = TrainSpec(tokens=T, seq_len=mcfg.seq_len, d_model=mcfg.d_model,
                          n_heads=mcfg.n_heads, d_ff=mcfg.d_ff, vocab_size=mcfg.vocab_size,
                          n_layers=mcfg.n_layers, moe_blocks=tuple(mcfg.moe_layer_ids()),
                          dense_params=dense, expert_params=experts_total // expert_ranks,
                          dp_size=dp, expert_dp_size=world // expert_ranks, mp=args.mp,
                          nodes=nodes, ranks_per_node=per, grad_accum=args.grad_accum,
                          recompute=args.recompute, elem_bytes=spec.elem_bytes)
        res = simulate_train(tspec, costs, {b: layer for b in tspec.moe_blocks})
        first = res["step_s"] if first is None else first
        res.update(variant=variant, routing=how, ratio_to_first=res["step_s"] / first,
                   moe_layer={k: layer[k] for k in ("step_s", "forward_s", "backward_s",
                                                    "recompute_s", "comm_s",
                                                    "exposed_comm_s")})
        rows.append(res)
    label = (f"--preset {args.preset}" + "".join(f" --set {o}" for o in args.overrides)
             + (f" --grad-accum {args.grad_accum}" if args.grad_accum > 1 else "")
             + (f" --recompute {args.recompute}" if args.recompute != "none" else ""))
    print(format_train_table(rows, label, world))
    if args.measured:
        _measured_train(args, mcfg, rows, _config_variant(mcfg, args), world, per)
    return write_rows(args, costs, rows)


def _measured_train(args: argparse.Namespace, mcfg, rows: list[dict], own: str, world: int,
                    per: int) -> None:
    """The measured twin (:mod:`.simulate_measured`): the run is checked against these
    arguments, and the row of the variant that run is (the config's own) gets its step times
    and predicted / measured."""
    from moeflow.commands.train_command import ESP_PLACEMENTS
    from moeflow.commands.simulate_measured import measured_twin

    if args.skip_steps < 0:
        raise SystemExit(f"moeflow simulate train: --skip-steps {args.skip_steps} must be >= 0")
    train = {"batch_size": args.batch_size, "grad_accum": args.grad_accum,
             "recompute": args.recompute, "mp_size": args.mp, "esp_size": args.esp,
             "ep_size": args.ep_size, "esp_in_node": ESP_PLACEMENTS[args.esp_placement]}
    try:
        m = measured_twin(args.measured, mcfg, train, world, per, args.device, args.skip_steps)
    except ConfigError as e:
        raise SystemExit(f"moeflow simulate train: {e}") from None
    row = next((r for r in rows if r["variant"] == own), None)
    if row is None:
        raise SystemExit(f"moeflow simulate train: --measured is the run of the config's own "
                         f"variant {own}, which --compare leaves out; add it to --compare")
    row["measured"] = m
    row["predicted_over_measured"] = row["step_s"] / m["median_s"]
    print(f"measured {m['run']}: steps {m['steps'][0]}-{m['steps'][1]} ({m['n']} log records, "
          f"the first {m['skip_steps']} steps skipped): median {m['median_s'] * 1e3:.2f} ms per "
          f"step (min {m['min_s'] * 1e3:.2f}, max {m['max_s'] * 1e3:.2f}); {own}: predicted "
          f"{row['step_s'] * 1e3:.2f} ms, predicted / measured "
          f"{row['predicted_over_measured']:.3f}")


def format_train_table(rows: list[dict], label: str, world: int) -> str:
    parts = list(dict.fromkeys(k for r in rows for k in r["parts_s"]))
    head = (f"{'variant':<16} {'step ms':>9} " + " ".join(f"{p[:12]:>12}" for p in parts)
            + f" {'tok/s':>10} {'x first':>7}")
    lines = [f"moeflow train {label} on {world} ranks, one step (predicted)", head,
             "-" * len(head)]
    for r in rows:
        lines.append(f"{r['variant']:<16} {r['step_s'] * 1e3:>9.2f} "
                     + " ".join(f"{r['parts_s'].get(p, 0.0) * 1e3:>12.2f}" for p in parts)
                     + f" {r['tokens_per_s']:>10.0f} {r['ratio_to_first']:>7.3f}")
    lines.append("parts in ms per optimizer step: dense compute (forward + backward; recompute: "
                 "the blocks' forward again), every MoE layer's predicted step, each x the "
                 "micro-batches; grad_accumulate, the gradient all-reduces and the optimizer "
                 "once; tok/s: distinct tokens per step / step")
    return "\n".join(lines)


def _simulate_pipeline(args: argparse.Namespace, mcfg, nodes: int, per: int) -> int:
    """``--pp N``: :mod:`moeflow.commands.simulate_pipeline`."""
    from moeflow.commands.simulate_pipeline import format_pipeline, run_pipeline
    from moeflow.measure.profiles import load_profile
    from moeflow.simulate import cost_model

    profile = load_profile(args.profile) if args.profile else None
    costs = cost_model(args.links, args.compute, profile, nodes, per, args.link_model,
                       args.dtype)
    row = run_pipeline(args, mcfg, costs, nodes, per)
    label = (f"--preset {args.preset}" + "".join(f" --set {o}" for o in args.overrides)
             + f" --batch-size {args.batch_size} --grad-accum {args.grad_accum}")
    print(format_pipeline(row, label, nodes * per))
    return write_rows(args, costs, [row])
