"""Algorithm 1's ``m`` from a memory budget (HECATE Section 4.2; moeflow/strategies/fssdp/memory.py):
the worst-case peak of every buffer a replica costs, the free-memory reading profiled once at
start (the same for every layer depth), the option's refusals, and one-process layers.
The measured peak is tests/multirank/test_fssdp_memory_peak.py; the 4-rank parity with
``t > m`` from a budget is tests/multirank/test_fssdp_layer.py's ``fssdp_sparse_budget``
variant."""

from __future__ import annotations

import pytest
import torch

from moeflow import MoELayer, Topology
from moeflow.errors import ConfigError
from moeflow.strategies.fssdp import memory
from moeflow.strategies.fssdp.materialize import algorithm1_branch
from moeflow.strategies.fssdp.options import FSSDPOptions
from tests.helpers import parity


def _cap(budget, fraction, free, row=100, **kw):
    kw = {"owned": 2, "world": 4, "slot_rows": 2, "num_experts": 8, **kw}
    return memory.capacity_from_budget(budget, fraction, free, row, **kw)


def test_worst_peak_counts_every_buffer():
    # 2 owned, 4 ranks, 2 slot rows: P' = P peaks at the held tensor + 3 gradient copies (8)
    assert memory.worst_peak_rows(0, 2, 4, 2) == 8
    # one replica: H = 3 -> 12 rows; the owner's receive buffers (3) + sums (2) -> 2H + 5 = 11
    assert memory.worst_peak_rows(1, 2, 4, 2) == 12
    # a hot owner on 8 ranks: the 7 others' replicas' gradient copies + 2 sums beat the held
    # tensor's 4H = 12
    assert memory.worst_peak_rows(1, 2, 8, 2) == 2 * 3 + 7 + 2
    assert memory.worst_peak_rows(2, 2, 8, 2) == max(2 + 4, 16, 8 + 14 + 2, 8 + 2 + 2)
    assert memory.worst_peak_rows(2, 2, 8, 2, "broadcast") == 16
    assert memory.worst_peak_rows(2, 2, 8, 2, "auto") == 24


def test_capacity_from_a_byte_budget_is_capped_by_free_memory():
    # each replica adds 4 rows (its held row and three gradient copies) on 4 ranks
    assert _cap(4 * 100 * 3, None, 10**9) == 3
    assert _cap(4 * 100 * 3 - 1, None, 10**9) == 2
    assert _cap(4 * 100 * 3, None, 4 * 100 + 7) == 1               # free is less
    assert _cap(4 * 100 * 2, None, None) == 2                       # not measurable
    assert _cap(0, None, 10**9) == 0
    assert _cap(10**12, None, None) == 6                            # the experts not owned


def test_capacity_from_a_fraction_of_free_memory():
    assert _cap(None, 0.5, 4 * 100 * 6) == 3
    assert _cap(None, 0.25, 4 * 100 * 6) == 1
    with pytest.raises(RuntimeError, match="memory_budget_bytes"):
        _cap(None, 0.5, None)


def test_hot_owner_receive_buffers_lower_m():
    """On 8 ranks a rank owning 2 experts receives up to 7 gradient copies of each: the first
    replicas cost more than the held rows alone (p2p), less with the broadcast transport."""
    row = 100
    budget = (24 - 8) * row                 # worst_peak_rows(2, 2, 8, 2) - floor
    assert _cap(budget, None, None, world=8, num_experts=16) == 2
    assert _cap(budget - 1, None, None, world=8, num_experts=16) == 1
    assert _cap(budget, None, None, world=8, num_experts=16, transport="broadcast") == 4


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


@pytest.fixture(autouse=True)
def _fresh_start_profile():
    """Each test profiles the free memory at start again (mocked values must not leak)."""
    memory.forget_start()
    yield
    memory.forget_start()


def test_layer_profiles_free_memory_once_at_start(monkeypatch):
    free = {"bytes": 0, "calls": 0}

    def measure(device):
        free["calls"] += 1
        return free["bytes"]

    monkeypatch.setattr("moeflow.strategies.fssdp.layer_experts.free_bytes", measure)
    layer = _layer(memory_budget_fraction=0.5)
    ex = layer.experts
    assert ex.memory_capacity is None                   # not measured before a forward
    free["bytes"] = 10**9
    _forward(layer)
    assert (ex.memory_capacity, ex.memory_free, free["calls"]) == (0, 10**9, 1)
    free["bytes"] = 10                                  # later readings are not the start
    _forward(layer)
    assert (ex.memory_free, free["calls"]) == (10**9, 1)
    # one rank owns every expert: nothing to materialize, m = 0 whatever the budget
    assert ex.memory_capacity == 0


def test_gpt_layers_get_the_same_m_at_every_depth(monkeypatch):
    """Measured per layer, each deeper layer would see less free memory (the earlier layers'
    held experts and activations, kept for the backward without re-materialization): the
    start profile gives every layer the same reading."""
    from moeflow.strategies.fssdp.layer_experts import FSSDPExperts
    from tests.helpers.fssdp_layer_worker import small_gpt

    calls = {"n": 0}

    def shrinking(device):
        calls["n"] += 1
        return 10**9 - calls["n"] * 10**6

    monkeypatch.setattr("moeflow.strategies.fssdp.layer_experts.free_bytes", shrinking)
    model = small_gpt(Topology.single(), placement="fssdp",
                      fssdp=dict(materialize="sparse", overlap_degree=2,
                                 memory_budget_fraction=0.5))
    for _ in range(2):
        model(torch.randint(0, 32, (2, 8)))[0].sum().backward()
    layers = [m for m in model.modules() if isinstance(m, FSSDPExperts)]
    assert len(layers) == 2
    assert [m.memory_free for m in layers] == [10**9 - 10**6] * 2
    assert calls["n"] == 1


def test_fraction_without_measurable_memory_is_refused(monkeypatch):
    monkeypatch.setattr("moeflow.strategies.fssdp.layer_experts.free_bytes", lambda device: None)
    layer = _layer(memory_budget_fraction=0.5)
    with pytest.raises(ConfigError, match="memory_budget_fraction=0.5.*memory_budget_bytes"):
        _forward(layer)
    layer = _layer(memory_budget_bytes=10**9)           # a byte budget is used as given
    _forward(layer)
    assert (layer.experts.memory_capacity, layer.experts.memory_free) == (0, None)


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
    for ex in layers:      # one rank owns every expert: m = 0 (the 4-rank m is in
        assert ex.options.memory_budget_bytes == 20000      # tests/multirank/test_fssdp_layer.py)
        assert ex.memory_capacity == 0


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
    assert [m.memory_capacity for m in after] == [0, 0]     # the agreed m, not None
    assert all(len(m.window) == 1 for m in after)
