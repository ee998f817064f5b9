"""Importable by spawned ranks: a layer step that fails mid-schedule, then a clean step.

The all-to-all is slowed down unevenly (rank 0 waits before issuing each exchange), so if a
failed step left communication tasks running, the next step's collectives (issued by the main
thread) would interleave with them in a different order on each rank.
"""

from __future__ import annotations

import time

import torch

from moeflow.comm.alltoall import ALLTOALLS, register_alltoall
from moeflow.comm.alltoall.direct import DirectAllToAll


class UnevenDirect(DirectAllToAll):
    def start(self, x, send_splits, recv_splits, matrix=None):
        if self.topo.rank == 0:
            time.sleep(0.3)
        return super().start(x, send_splits, recv_splits, matrix)


if "test-uneven-direct" not in ALLTOALLS:
    register_alltoall("test-uneven-direct")(UnevenDirect)


class Boom(RuntimeError):
    pass


def _step(layer, x):
    x = x.detach().requires_grad_()
    y = layer(x)
    (y.square().sum() + layer.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


def recover_worker(capacity_factor) -> dict:
    from moeflow import MoEConfig, MoELayer, Topology

    topo = Topology.from_env()
    cfg = MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2, seed=2,
                    capacity_factor=capacity_factor, a2a="test-uneven-direct",
                    schedule="optsche", pipeline_degree=2)
    layer = MoELayer(cfg, topo).double()
    x = torch.randn(10, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(topo.rank))
    real = layer.experts.forward
    calls = {"n": 0}

    def failing(*args, **kwargs):              # E of the first chunk raises, on every rank
        calls["n"] += 1
        if calls["n"] == 1:
            raise Boom("injected")
        return real(*args, **kwargs)

    layer.experts.forward = failing
    raised = False
    try:
        _step(layer, x)
    except Boom:
        raised = True
    layer.experts.forward = real
    got = _step(layer, x)
    ref = _step(MoELayer(cfg, topo).double(), x)
    return {"raised": raised, "got": got, "ref": ref}


# ---- checkpoint publishing: a process killed between the write and the publish ----------------

def kill_before_publish(out_dir: str, kill_at: int, threads: int | None = None) -> None:
    """Train the micro model in one process (checkpoints every 2 steps) and SIGKILL the
    process when the checkpoint of step ``kill_at`` is on disk but not yet published.
    ``threads``: the caller's torch thread count, so that both compute the same floats."""
    import os
    import signal

    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    from moeflow.topology import Topology
    from moeflow.trainer import Trainer

    real = Trainer._publish

    def publish_or_die(self, staged, step):
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        real(self, staged, step)

    Trainer._publish = publish_or_die
    Trainer(MICRO_MODEL, MICRO_TRAIN, out_dir, Topology.from_env(), progress=False).run()


def _micro():
    from moeflow.config import ModelConfig, TrainConfig

    return (ModelConfig(seq_len=16, d_model=16, n_layers=2, n_heads=2, d_ff=32, moe_every=1,
                        moe=dict(num_experts=2, d_expert=16, top_k=1)),
            TrainConfig(steps=6, batch_size=2, lr=1e-2, warmup_steps=1, eval_every=3,
                        eval_batches=1, log_every=1, checkpoint_every=2))


MICRO_MODEL, MICRO_TRAIN = _micro()


# ---- faults inside `moeflow train` ranks, installed at interpreter start ----------------------
# The ranks are fresh processes (spawned by torch's elastic agent), so a test cannot patch them
# from outside; it puts a sitecustomize.py (SITECUSTOMIZE) on the PYTHONPATH of the command,
# which calls install_from_env() in every process. MOEFLOW_FAULT="ACTION:RANK:STEP[:SECONDS]"
# (first attempt only): kill = SIGKILL rank RANK after its step STEP; sleep = rank RANK sleeps
# SECONDS before step STEP + 1 (past --timeout, so its peers' collective raises); slow = rank
# RANK sleeps SECONDS before every step from STEP on (time to signal the run mid-way).

SITECUSTOMIZE = ("import os\n"
                 "if os.environ.get('MOEFLOW_FAULT'):\n"
                 "    from tests.helpers import fault_injection\n"
                 "    fault_injection.install_from_env()\n")


def install_from_env() -> None:
    import os
    import signal

    from moeflow.launch import restart_count
    from moeflow.trainer import Trainer

    action, rank, step, *rest = os.environ["MOEFLOW_FAULT"].split(":")
    rank, step = int(rank), int(step)
    real = Trainer.train_step

    def faulty(self):
        hit = self.topo.rank == rank and restart_count() == 0
        if hit and action == "sleep" and self.step == step:
            time.sleep(float(rest[0]))
        if hit and action == "slow" and self.step >= step:
            time.sleep(float(rest[0]))
        out = real(self)
        if hit and action == "kill" and self.step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    Trainer.train_step = faulty
