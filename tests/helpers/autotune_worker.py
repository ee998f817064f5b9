"""Rank body of tests/multirank/test_autotune.py (importable by spawned ranks): an auto-tuned layer next
to the same layer with fixed settings (direct / sequential / r = 1, and the settings it chose),
float64, on 2 gloo ranks."""

from __future__ import annotations

import torch

from moeflow import MoEConfig, MoELayer, Topology, checkpoint
from moeflow import autotune

AUTO = dict(a2a="auto", schedule="auto", pipeline_degree="auto")


def _config(**kw) -> MoEConfig:
    return MoEConfig(d_model=8, d_expert=12, num_experts=4, top_k=2, capacity_factor=1.25,
                     seed=3, gate_noise=0.1, **kw)


def _step(layer: MoELayer, x: torch.Tensor) -> dict:
    x = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    (y.square().mean() + layer.aux_loss).backward()
    return {"y": y.detach(), "dx": x.grad,
            **{n: p.grad.clone() for n, p in layer.named_parameters()}}


def worker(ckpt_dir: str) -> dict:
    torch.set_default_dtype(torch.float64)
    topo = Topology.from_env()
    calls = []
    real_tune = autotune.tune

    def counting_tune(*a, **kw):
        calls.append(a[1].shape[0])
        return real_tune(*a, **kw)

    autotune.tune = counting_tune
    gen = torch.Generator().manual_seed(10 + topo.rank)
    x = torch.randn(12 + 3 * topo.rank, 8, generator=gen)
    fixed, auto = MoELayer(_config(), topo).train(), MoELayer(_config(**AUTO), topo).train()
    torch.manual_seed(5)                                 # gate noise: same draws in both
    ref = _step(fixed, x)
    torch.manual_seed(5)
    got = _step(auto, x)            # tunes first (state restored), then the real forward
    again = _step(auto, x)          # no re-tune for the same size
    t = auto.tuned
    chosen = MoELayer(_config(**t.settings()), topo).train()     # its choice, fixed
    torch.manual_seed(5)
    out = {"ref": ref, "got": got, "chosen": _step(chosen, x), "choice": t.as_dict(),
           "stats": auto.stats,
           "calls_first": list(calls), "again_y": again["y"]}
    # a resume (checkpoint with the choice) does not re-tune
    opt = torch.optim.AdamW(auto.parameters())
    checkpoint.save(ckpt_dir, auto, opt, 1)
    resumed = MoELayer(_config(**AUTO), topo)
    checkpoint.load(ckpt_dir, resumed, torch.optim.AdamW(resumed.parameters()))
    n = len(calls)
    _step(resumed, x)
    out["calls_after_resume"] = len(calls) - n
    out["resumed_choice"] = resumed.tuned.settings()
    # > 2x more tokens on every rank: the next forward after the change re-tunes
    big = torch.randn(4 * x.shape[0], 8, generator=gen)
    resumed.retune_check_every = 1         # check at every forward (default: every 50th)
    n = len(calls)
    _step(resumed, big)
    _step(resumed, big)
    _step(resumed, big)
    out["calls_after_growth"] = len(calls) - n
    return out
