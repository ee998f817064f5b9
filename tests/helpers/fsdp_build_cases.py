"""Building the GPT with its dense part sharded by FSDP2 from the start
(``moeflow.models.fsdp_build.build_fsdp_gpt``) on 4 gloo ranks (importable by spawned ranks;
run by tests/multirank/test_fsdp_build.py).

Each rank, for one layout of ``fsdp_cases.LAYOUTS``:

* builds the float64 ``fsdp_cases.CFG`` model both ways (built whole then sharded, as
  ``fsdp_cases.build``; and sharded from the start) and reports whether every parameter's local
  tensor (shard or expert) and every buffer is bit-identical;
* trains the one built sharded from the start for the stretch A of ``fsdp_cases`` (2 AdamW
  steps with clipping) and reports the losses and the whole dense weights after it, for the
  test to hold against the one-process reference;
* counts the tensor bytes alive at once (``tests.helpers.live_bytes``) while building
  ``WIDE``, a float32 model whose dense part dominates, both ways;
* runs ``moeflow train``'s Trainer for ``TRAIN_STEPS`` training steps of ``MICRO`` with
  ``dense_shard`` replicate and fsdp (the path ``--dense-shard fsdp`` takes) and reports the
  losses and whether the fsdp Trainer's dense parameters are FSDP2 shards.
"""

from __future__ import annotations


import torch

from moeflow.config import ModelConfig, TrainConfig
from moeflow.models import GPT
from moeflow.models.fsdp_build import build_fsdp_gpt
from moeflow.parallel.fsdp import is_fsdp_param, shard_dense
from moeflow.parallel.grad_sync import is_expert_param
from moeflow.parallel.replicas import prepare_model
from moeflow.parallel.tensor_parallel import tp_shard
from moeflow.topology import Topology
from moeflow.trainer import Trainer, make_optimizer
from tests.helpers import fsdp_cases as cases
from tests.helpers.live_bytes import LiveBytes

# dense part ~1.1 MB (float32), its largest parameter 64 KB, the experts 16 KB per rank
WIDE = ModelConfig(vocab_size=256, seq_len=64, d_model=64, n_layers=8, n_heads=4, d_ff=256,
                   moe_every=2, seed=3, moe=dict(num_experts=4, d_expert=8, top_k=2,
                                                 capacity_factor=None))

MICRO = ModelConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=64, moe_every=2,
                    moe=dict(num_experts=4, d_expert=16, top_k=2))
TRAIN_STEPS = 2


def dense_bytes(cfg: ModelConfig) -> int:
    """Bytes of the whole dense (non-expert) part of ``GPT(cfg)`` in float32."""
    model = GPT(cfg)
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if not is_expert_param(p))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_fsdp_param(t) else t


def worker(layout: str, root: str | None = None) -> dict:
    over, topo_kw = cases.LAYOUTS[layout]
    topo = Topology.from_env(**topo_kw)
    cfg = cases.CFG.replace(moe=over)
    out: dict = {}

    old, _, _ = cases.build(layout, True)
    new = build_fsdp_gpt(cfg, topo, dtype=torch.float64)
    new.checkpoint_blocks = old.checkpoint_blocks
    old_t = dict(old.named_parameters()) | dict(old.named_buffers())
    new_t = dict(new.named_parameters()) | dict(new.named_buffers())
    out["names_equal"] = sorted(old_t) == sorted(new_t)
    out["differ"] = [n for n in old_t if n in new_t and not (
        is_fsdp_param(old_t[n]) == is_fsdp_param(new_t[n])
        and torch.equal(_local(old_t[n]).detach(), _local(new_t[n]).detach())
        and _local(old_t[n]).dtype == _local(new_t[n]).dtype
        and tp_shard(old_t[n]) == tp_shard(new_t[n]))]      # an MP shard keeps its spec
    out["meta_left"] = [n for n, t in new_t.items() if t.is_meta]
    del old

    opt = make_optimizer(new, cases.TRAIN)
    out["losses"] = [cases.train_step(new, opt, topo, s) for s in range(cases.STRETCHES[0][3])]
    out["dense_after_A"] = {n: cases.whole(p) for n, p in new.named_parameters()
                            if not is_expert_param(p)}
    out["tp_specs"] = {n: tp_shard(p) for n, p in new.named_parameters() if tp_shard(p)}
    del new, opt

    with LiveBytes() as sharded:
        model = build_fsdp_gpt(WIDE, topo)
    out["sharded_from_start"] = {"peak": sharded.peak, "largest": sharded.largest}
    del model
    with LiveBytes() as whole_first:
        model = shard_dense(prepare_model(GPT(WIDE, topo), topo), topo)
    out["built_whole_then_sharded"] = {"peak": whole_first.peak,
                                       "largest": whole_first.largest}
    del model
    if root is not None:
        for mode in ("replicate", "fsdp"):
            tcfg = TrainConfig(steps=TRAIN_STEPS, batch_size=2, lr=1e-2, warmup_steps=0,
                               log_every=1, dense_shard=mode)
            trainer = Trainer(MICRO, tcfg, f"{root}/{mode}", topo, progress=False)
            out[f"trainer_{mode}"] = [float(trainer.train_step()[0])
                                      for _ in range(TRAIN_STEPS)]
            out[f"trainer_{mode}_sharded"] = sorted(
                n for n, p in trainer.model.named_parameters() if is_fsdp_param(p))
    return out
