"""The hot-path cases of the sync-budget and autocast tests (importable by spawned ranks);
the counter itself is :mod:`moeflow.bench.syncs`."""

from __future__ import annotations

import torch

from moeflow.bench.syncs import counting, step_syncs  # noqa: F401  (used by the tests)


# Codecs whose CPU coder is numpy code (zfp's numba coder, LLNL's zfpy): on CPU they read the
# payload through numpy by design, which on CPU is no device wait; their CUDA path (zfp's Triton
# kernels) is checked by the gpu suite. Every other codec is pure torch and held to the budget.
HOST_CODECS = ("zfp", "zfpy")


def layer_cases(topo) -> list[dict]:
    """Every all-to-all algorithm the topology takes x every codec x schedule/r x capacity."""
    from moeflow.comm.alltoall import ALLTOALLS
    from moeflow.comm.codecs import CODECS
    from moeflow.config import ConfigError, MoEConfig
    from moeflow.strategies import NodeDedup

    algos = []
    for name in ("direct", "pairwise", "hier1d", "hier2d", "pipe", "bilevel"):
        try:
            ALLTOALLS[name].check_topology(topo)
        except ConfigError:
            continue
        algos.append(name)
    cases = []
    for a2a in algos:
        for codec in CODECS:
            for schedule, r in (("sequential", 1), ("pipelined", 2), ("optsche", 2)):
                # capacity_padding="pad": what "auto" is on a GPU (this counts GPU waits);
                # "trim" (the CPU default) adds the kept counts' one sync, checked by
                # test_trimmed_capacity_sync_is_the_counts
                for cf in (1.25, None):
                    cases.append(dict(a2a=a2a, codec=codec, schedule=schedule,
                                      pipeline_degree=r, capacity_factor=cf,
                                      capacity_padding="pad"))
    try:            # the node-deduplicated exchange (two nodes or more): every codec and
        NodeDedup.check_config(MoEConfig(d_model=8, d_expert=8, num_experts=8), topo)
        for codec in CODECS:
            for schedule, r in (("sequential", 1), ("optsche", 2)):
                for cf, padding in ((1.25, "pad"), (1.25, "trim"), (None, "auto")):
                    cases.append(dict(placement="node_dedup", codec=codec, schedule=schedule,
                                      pipeline_degree=r, capacity_factor=cf,
                                      capacity_padding=padding))
        # padded with node-limited routing (DeepSeek-V3's topk_group = 1 of 2 nodes): its
        # capacity per destination node binds (node_dedup/node_capacity.py), still no sync
        for r in (1, 2):
            cases.append(dict(placement="node_dedup", codec="none", schedule="optsche",
                              pipeline_degree=r, capacity_factor=1.25, capacity_padding="pad",
                              node_limit=1))
    except ConfigError:
        pass
    return cases


def sync_budget(case: dict) -> int:
    """Host syncs allowed in one forward + backward: none in padded capacity mode, one
    dropless (the counts) and, for ``placement="node_dedup"``, one in trimmed capacity mode (the
    kept (token, node) pairs size its exchanges)."""
    if case["capacity_factor"] is None:
        return 1
    return int(case.get("placement") == "node_dedup" and case["capacity_padding"] == "trim")


def hot_path_worker(local_size: int | None) -> dict:
    """Per case: the would-be syncs of the second forward + backward (the first warms up;
    None for ``HOST_CODECS``), and under bf16 autocast the dtypes of the output and of the
    input's gradient next to those of a dense FFN (``nn.Linear``) on the same input."""
    from moeflow import MoEConfig, MoELayer, Topology

    topo = Topology.from_env(local_size=local_size)
    gen = torch.Generator().manual_seed(topo.rank)
    x = torch.randn(12, 16, generator=gen, requires_grad=True)
    dense = torch.nn.Linear(16, 16)
    out = {}
    for case in layer_cases(topo):
        opts = dict(case)
        if "node_limit" in opts:            # DeepSeek-V3's node-limited routing
            opts.update(router="deepseek_v3", aux_loss_coef=0.0, router_options=dict(
                n_group=topo.num_nodes, topk_group=opts.pop("node_limit")))
        cfg = MoEConfig(d_model=16, d_expert=32, num_experts=4, top_k=2, seed=1, **opts)
        layer = MoELayer(cfg, topo)
        syncs = None
        if case["codec"] not in HOST_CODECS:
            step_syncs(layer, x)
            syncs = dict(step_syncs(layer, x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, want = layer(x), dense(x)
        (gx,) = torch.autograd.grad(y.float().square().sum(), x)
        out[tuple(sorted(case.items()))] = {"syncs": syncs, "dtype": y.dtype,
                                            "dense_dtype": want.dtype, "grad_dtype": gx.dtype}
    return out
