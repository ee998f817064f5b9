"""Rank side of tests/multirank/test_fssdp_layer.py: MoELayer(placement="fssdp") vs "ep" vs one process.

Each case runs ``STEPS`` AdamW steps; at every step each rank has its own batch, calls backward
on its local loss and syncs gradients. The reference is one process holding every expert, each
rank's batch as its own local batch, on the mean of the local losses (tests/helpers/parity.py). Expert
tensors are compared per global expert id: ``{(expert, name): tensor}``.
"""

from __future__ import annotations

import torch

from moeflow import Topology, sync_gradients
from moeflow.experts.ffn import EXPERT_PARAM_ATTR
from moeflow.init import seeded_normal
from moeflow.strategies.fssdp.layer_experts import FSSDPExperts
from moeflow.strategies.fssdp.memory import worst_peak_rows
from tests.helpers import parity

WORLD, LOCAL, STEPS, LR = 4, 2, 3, 0.02
CASES = ["hot_expert_capacity", "hot_expert_dropless",
         "expert_bias_swiglu_dropless", "zero_token_rank"]
# P' per step (8 experts, rank r owns experts 2r and 2r + 1): every set holds the owner.
RANDOM = [
    [{0, 3}, {0}, {1, 2}, {1}, {2, 0}, {2}, {3, 1}, {3}],
    [{0}, {0, 1, 2}, {1}, {1, 3}, {2}, {2, 1}, {3, 0}, {3}],
    [{0, 1}, {0}, {1}, {1, 0, 2}, {2, 3}, {2}, {3}, {3, 2}],
]
SKEWED = [      # the hot experts (5 for hot_expert_dropless, 2 for hot_expert_capacity) everywhere
    [{0}, {0}, {1, 0, 2, 3}, {1}, {2}, {2, 0, 1, 3}, {3}, {3}],
    [{0, 2}, {0}, {1, 0, 2, 3}, {1}, {2}, {2, 0, 1, 3}, {3}, {3}],
    [{0}, {0}, {1, 0, 3}, {1}, {2}, {2, 1, 3}, {3}, {3, 0}],
]
VARIANTS = {
    "ep": dict(),
    "fssdp_static": dict(placement="fssdp"),
    "fssdp_random": dict(placement="fssdp", fssdp=dict(materialize="manual"), holders=RANDOM),
    "fssdp_skewed": dict(placement="fssdp", fssdp=dict(materialize="manual"), holders=SKEWED),
    "fssdp_skewed_rm": dict(placement="fssdp",
                            fssdp=dict(materialize="manual", rematerialize=True),
                            holders=SKEWED),
    # Algorithm 1 from the w = 5 window: branch t > m (slots by load), then t <= m with
    # calibration after the gate and re-materialization
    "fssdp_sparse": dict(placement="fssdp", fssdp=dict(materialize="sparse", overlap_degree=3,
                                                       memory_capacity=1)),
    "fssdp_sparse_cal_rm": dict(placement="fssdp",
                                fssdp=dict(materialize="sparse", overlap_degree=2,
                                           memory_capacity=2, calibrate=True,
                                           bandwidth_Bps=1e12, rematerialize=True)),
    # Algorithm 1 with m from a memory budget (bytes, per rank: 1, 3, 2, 1 extra experts; the
    # ranks agree on the least, m = 1 < t = 3: lines 6-11) and calibration after the gate
    "fssdp_sparse_budget": dict(placement="fssdp",
                                fssdp=dict(materialize="sparse", overlap_degree=3,
                                           calibrate=True, bandwidth_Bps=1e12),
                                budget_slots=(1, 3, 2, 1)),
    "fssdp_random_rm_r2": dict(placement="fssdp", pipeline_degree=2, schedule="optsche",
                               fssdp=dict(materialize="manual", rematerialize=True),
                               holders=RANDOM),
}


def batch(name: str, rank: int, step: int):
    x, g = parity.make_batch(name, rank % len(parity.TOKENS))   # 8 ranks: the sizes repeat,
    noise = seeded_normal(tuple(x.shape), 0.3, "fssdp-step", name, rank, step,
                          dtype=torch.float64)
    return x + noise, g


def expert_tensors(layer, grads: bool) -> dict:
    """``{(expert, name): tensor}`` of the experts this rank stores (grads or values)."""
    ex = layer.experts
    out = {}
    if isinstance(ex, FSSDPExperts):
        src = ex.slots.grad if grads else ex.slots.detach()
        for e, i in ex.slot_index.items():
            for n, v in ex._views(src[i:i + 1]).items():
                out[e, n] = v[0].clone()
        return out
    for n, p in ex.named_parameters():
        src = p.grad if grads else p.detach()
        for i in range(ex.num_local):
            out[ex.first_expert + i, n] = src[i].clone()
    return out


def dense(layer, grads: bool) -> dict:
    return {n: (p.grad if grads else p.detach()).clone() for n, p in layer.named_parameters()
            if not n.startswith("experts.")}


def run(name: str, topo: Topology, variant: dict) -> list[dict]:
    variant = dict(variant)
    holders = variant.pop("holders", None)
    budget_slots = variant.pop("budget_slots", None)
    if budget_slots is not None:        # this rank's budget: its extra experts' worst-case
        probe = parity.make_layer(name, Topology.single()).experts      # peak and half a row
        numel = sum(p[0].numel() for p in probe.parameters())
        owned = parity.make_config(name).num_experts // topo.world_size   # even shard map
        k = budget_slots[topo.rank]
        rows = (worst_peak_rows(k, owned, topo.world_size, owned)
                - worst_peak_rows(0, owned, topo.world_size, owned))
        variant["fssdp"] = dict(variant["fssdp"], memory_budget_bytes=int(
            (rows + 0.5) * numel * torch.float64.itemsize))
    layer = parity.make_layer(name, topo, **variant)
    opt = torch.optim.AdamW(layer.parameters(), lr=LR)
    steps = []
    for step in range(STEPS):
        if holders is not None:
            layer.experts.set_holders(holders[step])
        x, g = batch(name, topo.rank, step)
        x.requires_grad_()
        y = layer(x, **parity._spec(name).get("call", {}))
        parity.local_loss(y, g, layer).backward()
        sync_gradients(layer, topo)
        rec = {"y": y.detach(), "x_grad": x.grad, "grads": expert_tensors(layer, True),
               "dense_grads": dense(layer, True), "stats": layer.stats}
        opt.step()
        opt.zero_grad()
        rec.update(params=expert_tensors(layer, False), dense_params=dense(layer, False))
        if isinstance(layer.experts, FSSDPExperts):
            rec["states"] = len(opt.state)
            rec["bytes"] = dict(layer.experts.bytes)
            rec["holders"] = [sorted(h) for h in layer.experts.last_placement.holders]
            rec["m"] = layer.experts.memory_capacity
            rec["branch"] = layer.experts.last_branch
        steps.append(rec)
    return steps


# every variant on the first two cases; the others under EP and the two busiest variants
FULL_CASES = CASES[:2]
SHORT_VARIANTS = ["ep", "fssdp_random", "fssdp_sparse_cal_rm"]


def pairs() -> list[tuple[str, str]]:
    return [(c, v) for c in CASES for v in VARIANTS
            if c in FULL_CASES or v in SHORT_VARIANTS]


def worker() -> dict:
    topo = Topology.from_env(local_size=LOCAL)
    return {(c, v): run(c, topo, VARIANTS[v]) for c, v in pairs()}


def reference(name: str, n_steps: int = STEPS, state=None) -> list[dict]:
    """The one-process run of ``name`` over every rank's batches; ``state(layer, opt)``, when
    given, records the optimizer's state after each step too."""
    layer = parity.make_layer(name, Topology.single())
    opt = torch.optim.AdamW(layer.parameters(), lr=LR)
    steps = []
    for step in range(n_steps):
        total, ys, xs = 0.0, [], []
        for r in range(WORLD):
            x, g = batch(name, r, step)
            x.requires_grad_()
            y = layer(x, **parity._spec(name).get("call", {}))
            total = total + parity.local_loss(y, g, layer)
            ys.append(y.detach())
            xs.append(x)
        (total / WORLD).backward()
        rec = {"y": ys, "x_grad": [x.grad for x in xs], "grads": expert_tensors(layer, True),
               "dense_grads": dense(layer, True)}
        opt.step()
        opt.zero_grad()
        rec.update(params=expert_tensors(layer, False), dense_params=dense(layer, False))
        if state is not None:
            rec["state"] = state(layer, opt)
        steps.append(rec)
    return steps


# -- the GPT block: spAG launched before the attention (early_gather), several layers --------

def gpt_worker(steps: int = 3) -> dict:
    """Losses and final parameters of a 2-layer MoE GPT under EP and FSSDP (random P' in the
    first MoE layer, early gather on; re-materialization in a third run)."""
    from moeflow.config import ModelConfig
    from moeflow.models.gpt import GPT

    topo = Topology.from_env(local_size=LOCAL)
    out = {}
    for label, extra in (("ep", {}), ("fssdp", dict(placement="fssdp",
                                                    fssdp=dict(materialize="manual"))),
                         ("fssdp_rm", dict(placement="fssdp",
                                           fssdp=dict(materialize="manual",
                                                      rematerialize=True)))):
        cfg = ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=32,
                          moe_every=1, seed=5, moe=dict(num_experts=8, d_expert=12, top_k=2,
                                                        capacity_factor=None, **extra))
        model = GPT(cfg, topo).double()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        losses, prefetched = [], 0
        for step in range(steps):
            for i, layer in enumerate(model.moe_layers()):
                if isinstance(layer.experts, FSSDPExperts):
                    layer.experts.set_holders(RANDOM[(step + i) % len(RANDOM)])
            gen = torch.Generator().manual_seed(100 * step + topo.rank)
            idx = torch.randint(0, 32, (2, 8), generator=gen)
            tgt = torch.randint(0, 32, (2, 8), generator=gen)
            if label != "ep":
                model.blocks[0].ffn.prefetch()
                prefetched += model.blocks[0].ffn.experts._pending is not None
            _, loss = model(idx, tgt)
            (loss + model.aux_loss).backward()
            sync_gradients(model, topo)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        out[label] = {"losses": losses, "prefetched": prefetched,
                      "experts": {(li, k): v for li, layer in enumerate(model.moe_layers())
                                  for k, v in expert_tensors(layer, False).items()},
                      "dense": {n: p.detach().clone() for n, p in model.named_parameters()
                                if ".experts." not in n}}
    return out


# -- checkpoints: each expert once by global id, with its AdamW moments ----------------------

def small_gpt(topo, **extra):
    from moeflow.config import ModelConfig
    from moeflow.models.gpt import GPT

    cfg = ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=32,
                      moe_every=1, seed=5, moe=dict(num_experts=8, d_expert=12, top_k=2,
                                                    capacity_factor=None, **extra))
    return GPT(cfg, topo).double()


def train_steps(model, opt, topo, steps: range) -> list[float]:
    losses = []
    for step in steps:
        for i, layer in enumerate(model.moe_layers()):
            if isinstance(layer.experts, FSSDPExperts) and \
                    layer.experts.options.materialize == "manual":
                layer.experts.set_holders(RANDOM[(step + i) % len(RANDOM)])
        gen = torch.Generator().manual_seed(100 * step + topo.rank)
        idx = torch.randint(0, 32, (2, 8), generator=gen)
        _, loss = model(idx, torch.randint(0, 32, (2, 8), generator=gen))
        (loss + model.aux_loss).backward()
        sync_gradients(model, topo)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def all_experts(model) -> dict:
    return {(li, k): v for li, layer in enumerate(model.moe_layers())
            for k, v in expert_tensors(layer, False).items()}


def checkpoint_worker(path: str) -> dict:
    from moeflow import checkpoint

    topo = Topology.from_env(local_size=LOCAL)
    fs = dict(placement="fssdp", fssdp=dict(materialize="manual"))
    model = small_gpt(topo, **fs)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_steps(model, opt, topo, range(2))
    checkpoint.save(path, model, opt, 2)
    saved = all_experts(model)
    after = train_steps(model, opt, topo, range(2, 4))
    resumed = small_gpt(topo, **fs)
    ropt = torch.optim.AdamW(resumed.parameters(), lr=0.01)
    step = checkpoint.load(path, resumed, ropt)
    loaded = all_experts(resumed)
    again = train_steps(resumed, ropt, topo, range(2, 4))
    ep = small_gpt(topo)                                   # the same checkpoint under EP
    eopt = torch.optim.AdamW(ep.parameters(), lr=0.01)
    checkpoint.load(path, ep, eopt)
    ep_after = train_steps(ep, eopt, topo, range(2, 4))
    return {"step": step, "saved": saved, "loaded": loaded, "after": after, "again": again,
            "ep_after": ep_after, "final": all_experts(model), "final_resumed":
            all_experts(resumed), "final_ep": all_experts(ep)}


# -- Algorithm 2: a re-shard in the middle of training ---------------------------------------

def reshard_worker(path: str) -> dict:
    """EP vs FSSDP (static and Algorithm 1) with a re-shard after step 2 of 4; a checkpoint
    taken after the re-shard resumes exactly."""
    from moeflow import checkpoint
    from moeflow.strategies.fssdp.reshard import maybe_reshard

    topo = Topology.from_env(local_size=LOCAL)
    out = {}
    for label, extra in (("ep", {}),
                         ("static", dict(placement="fssdp", fssdp=dict(reshard_every=2))),
                         ("sparse", dict(placement="fssdp", fssdp=dict(
                             materialize="sparse", overlap_degree=2, memory_capacity=1,
                             reshard_every=2)))):
        model = small_gpt(topo, **extra)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        losses, owners = [], []
        for step in range(4):
            losses += train_steps(model, opt, topo, range(step, step + 1))
            if maybe_reshard(model, opt, step + 1):
                owners.append([list(m.experts.owners.owners) for m in model.moe_layers()])
            if step == 2 and label == "sparse":
                checkpoint.save(path, model, opt, 3)
        from moeflow.strategies.fssdp.metrics import fssdp_metrics

        rec = {"losses": losses, "owners": owners, "experts": all_experts(model),
               "metrics": fssdp_metrics(model),      # after a re-shard (the last step's P)
               "states": sum(1 for p in opt.state if getattr(p, EXPERT_PARAM_ATTR, False))}
        if label == "sparse":
            resumed = small_gpt(topo, **extra)
            ropt = torch.optim.AdamW(resumed.parameters(), lr=0.01)
            checkpoint.load(path, resumed, ropt)
            rec["resumed_owners"] = [list(m.experts.owners.owners)
                                     for m in resumed.moe_layers()]
            rec["resumed_loss"] = train_steps(resumed, ropt, topo, range(3, 4))
            rec["resumed_experts"] = all_experts(resumed)
        out[label] = rec
    return out


# -- composability: codecs, all-to-all algorithms, schedulers, BigMac, SMILE routing ---------

COMPOSE = {   # (parity case, overrides shared by EP and FSSDP)
    "fp16_codec": ("hot_expert_dropless", dict(codec="fp16", codec_backward=True)),
    "int8_codec_hier2d": ("hot_expert_capacity", dict(codec="int8", a2a="hier2d")),
    "bilevel_a2a_pipelined": ("hot_expert_dropless", dict(a2a="bilevel", pipeline_degree=3,
                                                          schedule="pipelined")),
    "pipe_a2a": ("expert_bias_swiglu_dropless", dict(a2a="pipe")),
    "bigmac": ("bigmac_swiglu_capacity", {}),
    "smile_router": ("bilevel_top1", {}),
}


def compose_worker() -> dict:
    topo = Topology.from_env(local_size=LOCAL)
    out = {}
    for label, (case, over) in COMPOSE.items():
        for kind, extra in (("ep", {}), ("fssdp", dict(placement="fssdp",
                                                       fssdp=dict(materialize="manual")))):
            layer = parity.make_layer(case, topo, **over, **extra)
            if kind == "fssdp":
                layer.experts.set_holders(SKEWED[0])
            x, g = batch(case, topo.rank, 0)
            x.requires_grad_()
            y = layer(x)
            parity.local_loss(y, g, layer).backward()
            sync_gradients(layer, topo)
            out[label, kind] = {"y": y.detach(), "x_grad": x.grad,
                                "grads": expert_tensors(layer, True),
                                "dense_grads": dense(layer, True)}
    return out


def memory_worker() -> dict:
    """``moeflow bench hecate``'s memory probe: the materialized experts' bytes held between
    forward and backward, without and with re-materialization (HECATE-RM), and the gradients
    (the probe must not change them)."""
    from benchmarks.hecate.hecate_memory import MaterializedProbe

    topo = Topology.from_env(local_size=LOCAL)
    out = {}
    for rm in (False, True):
        layer = parity.make_layer("hot_expert_dropless", topo, placement="fssdp",
                                  fssdp=dict(materialize="manual", rematerialize=rm))
        layer.experts.set_holders(SKEWED[0])
        probe = MaterializedProbe(layer.experts)
        x, g = batch("hot_expert_dropless", topo.rank, 0)
        y = layer(x)
        held = probe.held_bytes()
        parity.local_loss(y, g, layer).backward()
        out[rm] = {"held": held, "rows": probe.rows(),
                   "after_backward": probe.held_bytes(),
                   "expert_bytes": layer.experts.expert_bytes,
                   "grad": layer.experts.slots.grad.clone()}
    return out


def all_worker(ckpt_path: str, reshard_path: str) -> dict:
    """Everything the test module needs, in one launch (one process start per rank)."""
    return {"layer": worker(), "gpt": gpt_worker(), "ckpt": checkpoint_worker(ckpt_path),
            "reshard": reshard_worker(reshard_path), "compose": compose_worker(),
            "memory": memory_worker()}


# -- 8 ranks (4 nodes x 2): the variants whose P' the layer chooses itself ------------------

#: the hand-made RANDOM / SKEWED placements above name owners of a 4-rank job; these are valid
#: on any world size
AUTO_VARIANTS = ["ep", "fssdp_static", "fssdp_sparse", "fssdp_sparse_cal_rm"]


def worker_world(world: int) -> dict:
    global WORLD
    WORLD = world
    topo = Topology.from_env(local_size=LOCAL)
    return {(c, v): run(c, topo, VARIANTS[v]) for c in FULL_CASES for v in AUTO_VARIANTS}


def check_eight_ranks() -> None:
    """FSSDP = EP = one process on 8 ranks (4 nodes x 2, one expert per rank), float64, over
    ``STEPS`` AdamW steps (``tests/multirank/test_fssdp_layer.py``, or ``python -m
    tests.helpers.fssdp_layer_worker``)."""
    from moeflow.launch import launch_local
    from tests.helpers import fssdp_layer_worker as w      # the module _check reads (not __main__)
    from tests.multirank.test_fssdp_layer import _check

    four, w.WORLD = w.WORLD, 8
    try:
        got = launch_local(w.worker_world, w.WORLD, w.WORLD, timeout_s=600)
        for case in FULL_CASES:
            ref = w.reference(case)
            for variant in AUTO_VARIANTS:
                for rank in range(w.WORLD):
                    for step in range(STEPS):
                        _check(got[rank][case, variant][step], ref[step], rank,
                               f"8 ranks {case}/{variant} step {step}")
            for variant in ("fssdp_sparse", "fssdp_sparse_cal_rm"):    # Algorithm 1 replicated
                assert any(len(h) > 1 for rec in got[0][case, variant]
                           for h in rec["holders"]), \
                    f"{case}/{variant}: Algorithm 1 held no expert on a second rank"
            # t = 3 > m = 1: the topology-aware lines 6-11 once the window has loads (step 1
            # on), every rank the same P', none holding more than m = 1 replica
            recs = [got[r][case, "fssdp_sparse"] for r in range(w.WORLD)]
            for step in range(1, STEPS):
                assert all(rs[step]["branch"] == "slots_by_load" for rs in recs), \
                    f"{case}: 8 ranks took {recs[0][step]['branch']!r} at step {step}"
                holders = recs[0][step]["holders"]
                assert all(rs[step]["holders"] == holders for rs in recs)
                extra = [sum(r in h for h in holders) - 1 for r in range(w.WORLD)]
                assert max(extra) <= 1 and sum(extra) > 0, (case, step, holders)
    finally:
        w.WORLD = four
    print(f"8 ranks (4 nodes x {LOCAL}): {FULL_CASES} x {AUTO_VARIANTS} over {STEPS} AdamW "
          "steps match the single-process reference")


if __name__ == "__main__":
    check_eight_ranks()
