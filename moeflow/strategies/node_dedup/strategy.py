"""Node-deduplicated dispatch and combine (``MoEConfig(placement="node_dedup")``).

The hierarchical exchange of DeepEP's inter-node kernels and Megatron-core's flex dispatcher
(and SMILE section 3.2.3's two stages, made token-aware): rank (n, l) = node n, local rank l.

Dispatch
  1. For every token, the distinct nodes holding one of its k experts. The token goes once to
     each such node m, to rank (m, l), with its k expert ids and k gate weights (an
     inter-node all-to-all among the ranks of local rank l).
  2. The relay (m, l) forwards each received token once to each rank of node m holding one
     of its experts (an intra-node all-to-all; DeepEP's normal mode: one copy per (token,
     rank), not per choice), and that rank makes its choices' rows locally; the experts run.
Combine (the mirror)
  3. Each expert rank weights its own choices' outputs by their gates and sums them per copy
     (one partial row per (token, rank)); they go back to the relay (intra-node), which sums
     its node's: one partial sum per (token, node).
  4. The partial sums cross back (inter-node) and each token sums its nodes' partials.
Inter-node rows per dispatch and per combine are (tokens x distinct destination nodes)
instead of (tokens x k); intra-node rows (tokens x distinct destination ranks). This is the
counted layout (:mod:`moeflow.strategies.node_dedup.trimmed`); padded capacity mode
(:mod:`moeflow.strategies.node_dedup.padded`) fans out one row per choice into GShard's slots
and sums at the relay. The backward is the mirror: the gradients of the partial sums cross
once per (token, node), and the gradients of the tokens and gates once per (token, node) the
other way. (The step simulator, :func:`moeflow.comm.alltoall.phases.node_dedup_phases`, models
the intra-node hop per choice.) Trimmed, with several ranks per node, the two hops
overlap per source node as in DeepEP's normal mode: the relay forwards the rows already
received while the other nodes' are in flight, and returns each node's sums while it gathers
the next (:mod:`moeflow.strategies.node_dedup.relay_overlap`).

Pipelining (``pipeline_degree`` r > 1, any scheduler; ScheMoE section 4): the tokens are cut
into r chunks of consecutive tokens and each chunk runs the whole exchange above as the seven
tasks of a schedule, the hops on the communication lane (the task mapping is in
:mod:`moeflow.strategies.node_dedup.steps`). The backward runs the mirrored tasks in the same
scheduler's order, its hops on the lane beside other chunks' expert backward
(:mod:`moeflow.strategies.node_dedup.backward`; under saved-tensor hooks too, its tasks' graphs
then saved as they are; at r = 1 under hooks, autograd's mirror of the chunk's graph).

Trimmed: one count exchange per call (one host synchronisation, as dropless ``direct``):
every rank all-gathers, per chunk, its choices per expert, its tokens per destination node
and its tokens per destination rank, from which every split size follows on the host. It runs on the computing thread before the
schedule; while the schedule runs, every collective is a lane task, in the schedule's order
(docs/design.md, "One collective order per rank"), in forward and in backward. The gathered
counts stay on the plan (``NodeDedupPlan.gathered``), so a checkpoint's recomputation, which
replays the plan (:mod:`moeflow.plan_record`), exchanges no counts: it issues the first
forward's all-to-alls and nothing else.

Supported: dropless and capacity mode (GShard's drops decided on the source rank, as with
``direct``), trimmed (only kept pairs and choices travel: the count exchange above) or padded
(``capacity_padding``: fixed splits from the ranks' token counts and capacities, no host read
of device values, blocks sized by a capacity per destination node that drops the copies
past it under node-limited routing: :mod:`moeflow.strategies.node_dedup.padded`,
:mod:`moeflow.strategies.node_dedup.node_capacity`), every codec (on the inter-node
hops: one encoding per (token, node) in dispatch, per partial sum in combine;
``codec_backward`` for the gradients), any ``pipeline_degree`` and scheduler, every router,
shared experts, BigMac and the other structures, and the auto-tuner (``schedule`` /
``pipeline_degree`` "auto"). Refused with a ConfigError at construction: Parm's MP/ESP (it
places experts differently), an EP group smaller than the world, a single node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeflow.dispatch import DispatchPlan, make_plan
from moeflow.comm.alltoall.phases import kept_choices
from moeflow.errors import ConfigError
from moeflow.strategies.base import ExpertStrategy, register_strategy
from moeflow.strategies.node_dedup.backward import scheduled_dedup
from moeflow.strategies.node_dedup.node_capacity import (drop_past_node_capacity,
                                                         node_capacity, nodes_per_token)
from moeflow.strategies.node_dedup.padded import padded_stage
from moeflow.strategies.node_dedup.steps import DedupStage
from moeflow.strategies.node_dedup.trimmed import trimmed_stage

_FIX = "or use placement='ep'"


def check_config(cfg, topo) -> None:
    """Raise ConfigError for what node_dedup does not run with (yet)."""
    if cfg.recompute == "moe_act":
        # its task E keeps the experts' graph (node_dedup/backward.py): moe_act would save
        # nothing, so it is refused rather than silently ignored
        raise ConfigError(
            f"MoEConfig.recompute={cfg.recompute!r} cannot be combined with "
            "placement='node_dedup' yet: its experts keep their activations; use "
            "recompute='none' (or TrainConfig.recompute='full', which node_dedup replays), "
            f"{_FIX}")
    if topo.esp_size > 1 or topo.mp_size > 1:
        raise ConfigError(f"MoEConfig.placement='node_dedup' cannot be combined with Parm's "
                          f"MP/ESP (mp_size={topo.mp_size}, esp_size={topo.esp_size}) yet: use "
                          f"mp_size=esp_size=1, {_FIX}")
    if topo.world_size > 1 and topo.ep_size != topo.world_size:
        raise ConfigError(
            f"MoEConfig.placement='node_dedup' is invalid with ep_size={topo.ep_size} on a "
            f"world of {topo.world_size}: its exchange runs over the whole world; use "
            f"ep_size=None (all ranks), {_FIX}")
    if topo.num_nodes < 2:
        raise ConfigError(
            f"MoEConfig.placement='node_dedup' is invalid on {topo.num_nodes} node x "
            f"{topo.local_size} ranks: it needs several nodes; run on several (emulated) nodes "
            "(torchrun's LOCAL_WORLD_SIZE, or Topology.from_env(local_size=...)), " + _FIX)


@dataclass
class NodeDedupPlan(DispatchPlan):
    experts: torch.Tensor | None = None      # (T, k) expert ids (E: dropped by capacity)
    positions: torch.Tensor | None = None    # capacity: (T, k) GShard slot of each kept choice
    # what the exchange gathered (host arrays), kept for a checkpoint's recomputation, which
    # replays this plan (moeflow/plan_record.py) and so gathers nothing again: (key, values),
    # key r (the pipeline degree) with every rank's choices per expert and pairs per node per
    # chunk (trimmed), key "padded" with every rank's tokens and capacity (padded)
    gathered: tuple[object, np.ndarray] | None = None
    # the most distinct nodes a token's choices reach (node_capacity.py; same on every rank)
    nodes_per_token: int = 1

    def gathered_for(self, key) -> np.ndarray | None:
        """What the first forward gathered under ``key`` (None: nothing, gather now)."""
        return self.gathered[1] if self.gathered is not None and self.gathered[0] == key \
            else None


@register_strategy("node_dedup")
class NodeDedup(ExpertStrategy):
    """Whole experts on their EP rank (EP = the world), reached through the node-deduplicated
    exchange above; the gate weights travel with the token, so the combine happens inside
    :meth:`exchange` and the layer's combine is the identity."""

    trims_padding = False
    combines_in_exchange = True
    # its own two hops: no all-to-all algorithm to choose (a2a is not used)
    tunable_fields = ("schedule", "pipeline_degree", "codec")
    intra_node_bytes: torch.Tensor | None = None

    @classmethod
    def check_config(cls, cfg, topo) -> None:
        check_config(cfg, topo)

    def _plan(self, expert_ids, cap, device, call) -> NodeDedupPlan:
        """Dropless: every choice. Capacity: GShard's slots decide on this rank's tokens, as
        with ``direct``; a dropped choice gets the id E (no node) and travels nowhere."""
        E, topo = self.layer.cfg.num_experts, self.layer.topo
        p = make_plan(expert_ids, E, cap)
        per_token = nodes_per_token(self.layer.router, expert_ids.shape[1], topo.num_nodes)
        if cap is not None:
            T, k = expert_ids.shape
            En = E // topo.num_nodes
            positions = (p.slot - expert_ids.t().reshape(-1) * cap).view(k, T).t()
            expert_ids, p.local_counts = kept_choices(expert_ids, p.slot, p.send_rows, E)
            if per_token < k and self._pads(device):
                # padded: fixed blocks per destination node, the node capacity binds
                # (node_capacity.py); trimmed sends each node the copies it has
                expert_ids, more = drop_past_node_capacity(
                    expert_ids, En, topo.num_nodes, E, node_capacity(En, cap, k, per_token))
                p.dropped = p.dropped + more
                p.local_counts = expert_ids.new_zeros(E + 1).index_add_(
                    0, expert_ids.reshape(-1), torch.ones_like(expert_ids.reshape(-1)))[:E]
        return NodeDedupPlan(**{f: getattr(p, f) for f in p.__dataclass_fields__},
                             experts=expert_ids,
                             positions=positions if cap is not None else None,
                             nodes_per_token=per_token)

    def _pads(self, device: torch.device) -> bool:
        """Capacity mode's layout (``MoEConfig.capacity_padding``): padded, fixed splits and
        no host read (:mod:`moeflow.strategies.node_dedup.padded`) for "pad", and for "auto"
        where a host read is not free (GPUs, ``torch.compile``); else only the kept pairs,
        their counts read once."""
        mode = self.layer.cfg.capacity_padding
        return mode == "pad" or (mode == "auto" and not (
            device.type == "cpu" and not torch.compiler.is_compiling()))

    def _permute(self, h: torch.Tensor, plan, weights: torch.Tensor) -> torch.Tensor:
        """The token and its k gate weights, one row: they travel together."""
        return torch.cat([h, weights.to(h.dtype)], 1)

    def exchange(self, send, runner, tokens, call):
        """The r chunks of consecutive tokens, each through the whole deduplicated exchange,
        as the scheduler's tasks (:mod:`moeflow.strategies.node_dedup.steps`), forward and,
        scheduled the same way, backward (:mod:`moeflow.strategies.node_dedup.backward`).
        Returns the tokens' gated sums (``combines_in_exchange``)."""
        plan: NodeDedupPlan = call.plan
        if not call.replay or self.intra_node_bytes is None:
            # host counter (no device sync), as the layer's inter-node one; a checkpoint's
            # recomputation adds to the first forward's
            self.intra_node_bytes = torch.zeros((), dtype=torch.long)
        if plan.capacity is not None and self._pads(send.device):
            def build(x):
                return padded_stage(self, x, plan, runner, runner.r)
        else:
            def build(x):
                return self._trimmed_stage(x, plan, runner)
        return scheduled_dedup(send, build, runner), None

    def _trimmed_stage(self, send, plan: NodeDedupPlan, runner) -> DedupStage:
        """Split sizes from the count exchange (dropless, trimmed capacity):
        :func:`moeflow.strategies.node_dedup.trimmed.trimmed_stage`."""
        return trimmed_stage(self, send, plan, runner)

    def stats(self) -> dict[str, object]:
        """``intra_node_bytes``: the payload bytes this rank sent to other ranks of its node
        in the last step's exchange (forward, and backward added in place when it runs)."""
        return {} if self.intra_node_bytes is None else {"intra_node_bytes":
                                                         self.intra_node_bytes}
