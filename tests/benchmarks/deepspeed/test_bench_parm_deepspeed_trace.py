"""The collective tracer of ``python -m benchmarks.deepspeed.parm_deepspeed_trace``: what it wraps,
what it logs, that it restores everything. The trace of DeepSpeed's layer itself needs
deepspeed and 4 ranks; it is run by hand (docs/benchmarks/parm.md, "DeepSpeed 0.8.1 itself")."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.distributed as dist

from benchmarks.deepspeed import parm_deepspeed_trace as tr


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def alias_module(monkeypatch):
    """A moeflow module keeping its own reference to a collective, as collectives.py does."""
    mod = types.ModuleType("moeflow._trace_probe")
    mod.reduce = dist.all_reduce
    mod.gather = dist.all_gather_into_tensor
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def test_logs_calls_through_torch_distributed_and_through_aliases(one_rank, alias_module):
    log, phase = [], ["forward"]
    t = torch.ones(3)
    with tr.traced(log, phase):
        dist.all_reduce(t)
        phase[0] = "backward"
        alias_module.reduce(torch.ones(5), group=dist.group.WORLD)
        alias_module.gather(torch.empty(2), torch.ones(2))
    assert [(c["phase"], c["op"], c["elements"]) for c in log] == [
        ("forward", "all_reduce", 3), ("backward", "all_reduce", 5),
        ("backward", "all_gather_into_tensor", 2)]
    assert log[0]["group"] == "world" and log[1]["group"] == [0]
    assert torch.equal(t, torch.ones(3))           # the real collective ran


def test_everything_is_restored(alias_module):
    before = (dist.all_reduce, alias_module.reduce, alias_module.gather, dist.all_to_all_single)
    with tr.traced([], ["forward"]):
        assert dist.all_reduce is not before[0] and alias_module.reduce is not before[1]
        assert alias_module.reduce is dist.all_reduce      # one wrapper per function
    assert (dist.all_reduce, alias_module.reduce, alias_module.gather,
            dist.all_to_all_single) == before


@pytest.mark.parametrize("tokens", ["7", "0"])
def test_odd_or_empty_token_counts_are_rejected(tokens, capsys):
    with pytest.raises(SystemExit) as err:
        tr.main(["--tokens", tokens])
    assert err.value.code == 2
    assert f"--tokens {tokens}: pick a multiple of N_MP = 2" in capsys.readouterr().err


@pytest.mark.parametrize("layout, says", [("2,2", "give three integers"),
                                           ("2,2,4", "N_ESP = 1) or tensor parallel")])
def test_layouts_deepspeed_cannot_express_are_rejected(layout, says, capsys):
    with pytest.raises(SystemExit) as err:
        tr.main(["--layout", layout])
    assert err.value.code == 2
    assert says in capsys.readouterr().err
