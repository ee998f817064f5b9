"""``moeflow simulate bigmac``: predict ``moeflow bench bigmac``'s table from fits or a profile.

Takes exactly ``bench bigmac``'s arguments (:func:`moeflow.commands.bigmac_args.add_bigmac_args`:
the same cases, named alike), so every predicted row has a measured twin in a ``bench bigmac
--out`` file given to ``--measured``. Each case is one MoE layer's forward + backward in
:func:`moeflow.simulate.simulate_layer`, BigMac's rows with the DCCA structure (BigMac, "DCCA:
Low-dimensional Communication Strategy", Eq. 2: descend, the two all-to-alls and the experts
at ``r * d_model``, ascend); the routing is the one each rank's router picks on bench bigmac's
inputs (``--routing bench``) or the uniform expectation. The paper's claim it restates as a
prediction: BigMac's speedup over the fine-grained layer (Fig. 3-4).
"""

from __future__ import annotations

import argparse
import json

from moeflow.errors import ConfigError


def add_parser(ssub) -> None:
    from moeflow.commands.bigmac_args import add_bigmac_args
    from moeflow.commands.simulate_common import add_model_args, add_out_summary

    p = ssub.add_parser("bigmac", help="predict `moeflow bench bigmac` (same arguments): "
                                       "fine-grained vs BigMac layers from fits or a profile")
    add_bigmac_args(p)
    g = p.add_argument_group("the models and the layout")
    add_model_args(g, "bigmac-32gpu")
    g.add_argument("--nodes", type=int, default=1, help="nodes of the simulated layout")
    g.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per node (default: --nproc / --nodes, so the world is bench "
                        "bigmac's --nproc)")
    g.add_argument("--routing", default="bench", choices=("bench", "uniform"),
                   help="bench (default): plan the expert ids each rank's router picks on bench "
                        "bigmac's inputs; uniform: tokens x top_k spread evenly over experts")
    g.add_argument("--measured", default=None, metavar="JSON",
                   help="a `moeflow bench bigmac --out` file of the same arguments: adds the "
                        "measured step and predicted / measured per row")
    add_out_summary(g)
    p.set_defaults(func=run_simulate_bigmac)


def _layout(args: argparse.Namespace) -> tuple[int, int]:
    nodes = args.nodes
    per = (args.ranks_per_node if args.ranks_per_node is not None
           else args.nproc // nodes if nodes >= 1 else 0)
    if nodes < 1 or per < 1 or (args.ranks_per_node is None and args.nproc % nodes):
        raise SystemExit(f"moeflow simulate bigmac: --nodes {nodes} does not divide --nproc "
                         f"{args.nproc}; give --ranks-per-node")
    return nodes, per


def case_spec(case, args: argparse.Namespace, nodes: int, per: int):
    """The :class:`~moeflow.simulate.LayerSpec` of one bench bigmac case: its layer's own
    config (:func:`moeflow.cases.structures.case_config`: capacity resolved by the structure,
    capacity buffers padded as the bench pads them), on the direct all-to-all the bench's
    ``counting`` algorithm is."""
    from moeflow.bench import a2a_count  # noqa: F401  (registers the cases' "counting")
    from moeflow.cases.structures import case_config
    from moeflow.simulate import LayerSpec

    cfg = case_config(case, args.d_model)
    return LayerSpec(tokens=args.tokens, d_model=cfg.d_model, d_expert=cfg.d_expert,
                     num_experts=cfg.num_experts, top_k=cfg.top_k,
                     capacity_factor=cfg.capacity_factor, activation=cfg.activation,
                     schedule=cfg.schedule, pipeline_degree=cfg.pipeline_degree, a2a="direct",
                     nodes=nodes, ranks_per_node=per, trim_padding=False,
                     structure=cfg.structure, downscale_factor=cfg.downscale_factor)


def speedups(rows: list[dict]) -> dict[int, float]:
    """Per top-k, the fine-grained row's predicted step over the BigMac row's (the paper's
    speedup, Fig. 3-4)."""
    out = {}
    for r in rows:
        if r["structure"] == "bigmac":
            fine = [f for f in rows if f["structure"] == "fine_grained"
                    and f["top_k"] == r["top_k"]]
            if fine:
                out[r["top_k"]] = fine[0]["step_s"] / r["step_s"]
    return out


def format_table(rows: list[dict]) -> str:
    head = (f"{'config':<26} {'world':>5} {'a2a w':>5} {'pred ms':>9} {'fwd ms':>8} "
            f"{'bwd ms':>8} {'comm ms':>8} {'A2A B/tok':>10} {'meas ms':>8} {'pred/meas':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        meas = r.get("measured_step_ms")
        lines.append(f"{r['name']:<26} {r['world']:>5} {r['width']:>5} "
                     f"{r['step_s'] * 1e3:>9.2f} {r['forward_s'] * 1e3:>8.2f} "
                     f"{r['backward_s'] * 1e3:>8.2f} {r['comm_s'] * 1e3:>8.2f} "
                     f"{r['a2a_bytes_per_token']:>10.0f} "
                     + (f"{meas:>8.2f} {r['step_s'] * 1e3 / meas:>9.2f}" if meas
                        else f"{'-':>8} {'-':>9}"))
    for k, s in sorted(speedups(rows).items()):
        lines.append(f"top-{k}: predicted BigMac speedup over fine-grained (fine / BigMac "
                     f"step): {s:.2f}x")
    lines.append("pred: predicted forward+backward of the slowest rank; comm: collective time; "
                 "A2A B/tok: bytes handed to the all-to-all per token (fwd+bwd, dispatch+combine; "
                 "bench bigmac's counted column)")
    return "\n".join(lines)


def run_simulate_bigmac(args: argparse.Namespace) -> int:
    from moeflow.cases.structures import case_routing
    from moeflow.commands.bigmac_args import bigmac_cases
    from moeflow.commands.simulate_common import write_rows
    from moeflow.measure.profiles import load_profile
    from moeflow.simulate import cost_model, simulate_layer

    cases = bigmac_cases(args, "simulate bigmac")
    nodes, per = _layout(args)
    profile = load_profile(args.profile) if args.profile else None
    costs = cost_model(args.links, args.compute, profile, nodes, per, args.link_model)
    measured = {}
    if args.measured:
        with open(args.measured) as f:
            data = json.load(f)
        if "speedup_fine_over_bigmac" not in data:
            raise SystemExit(f"moeflow simulate bigmac: --measured {args.measured} is not a "
                             "`moeflow bench bigmac --out` file")
        measured = {r["name"]: r for r in data["results"]}
    rows = []
    for case in cases:
        try:
            spec = case_spec(case, args, nodes, per)
        except ConfigError as e:
            raise SystemExit(f"moeflow simulate bigmac: case {case.name}: {e}") from None
        routing, how = None, "uniform"
        if args.routing == "bench":
            routing, how = case_routing(case, spec.world, args.tokens, args.d_model), "bench"
        try:
            res = simulate_layer(spec, costs, routing)
        except ConfigError as e:
            raise SystemExit(f"moeflow simulate bigmac: case {case.name}: {e}") from None
        sent = sum(sum(v) for v in res["step_bytes"].values())
        res.update(name=case.name, structure=case.structure, top_k=case.top_k,
                   routing=how, a2a_bytes_per_token=sent / (spec.world * spec.tokens))
        if case.name in measured:
            m = measured[case.name]
            if m["world_size"] != spec.world or m["tokens_per_rank"] != spec.tokens:
                raise SystemExit(f"moeflow simulate bigmac: --measured row {case.name} ran "
                                 f"{m['world_size']} ranks x {m['tokens_per_rank']} tokens; "
                                 f"this prediction is {spec.world} x {spec.tokens}: give the "
                                 "bench's arguments")
            res["measured_step_ms"] = m["step_ms"]
            res["measured_a2a_bytes_per_token"] = m["a2a_bytes_per_token"]
        rows.append(res)
    print(format_table(rows))
    return write_rows(args, costs, rows,
                      predicted_speedup_fine_over_bigmac=speedups(rows))
