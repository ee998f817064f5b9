"""Codecs in the step simulator: encode / decode as the C and D tasks (ScheMoE Section 3.1) timed
by the ``codec:NAME`` fit of ``bench compute``, the compressed bytes on the wire from the
codec's own size function, and the trade-off of ScheMoE Section 2.3 (compression pays where
links are slow, not where they are fast)."""

from __future__ import annotations

import pytest
import torch

from moeflow.comm.codecs import CODECS
from moeflow.errors import ConfigError
from moeflow.measure.linkmodel import AlphaBeta
from moeflow.simulate import CostModel, LayerSpec, simulate_layer
from moeflow.simulate.costs import KINDS


def _costs(a2a=(1e-4, 1e-8), codec=(1e-5, 1e-9), source="measured") -> CostModel:
    comp = {k: AlphaBeta(1e-6, 1e-10) for k in KINDS}
    for name in ("fp16", "int8", "zfp"):
        comp[f"codec:{name}"] = AlphaBeta(*codec)
    return CostModel(comp, {(c, op): AlphaBeta(*a2a) for c in ("intra", "inter", "world")
                            for op in ("all_to_all", "all_gather")}, {"compute": source})


def _spec(**kw) -> LayerSpec:
    base = dict(tokens=512, d_model=64, d_expert=128, num_experts=4, top_k=2,
                capacity_factor=None, ranks_per_node=2)
    return LayerSpec(**{**base, **kw})


def _tasks(sim, name, phase="forward", rank=0):
    return [t for t in sim["tasks"] if t["task"] == name and t["phase"] == phase
            and t["rank"] == rank]


@pytest.mark.parametrize("codec", ["fp16", "int8", "zfp"])
def test_wire_bytes_are_the_codecs(codec):
    plain = simulate_layer(_spec(), _costs())
    sim = simulate_layer(_spec(codec=codec), _costs())
    rows = plain["a2a_bytes"]["A1^1"][0] // (64 * 4)
    want = CODECS[codec]().wire_bytes(rows, 64, torch.float32)
    assert _tasks(sim, "A1^1")[0]["size"] == want < _tasks(plain, "A1^1")[0]["size"]
    # the backward sends raw rows unless codec_backward
    raw = _tasks(plain, "A1^1", "backward")[0]["size"]
    assert _tasks(sim, "A1^1", "backward")[0]["size"] == raw
    both = simulate_layer(_spec(codec=codec, codec_backward=True), _costs())
    assert _tasks(both, "A1^1", "backward")[0]["size"] == want


def test_encode_and_decode_are_the_c_and_d_tasks():
    """r = 1: C1 encodes the send buffer, D1 decodes what arrived, each half the measured
    encode + decode fit of their input bytes; with codec none they take no time."""
    sim = simulate_layer(_spec(codec="int8"), _costs(codec=(2e-5, 3e-9)))
    rows = 512 * 2                                     # uniform: every rank sends T k rows
    half = 0.5 * (2e-5 + 3e-9 * rows * 64 * 4)
    for name in ("C1^1", "D1^1", "C2^1", "D2^1"):
        t = _tasks(sim, name)[0]
        assert t["end_s"] - t["start_s"] == pytest.approx(half)
        assert t["size"] == rows * 64
    plain = simulate_layer(_spec(), _costs())
    assert all(t["end_s"] == t["start_s"] for t in plain["tasks"] if t["task"][0] in "D")


def test_compression_pays_on_slow_links_only():
    """ScheMoE Section 2.3 / 7: compression costs computing time; it shortens the step when the
    all-to-all is slow and lengthens it when the link is fast and the codec slow."""
    slow_link = _costs(a2a=(1e-4, 1e-7), codec=(1e-6, 1e-10))
    assert (simulate_layer(_spec(codec="fp16"), slow_link)["step_s"]
            < simulate_layer(_spec(), slow_link)["step_s"])
    fast_link = _costs(a2a=(1e-5, 1e-11), codec=(1e-5, 1e-8))
    assert (simulate_layer(_spec(codec="fp16"), fast_link)["step_s"]
            > simulate_layer(_spec(), fast_link)["step_s"])


def test_missing_fit_and_profile_fallback():
    comp = {k: AlphaBeta(1e-6, 1e-10) for k in KINDS}
    links = {(c, op): AlphaBeta(1e-4, 1e-8) for c in ("intra",) for op in ("all_to_all",
                                                                          "all_gather")}
    with pytest.raises(ConfigError, match="--codecs fp8"):
        simulate_layer(_spec(codec="fp8"), CostModel(comp, links, {"compute": "c.json"}))
    # a datasheet has no codec fit: memory traffic, the payload read and the wire bytes written
    prof = CostModel(comp, links, {"compute": "profile x"})
    sim = simulate_layer(_spec(codec="fp16"), prof)
    rows = 512 * 2
    t = _tasks(sim, "C1^1")[0]
    assert t["end_s"] - t["start_s"] == pytest.approx(1e-6 + 1e-10 * rows * 64 * (4 + 2))


def test_refusals():
    with pytest.raises(ConfigError, match="codec='nope'"):
        _spec(codec="nope")
    _spec(codec="fp16", a2a="node_dedup", nodes=2, pipeline_degree=2)     # modelled
    with pytest.raises(ConfigError, match="recompute='full' with a2a='node_dedup' and "
                                          "pipeline_degree=2"):
        _spec(a2a="node_dedup", nodes=2, pipeline_degree=2, recompute="full")
