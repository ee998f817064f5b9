"""Communication/compute overlap on CUDA, read from CUDA-event timelines (``layer.timeline``).

On one GPU the all-to-all of a world of 1 moves nothing, so the lanes are checked with it
(comm tasks on the comm lane and stream, results equal to the sequential schedule's) and the
overlap with an all-to-all that occupies the comm stream for a fixed time
(``torch.cuda._sleep``): ``optsche`` with r=2 must hide part of it behind the experts,
``sequential`` none of it. The real check, NCCL between 2 GPUs, needs 2 devices: NCCL
refuses two ranks on one GPU, and gloo has no all-to-all of CUDA tensors."""

from __future__ import annotations

import pytest
import torch

from moeflow import MoEConfig, MoELayer, Pending
from moeflow.comm.alltoall.base import AllToAll
from moeflow.schedule.executor import Timeline
from tests.helpers import gpu_cases as gc

pytestmark = pytest.mark.gpu


class SleepyIdentity(AllToAll):
    """A world-of-1 all-to-all that keeps the current (comm) stream busy for ``cycles`` GPU
    cycles before handing the rows back, like a slow link would."""

    cycles = 3_000_000          # about 2 ms at H100 clocks

    def start(self, x, send_splits, recv_splits, matrix=None) -> Pending:
        torch.cuda._sleep(self.cycles)
        return Pending(lambda: x)


def _layer(schedule: str, r: int, capacity_factor=1.0, big: bool = False) -> MoELayer:
    dims = (dict(d_model=1024, d_expert=4096) if big else dict(d_model=64, d_expert=128))
    return MoELayer(MoEConfig(**dims, num_experts=8, top_k=2, capacity_factor=capacity_factor,
                              schedule=schedule, pipeline_degree=r, seed=2)).cuda()


def _step(layer: MoELayer, x: torch.Tensor) -> dict:
    xi = x.detach().requires_grad_()
    y = layer(xi)
    (y.square().mean() + layer.aux_loss).backward()
    out = {"y": y.detach(), "x_grad": xi.grad}
    out.update({n: p.grad.clone() for n, p in layer.named_parameters()})
    layer.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("capacity_factor", [1.0, None], ids=["capacity", "dropless"])
def test_optsche_lanes_on_one_gpu(capacity_factor):
    x = torch.randn(300, 64, device="cuda")
    ref = _step(_layer("sequential", 2, capacity_factor), x)
    layer = _layer("optsche", 2, capacity_factor)
    layer.timeline = Timeline()
    got = _step(layer, x)
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-7, msg=k)
    lanes = gc.lanes_of(layer.timeline.records)
    assert lanes.pop("A1") == {"comm"} and lanes.pop("A2") == {"comm"}, lanes
    assert all(v == {"compute"} for v in lanes.values()), lanes
    comm = layer.lane.stream(torch.device("cuda"))
    assert comm is not None and comm != torch.cuda.current_stream()
    # 7 tasks x r=2 chunks, forward and backward, each stamped with increasing CUDA times
    recs = layer.timeline.records
    assert len(recs) == 2 * 7 * 2 and all(r.end >= r.start for r in recs)


def _timed(schedule: str, runs: int = 3) -> Timeline:
    layer = _layer(schedule, 2, big=True)
    layer.algo = SleepyIdentity(layer.topo)
    layer.timeline = Timeline()
    x = torch.randn(4096, 1024, device="cuda")
    for i in range(runs + 1):
        if i == 1:
            torch.cuda.synchronize()
            layer.timeline.clear()
        _step(layer, x)
    return layer.timeline


def test_optsche_hides_comm_stream_work_behind_experts_on_one_gpu():
    tl = _timed("optsche")
    pairs = gc.overlapping_pairs(tl.records)
    assert pairs, "no all-to-all task ran while an expert task ran"
    assert tl.overlap_fraction("forward") > 0.25, tl.overlap_fraction("forward")
    seq = _timed("sequential")
    assert not gc.overlapping_pairs(seq.records)
    assert seq.overlap_fraction("forward") < 0.05, seq.overlap_fraction("forward")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA devices (NCCL: one rank per GPU)")
def test_optsche_overlaps_nccl_all_to_all_with_experts_on_two_gpus():
    from moeflow.launch import launch_local

    out = launch_local(gc.overlap_worker, 2, backend="cpu:gloo,cuda:nccl", timeout_s=300)
    for rank, res in out.items():
        kinds = {k for k, *_ in res["records"]}
        assert {"A1", "A2", "E"} <= kinds, (rank, kinds)
        assert res["pairs"], (rank, "no A^j overlapped an E^i", res["fraction"])
        assert res["fraction"]["forward"] > 0, (rank, res["fraction"])
