"""Checkpoints across pipeline layouts (importable by spawned ranks; run by
tests/multirank/test_pipeline_checkpoint.py): ``moeflow train``'s Trainer, fp32 on CPU, PP 2 x
EP 2 on 4 ranks and PP 1 x EP 2 on 2 ranks (the same function, tests/helpers/pipeline_cases.py),
a DeepSeek-V3 router with its bias update (a buffer in the checkpoint) and the balancing loss.

A straight PP 2 run of 6 steps saves every 2 steps; a PP 2 run resumed from its step 2 must log
the same losses bit for bit; a PP 1 run resumed from that step 2 and a PP 2 run resumed from the
PP 1 run's step 4 (all with ``--steps 6``: the learning-rate schedule spans it) must log them
to round-off.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from moeflow.checkpoint import LATEST
from moeflow.config import ModelConfig, TrainConfig
from moeflow.trainer import train_worker

MCFG = ModelConfig(n_layers=4, seq_len=16, d_model=32, n_heads=2, d_ff=64, moe_every=2,
                   moe=dict(num_experts=4, d_expert=32, capacity_factor=None,
                            aux_loss_coef=0.01, router="deepseek_v3",
                            router_options={"bias_update_speed": 0.01}))


def train(out: str, pp: int, steps: int, resume: bool) -> dict[int, float]:
    tcfg = TrainConfig(steps=steps, pp=pp, grad_accum=2, batch_size=2, ep_size=2, log_every=1,
                       eval_every=100, eval_batches=2, checkpoint_every=2, warmup_steps=0)
    res = train_worker(MCFG, tcfg, out, None, resume, progress=False)
    return {r["step"]: r["loss"] for r in res["history"] if "loss" in r}


def copy_run(src: str, dst: str, step: int) -> None:
    """A run folder ``dst`` holding ``src``'s options and its checkpoint of ``step`` only."""
    (Path(dst) / "checkpoint").mkdir(parents=True)
    shutil.copy(Path(src) / "config.json", Path(dst) / "config.json")
    shutil.copytree(Path(src) / "checkpoint" / f"step-{step}",
                    Path(dst) / "checkpoint" / f"step-{step}")
    (Path(dst) / "checkpoint" / LATEST).write_text(f"step-{step}")


def straight_and_resumed(root: str) -> dict:
    """4 ranks: the straight PP 2 run, and a PP 2 run resumed from its step 2."""
    straight = train(f"{root}/straight", 2, 6, False)
    if dist.get_rank() == 0:
        copy_run(f"{root}/straight", f"{root}/resumed", 2)
    dist.barrier()
    return {"straight": straight, "resumed": train(f"{root}/resumed", 2, 6, True)}


def resume(out: str, pp: int, steps: int) -> dict[int, float]:
    return train(out, pp, steps, True)
