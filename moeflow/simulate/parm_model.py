"""Parm's schedules in the simulator: every rank's collectives and tasks of one MoE layer step
under MP + EP + ESP (Parm Section III; ``moeflow/strategies/parm/``).

* ``baseline`` (Fig. 3a, Eq. 1; DeepSpeed-MoE 0.8.1's volumes where the ESP group lies inside
  the MP group, :func:`moeflow.strategies.parm.baseline.esp_peers_share_tokens`): EP-AlltoAll,
  expert shards with the ESP-AllReduce inside task E (forward: the outputs; backward: the
  input gradients), EP-AlltoAll back; where the ESP peers hold other tokens, Eq. 1's
  ESP-AllGather of the input (with the int64 row maps), the merged buffers' EP-AlltoAll,
  ESP-AllReduce, ESP-Split, and in backward ESP-Split's AllGather and the gather's
  ReduceScatter; with MP and whole experts (``N_ESP = 1``), 0.8.1's duplicate-token drop: MP
  rank m's share of every expert's rows through the EP-AlltoAlls, the MP-AllGather after
  (backward: the drop's AllGather of the input gradient's parts; ``baseline_mp.py``).
* ``s1`` (Fig. 3b, Eq. 11): MP-Split before the gate (backward: an AllGather), the EP&ESP
  exchange of the dumped buffer (Fig. 4c, :class:`moeflow.strategies.parm.ep_esp.Dump`), the
  local combine, the MP-AllGather of the outputs and of the MP parts' balancing losses.
* ``s2`` (Fig. 3c, Eq. 7 / 14): the gate on the whole batch, MP-Split of the send buffer
  (:func:`moeflow.schedule.chunks.chunk_counts` shares, as :func:`moeflow.strategies.parm.s2.
  s2_experts`), the EP&ESP-AlltoAll, then SAA (Section III-D, Fig. 5: ``u`` phases of
  point-to-point exchange, each overlapped with the MP-AllGather of the previous phase's slice;
  backward: the reduce-scatters with the reverse exchanges) or AAS (``saa=False``: the
  all-to-all back, then the AllGather).

Every size comes from the library's own functions on a :class:`~moeflow.topology.Topology`
built without process groups (its coordinates are plain arithmetic): the groups
(``esp_peer_ranks``, ``slot_coords``, ``mp_slots``), the MP parts (``s1.token_rows``), the
dump (``Dump.build``), capacity (``dispatch.capacity``) and the gate's counts (``make_plan``,
padded, as ``capacity_padding="pad"`` runs them; the schedules that trim,
docs/parm.md "Sending only the kept rows", are modelled padded). Collectives pad to the
group's largest block as ``collectives._gather`` does. Each collective's time is the link fit of its group's class
(``intra`` inside a node, ``inter`` one rank per node, ``world`` otherwise) and op, at the nccl-tests
byte convention (``moeflow.measure.linkmodel``), the slowest member's buffer. The MP
collectives run on the computing thread (as in the library); with one chunk, which is what is
modelled here, the EP&ESP exchange is sequential too (the computing lane waits for each
all-to-all). SAA's AllGather runs on a second lane beside the point-to-point phase it
overlaps. Int64 bookkeeping gathers (count matrices, row maps) are timed as small all-gathers.

Recomputation (``ParmSpec.recompute``, as :mod:`.layer`'s; docs/training.md, "Activation
recomputation"): ``moe_act`` reruns the expert shards' forward in backward task E; ``full``
reruns the forward's steps (Parm's ESP / MP collectives and the all-to-alls included) before the
backward, minus the count gather (the plan record keeps the counts, Parm's EP&ESP block counts
included: :mod:`moeflow.plan_record`), and its backward task E reruns the experts too.

Not modelled: chunks (``pipeline_degree`` > 1) and codecs on the EP&ESP payloads, ``auto``
(Algorithm 1 picks S1 or S2 per call: simulate both), the ``ted`` schedule
(``strategies/parm/ted.py``), BigMac's widths.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from moeflow.dispatch.capacity import capacity
from moeflow.dispatch.plan import make_plan
from moeflow.errors import ConfigError
from moeflow.strategies.parm.baseline import esp_peer_ranks, esp_peers_share_tokens
from moeflow.strategies.parm.ep_esp import Dump
from moeflow.strategies.parm.s1 import token_rows
from moeflow.strategies.parm.s2 import mp_slots
from moeflow.schedule.chunks import chunk_counts
from moeflow.simulate import engine
from moeflow.simulate.costs import CostModel
from moeflow.simulate.layer_model import RECOMPUTES
from moeflow.simulate.engine import SimTask
from moeflow.topology import Topology, check_parm_layout

SCHEDULES = ("baseline", "s1", "s2")
PHASES = ("forward", "recompute", "backward")     # in the order a rank runs them
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}
# the op's nccl-tests byte count from (elements this rank puts in, group size)
_NCCL = {"all_to_all": lambda e, g: e, "all_reduce": lambda e, g: e,
         "all_gather": lambda e, g: e * g, "reduce_scatter": lambda e, g: e,
         "p2p": lambda e, g: e}


@dataclass(frozen=True)
class ParmSpec:
    """One Parm layer call: ``tokens`` of MoE input per rank (replicated over the MP group),
    the layout ``nodes x ranks_per_node`` with ``mp x (ep x esp) blocks``, and the schedule."""

    tokens: int
    d_model: int
    d_expert: int
    num_experts: int
    top_k: int
    capacity_factor: float | None
    mp: int = 1
    ep: int = 1
    esp: int = 1
    esp_in_node: bool = True
    schedule: str = "baseline"
    saa: bool = True                # S2: SAA (Fig. 5); False: AAS
    activation: str = "gelu"
    nodes: int = 1
    ranks_per_node: int = 1
    dtype: str = "fp32"
    recompute: str = "none"         # "moe_act" / "full": module docstring

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTES:
            raise ConfigError(f"ParmSpec.recompute={self.recompute!r} is invalid; choose one "
                              f"of {', '.join(RECOMPUTES)}")
        for name in ("tokens", "d_model", "d_expert", "num_experts", "top_k", "mp", "ep",
                     "esp", "nodes", "ranks_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"ParmSpec.{name}={v!r} is invalid: a positive integer")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"ParmSpec.schedule={self.schedule!r} is invalid; choose one of "
                              f"{', '.join(SCHEDULES)} (auto picks S1 or S2 per call: simulate "
                              "both)")
        check_parm_layout(self.world, self.ranks_per_node, self.ep, self.mp, self.esp,
                          self.esp_in_node)
        if self.num_experts % self.ep:
            raise ConfigError(f"ParmSpec.num_experts={self.num_experts} is invalid for "
                              f"ep={self.ep}: give a multiple of the EP size")
        if self.d_expert % self.esp:
            raise ConfigError(f"ParmSpec.d_expert={self.d_expert} is invalid for esp="
                              f"{self.esp}: the hidden width is split over the ESP group, so "
                              f"it must be a multiple of {self.esp}")
        if self.dtype not in _BYTES:
            raise ConfigError(f"ParmSpec.dtype={self.dtype!r} is invalid; choose one of "
                              f"{', '.join(_BYTES)}")

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def topology(self, rank: int) -> Topology:
        """Rank ``rank``'s coordinates (no process groups: the simulator only reads them)."""
        return Topology(rank=rank, world_size=self.world, local_size=self.ranks_per_node,
                        ep_size=self.ep, mp_size=self.mp, esp_size=self.esp,
                        esp_in_node=self.esp_in_node)


# -- groups (global ranks) -------------------------------------------------------------------

def block_ranks(topo: Topology) -> list[int]:
    """The EP&ESP block of ``topo.rank``, slot order."""
    first = topo.rank - topo.expert_slot
    return [first + q for q in range(topo.expert_slots)]


def ep_group(topo: Topology) -> list[int]:
    """This rank's EP group: the block's ranks of its ESP index, in EP order."""
    first = topo.rank - topo.expert_slot
    members = sorted((topo.slot_coords(q)[0], first + q) for q in range(topo.expert_slots)
                     if topo.slot_coords(q)[1] == topo.esp_rank)
    return [r for _, r in members]


def mp_group(topo: Topology) -> list[int]:
    first = topo.rank - topo.mp_rank
    return list(range(first, first + topo.mp_size))


# -- what each rank gates ---------------------------------------------------------------------

def gated_tokens(spec: ParmSpec, topo: Topology) -> range:
    """The rows of the MoE input this rank gates (S1: its MP part, else all of them)."""
    if spec.schedule == "s1":
        return token_rows(spec.tokens, spec.mp)[topo.mp_rank]
    return range(spec.tokens)


def gate_counts(spec: ParmSpec, topo: Topology, ids) -> np.ndarray:
    """``(E,)`` rows of this rank's send buffer per expert: the capacity (padded, as Parm
    always sends) or the dropless plan's counts; ``ids``: the ``(n, k)`` expert ids of the
    gated tokens, or None (the uniform expectation)."""
    E, k = spec.num_experts, spec.top_k
    n = len(gated_tokens(spec, topo))
    if spec.capacity_factor is not None:
        return np.full(E, capacity(n, k, E, spec.capacity_factor), dtype=np.int64)
    if ids is None:
        even = np.full(E, (n * k) // E, dtype=np.int64)
        even[: (n * k) % E] += 1
        return even
    plan = make_plan(torch.as_tensor(np.asarray(ids), dtype=torch.int64), E, None)
    return plan.local_counts.numpy().astype(np.int64)


def _rank_ids(spec: ParmSpec, topo: Topology, routing):
    if routing is None:
        return None
    ids = np.asarray(routing[topo.rank])
    rows = gated_tokens(spec, topo)
    if ids.shape[0] == spec.tokens and len(rows) != spec.tokens:
        ids = ids[rows.start:rows.stop]           # the whole input given: S1 gates its part
    if ids.shape[0] != len(rows):
        raise ConfigError(f"the routing sample of rank {topo.rank} has {ids.shape[0]} tokens; "
                          f"it gates {len(rows)} of {spec.tokens}")
    return ids


# -- the steps of one rank --------------------------------------------------------------------

@dataclass
class Step:
    """A computing task (``op`` None) or a collective of one rank."""

    name: str
    op: str | None = None          # all_to_all / all_gather / reduce_scatter / all_reduce / p2p
    ranks: tuple = ()              # the group's global ranks (p2p: (me, peer))
    elements: int = 0              # elements this rank puts in (padded as the library pads)
    key: str = ""                  # the same on every member: one collective
    dtype: str = "float"           # "int64": bookkeeping
    kind: str | None = None        # computing: the cost kind ("experts", "gemm", ...)
    work: float = 0.0
    lane: str = "compute"
    beside_previous: bool = False  # starts with the previous step (SAA's overlapped gather)


def _coll(name, op, ranks, elements, key, **kw) -> list[Step]:
    if len(ranks) < 2:
        return []                  # a group of one rank: the library sends nothing across
    return [Step(name, op, tuple(ranks), int(elements), key, **kw)]


def rank_steps(spec: ParmSpec, rank: int, counts: dict[int, np.ndarray]
               ) -> dict[str, list[Step]]:
    """``{"forward": [...], "backward": [...]}``: rank ``rank``'s tasks and collectives in
    issue order; ``counts[q]``: rank q's :func:`gate_counts`."""
    topo = spec.topology(rank)
    M, E, k, B = spec.d_model, spec.num_experts, spec.top_k, _BYTES[spec.dtype]
    n = len(gated_tokens(spec, topo))
    sent = int(counts[rank].sum())                      # send buffer rows
    mats = 3 if spec.activation == "swiglu" else 2
    hid = spec.d_expert // spec.esp
    el = lambda rows: 2 * rows * M * B                  # noqa: E731: read + write a row block
    fwd: list[Step] = [
        Step("route", kind="gemm", work=2 * n * M * E),
        Step("route", kind="elementwise", work=4 * n * E * B),
        Step("permute", kind="elementwise", work=el(sent))]
    bwd: list[Step] = []

    def experts(rows: int) -> tuple[Step, Step]:
        flops = 2 * rows * mats * M * hid
        return (Step("E", kind="experts", work=flops),
                Step("E", kind="experts_backward", work=2 * flops))

    def key(tag: str, ranks) -> str:
        return f"{tag}/{'-'.join(map(str, ranks))}"

    block = block_ranks(topo)
    count_width = 1 if spec.capacity_factor is not None else E
    if spec.schedule == "baseline":
        peers = esp_peer_ranks(topo)
        epg = ep_group(topo)
        e_l = E // spec.ep
        me = epg.index(rank)
        drop_sizes = None
        if esp_peers_share_tokens(topo):
            # DeepSpeed 0.8.1's case: each rank's own E C M buffer into the EP-AlltoAll
            merged = {q: counts[q] for q in epg}
            gather_in = []
            if spec.mp > 1 and spec.esp == 1:
                # whole experts: 0.8.1's drop_tokens, each EP peer sends its MP rank's share
                # of its buffer (strategies/parm/baseline_mp.py), gather_tokens after
                shares = chunk_counts(np.stack([counts[q] for q in epg]), spec.mp)
                merged = {q: shares[q % spec.mp][i] for i, q in enumerate(epg)}
                drop_sizes = [int(shares[m][me].sum()) for m in range(spec.mp)]
        else:
            # Eq. 1: the ESP peers' inputs gathered; EP rank i's buffer: its ESP group's rows
            sizes = [int(counts[q].sum()) for q in peers]
            tokens = [len(gated_tokens(spec, spec.topology(q))) for q in peers]
            # the peers' token counts (host integers; a call under MoEConfig.equal_rank_tokens
            # after its first skips it: modelled as without the promise), then the row maps
            gather_in = (_coll("ESP-AllGather/tokens", "all_gather", peers, 1,
                               key("forward/esp-tokens", peers), dtype="int64")
                         + _coll("ESP-AllGather/maps", "all_gather", peers, max(sizes),
                                 key("forward/esp-maps", peers), dtype="int64")
                         + _coll("ESP-AllGather", "all_gather", peers, max(tokens) * M,
                                 key("forward/esp-ag", peers)))
            merged = {}
            for q in epg:
                tq = spec.topology(q)
                merged[q] = sum(counts[p] for p in esp_peer_ranks(tq))
        send = [int(merged[rank][j * e_l:(j + 1) * e_l].sum()) for j in range(len(epg))]
        recv = [int(merged[q][me * e_l:(me + 1) * e_l].sum()) for q in epg]
        S, R = sum(send), sum(recv)
        ef, eb = experts(R)
        # the count matrix: the plain exchange's over the EP group, or block_counts' over the
        # EP&ESP block (baseline_experts)
        cg = epg if not gather_in else block
        fwd += _coll("counts", "all_gather", cg, count_width, key("forward/counts", cg),
                     dtype="int64")
        fwd += gather_in
        fwd += _coll("A1", "all_to_all", epg, S * M, key("forward/A1", epg))
        fwd += [ef] + _coll("ESP-AllReduce", "all_reduce", peers, R * M,
                            key("forward/esp-ar", peers))
        fwd += _coll("A2", "all_to_all", epg, R * M, key("forward/A2", epg))
        if drop_sizes is not None:
            fwd += _coll("MP-AllGather", "all_gather", mp_group(topo), max(drop_sizes) * M,
                         key("forward/mp-ag", mp_group(topo)))
        fwd += [Step("combine", kind="elementwise", work=el(sent) + n * M * B)]
        bwd += [Step("combine", kind="elementwise", work=el(sent) + n * M * B)]
        if gather_in:
            bwd += _coll("ESP-Split/AllGather", "all_gather", peers, max(sizes) * M,
                         key("backward/esp-split", peers))
        bwd += _coll("A2", "all_to_all", epg, S * M, key("backward/A2", epg))
        bwd += [eb]
        if not gather_in:           # Megatron's f: the shards' partial input gradients summed
            bwd += _coll("ESP-AllReduce", "all_reduce", peers, R * M,
                         key("backward/esp-ar", peers))
        bwd += _coll("A1", "all_to_all", epg, R * M, key("backward/A1", epg))
        if drop_sizes is not None:      # drop_tokens' backward: the parts' gradients gathered
            bwd += _coll("MP-Split/AllGather", "all_gather", mp_group(topo),
                         max(drop_sizes) * M, key("backward/mp-split", mp_group(topo)))
        if gather_in:
            bwd += _coll("ESP-AllGather/ReduceScatter", "reduce_scatter", peers,
                         len(peers) * max(tokens) * M, key("backward/esp-rs", peers))
    else:
        u = topo.expert_slots
        me = topo.expert_slot
        full = np.stack([counts[q] for q in block])          # block_counts: (u, E)
        mpg, mp_me = mp_group(topo), topo.mp_rank
        if spec.schedule == "s1":
            C, peer_sizes = full, None
        else:                       # s2_experts: every MP rank's share of every slot's buffer
            first = rank - me
            shares = chunk_counts(full, spec.mp)
            C = np.stack([shares[(first + q) % spec.mp][q] for q in range(u)])
            peer_dumps = [Dump.build(np.where(np.arange(u)[:, None] == me, shares[m][me], C),
                                     topo) for m in range(spec.mp)]
            peer_sizes = [int(shares[m][me].sum()) for m in range(spec.mp)]
        dump = Dump.build(C, topo)
        Smat = dump.matrix
        out_rows, back_rows = int(Smat[me].sum()), int(Smat[:, me].sum())
        ef, eb = experts(back_rows)
        fwd += _coll("counts", "all_gather", block, count_width, key("forward/counts", block),
                     dtype="int64")
        fwd += [Step("dump", kind="elementwise", work=el(out_rows))]
        fwd += _coll("A1", "all_to_all", block, out_rows * M, key("forward/A1", block))
        fwd += [ef]
        bwd_a2a: list[Step] = []
        if spec.schedule == "s2" and spec.saa:
            send, recv = Smat[:, me].tolist(), Smat[me].tolist()    # run_saa's splits
            ag = np.stack([d.matrix[me] for d in peer_dumps])
            slots = mp_slots(topo)
            mp = spec.mp

            def phase_sizes(t):
                srcs = [(slots[m] - t) % u for m in range(mp)]
                return [int(ag[m][srcs[m]]) for m in range(mp)]
            for t in range(u + 1):
                if 0 < t < u:
                    dst = block[(me + t) % u]
                    fwd += [Step(f"SAA{t}", "p2p", (rank, dst), send[(me + t) % u] * M,
                                 key(f"forward/saa-p2p{t}", block))]
                if t >= 1 and mp > 1:
                    fwd += [Step(f"SAA{t}/AllGather", "all_gather", tuple(mpg),
                                 max(phase_sizes(t - 1)) * M,
                                 key(f"forward/saa-ag{t}", mpg), lane="mp",
                                 beside_previous=0 < t < u)]
            if mp == 1:
                bwd_a2a += _coll("A2", "all_to_all", block, sum(recv) * M,
                                 key("backward/A2", block))
            else:
                pending = None
                for t in range(u - 1, -2, -1):
                    rs = None
                    if t >= 0:
                        rs = Step(f"SAA{t}/ReduceScatter", "reduce_scatter", tuple(mpg),
                                  mp * max(phase_sizes(t)) * M,
                                  key(f"backward/saa-rs{t}", mpg), lane="mp")
                    # issued as the library does: the reduce-scatter of phase t, then beside
                    # it the reverse exchange of phase t + 1 (phase 0's is a local copy)
                    if rs is not None:
                        bwd_a2a += [rs]
                    if pending is not None and pending[0] != 0:
                        s, rows = pending
                        bwd_a2a += [Step(f"SAA{s}", "p2p", (rank, block[(me - s) % u]),
                                         rows * M, key(f"backward/saa-p2p{s}", block),
                                         beside_previous=rs is not None)]
                    pending = None if t < 0 else (t, phase_sizes(t)[mp_me])
        else:
            fwd += _coll("A2", "all_to_all", block, back_rows * M, key("forward/A2", block))
            bwd_a2a += _coll("A2", "all_to_all", block, out_rows * M, key("backward/A2", block))
            if spec.schedule == "s2":       # AAS: the AllGather after the all-to-all back
                top = max(d.index.size for d in peer_dumps)
                fwd += _coll("MP-AllGather", "all_gather", mpg, top * M,
                             key("forward/aas-ag", mpg))
                bwd_a2a = _coll("MP-AllGather/ReduceScatter", "reduce_scatter", mpg,
                                spec.mp * top * M, key("backward/aas-rs", mpg)) + bwd_a2a
        combined = sent if spec.schedule == "s1" else int(counts[rank].sum())
        fwd += [Step("local combine", kind="elementwise", work=el(out_rows)),
                Step("combine", kind="elementwise", work=el(combined) + n * M * B)]
        bwd += [Step("combine", kind="elementwise", work=el(combined) + n * M * B)]
        if spec.schedule == "s1":
            parts = [len(r) for r in token_rows(spec.tokens, spec.mp)]
            fwd += _coll("MP-AllGather", "all_gather", mpg, max(parts) * M,
                         key("forward/mp-ag", mpg))
            fwd += _coll("MP-AllGather/loss", "all_gather", mpg, 1, key("forward/loss", mpg))
            # autograd runs the later-made node first: the loss's gather, then the outputs'
            bwd = (_coll("MP-AllGather/loss", "reduce_scatter", mpg, spec.mp,
                         key("backward/loss", mpg))
                   + _coll("MP-AllGather/ReduceScatter", "reduce_scatter", mpg,
                           spec.mp * max(parts) * M, key("backward/mp-rs", mpg)) + bwd)
        bwd += [Step("local combine", kind="elementwise", work=el(out_rows))]
        bwd += bwd_a2a + [eb]
        bwd += _coll("A1", "all_to_all", block, back_rows * M, key("backward/A1", block))
        bwd += [Step("dump", kind="elementwise", work=el(out_rows))]
        if spec.schedule == "s2":   # MP-Split of the send buffer: its gradient's AllGather
            bwd += _coll("MP-Split/AllGather", "all_gather", mpg, max(peer_sizes) * M,
                         key("backward/mp-split", mpg))
    bwd += [Step("permute", kind="elementwise", work=el(sent)),
            Step("route", kind="gemm_backward", work=4 * n * M * E),
            Step("route", kind="elementwise", work=4 * n * E * B)]
    if spec.schedule == "s1":       # MP-Split before the gate: its gradient's AllGather
        parts = [len(r) for r in token_rows(spec.tokens, spec.mp)]
        bwd += _coll("MP-Split/AllGather", "all_gather", mpg, max(parts) * M,
                     key("backward/mp-split", mpg))
    return _with_recompute(spec, {"forward": fwd, "backward": bwd})


def _with_recompute(spec: ParmSpec, steps: dict[str, list[Step]]) -> dict[str, list[Step]]:
    """``spec.recompute``: the experts' forward before each backward task E; under ``full``
    the ``"recompute"`` pass, the forward's steps without the count gather (replayed)."""
    if spec.recompute == "none":
        return steps
    bwd = []
    for s in steps["backward"]:
        if s.kind == "experts_backward":
            bwd.append(Step("E", kind="experts", work=s.work / 2))
        bwd.append(s)
    out = {"forward": steps["forward"], "backward": bwd}
    if spec.recompute == "full":
        out["recompute"] = [replace(s, key=s.key.replace("forward/", "recompute/", 1))
                            for s in steps["forward"] if s.name != "counts"]
    return out


def _link_class(spec: ParmSpec, ranks) -> str:
    nodes = {r // spec.ranks_per_node for r in ranks}
    if len(nodes) == 1:
        return "intra"
    return "inter" if len(nodes) == len(ranks) else "world"


def collective_seconds(spec: ParmSpec, costs: CostModel, steps: list[Step]) -> float:
    """One collective (the members' steps): the fit of its link class and op at the slowest
    member's buffer (nccl-tests bytes); SAA's point-to-point phase at its slowest pair."""
    s0 = steps[0]
    B = 8 if s0.dtype == "int64" else _BYTES[spec.dtype]
    if s0.op == "p2p":
        classes = {_link_class(spec, s.ranks) for s in steps}
        cls = "inter" if "inter" in classes or "world" in classes else "intra"
        return costs.link(cls, "p2p").predict(max(s.elements for s in steps) * B)
    g = len(s0.ranks)
    nbytes = max(_NCCL[s0.op](s.elements, g) for s in steps) * B
    return costs.link(_link_class(spec, s0.ranks), s0.op).predict(nbytes)


def simulate_parm(spec: ParmSpec, costs: CostModel, routing: list | None = None) -> dict:
    """The predicted step (forward + backward) of a Parm layer; ``routing``: per rank the
    ``(tokens, top_k)`` expert ids of its MoE input (the MP ranks' equal), or None."""
    W = spec.world
    if routing is not None and len(routing) != W:
        raise ConfigError(f"the routing sample has {len(routing)} ranks; the layout has {W}")
    counts = {r: gate_counts(spec, spec.topology(r), _rank_ids(spec, spec.topology(r), routing))
              for r in range(W)}
    steps = {r: rank_steps(spec, r, counts) for r in range(W)}
    members: dict[str, list[Step]] = {}
    for r in range(W):
        for phase in PHASES:
            for s in steps[r].get(phase, ()):
                if s.op is not None:
                    members.setdefault(s.key, []).append(s)
    lanes: dict = {(r, lane): [] for r in range(W) for lane in ("compute", "mp")}
    busy: dict[int, dict[str, float]] = {r: {} for r in range(W)}
    for r in range(W):
        prev: list[SimTask] = []
        before: list[SimTask] = []
        for phase in PHASES:
            for s in steps[r].get(phase, ()):
                if s.op is None:
                    sec = costs.compute_time(s.kind, s.work)
                    t = SimTask(s.name, r, "compute", "compute", phase, sec, [])
                else:
                    sec = collective_seconds(spec, costs, members[s.key])
                    cls = (_link_class(spec, s.ranks))
                    t = SimTask(s.name, r, "comm", s.lane, phase, sec, [], collective=s.key,
                                size=s.elements * (8 if s.dtype == "int64"
                                                   else _BYTES[spec.dtype]),
                                link=cls, stage=s.op, ranks=s.ranks, elements=s.elements)
                # a step waits for the previous one; a step beside the previous one starts
                # with it (SAA: the AllGather of phase t - 1 with the exchange of phase t)
                if s.beside_previous:
                    t.deps = list(before)
                    prev = prev + [t]
                else:
                    t.deps, before = list(prev), list(prev)
                    prev = [t]
                lanes[(r, t.runs_on)].append(t)
                busy[r][s.name] = busy[r].get(s.name, 0.0) + sec
    step = engine.run(lanes)
    tasks = [t for v in lanes.values() for t in v]
    fwd_end = max(t.end for t in tasks if t.phase == "forward")
    rerun = [t.end for t in tasks if t.phase == "recompute"]
    slowest = max(range(W), key=lambda r: max(t.end for t in tasks if t.rank == r))
    mine = [t for t in tasks if t.rank == slowest]
    comm = sum(t.end - t.start for t in mine if t.stage is not None)
    compute = sum(t.end - t.start for t in mine if t.stage is None)
    return {"spec": asdict(spec), "world": W, "step_s": step, "forward_s": fwd_end,
            "backward_s": step - fwd_end, "recompute_s": max(rerun) - fwd_end if rerun else 0.0,
            "comm_s": comm, "compute_s": compute,
            "exposed_comm_s": max(0.0, step - compute), "busy_s": busy[slowest],
            "counts": [counts[r].tolist() for r in range(W)],
            "collectives": {r: [collective_record(s, phase) for phase in PHASES
                                for s in steps[r].get(phase, ()) if s.op is not None]
                            for r in range(W)},
            "tasks": sorted((t.record() for t in tasks),
                            key=lambda rec: (rec["rank"], rec["start_s"]))}


def collective_record(s: Step, phase: str) -> dict:
    return {"phase": phase, "name": s.name, "op": s.op, "ranks": list(s.ranks),
            "elements": s.elements, "dtype": s.dtype}


__all__ = ["ParmSpec", "SCHEDULES", "rank_steps", "simulate_parm"]
