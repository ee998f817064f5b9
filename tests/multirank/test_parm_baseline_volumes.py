"""Parm's baseline (Fig. 3a) moves DeepSpeed-MoE 0.8.1's collective volumes where 0.8.1 has the
layout, and Eq. 1's where it has none (``moeflow/strategies/parm/baseline.py``).

One spawn of 4 gloo ranks traces one forward + backward of moeflow's ``baseline`` layer per
layout (tests/helpers/parm_volume_worker.py, the tracer of ``benchmarks.deepspeed.parm_deepspeed_trace``)
and compares the floating-point collectives over groups of more than one rank, in issue order:

* (N_MP, N_EP, N_ESP) = (2, 2, 2), ESP groups = MP groups (Parm's Fig. 2): equal, group by
  group, to the trace of DeepSpeed 0.8.1's own layer recorded on the same configuration
  (docs/results/parm/parm_deepspeed_trace_081.json, rank 0);
* (2, 2, 1) and, on 8 ranks (``slow``), (2, 4, 1): equal, group by group, to the traces of
  0.8.1's own layer with whole experts (docs/results/parm/parm_deepspeed_trace_081_2x2x1.json,
  ``..._2x4x1.json``): ``drop_tokens`` keeps ``E C M / N_MP`` for the EP-AlltoAlls and
  ``gather_tokens`` all-gathers it over the MP group, forward and backward;
* (2, 1, 2): 0.8.1's volumes for that layout, from its ``MOELayer.forward`` (experts tensor
  parallel over the MP group, no ``drop_tokens``): no EP-AlltoAll (an EP group of one rank),
  Megatron's all-reduces of ``E C M`` in forward and backward;
* (1, 2, 2) and (2, 2, 2) with ESP groups across MP groups (no DeepSpeed version has them):
  Eq. 1, the input gathered (``B L M`` per peer), ``N_ESP E C M`` exchanged and reduced.

DeepSpeed all-reduces each local expert's output apart, moeflow all of them at once, so
consecutive all-reduces on one group are summed before the comparison. moeflow's int64
count / row-map exchanges are left out (the tracer records dtypes; 0.8.1's trace has none).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeflow.config import ConfigError, MoEConfig
from moeflow.launch import launch_local
from moeflow.strategies.parm.baseline import esp_peers_share_tokens
from moeflow.strategies.parm.checks import check_parm_layer
from moeflow.topology import Topology
from tests.helpers import parm_volume_worker as worker

# the repository root: the first parent holding docs/ (the tests may move into sub-folders)
_ROOT = next(p for p in Path(__file__).resolve().parents if (p / "docs" / "results").is_dir())
TRACE_081 = _ROOT / "docs/results/parm/parm_deepspeed_trace_081.json"
#: 0.8.1's traces with whole experts (N_ESP = 1), per layout
TRACES_081_WHOLE = {layout: _ROOT / f"docs/results/parm/parm_deepspeed_trace_081_{name}.json"
                    for layout, name in (("2,2,1", "2x2x1"), ("2,4,1", "2x4x1"))}
KIND = {"all_to_all_single": "A2A", "all_to_all": "A2A", "all_reduce": "AR",
        "all_gather": "AG", "all_gather_into_tensor": "AG", "all_gather_single": "AG",
        "reduce_scatter": "RS", "reduce_scatter_tensor": "RS", "reduce_scatter_single": "RS"}
ECM = worker.E * worker.TOKENS * worker.M          # f = 2, top-2: C = T (512)
BLM = worker.TOKENS * worker.M                     # one rank's input (128)


def volumes(log: list[dict], ranks: bool = True) -> list[tuple]:
    """(phase, kind, group ranks or size, elements), float collectives on groups of >1 rank,
    consecutive all-reduces on one group summed."""
    out: list[tuple] = []
    for c in log:
        group = c["group"]
        if c.get("dtype", "float32").startswith("int") or (group != "world" and len(group) < 2):
            continue
        key = (c["phase"], KIND[c["op"]], tuple(group) if ranks else len(group))
        if out and key[1] == "AR" and out[-1][:3] == key:
            out[-1] = key + (out[-1][3] + c["elements"],)
        else:
            out.append(key + (c["elements"],))
    return out


def expected(layout: str) -> list[tuple]:
    """Group size and elements per collective, rank 0, from 0.8.1's code / Eq. 1."""
    mp, ep, esp, _ = worker.LAYOUTS[layout]
    a2a = [] if ep == 1 else [("A2A", ep)]
    if layout == "2,1,2":                            # 0.8.1: each rank its own copy
        fwd = bwd = [("AR", esp, ECM)]
    elif esp == 1:                                   # 0.8.1: the MP duplicates dropped
        part = ECM // mp
        fwd = bwd = [(k, n, part) for k, n in a2a] * 2 + [("AG", mp, part)]
    else:                                            # Eq. 1: the peers' inputs gathered
        rows = esp * ECM
        fwd = [("AG", esp, BLM)] + [(k, n, rows) for k, n in a2a] + [("AR", esp, rows)] + [
            (k, n, rows) for k, n in a2a]
        # ESP-Split's backward gathers the rows' gradients; the AllGather's, a ReduceScatter
        bwd = [("AG", esp, ECM)] + [(k, n, rows) for k, n in a2a] * 2 + [("RS", esp, esp * BLM)]
    return [("forward",) + v for v in fwd] + [("backward",) + v for v in bwd]


@pytest.fixture(scope="module")
def traces():
    return launch_local(worker.worker, 4, timeout_s=240)


def test_the_recorded_081_trace_tells_the_old_baseline_apart():
    """The comparison can fail: the recorded trace of the earlier baseline (which gathered
    the dispatched rows over ESP = MP) differs from 0.8.1's."""
    rec = json.loads(TRACE_081.read_text())
    assert rec["deepspeed_version"] == "0.8.1"
    assert rec["capacity_elements_per_rank"] == ECM and rec["tokens_per_rank"] == worker.TOKENS
    assert volumes(rec["moeflow-baseline"]) != volumes(rec["deepspeed"])
    assert volumes(rec["deepspeed"]) == [
        ("forward", "A2A", (0, 2), ECM), ("forward", "AR", (0, 1), ECM),
        ("forward", "A2A", (0, 2), ECM), ("backward", "A2A", (0, 2), ECM),
        ("backward", "AR", (0, 1), ECM), ("backward", "A2A", (0, 2), ECM)]


@pytest.mark.multirank
def test_fig2_layout_moves_deepspeed_081s_volumes(traces):
    rec = json.loads(TRACE_081.read_text())
    assert volumes(traces[0]["2,2,2"]) == volumes(rec["deepspeed"])


def test_the_recorded_whole_expert_traces_drop_the_mp_duplicates():
    """0.8.1 with whole experts and an mpu: E C M / N_MP per EP-AlltoAll, then gather_tokens
    over the MP group (forward and backward), as its sharded_moe.py reads."""
    for layout, path in TRACES_081_WHOLE.items():
        rec = json.loads(path.read_text())
        mp, ep, esp = rec["layout"]
        assert (rec["deepspeed_version"], f"{mp},{ep},{esp}") == ("0.8.1", layout)
        ep_ranks, mp_ranks = tuple(range(ep)), tuple(range(mp))
        part = rec["capacity_elements_per_rank"] // mp
        one = [("A2A", ep_ranks, part)] * 2 + [("AG", mp_ranks, part)]
        assert volumes(rec["deepspeed"]) == [("forward",) + v for v in one] + [
            ("backward",) + v for v in one]


@pytest.mark.multirank
def test_mp_without_esp_moves_081s_collectives(traces):
    rec = json.loads(TRACES_081_WHOLE["2,2,1"].read_text())
    assert volumes(traces[0]["2,2,1"]) == volumes(rec["deepspeed"])


@pytest.mark.multirank
@pytest.mark.slow
def test_mp_without_esp_on_8_ranks_moves_081s_collectives():
    """(2, 4, 1): the EP group of 4 holds two MP groups (0.8.1's and moeflow's alike)."""
    got = launch_local(worker.worker_8, 8, timeout_s=300)
    rec = json.loads(TRACES_081_WHOLE["2,4,1"].read_text())
    assert volumes(got[0]["2,4,1"]) == volumes(rec["deepspeed"])
    first = [(p, k, e) for p, k, _, e in volumes(got[0]["2,4,1"], ranks=False)]
    for rank in range(1, 8):
        assert [(p, k, e) for p, k, _, e in volumes(got[rank]["2,4,1"], ranks=False)] == first


@pytest.mark.multirank
@pytest.mark.parametrize("layout", [k for k in worker.LAYOUTS if k != "2,2,2"])
def test_other_layouts_move_081s_or_eq1s_volumes(traces, layout):
    got = [(p, k, n, e) for p, k, n, e in volumes(traces[0][layout], ranks=False)]
    assert got == expected(layout)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(worker.LAYOUTS))
def test_every_rank_moves_the_same_volumes(traces, layout):
    first = [(p, k, e) for p, k, _, e in volumes(traces[0][layout], ranks=False)]
    for rank in range(1, 4):
        assert [(p, k, e) for p, k, _, e in volumes(traces[rank][layout], ranks=False)] == first


@pytest.mark.multirank
def test_plan_check_runs_with_the_baseline(traces):
    assert [traces[rank]["checked_plans"] for rank in range(4)] == [1] * 4


@pytest.mark.multirank
def test_the_esp_groups_are_the_ones_the_baseline_assumes(traces):
    for rank in range(4):
        for layout, (actual, computed) in traces[rank]["esp_ranks"].items():
            assert actual == computed, (rank, layout)


def test_which_layouts_gather():
    def topo(rank, mp, ep, esp, world=4, in_node=True):
        return Topology(rank=rank, world_size=world, local_size=world // 2, ep_size=ep,
                        mp_size=mp, esp_size=esp, esp_in_node=in_node)

    assert all(esp_peers_share_tokens(topo(r, 2, 2, 2)) for r in range(4))      # Fig. 2
    assert all(esp_peers_share_tokens(topo(r, 2, 1, 2, in_node=i)) for r in range(4)
               for i in (True, False))                                     # ESP = MP
    assert all(esp_peers_share_tokens(topo(r, 4, 1, 2, world=8)) for r in range(8))
    assert not any(esp_peers_share_tokens(topo(r, 1, 2, 2)) for r in range(4))   # no MP
    assert not any(esp_peers_share_tokens(topo(r, 2, 2, 2, world=8, in_node=False))
                   for r in range(8))                                      # ESP across MP


def test_noisy_gates_are_refused_where_esp_peers_sum_their_own_copies():
    cfg = MoEConfig(d_model=8, num_experts=4, d_expert=8, gate_noise=0.1)
    inside = Topology(rank=0, world_size=4, local_size=2, ep_size=2, mp_size=2, esp_size=2)
    with pytest.raises(ConfigError, match=r"gate_noise=0.1 .*route identically"):
        check_parm_layer(cfg, inside, 8)
    across = Topology(rank=0, world_size=8, local_size=4, ep_size=2, mp_size=2, esp_size=2,
                      esp_in_node=False)
    check_parm_layer(cfg, across, 8)             # each peer's tokens routed by their owner
