"""Multi-rank codec case (importable by spawned ranks): the same MoE layer and batch with each
codec, forward + backward, on every rank."""

from __future__ import annotations

import torch

from moeflow import MoEConfig, MoELayer, Topology


def codec_worker(codecs: list[str]) -> dict:
    topo = Topology.from_env()
    out = {}
    for name in codecs:
        cfg = MoEConfig(d_model=16, d_expert=24, num_experts=4, top_k=2, capacity_factor=None,
                        codec=name, seed=3)
        layer = MoELayer(cfg, topo)
        gen = torch.Generator().manual_seed(100 + topo.rank)
        x = torch.randn(10, 16, generator=gen).requires_grad_()
        y = layer(x)
        (y.square().sum() + layer.aux_loss).backward()
        out[name] = {"y": y.detach(), "x_grad": x.grad,
                     "w_grad": {n: p.grad.clone() for n, p in layer.named_parameters()}}
    return out
