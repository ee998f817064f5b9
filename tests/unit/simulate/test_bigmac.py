"""BigMac's DCCA structure in the simulator (moeflow/simulate/layer_model.py; BigMac Eq. 2 and 4):
the widths are the library's, the projections sit where MoELayer runs them, the all-to-alls
carry r times plain EP's bytes and the experts cost what fine-grained ones do. (Its sizes
against the real layer on 2 ranks: tests/multirank/test_simulate.py.)"""

from __future__ import annotations

from dataclasses import replace

import pytest

from moeflow.config import MoEConfig
from moeflow.errors import ConfigError
from moeflow.experts.structure import comm_width, expert_hidden
from moeflow.measure.linkmodel import AlphaBeta
from moeflow.simulate import LayerSpec, simulate_layer
from moeflow.simulate.costs import KINDS, CostModel
from moeflow.simulate.fssdp_model import FSSDPSpec

GEMM = 1e-9          # seconds per FLOP of every compute kind (alpha 0)


def _costs() -> CostModel:
    return CostModel({k: AlphaBeta(0.0, GEMM) for k in KINDS},
                     {("intra", "all_to_all"): AlphaBeta(1e-4, 1e-8),
                      ("intra", "all_gather"): AlphaBeta(1e-5, 1e-9),
                      ("intra", "p2p"): AlphaBeta(1e-5, 1e-9)})


def _spec(**kw) -> LayerSpec:
    base = dict(tokens=64, d_model=32, d_expert=16, num_experts=4, top_k=2,
                capacity_factor=None, ranks_per_node=2, structure="bigmac")
    return LayerSpec(**{**base, **kw})


def test_widths_are_the_librarys():
    for r in (None, 0.5, 0.125):
        spec = _spec(downscale_factor=r)
        cfg = MoEConfig(d_model=32, d_expert=16, num_experts=4, top_k=2, capacity_factor=None,
                        structure="bigmac", downscale_factor=r)
        assert (spec.width, spec.hidden) == (comm_width(cfg), expert_hidden(cfg))
    assert (_spec().width, _spec().hidden) == (8, 64)            # r = 0.25 by default
    assert (_spec(structure="fine_grained").width, _spec(structure="fine_grained").hidden) \
        == (32, 16)
    with pytest.raises(ConfigError, match="downscale_factor"):
        _spec(downscale_factor=0.3)                 # 0.3 x 32 columns is not whole
    with pytest.raises(ConfigError, match="structure='nope'"):
        _spec(structure="nope")


def _names(sim: dict, phase: str) -> list[str]:
    return [t["task"] for t in sim["tasks"] if t["rank"] == 0 and t["phase"] == phase
            and t["lane"] == "compute" and "^" not in t["task"] and t["task"] != "counts"]


def test_projections_sit_around_the_exchange():
    """Eq. 2: descend after the router (which reads x) and before the dispatch, ascend after
    the combine; backward mirrors them, each at twice the forward's FLOPs."""
    sim = simulate_layer(_spec(), _costs())
    assert _names(sim, "forward") == ["route", "descend", "permute", "combine", "ascend"]
    assert _names(sim, "backward") == ["ascend", "combine", "permute", "descend", "route"]
    T, M, w = 64, 32, 8
    dur = {(t["phase"], t["task"]): t["end_s"] - t["start_s"] for t in sim["tasks"]
           if t["rank"] == 0}
    assert dur[("forward", "descend")] == pytest.approx(GEMM * 2 * T * M * w)
    assert dur[("forward", "ascend")] == pytest.approx(GEMM * 2 * T * w * M)
    assert dur[("backward", "descend")] == pytest.approx(GEMM * 4 * T * M * w)
    fine = simulate_layer(_spec(structure="fine_grained"), _costs())
    assert _names(fine, "forward") == ["route", "permute", "combine"]


@pytest.mark.parametrize("a2a,nodes", [("direct", 1), ("pairwise", 1), ("hier2d", 2)])
def test_a2a_bytes_fall_by_r_and_experts_cost_the_same(a2a, nodes):
    costs = _costs()
    if nodes > 1:
        costs.links.update({(c, "all_to_all"): AlphaBeta(1e-4, 1e-8) for c in ("inter",
                                                                              "world")})
        costs.links[("world", "all_gather")] = AlphaBeta(1e-5, 1e-9)
    spec = _spec(a2a=a2a, nodes=nodes, capacity_factor=1.25, pipeline_degree=2,
                 schedule="optsche")
    big = simulate_layer(spec, costs)
    fine = simulate_layer(replace(spec, structure="fine_grained"), costs)
    assert big["counts"] == fine["counts"]
    assert big["step_bytes"].keys() == fine["step_bytes"].keys()
    for key, b in big["step_bytes"].items():
        assert [4 * v for v in b] == fine["step_bytes"][key] and sum(b) > 0
    for key, b in big["a2a_bytes"].items():
        assert [4 * v for v in b] == fine["a2a_bytes"][key]
    # Eq. 4: rM -> F/r -> rM has the fine-grained expert's FLOPs
    assert big["busy_s"]["E"] == pytest.approx(fine["busy_s"]["E"])
    assert big["comm_s"] < fine["comm_s"]


def test_codec_bytes_are_at_the_reduced_width():
    spec = _spec(codec="fp16")
    big = simulate_layer(spec, _with_codec())
    fine = simulate_layer(replace(spec, structure="fine_grained"), _with_codec())
    for key, b in big["step_bytes"].items():
        if key.startswith("forward"):
            assert [4 * v for v in b] == fine["step_bytes"][key]


def _with_codec() -> CostModel:
    c = _costs()
    c.compute["codec:fp16"] = AlphaBeta(1e-6, 1e-10)
    return c


def test_fssdp_moves_bigmac_experts_at_their_own_shape():
    """An expert rM x F/r (Eq. 4) holds as many elements as a fine-grained M x F one."""
    fs = FSSDPSpec(materialize="manual", holders=({0, 1}, {0}, {1, 0}, {1}))
    big = simulate_layer(_spec(), _costs(), fssdp=fs)
    fine = simulate_layer(_spec(structure="fine_grained"), _costs(), fssdp=fs)
    assert big["fssdp"]["spag_send_bytes"] == fine["fssdp"]["spag_send_bytes"]
    assert sum(big["fssdp"]["spag_send_bytes"]) > 0
