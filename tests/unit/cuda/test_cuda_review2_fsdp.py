"""CPU proofs for FSDP2 on the dense part under the CUDA review's second read (docs/gpu.md,
"CUDA-path review, second read"): the data-parallel mesh on a process group of its own, the
bf16 mixed-precision policy with fp32 routers, and the refusal of HECATE's lane overlap
(FSDP2: Zhao et al., VLDB 2023, Sections 3 and 4.3; HECATE Section 3.2).

One gloo process (a world of one over a file store): enough to build the mesh and run
``fully_shard``'s hooks.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moeflow.config import ModelConfig
from moeflow.errors import ConfigError
from moeflow.models import GPT
from moeflow.parallel import fsdp
from moeflow.topology import Topology


@pytest.fixture
def world_of_one(tmp_path, monkeypatch):
    monkeypatch.setattr(fsdp, "_MESHES", {})
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    yield types.SimpleNamespace(dense_mesh=None, world_size=1, distributed=True)
    dist.destroy_process_group()


def test_dense_mesh_has_a_group_of_its_own(world_of_one):
    mesh = fsdp.dense_dp_mesh(world_of_one)
    group = mesh.get_group()
    assert group is not dist.group.WORLD
    assert dist.get_world_size(group) == 1 and mesh.mesh_dim_names == ("dp",)
    assert fsdp.dense_dp_mesh(world_of_one) is mesh          # built once per world
    t = torch.ones(2)
    dist.all_reduce(t, group=group)                        # a working group
    assert t.tolist() == [1.0, 1.0]


def test_a_world_spanning_parm_dense_mesh_gets_a_group_of_its_own(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh

    dense = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "mp"))
    assert dense["dp"].get_group() is dist.group.WORLD            # torch reuses the world
    topo = types.SimpleNamespace(dense_mesh=dense, world_size=1, distributed=True)
    assert fsdp.dense_dp_mesh(topo).get_group() is not dist.group.WORLD


def test_mixed_precision_policy_only_under_bf16():
    policy = fsdp.mixed_precision(torch.bfloat16)
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert fsdp.mixed_precision(torch.float32) is None
    assert fsdp.mixed_precision(None) is None


class _Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))
        self.seen = None

    def forward(self, x):
        self.seen = self.weight.dtype                     # what the forward computes from
        return x.float() @ self.weight.float()


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.router = _Router()
        self.seen = None

    def forward(self, x):
        self.seen = self.proj.weight.dtype
        return self.proj(x) + self.router(x).sum(-1, keepdim=True)


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("dtype, dense, router", [(torch.bfloat16, torch.bfloat16,
                                                   torch.float32),
                                                  (torch.float32, torch.float32, torch.float32)])
def test_bf16_runs_gather_bf16_dense_weights_and_fp32_routers(world_of_one, dtype, dense,
                                                              router):
    model = fsdp.shard_dense(_Toy(), world_of_one, param_dtype=dtype)
    model(torch.randn(5, 4)).float().sum().backward()
    for b in model.blocks:
        assert b.seen == dense and b.router.seen == router
        # the sharded master weights and their gradients stay fp32
        assert b.proj.weight.dtype == torch.float32
        assert b.proj.weight.grad.dtype == torch.float32
        assert b.router.weight.grad.dtype == torch.float32
        # under bf16 the router is a plain replicated tensor (out of FSDP2), else sharded
        assert fsdp.is_fsdp_param(b.router.weight) == (dtype != torch.bfloat16)


def test_trainer_passes_the_autocast_dtype_to_fsdp():
    import inspect

    from moeflow import trainer as train
    src = inspect.getsource(train.Trainer.__init__)
    assert "build_fsdp_gpt(gpt_cfg, topo, self.device, compute_dtype=self.dtype)" in src


@pytest.mark.parametrize("option", fsdp.LANE_OVERLAP_OPTIONS)
def test_fsdp_refuses_hecate_lane_overlap(option):
    fssdp = {"overlap_backward": option == "overlap_backward",
             "overlap_regather": option == "overlap_regather",
             "rematerialize": option == "overlap_regather"}
    cfg = ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=4, d_ff=24,
                      moe_every=2, moe=dict(num_experts=4, d_expert=8, top_k=2,
                                            placement="fssdp", fssdp=fssdp))
    model = GPT(cfg, Topology.single())
    with pytest.raises(ConfigError, match=rf"--dense-shard fsdp.*fssdp\.{option}=True"):
        fsdp.shard_dense(model, Topology.single())
    plain = GPT(ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=4,
                            d_ff=24, moe_every=2, moe=dict(num_experts=4, d_expert=8, top_k=2,
                                                           placement="fssdp")),
              Topology.single())
    fsdp.check_lane_overlap(plain)                          # without the options: accepted
