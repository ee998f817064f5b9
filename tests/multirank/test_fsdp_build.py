"""The GPT sharded by FSDP2 from the start (``moeflow.models.fsdp_build``, what ``moeflow train
--dense-shard fsdp`` builds): bit-identical to the GPT built whole and then sharded, trains like
one unsharded process in float64, gives the Trainer the losses of the replicated dense part
(float32), and never holds the whole dense part on a rank while it is
built (4 gloo ranks, tests/helpers/fsdp_build_cases.py). The default run covers EP over two
groups of 2 ranks; HECATE's FSSDP and Parm's expert sharding (ESP 2) are slow variants. The
single-process cases check the meta build and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moeflow.config import ConfigError
from moeflow.launch import launch_local
from moeflow.models import GPT
from moeflow.models.fsdp_build import build_fsdp_gpt
from moeflow.parallel.fsdp import init_meta_shards
from moeflow.parallel.grad_sync import is_expert_param
from moeflow.parallel.tensor_parallel import shard_of
from moeflow.topology import Topology
from tests.helpers import fsdp_build_cases as bc
from tests.helpers import fsdp_cases as cases

TOL = dict(rtol=1e-9, atol=1e-12)


def _check(layout: str, root=None) -> None:
    results = launch_local(bc.worker, cases.WORLD, layout, None if root is None else str(root),
                           timeout_s=300)
    ref = cases.reference()
    dense = bc.dense_bytes(bc.WIDE)
    for rank, got in results.items():
        # the same local tensors, bit for bit, as the model built whole and then sharded
        assert got["names_equal"] and not got["differ"] and not got["meta_left"], (rank, got)
        # and the same training: stretch A's losses and dense weights of the reference
        assert got["losses"] == pytest.approx(ref["losses"][:len(got["losses"])], rel=1e-10)
        specs = got["tp_specs"]    # with Parm's MP: this rank's MP block of each MP shard
        assert len(specs) == (6 if cases.LAYOUTS[layout][1].get("mp_size", 1) > 1 else 0)
        for name, value in got["dense_after_A"].items():
            want = ref["after_A"][name]
            want = shard_of(want, specs[name]) if name in specs else want
            torch.testing.assert_close(value, want, **TOL,
                                       msg=lambda m: f"{name} on rank {rank}: {m}")
        # memory: building whole first holds every dense weight (and a flat copy for the
        # replica broadcast) on each rank; sharded from the start, a rank holds its quarter,
        # its experts and one whole parameter at a time
        whole, sharded = got["built_whole_then_sharded"], got["sharded_from_start"]
        assert whole["peak"] >= dense, (rank, whole, dense)
        assert sharded["peak"] < 0.5 * dense, (rank, sharded, dense)
        largest = max(p.numel() * 4 for p in GPT(bc.WIDE).parameters())
        assert sharded["largest"] <= largest, (rank, sharded, largest)
        if root is not None:     # moeflow train --dense-shard fsdp builds it this way
            assert "tok.weight" in got["trainer_fsdp_sharded"]
            assert not got["trainer_replicate_sharded"]
            assert len(got["trainer_fsdp"]) == bc.TRAIN_STEPS
            assert got["trainer_fsdp"] == pytest.approx(got["trainer_replicate"], rel=1e-5)


@pytest.mark.multirank
def test_sharded_from_the_start_ep2(tmp_path):
    _check("ep2", tmp_path)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["fssdp", "esp2", "mp2_s1"])
def test_sharded_from_the_start_slow_layouts(layout):
    _check(layout)


def test_meta_dense_builds_the_moe_layers_only():
    model = GPT(cases.CFG, meta_dense=True)
    moe = {id(p) for m in model.moe_layers() for p in m.parameters()}
    for name, p in model.named_parameters():
        assert p.is_meta == (id(p) not in moe), name
    assert any(is_expert_param(p) for p in model.parameters())
    # the values the sharded build fills in are the unsharded GPT's
    ref = dict(GPT(cases.CFG).named_parameters())
    for name, p in model.named_parameters():
        if p.is_meta:
            assert torch.equal(model.initial_value(name, tuple(p.shape)), ref[name]), name


def test_one_process_builds_the_plain_gpt():
    model = build_fsdp_gpt(cases.CFG, Topology.single(), dtype=torch.float64)
    ref = dict(GPT(cases.CFG).double().named_parameters())
    for name, p in model.named_parameters():
        assert type(p) is nn.Parameter and torch.equal(p, ref[name]), name


def test_refusals():
    with pytest.raises(ValueError, match=r"init_meta_shards: \['weight', 'bias'\] are on the "
                                         r"meta device but not sharded by FSDP2"):
        init_meta_shards(nn.Linear(2, 2, device="meta"), lambda n, s: torch.zeros(s))
