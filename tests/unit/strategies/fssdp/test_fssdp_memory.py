"""Algorithm 1's ``m`` from a memory budget (HECATE Section 4.2; moeflow/strategies/fssdp/memory.py):
the arithmetic, the free-memory reading, the option's refusals, and a one-process layer that
derives ``m`` from mocked free memory. The 4-rank parity with ``t > m`` from a budget is
tests/multirank/test_fssdp_layer.py's ``fssdp_sparse_budget`` variant."""

from __future__ import annotations

import pytest
import torch

from moeflow import MoELayer, Topology
from moeflow.errors import ConfigError
from moeflow.strategies.fssdp import memory
from moeflow.strategies.fssdp.materialize import algorithm1_branch
from moeflow.strategies.fssdp.options import FSSDPOptions
from tests.helpers import parity


def test_capacity_from_a_byte_budget_is_capped_by_free_memory():
    per = memory.slot_bytes(100, 8)
    assert per == 1600                                  # held row + its gradient
    assert memory.capacity_from_budget(5 * per + 1, None, 10**9, per) == 5
    assert memory.capacity_from_budget(5 * per, None, 2 * per + 7, per) == 2   # free is less
    assert memory.capacity_from_budget(5 * per - 1, None, None, per) == 4      # not measurable
    assert memory.capacity_from_budget(0, None, 10**9, per) == 0


def test_capacity_from_a_fraction_of_free_memory():
    per = memory.slot_bytes(10, 4)
    assert memory.capacity_from_budget(None, 0.5, 10 * per, per) == 5
    assert memory.capacity_from_budget(None, 0.25, 10 * per, per) == 2
    with pytest.raises(RuntimeError, match="memory_budget_bytes"):
        memory.capacity_from_budget(None, 0.5, None, per)


def test_free_bytes_reads_memavailable_on_cpu(tmp_path, monkeypatch):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    300 kB\n")
    monkeypatch.setattr(memory, "MEMINFO", str(f))
    assert memory.free_bytes(torch.device("cpu")) == 300 * 1024
    monkeypatch.setattr(memory, "MEMINFO", str(tmp_path / "absent"))
    assert memory.free_bytes(torch.device("cpu")) is None


def test_options_refuse_bad_budgets():
    with pytest.raises(ConfigError, match="memory_budget_bytes=-1"):
        FSSDPOptions(materialize="sparse", overlap_degree=1, memory_budget_bytes=-1)
    with pytest.raises(ConfigError, match="memory_budget_bytes=1.5"):
        FSSDPOptions(materialize="sparse", overlap_degree=1, memory_budget_bytes=1.5)
    for bad in (0, 1.5, True, "half"):
        with pytest.raises(ConfigError, match="memory_budget_fraction"):
            FSSDPOptions(materialize="sparse", overlap_degree=1, memory_budget_fraction=bad)
    with pytest.raises(ConfigError, match="memory_capacity and memory_budget_bytes"):
        FSSDPOptions(materialize="sparse", overlap_degree=1, memory_capacity=1,
                     memory_budget_bytes=10)
    with pytest.raises(ConfigError, match="materialize='sparse'"):
        FSSDPOptions(memory_budget_fraction=0.5)
    FSSDPOptions(materialize="sparse", overlap_degree=1, memory_budget_fraction=1)


def test_algorithm1_branch():
    assert algorithm1_branch(0, 3, 8) == "none"
    assert algorithm1_branch(2, 2, 8) == "replicate"
    assert algorithm1_branch(3, 1, 8) == "slots_by_load"
    assert algorithm1_branch(20, 8, 8) == "replicate"   # t <- min(t, |E|)


def _layer(**fssdp):
    cfg = parity.make_config("hot_expert_dropless", placement="fssdp",
                             fssdp=dict(materialize="sparse", overlap_degree=3, **fssdp))
    return MoELayer(cfg, Topology.single()).double()


def _forward(layer):
    x, g = parity.make_batch("hot_expert_dropless", 0)
    parity.local_loss(layer(x), g, layer).backward()


def test_layer_derives_m_from_mocked_free_memory(monkeypatch):
    free = {"bytes": 0}
    monkeypatch.setattr("moeflow.strategies.fssdp.layer_experts.free_bytes",
                        lambda device: free["bytes"])
    layer = _layer(memory_budget_fraction=0.5)
    ex = layer.experts
    per = memory.slot_bytes(ex.numel, 8)
    assert ex.memory_capacity is None                   # not measured before a forward
    free["bytes"] = 6 * per + 3
    _forward(layer)
    assert (ex.memory_capacity, ex.memory_free) == (3, 6 * per + 3)
    free["bytes"] = 2 * per                             # memory got tight: m follows
    _forward(layer)
    assert ex.memory_capacity == 1
    free["bytes"] = 10**12                              # capped at the number of experts
    _forward(layer)
    assert ex.memory_capacity == 8
    layer = _layer(memory_budget_bytes=2 * per + 5)     # bytes: min(budget, free)
    _forward(layer)
    assert layer.experts.memory_capacity == 2
    free["bytes"] = per
    _forward(layer)
    assert layer.experts.memory_capacity == 1


def test_fraction_without_measurable_memory_is_refused(monkeypatch):
    monkeypatch.setattr("moeflow.strategies.fssdp.layer_experts.free_bytes", lambda device: None)
    layer = _layer(memory_budget_fraction=0.5)
    with pytest.raises(ConfigError, match="memory_budget_fraction=0.5.*memory_budget_bytes"):
        _forward(layer)
    layer = _layer(memory_budget_bytes=10**9)           # a byte budget is used as given
    _forward(layer)
    assert layer.experts.memory_capacity == 8


def test_explicit_memory_capacity_still_works():
    layer = _layer(memory_capacity=2)
    _forward(layer)
    assert layer.experts.memory_capacity == 2
    assert _layer().experts.memory_capacity == 8        # None: the experts it owns


def test_cli_budget_reaches_every_gpt_layer():
    from moeflow.commands.common import parse_overrides
    from moeflow.config import ModelConfig
    from moeflow.strategies.fssdp.layer_experts import FSSDPExperts
    from tests.helpers.fssdp_layer_worker import small_gpt

    over = parse_overrides(["moe.placement=fssdp", 'moe.fssdp={"materialize": "sparse", '
                            '"overlap_degree": 2, "memory_budget_bytes": 4096}'], ModelConfig)
    cfg = ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=32,
                      moe=dict(num_experts=4, d_expert=8, **over["moe"]))
    assert cfg.moe_config(1).fssdp.memory_budget_bytes == 4096
    model = small_gpt(Topology.single(), placement="fssdp",
                      fssdp=dict(materialize="sparse", overlap_degree=2,
                                 memory_budget_bytes=20000))
    model(torch.randint(0, 32, (2, 8)))[0].sum().backward()
    layers = [m for m in model.modules() if isinstance(m, FSSDPExperts)]
    assert len(layers) == 2
    for ex in layers:      # float64 experts of 2 x 16 x 12 elements: 6144 bytes a replica
        assert ex.memory_capacity == 20000 // memory.slot_bytes(ex.numel, 8) == 3


def test_checkpoint_keeps_the_agreed_m(tmp_path):
    """A resumed run plans its first P' with the m the saved run had agreed on (its window
    has loads), not with m = 0, so it continues as the uninterrupted run would."""
    from moeflow import checkpoint
    from moeflow.strategies.fssdp.layer_experts import FSSDPExperts
    from tests.helpers.fssdp_layer_worker import small_gpt

    def gpt():
        return small_gpt(Topology.single(), placement="fssdp",
                         fssdp=dict(materialize="sparse", overlap_degree=2,
                                    memory_budget_bytes=20000))

    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randint(0, 32, (2, 8)))[0].sum().backward()
    opt.step()
    checkpoint.save(str(tmp_path / "ckpt"), model, opt, 1)
    fresh = gpt()
    before = [m.memory_capacity for m in fresh.modules() if isinstance(m, FSSDPExperts)]
    assert before == [None, None]
    checkpoint.load(str(tmp_path / "ckpt"), fresh, torch.optim.AdamW(fresh.parameters()))
    after = [m for m in fresh.modules() if isinstance(m, FSSDPExperts)]
    assert [m.memory_capacity for m in after] == [3, 3]
    assert all(len(m.window) == 1 for m in after)
