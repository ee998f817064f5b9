"""CPU proofs of the fixes from the CUDA-path review (docs/gpu.md, "CUDA-path review").

No GPU is needed: CUDA objects (NCCL work handles, streams, device capability, the current
device) are replaced by recording fakes, so each test fails if the CUDA branch regresses.
"""

from __future__ import annotations

import datetime
import types

import pytest
import torch

from moeflow.comm import sparse as sparse_mod
from moeflow.placement import reshard as reshard_mod

TIMEOUT = datetime.timedelta(seconds=7)


class FakeWork:
    """A ProcessGroupNCCL work handle that records the arguments ``wait`` got."""

    def __init__(self, log):
        self.log = log

    def wait(self, *args):
        self.log.append(args)
        return True


# -- 1. sparse collectives: a stream wait on CUDA, a bounded host wait on gloo ----------------

@pytest.mark.parametrize("device, expect", [("cuda", ()), ("cuda:1", ()), ("cpu", (TIMEOUT,))])
def test_wait_work_passes_timeout_only_off_cuda(device, expect):
    log = []
    sparse_mod.wait_work(FakeWork(log), TIMEOUT, device)
    assert log == [expect]


def _fake_dist(log, n_works=3):
    return types.SimpleNamespace(
        isend="isend", irecv="irecv",
        P2POp=lambda op, t, group=None, group_peer=None, tag=0: (op, group_peer, tag),
        batch_isend_irecv=lambda ops: [FakeWork(log) for _ in range(n_works)])


@pytest.mark.parametrize("device, expect", [("cuda", ()), ("cpu", (TIMEOUT,))])
def test_sparse_exchange_waits_without_timeout_on_cuda(monkeypatch, device, expect):
    log = []
    monkeypatch.setattr(sparse_mod, "dist", _fake_dist(log))
    obj = object.__new__(sparse_mod.SparseAllGather)
    obj.group, obj.timeout, obj.device = None, TIMEOUT, torch.device(device)
    t = torch.zeros(2)
    obj._exchange([(0, 1, t)], [(1, 1, t.clone())])
    assert log == [expect] * 3


@pytest.mark.parametrize("device, expect", [("cuda", ()), ("cpu", (TIMEOUT,))])
def test_sparse_agree_waits_without_timeout_on_cuda(monkeypatch, device, expect):
    """The pre-condition all-gather: the device of its tensors decides the wait (the tensors
    themselves are made on CPU here; only the wait is under test)."""
    log = []
    obj = object.__new__(sparse_mod.SparseAllGather)
    obj.group, obj.timeout, obj.world = None, TIMEOUT, 1
    obj.p0, obj.p1, obj.shape, obj.dtype, obj.rank = [[0]], [[0]], torch.Size([2]), \
        torch.float32, 0
    obj.device = torch.device(device)
    real_tensor = torch.tensor
    monkeypatch.setattr(sparse_mod.torch, "tensor",
                        lambda data, dtype=None, device=None: real_tensor(data, dtype=dtype))

    def fake_gather(out, inp, group=None, async_op=False):
        out.copy_(inp)
        return FakeWork(log)
    monkeypatch.setattr(sparse_mod, "_all_gather", fake_gather)
    obj._agree(None)
    assert log == [expect]


@pytest.mark.parametrize("device, expect", [("cuda", ()), ("cpu", (TIMEOUT,))])
def test_reshard_move_rows_waits_without_timeout_on_cuda(monkeypatch, device, expect):
    """Algorithm 2's row moves: the wait follows the moved tensors' device."""
    log, seen = [], []
    monkeypatch.setattr(reshard_mod, "dist", _fake_dist(log, n_works=2))
    monkeypatch.setattr(reshard_mod, "group_timeout", lambda group: TIMEOUT)
    real_wait = sparse_mod.wait_work

    def spy(work, timeout, dev):
        seen.append(torch.device(dev).type)
        real_wait(work, timeout, device)         # the device the tensors would live on
    monkeypatch.setattr(reshard_mod, "wait_work", spy)
    rows = torch.arange(4.0).view(2, 2)          # rank 0 owns experts 0 and 1 of one layer
    reshard_mod._move_rows([rows], old=[[0, 0, 1]], new=[[1, 0, 0]], rank=0, world=2,
                           group=None)
    assert seen == ["cpu", "cpu"] and log == [expect] * 2
