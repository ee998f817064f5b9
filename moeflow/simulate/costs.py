"""Task times for the step simulator: compute kernels and collectives as alpha-beta models.

The same linear models ScheMoE's profiler fits per task (Section 4.2) and Parm's cost model
states per collective (Section IV, ``t = alpha + beta * volume``): compute kinds from a
``moeflow bench compute`` JSON (``moeflow.compute/1``: ``t = alpha + beta * work``, work in
FLOPs or bytes), collectives from a ``moeflow bench links`` JSON (``moeflow.links/1``: per link
class and op), or both from a hardware profile's datasheet numbers
(:mod:`moeflow.measure.profiles`), which have no alpha for compute. Codecs (ScheMoE Section
3.1's compression tasks C and D; Section 2.3: compression trades computing time for a smaller
all-to-all volume) take their time from the ``codec:NAME`` fit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from moeflow.errors import ConfigError
from moeflow.measure.linkmodel import AlphaBeta, load_fits
from moeflow.measure.profiles import Profile

COMPUTE_SCHEMA = "moeflow.compute/1"
# the kinds the layer model uses (moeflow/bench/compute.py measures them)
KINDS = ("gemm", "gemm_backward", "experts", "experts_backward", "elementwise")


@dataclass
class CostModel:
    """``compute[kind]``: seconds = alpha + beta * work; ``links[(class, op)]``: seconds =
    alpha + beta * bytes (nccl-tests byte convention, :mod:`moeflow.measure.linkmodel`)."""

    compute: dict[str, AlphaBeta]
    links: dict[tuple[str, str], AlphaBeta]
    source: dict[str, str] = field(default_factory=dict)    # what each half was read from

    def compute_time(self, kind: str, work: float) -> float:
        if work <= 0:
            return 0.0
        if kind not in self.compute:
            raise ConfigError(f"the compute model ({self.source.get('compute', '?')}) has no "
                              f"fit for kind {kind!r} (it has: {', '.join(sorted(self.compute))}"
                              "); re-run `moeflow bench compute --out FILE`")
        return self.compute[kind].predict(work)

    def codec_time(self, name: str, in_bytes: float, wire_bytes: float) -> float:
        """Seconds of one direction (encode, or decode) of codec ``name`` on a payload of
        ``in_bytes`` (``wire_bytes`` compressed): half the ``codec:NAME`` fit of ``moeflow bench
        compute`` (it times encode + decode of ``in_bytes`` together); from a datasheet profile,
        memory traffic (the payload read, the compressed bytes written, or back)."""
        if name == "none" or in_bytes <= 0:
            return 0.0               # the payload passes through (ScheMoE's D/C tasks empty)
        kind = f"codec:{name}"
        if kind in self.compute:
            return 0.5 * self.compute[kind].predict(in_bytes)
        if self.source.get("compute", "").startswith("profile"):
            return self.compute["elementwise"].predict(in_bytes + wire_bytes)
        have = ", ".join(k for k in sorted(self.compute) if k.startswith("codec:")) or "none"
        raise ConfigError(f"the compute model ({self.source.get('compute', '?')}) has no fit "
                          f"for {kind!r} (codec fits: {have}); re-run `moeflow bench compute "
                          f"--codecs {name} --out FILE`")

    def link(self, link_class: str, op: str) -> AlphaBeta:
        if (link_class, op) not in self.links:
            have = ", ".join(f"{c}/{o}" for c, o in sorted(self.links))
            raise ConfigError(f"the link model ({self.source.get('links', '?')}) has no fit "
                              f"for {op} over the {link_class!r} link class (it has: {have}); "
                              "measure this layout with `moeflow bench links --out FILE` or "
                              "choose an all-to-all it has fits for")
        return self.links[(link_class, op)]


def load_compute(path: str) -> dict[str, AlphaBeta]:
    """``{kind: AlphaBeta}`` from a ``moeflow bench compute --out`` file."""
    with open(path) as f:
        data = json.load(f)
    if data.get("schema") != COMPUTE_SCHEMA:
        raise ConfigError(f"--compute {path}: schema {data.get('schema')!r} is not "
                          f"{COMPUTE_SCHEMA!r}; write it with `moeflow bench compute --out`")
    return {r["kind"]: AlphaBeta(r["alpha_s"], r["beta_s_per_unit"], 0,
                                 r.get("r2", math.nan), r.get("max_rel_err", math.nan))
            for r in data["fits"]}


def profile_compute(profile: Profile, dtype: str = "fp32") -> dict[str, AlphaBeta]:
    """Compute fits stated by a datasheet: matrix products at ``peak x gemm_efficiency``,
    elementwise work at the memory bandwidth; no per-call overhead (alpha 0)."""
    gemm = AlphaBeta(0.0, 1.0 / profile.gemm_flops(dtype))
    return {"gemm": gemm, "gemm_backward": gemm, "experts": gemm, "experts_backward": gemm,
            "elementwise": AlphaBeta(0.0, 1.0 / profile.memory_bandwidth_Bps)}


def profile_links(profile: Profile, nodes: int, ranks_per_node: int
                  ) -> dict[tuple[str, str], AlphaBeta]:
    """Link fits stated by a datasheet for a layout of ``nodes x ranks_per_node``.

    An all-to-all of a B-byte send buffer among g ranks sends ``B (g-1)/g`` per rank; across
    nodes, a node's ``ranks_per_node`` ranks share its inter-node link and send
    ``B (W - ranks_per_node) / W`` each over it; the ``inter`` class (one rank per node) runs
    its ``ranks_per_node`` groups at once over the same links. p2p is one flow on one link."""
    intra, inter, per, world = profile.intra, profile.inter, ranks_per_node, nodes * ranks_per_node
    out = {("intra", "p2p"): intra.alpha_beta()}
    if per > 1:
        out[("intra", "all_to_all")] = AlphaBeta(intra.latency_s,
                                                 (per - 1) / per / intra.bandwidth_Bps, per)
    if nodes > 1:
        if inter is None:
            raise ConfigError(f"profile {profile.name!r} has no [inter_node] link, but the "
                              f"layout has nodes={nodes}; give a profile with one or --nodes 1")
        out[("inter", "p2p")] = inter.alpha_beta()
        # an inter-node group holds one rank per node, and the node's ranks_per_node such groups
        # run at once (as `bench links` measures a class: every group together), sharing the
        # node's link
        out[("inter", "all_to_all")] = AlphaBeta(inter.latency_s,
                                                 per * (nodes - 1) / nodes / inter.bandwidth_Bps,
                                                 nodes)
        if per > 1:
            beta = max(per * (world - per) / world / inter.bandwidth_Bps,
                       (per - 1) / world / intra.bandwidth_Bps)
            out[("world", "all_to_all")] = AlphaBeta(inter.latency_s + intra.latency_s, beta,
                                                     world)
    # a ring all-gather of a B-byte output (a reduce-scatter of a B-byte input) moves
    # B (g-1)/g per rank, as the all-to-all above; a ring all-reduce twice that
    for cls in ("intra", "inter", "world"):
        if (cls, "all_to_all") in out:
            a2a = out[(cls, "all_to_all")]
            out[(cls, "all_gather")] = out[(cls, "reduce_scatter")] = a2a
            out[(cls, "all_reduce")] = AlphaBeta(2 * a2a.alpha, 2 * a2a.beta, a2a.group_size)
    return out


LINK_MODELS = ("curve", "fit")


def cost_model(links: str | None = None, compute: str | None = None,
               profile: Profile | None = None, nodes: int = 1,
               ranks_per_node: int = 1, link_model: str = "curve",
               dtype: str = "fp32") -> CostModel:
    """Measured fits where given, the profile's datasheet numbers for the rest (its GEMM peak
    for ``dtype``). ``link_model``: ``curve`` reads each measured collective as the curve
    through its points (:class:`moeflow.measure.linkmodel.MeasuredCurve`), ``fit`` as its
    alpha-beta line."""
    if link_model not in LINK_MODELS:
        raise ConfigError(f"link_model={link_model!r} is not one of {', '.join(LINK_MODELS)}")
    if compute is None and profile is None:
        raise ConfigError("the simulator needs compute times: give --compute FILE (from "
                          "`moeflow bench compute --out`) or --profile NAME")
    if links is None and profile is None and nodes * ranks_per_node > 1:
        raise ConfigError("the simulator needs link times for a layout of more than one rank: "
                          "give --links FILE (from `moeflow bench links --out`) or --profile NAME")
    source = {"compute": compute or f"profile {profile.name}",
              "links": links or (f"profile {profile.name}" if profile else "none")}
    if links:
        source["link_model"] = link_model
    comp = load_compute(compute) if compute else profile_compute(profile, dtype)
    if links:
        lk = load_fits(links, curves=link_model == "curve")
    elif profile is not None:
        lk = profile_links(profile, nodes, ranks_per_node)
    else:
        lk = {}
    return CostModel(comp, lk, source)
