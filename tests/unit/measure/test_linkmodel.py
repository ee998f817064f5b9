"""``moeflow.measure.linkmodel``: the alpha-beta fit and the measured curve the simulator reads
by default (linear between the sizes ``bench links`` measured)."""

from __future__ import annotations

import json

import pytest

from moeflow.config import ConfigError
from moeflow.measure.linkmodel import MeasuredCurve, fit_alpha_beta, fit_record, load_fits, save_fits

# a world all-to-all as measured on an emulated 2 x 4 cluster at 1 Gbit/s: the 4 MiB point took
# 268 ms, 4x its link bound (8 MiB leave each node through 1 Gbit/s: 67 ms)
POINTS = [(65536, 4.59e-3), (262144, 6.65e-3), (1048576, 16.91e-3), (4194304, 268.5e-3)]


def _curve() -> MeasuredCurve:
    s, t = zip(*POINTS)
    return MeasuredCurve(s, t, fit_alpha_beta(s, t))


def test_the_curve_passes_through_every_point_and_is_linear_between():
    c = _curve()
    for s, t in POINTS:
        assert c.predict(s) == pytest.approx(t)
    mid = (POINTS[1][0] + POINTS[2][0]) / 2
    assert c.predict(mid) == pytest.approx((POINTS[1][1] + POINTS[2][1]) / 2)


def test_outside_the_measured_sizes():
    c = _curve()
    assert c.predict(1024) == pytest.approx(POINTS[0][1])        # latency-bound below
    slope = (POINTS[3][1] - POINTS[2][1]) / (POINTS[3][0] - POINTS[2][0])
    assert c.predict(8388608) == pytest.approx(POINTS[3][1] + slope * 4194304)
    falling = MeasuredCurve((1.0, 2.0), (2.0, 1.0), fit_alpha_beta([1, 2], [2, 1]))
    assert falling.predict(1.5) == pytest.approx(2.0)               # never faster with more bytes


def test_one_line_is_pulled_by_its_largest_point_and_the_curve_is_not():
    s, t = zip(*POINTS)
    line = fit_alpha_beta(s, t)
    assert line.predict(1048576) > 3 * POINTS[2][1]
    assert _curve().predict(1048576) == pytest.approx(POINTS[2][1])


def test_load_fits_reads_curves_from_the_stored_points(tmp_path):
    path = tmp_path / "links.json"
    save_fits(str(path), [fit_record("world", "all_to_all", 8, 1, POINTS),
                          fit_record("intra", "p2p", 2, 1, [(4096, 1e-4), (4096, 2e-4)])],
              {"command": "test"})
    lines = load_fits(str(path))
    curves = load_fits(str(path), curves=True)
    assert not isinstance(lines[("world", "all_to_all")], MeasuredCurve)
    c = curves[("world", "all_to_all")]
    assert isinstance(c, MeasuredCurve) and c.group_size == 8
    assert c.predict(262144) == pytest.approx(6.65e-3)
    assert c.alpha == lines[("world", "all_to_all")].alpha       # the line kept for reports
    assert not isinstance(curves[("intra", "p2p")], MeasuredCurve)   # one distinct size


def test_the_simulator_reads_curves_unless_told_fit(tmp_path):
    from moeflow.simulate.costs import cost_model

    links = tmp_path / "links.json"
    save_fits(str(links), [fit_record("world", "all_to_all", 4, 1, POINTS)], {"command": "t"})
    compute = tmp_path / "compute.json"
    compute.write_text(json.dumps({"schema": "moeflow.compute/1", "fits": [
        {"kind": "gemm", "alpha_s": 0.0, "beta_s_per_unit": 1e-9}]}))
    curve = cost_model(str(links), str(compute), nodes=1, ranks_per_node=4)
    line = cost_model(str(links), str(compute), nodes=1, ranks_per_node=4, link_model="fit")
    assert curve.link("world", "all_to_all").predict(1048576) == pytest.approx(16.91e-3)
    assert line.link("world", "all_to_all").predict(1048576) > 3 * 16.91e-3
    assert curve.source["link_model"] == "curve" and line.source["link_model"] == "fit"
    with pytest.raises(ConfigError, match="link_model='spline'"):
        cost_model(str(links), str(compute), nodes=1, ranks_per_node=4, link_model="spline")
