"""Host-sync cases of the parallel paths added beside EP (importable by spawned ranks): Parm's
S1, S2-SAA and S2-AAS, HECATE's FSSDP placement and shared experts, each in capacity mode and
dropless, on 4 gloo ranks seen as 2 nodes x 2. The counter is :mod:`moeflow.bench.syncs`."""

from __future__ import annotations

from moeflow import Topology
from moeflow.bench.syncs import step_syncs
from tests.helpers import parity
from tests.helpers.fssdp_layer_worker import SKEWED

WORLD, LOCAL = 4, 2
#: (N_MP, N_EP, N_ESP) = (2, 1, 2) with the ESP group inside a node: S1's all-gather over MP,
#: S2's SAA/AAS over MP and the EP&ESP all-to-all all run
PARM_LAYOUT = dict(mp_size=2, ep_size=1, esp_size=2, esp_in_node=True)
#: S1 padded: the contract GPUs get by default (on CPU "auto" trims S1, which reads the kept
#: counts once: test_host_sync's trimmed case)
PARM = {"s1": dict(parallel_schedule="s1", capacity_padding="pad"),
        "s2_saa": dict(parallel_schedule="s2"),
        "s2_aas": dict(parallel_schedule="s2", parm_saa=False)}
#: Parm's baseline (Fig. 3a) with ESP peers holding different tokens, (N_MP, N_EP, N_ESP) =
#: (1, 2, 2): Eq. 1's ESP-AllGather of the input and its row maps (``moeflow train --esp 2``)
BASELINE_LAYOUT = dict(mp_size=1, ep_size=2, esp_size=2, esp_in_node=True)
BASELINE = {"parm_baseline_esp": dict(parallel_schedule="baseline")}
FSSDP = {"fssdp_static": dict(placement="fssdp"),
         "fssdp_skewed": dict(placement="fssdp", fssdp=dict(materialize="manual")),
         # Algorithm 1 (branch t > m from the load window) with re-materialization
         "fssdp_sparse_rm": dict(placement="fssdp",
                                 fssdp=dict(materialize="sparse", overlap_degree=3,
                                            memory_capacity=1, rematerialize=True))}
SHARED = ("shared_gated_capacity", "shared_deepseek_v3")
MODES = {"capacity": "capacity_k2", "dropless": "dropless_k2"}
FSSDP_MODES = {"capacity": "hot_expert_capacity", "dropless": "hot_expert_dropless"}


def cases() -> list[tuple[str, str, str, dict, bool]]:
    """(path, mode, parity case, MoEConfig overrides, Parm layout?) of every checked step."""
    out = [(s, m, c, kw, True) for s, kw in PARM.items() for m, c in MODES.items()]
    out += [(s, m, c, kw, False) for s, kw in BASELINE.items() for m, c in MODES.items()]
    out += [(f, m, c, kw, False) for f, kw in FSSDP.items() for m, c in FSSDP_MODES.items()]
    # shared experts run on EP's path: padded capacity there, the contract GPUs get by default
    # (on CPU capacity_padding="auto" trims, which reads the kept counts once: test_host_sync)
    out += [(c, "capacity" if "capacity" in c else "dropless", c, {"capacity_padding": "pad"},
             False) for c in SHARED]
    return out


def worker() -> dict:
    """``{(path, mode): would-be syncs of the second forward + backward}`` on this rank."""
    parm_topo = Topology.from_env(local_size=LOCAL, **PARM_LAYOUT)
    ep_topo = Topology.from_env(local_size=LOCAL)
    base_topo = Topology.from_env(local_size=LOCAL, **BASELINE_LAYOUT)
    out = {}
    for path, mode, case, kw, parm in cases():
        topo = parm_topo if parm else base_topo if path in BASELINE else ep_topo
        layer = parity.make_layer(case, topo, **kw)
        x, _ = parity.make_batch(case, ep_topo.rank // (2 if parm else 1))
        x.requires_grad_()
        for step in range(2):
            if path == "fssdp_skewed":
                layer.experts.set_holders(SKEWED[step])
            syncs = step_syncs(layer, x)
        out[path, mode] = dict(syncs)
    return out
