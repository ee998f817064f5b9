"""``moeflow train``'s Trainer with ``TrainConfig.recompute`` none / full / moe_act (and full
with gradient accumulation) on 2 gloo ranks (importable by spawned ranks; run by
tests/multirank/test_recompute.py): the losses and parameters after two steps, and the forwards each
MoE layer ran (a hook on its router)."""

from __future__ import annotations


import torch

from moeflow.config import ModelConfig, TrainConfig
from moeflow.topology import Topology
from moeflow.trainer import Trainer

MCFG = ModelConfig(n_layers=2, seq_len=16, d_model=32, n_heads=2, d_ff=64,
                   moe=dict(num_experts=4, d_expert=32, pipeline_degree=2, schedule="optsche"))
RUNS = {"none": {}, "full": dict(recompute="full"), "moe_act": dict(recompute="moe_act"),
        "accum2": dict(grad_accum=2, batch_size=2),
        "full_accum2": dict(recompute="full", grad_accum=2, batch_size=2),
        "fssdp_none": {}, "fssdp_full": dict(recompute="full"),
        "fssdp_moe_act": dict(recompute="moe_act")}
# FSSDP with Algorithm 1 from the load window (P' changes after the first step)
FSSDP_CFG = dict(placement="fssdp", fssdp=dict(materialize="sparse", overlap_degree=2,
                                               memory_capacity=1))


def worker(out_dir: str) -> dict:
    torch.manual_seed(0)
    out = {}
    for name, kw in RUNS.items():
        kw = {"batch_size": 4, **kw}
        tcfg = TrainConfig(steps=2, log_every=1, eval_every=100, eval_batches=1,
                           warmup_steps=0, **kw)
        mcfg = (MCFG.replace(moe=FSSDP_CFG) if name.startswith("fssdp")
                else MCFG)
        trainer = Trainer(mcfg, tcfg, f"{out_dir}/{name}", Topology.from_env(), progress=False)
        calls = [0]
        for m in trainer.model.moe_layers():
            m.router.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        res = trainer.run()
        out[name] = {"loss": [r["loss"] for r in res["history"] if "loss" in r],
                     "params": {n: p.detach().clone()
                                for n, p in trainer.model.named_parameters()},
                     "forwards": calls[0],
                     "moe_recompute": [m.cfg.recompute for m in trainer.model.moe_layers()]}
    return out
