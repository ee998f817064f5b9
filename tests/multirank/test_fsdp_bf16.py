"""``moeflow train --dense-shard fsdp --dtype bf16`` on 2 gloo ranks (CPU bf16 autocast): FSDP2's
mixed-precision policy (bf16 all-gathers, fp32 reduce-scatters; FSDP, Zhao et al., VLDB 2023,
Section 4.3) trains the GPT with the routers kept out of FSDP2 as fp32 replicated tensors
(docs/training.md, "Sharding the dense part with FSDP2")."""

from __future__ import annotations

import math

import pytest

from moeflow.launch import launch_local

pytestmark = pytest.mark.multirank


def worker(out: str) -> dict:
    import torch

    from moeflow.config import TrainConfig, model_preset
    from moeflow.parallel.fsdp import is_fsdp_param
    from moeflow.topology import Topology
    from moeflow.trainer import Trainer

    cfg = TrainConfig(steps=2, batch_size=2, grad_accum=2, dense_shard="fsdp", dtype="bf16",
                      device="cpu", eval_every=2, eval_batches=1, log_every=1)
    t = Trainer(model_preset("tiny"), cfg, out, Topology.from_env(), progress=False)
    result = t.run()
    routers = [m.router.weight for m in t.model.moe_layers()]
    policy = t.model.blocks[0]._get_fsdp_state()._fsdp_param_group.mp_policy
    return {"losses": [r["loss"] for r in result["history"] if "loss" in r],
            "val": result["final_val_loss"],
            "routers_plain_fp32": all(not is_fsdp_param(w) and w.dtype == torch.float32
                                      for w in routers) and bool(routers),
            "dense_sharded": is_fsdp_param(t.model.blocks[0].attn.qkv.weight),
            "policy": (str(policy.param_dtype), str(policy.reduce_dtype))}


def test_bf16_fsdp_trains_with_fp32_routers(tmp_path):
    got = launch_local(worker, 2, str(tmp_path), timeout_s=300, threads=1)
    for rank, res in got.items():
        assert len(res["losses"]) == 2 and all(math.isfinite(x) for x in res["losses"]), rank
        assert math.isfinite(res["val"]), rank
        assert res["routers_plain_fp32"], rank
        assert res["dense_sharded"] is True, rank
        assert res["policy"] == ("torch.bfloat16", "torch.float32"), rank
