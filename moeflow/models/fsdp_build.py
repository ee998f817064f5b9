"""The GPT with its dense part sharded by FSDP2 from the start (``--dense-shard fsdp``;
docs/training.md, "Sharding the dense part with FSDP2").

Building the whole GPT and then sharding it (:func:`~moeflow.parallel.fsdp.shard_dense` on a
built model) makes every rank hold every dense weight once, and the replica broadcast a flat
copy of them besides: a start-up peak well above the sharded state. Here, as torchtitan
initialises its models (meta device, ``fully_shard``, ``to_empty``, then ``init_weights``):

1. the GPT is built with its own dense modules on the meta device (``GPT(meta_dense=True)``:
   embeddings, layer norms, attention, dense MLPs, final norm) and its MoE layers as usual
   (experts, router, shared experts and BigMac projections with their values), the real part
   moved to ``device`` / ``dtype``;
2. :func:`~moeflow.parallel.replicas.prepare_model` makes the real replicated tensors equal
   (the meta ones have no values yet: they come from the seed below);
3. :func:`~moeflow.parallel.fsdp.shard_dense` applies FSDP2 (ZeRO-3; Zhao et al., VLDB 2023,
   Section 3) to the blocks and the root;
4. :func:`~moeflow.parallel.fsdp.init_meta_shards` gives each meta parameter its local shard
   and fills it with its slice of :meth:`GPT.initial_value`, one whole parameter at a time on
   CPU.

The values equal the unsharded GPT's exactly (the same float32 draws from (seed, name), cast
to ``dtype`` as ``.to(dtype)`` casts them): layout independence (docs/design.md). What a rank
holds at once is its shards, its experts, the MoE layers' own dense parameters (sharded in
step 3) and one whole dense parameter.
"""

from __future__ import annotations

import torch

from moeflow.config import ModelConfig
from moeflow.models.gpt import GPT
from moeflow.parallel.fsdp import init_meta_shards, shard_dense
from moeflow.parallel.replicas import prepare_model
from moeflow.topology import Topology


def build_fsdp_gpt(cfg: ModelConfig, topo: Topology, device: torch.device | str = "cpu",
                   dtype: torch.dtype | None = None,
                   compute_dtype: torch.dtype | None = None) -> GPT:
    """``GPT(cfg, topo)`` on ``device`` (floating tensors in ``dtype`` if given), replicas
    equal, its dense part sharded by FSDP2 over the data-parallel ranks, without ever holding
    the whole dense part (module docstring). Build the optimizer after it. A world of one has
    nothing to shard: the plain GPT is returned. ``compute_dtype``: the run's autocast dtype
    (bf16: FSDP2's mixed-precision policy, :func:`~moeflow.parallel.fsdp.shard_dense`)."""
    if not topo.distributed:
        return GPT(cfg, topo).to(device=device, dtype=dtype)

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:
            return t
        return t.to(device=device, dtype=dtype if t.is_floating_point() else None)

    model = GPT(cfg, topo, meta_dense=True)
    model._apply(move)
    prepare_model(model, topo)
    shard_dense(model, topo, param_dtype=compute_dtype)
    init_meta_shards(model, model.initial_value, device, dtype)
    return model
