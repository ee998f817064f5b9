"""CPU proofs for the host side of the CUDA review's second read (docs/gpu.md, "CUDA-path
review, second read"): the preemption agreement every K steps (``FaultConfig.
preempt_check_every``) and the async checkpoint's pinned, non-blocking staging (DCP's
``DefaultStager``; the CUDA objects are replaced by recorders, so each test fails if the CUDA
branch regresses)."""

from __future__ import annotations

import os
import signal
import types

import pytest
import torch
from torch import nn

from moeflow import checkpoint
from moeflow import trainer as train_mod
from moeflow.errors import ConfigError
from moeflow.topology import Topology
from moeflow.trainer import FaultConfig, Trainer
from tests.helpers.fault_injection import MICRO_MODEL, MICRO_TRAIN


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_preempt_check_every_is_validated(bad):
    with pytest.raises(ConfigError, match=r"--preempt-check-every: FaultConfig\."
                                          r"preempt_check_every"):
        FaultConfig(preempt_check_every=bad)


def test_cli_flag_reaches_the_fault_config():
    import argparse

    from moeflow.commands import train_command as cmd
    p = argparse.ArgumentParser()
    cmd.register(p.add_subparsers())
    assert cmd.fault_config(p.parse_args(["train"])).preempt_check_every == 1
    args = p.parse_args(["train", "--preempt-check-every", "4"])
    assert cmd.fault_config(args).preempt_check_every == 4


def test_agreement_runs_every_k_steps(monkeypatch):
    calls = []
    monkeypatch.setattr(train_mod, "host_all_reduce",
                        lambda v, op="sum", group=None: calls.append(v) or [15.0])
    t = object.__new__(Trainer)
    t.topo = types.SimpleNamespace(distributed=True)
    t.ft, t._signal = FaultConfig(preempt_check_every=3), 0
    got = []
    for step in range(1, 11):
        t.step = step
        got.append(t._agreed_signal())
    assert len(calls) == 3                          # steps 3, 6, 9: one all-reduce each
    assert got == [0, 0, 15, 0, 0, 15, 0, 0, 15, 0]


def test_a_signal_is_acted_on_at_the_next_multiple_of_k(tmp_path):
    fault = FaultConfig(preempt_check_every=2)
    trainer = Trainer(MICRO_MODEL, MICRO_TRAIN, tmp_path, Topology.single(), progress=False,
                      fault=fault)
    step_fn = trainer.train_step

    def step_then_signal():
        if trainer.step == 2:                        # arrives while step 3 runs
            os.kill(os.getpid(), signal.SIGUSR1)
        return step_fn()

    trainer.train_step = step_then_signal
    out = trainer.run()
    assert MICRO_TRAIN.steps > 4
    assert out["step"] == 4 and out["preempted"]["signal"] == "SIGUSR1"
    assert (tmp_path / "checkpoint" / "latest").read_text() == "step-4"


def test_staging_is_pinned_and_non_blocking_only_on_cuda():
    cuda, cpu = checkpoint.staging_options("cuda"), checkpoint.staging_options("cpu")
    assert cuda.use_pinned_memory and cuda.use_non_blocking_copy
    assert not (cpu.use_pinned_memory or cpu.use_non_blocking_copy)
    # synchronous staging either way: done before the next optimizer step changes a tensor
    assert not cuda.use_async_staging and not cpu.use_async_staging
    assert not cuda.use_shared_memory


def test_async_save_hands_dcp_the_devices_stager(monkeypatch, tmp_path):
    from torch.distributed.checkpoint import staging

    made, seen = [], {}

    class Recorder:
        def __init__(self, options):
            made.append(options)

    monkeypatch.setattr(staging, "DefaultStager", Recorder)
    monkeypatch.setattr(checkpoint, "_STAGERS", {})
    monkeypatch.setattr(checkpoint.dcp, "async_save",
                        lambda state, **kw: seen.setdefault("kw", kw))
    monkeypatch.setattr(checkpoint, "_state_device_type", lambda model: "cuda")
    model = nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):                               # one stager, reused
        checkpoint.async_save(str(tmp_path / "c"), model, opt, 1)
    assert len(made) == 1 and made[0].use_pinned_memory and made[0].use_non_blocking_copy
    assert isinstance(seen["kw"]["async_stager"], Recorder)


def test_state_device_type_follows_the_parameters():
    assert checkpoint._state_device_type(nn.Linear(2, 2)) == "cpu"
