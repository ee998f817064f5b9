"""Float64 parity cases for Parm's baseline schedule (importable by spawned ranks).

A layout is (N_MP, N_EP, N_ESP, esp_in_node) on 4 ranks seen as 2 nodes x 2. With MP the MoE
input is replicated in the MP group, so the ranks of one MP group (consecutive ranks) run the
same batch; the reference runs each rank's batch as its own local batch (capacity per local
batch) on the mean of the world's local losses, which counts an MP group's batch once per rank
exactly as the distributed job does.
"""

from __future__ import annotations

import torch

from moeflow import MoEConfig, MoELayer, Topology, sync_gradients
from moeflow.config import ConfigError
from moeflow.parallel.grad_clip import global_grad_norm
from tests.helpers import parity

LAYOUTS = {
    "ep2_esp2_esp_in_node": (1, 2, 2, True),       # Parm IV-A case 2
    "ep2_esp2_ep_in_node": (1, 2, 2, False),       # case 3
    "mp2_ep2": (2, 2, 1, True),
    "mp2_esp2_esp_in_node": (2, 1, 2, True),
    "mp2_esp2_ep_in_node": (2, 1, 2, False),
}
CASES = {                                          # parity case name -> MoEConfig overrides
    "capacity_k2": {},
    "dropless_k2": {},
    "expert_bias_swiglu_dropless": {},
    "expert_bias_capacity": {"pipeline_degree": 2},
    "shared_gated_capacity": {},                   # shared experts beside ESP (DeepSeek-V3, Qwen2-MoE)
}
HIDDEN = {"w1": 2, "w3": 2, "w2": 1, "b1": 1, "b3": 1}   # the hidden dim of stacked weights


def batch_index(rank: int, mp: int) -> int:
    return rank // mp


def topology(layout: str) -> Topology:
    mp, ep, esp, in_node = LAYOUTS[layout]
    return Topology.from_env(ep_size=ep, local_size=2, mp_size=mp, esp_size=esp,
                             esp_in_node=in_node)


def run_rank(name: str, topo: Topology, **overrides) -> dict:
    layer = parity.make_layer(name, topo, **overrides)
    x, g = parity.make_batch(name, batch_index(topo.rank, topo.mp_size))
    x.requires_grad_()
    y = layer(x)
    parity.local_loss(y, g, layer).backward()
    sync_gradients(layer, topo)
    norm = global_grad_norm(layer, topo)
    grads, params = parity._snapshot(layer)
    return {"y": y.detach(), "x_grad": x.grad, "aux": layer.aux_loss.detach(), "norm": norm,
            "grads": grads, "params": params, "first_expert": layer.experts.first_expert,
            "num_local": layer.num_local, "shard": layer.experts.shard}


def rank_worker(layouts: list[str]) -> dict:
    out = {}
    for layout in layouts:
        topo = topology(layout)
        for name, overrides in CASES.items():
            out[(layout, name)] = run_rank(name, topo, **overrides)
    out["errors"] = layer_errors(topology("ep2_esp2_esp_in_node"))
    return out


def layer_errors(topo: Topology) -> dict[str, str]:
    """The ConfigError messages of layers the baseline with expert shards cannot run."""
    bad = {"hidden": dict(d_expert=13), "a2a": dict(a2a="hier1d"),
           "bilevel": dict(router="bilevel", bilevel_nodes=2, top_k=1)}
    errors = {}
    for key, kw in bad.items():
        try:
            MoELayer(MoEConfig(d_model=8, num_experts=4, **{"d_expert": 8, **kw}), topo)
        except ConfigError as e:
            errors[key] = str(e)
    return errors


def reference(name: str, world: int, mp: int) -> dict:
    layer = parity.make_layer(name, Topology.single(), **CASES[name])
    ys, xs, auxs, total = [], [], [], 0.0
    for r in range(world):
        x, g = parity.make_batch(name, batch_index(r, mp))
        x.requires_grad_()
        y = layer(x)
        total = total + parity.local_loss(y, g, layer)
        ys.append(y.detach())
        xs.append(x)
        auxs.append(layer.aux_loss.detach())
    (total / world).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in layer.parameters()], 2.0)
    grads, params = parity._snapshot(layer)
    return {"y": ys, "x_grad": [x.grad for x in xs], "aux": auxs, "grads": grads,
            "params": params, "norm": norm}


def expected_slice(pname: str, value: torch.Tensor, got: dict) -> torch.Tensor:
    """The part of the reference's ``pname`` that this rank holds: its experts and, for an
    ESP shard, its slice of their hidden dimension."""
    if not pname.startswith("experts."):
        return value
    lo, n = got["first_expert"], got["num_local"]
    value = value[lo:lo + n]
    s, shards = got["shard"]
    dim = HIDDEN.get(pname.split(".", 1)[1])
    if shards > 1 and dim is not None:
        width = value.shape[dim] // shards
        value = value.narrow(dim, s * width, width)
    return value


def assert_rank_matches(got: dict, ref: dict, rank: int, world: int, label: str) -> None:
    tol = parity.TOL
    torch.testing.assert_close(got["y"], ref["y"][rank], **tol)
    torch.testing.assert_close(got["aux"], ref["aux"][rank], **tol)
    torch.testing.assert_close(got["x_grad"], world * ref["x_grad"][rank], **tol)
    torch.testing.assert_close(got["norm"].double(), ref["norm"].double(), rtol=1e-6, atol=0)
    for what in ("grads", "params"):
        for pname, value in got[what].items():
            expect = expected_slice(pname, ref[what][pname], got)
            torch.testing.assert_close(value, expect, **tol, msg=lambda m: (
                f"{what} of {pname} on rank {rank} {label}: {m}"))
