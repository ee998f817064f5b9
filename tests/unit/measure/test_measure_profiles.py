"""Hardware profiles (moeflow/measure/profiles.py): the shipped paper testbeds load, state their
sources, label what their paper does not state, and bad files are clear errors."""

from __future__ import annotations

import tomllib

import pytest

from moeflow.errors import ConfigError
from moeflow.measure.profiles import PROFILES_DIR, builtin_profiles, load_profile, parse_profile


def test_every_paper_testbed_loads_and_labels_its_assumptions():
    names = builtin_profiles()
    assert {"schemoe-32gpu", "parm-testbed-a", "parm-testbed-b", "hecate-cluster-a",
            "hecate-cluster-b", "smile-p4d-128gpu", "bigmac-32gpu"} <= set(names)
    for name in names:
        p = load_profile(name)
        assert p.source and p.world >= 8 and p.intra.bandwidth_Bps > 0
        assert (p.inter is None) == (p.nodes == 1)
        # whatever the paper does not state is labelled (datasheet peaks at least)
        assert {"gpu.fp32_tflops", "gpu.gemm_efficiency"} <= set(p.assumptions)
        raw = tomllib.loads((PROFILES_DIR / f"{name}.toml").read_text())
        for path in p.assumptions:
            table, _, key = path.rpartition(".")
            entry = raw[table][key] if table else raw[key]
            assert isinstance(entry, dict) and entry["assumption"]


def test_stated_numbers_are_not_labelled_and_links_become_alpha_beta():
    p = load_profile("hecate-cluster-b")
    assert p.intra.bandwidth_Bps == 600e9 and "intra_node.bandwidth_gbps" not in p.assumptions
    assert p.inter.bandwidth_Bps == 50e9 and "inter_node.latency_us" in p.assumptions
    ab = p.inter.alpha_beta()
    assert ab.predict(50e9) == pytest.approx(1.0 + 15e-6)
    assert p.gemm_flops("fp16") == pytest.approx(312e12 * 0.6)
    with pytest.raises(ConfigError, match="no peak for dtype 'fp8'"):
        p.gemm_flops("fp8")


BASE = {"nodes": 1, "gpus_per_node": 2,
        "gpu": {"memory_gib": 1, "fp32_tflops": 1, "fp16_tflops": 2,
                "memory_bandwidth_gbps": 1, "gemm_efficiency": 0.5},
        "intra_node": {"bandwidth_gbps": 1, "latency_us": 1}}


@pytest.mark.parametrize("change,message", [
    ({"nodes": 2}, "needs an [inter_node] table"),
    ({"gpu": {**BASE["gpu"], "fp32_tflops": -1}}, "gpu.fp32_tflops=-1 is invalid"),
    ({"gpu": {**BASE["gpu"], "gemm_efficiency": 2}}, "a fraction of peak"),
    ({"gpu": {**BASE["gpu"], "fp16_tflops": {"value": 3}}}, "assumption = \\\"why\\\""),
    ({"intra_node": {"bandwidth_gbps": 1}}, "intra_node.latency_us is missing"),
])
def test_bad_profiles_name_the_field(change, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_profile({**BASE, **change}, "test.toml")


def test_unknown_profile_lists_the_built_in_ones():
    with pytest.raises(FileNotFoundError, match="schemoe-32gpu"):
        load_profile("no-such-cluster")
