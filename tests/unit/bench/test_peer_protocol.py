"""The protocol between moeflow and a peer runner under its own interpreter
(benchmarks/peers/protocol.py, moeflow/bench/peer_process.py), without the peers installed: the
case file round trip, the float64 parity check (failing on a perturbed weight), the runner's
command loop driven through a pipe by a stand-in runner (the protocol's own float64 SwiGLU
MoE), and the CLI's errors. The comparisons against torchtitan and Megatron-core themselves
run when their venvs are built (docs/benchmarks/install_torchtitan.sh,
install_megatron_core.sh), else they are skipped."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.peers import protocol
from moeflow.bench.peer_process import PROCESS_PEERS, RunnerProcess, TorchtitanPeer
from moeflow.cli import main
from moeflow.config import ConfigError, MoEConfig
from moeflow.layer import MoELayer

ROOT = Path(__file__).resolve().parents[3]
TORCHTITAN_PYTHON = Path("/opt/torchtitan-venv/bin/python")
MEGATRON_PYTHON = Path("/opt/megatron-core-venv/bin/python")


def _case(perturb: float = 0.0) -> dict:
    g = torch.Generator().manual_seed(0)
    m, h, e, t = 8, 16, 4, 24

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    case = {"config": dict(d_model=m, d_expert=h, num_experts=e, top_k=2, renormalize=True,
                           threads=1, dtype="fp32", rank=0, world=1, first_expert=0,
                           num_local=e, port=0, addr="127.0.0.1"),
            "router": r(m, e, scale=0.5), "w1": r(e, m, h, scale=m ** -0.5),
            "w3": r(e, m, h, scale=m ** -0.5), "w2": r(e, h, m, scale=h ** -0.5),
            "x": r(t, m)}
    y, dx = protocol.loss_and_grad(protocol.swiglu_reference(case), case["x"])
    case["ref_y"], case["ref_dx"] = y, dx
    case["w2"] = case["w2"] + perturb                      # after the reference
    return case


def test_case_file_round_trip(tmp_path):
    case = _case()
    protocol.write_case(str(tmp_path / "c.pt"), case)
    back = protocol.read_case(str(tmp_path / "c.pt"))
    assert back["config"] == case["config"]
    for k in ("router", "w1", "w3", "w2", "x", "ref_y", "ref_dx"):
        assert torch.equal(back[k], case[k]), k


@pytest.mark.parametrize("key,value,message", [
    ("w1", torch.zeros(4, 8, 15, dtype=torch.float64), "w1"),
    ("x", torch.zeros(24, 8), "float64"),
    ("config", {"d_model": 8}, "config lacks"),
])
def test_case_file_refuses_a_wrong_case(tmp_path, key, value, message):
    case = _case()
    case[key] = value
    with pytest.raises(ValueError, match=message):
        protocol.write_case(str(tmp_path / "c.pt"), case)


def test_parity_holds_for_the_same_weights_and_fails_on_a_perturbed_one():
    case = _case()
    y, dx = protocol.loss_and_grad(protocol.swiglu_reference(case), case["x"])
    assert protocol.parity(y, dx, case["ref_y"], case["ref_dx"])["agree"]
    bad = _case(perturb=1e-6)
    y, dx = protocol.loss_and_grad(protocol.swiglu_reference(bad), bad["x"])
    got = protocol.parity(y, dx, bad["ref_y"], bad["ref_dx"])
    assert not got["agree"] and got["max_abs_diff_y"] > 1e-8


def test_serve_answers_steps_and_stops_on_quit(monkeypatch):
    said = []
    monkeypatch.setattr(sys, "stdin", io.StringIO("step 2\nstep 1\nquit\nstep 5\n"))
    protocol.serve(lambda: 0.5, said.append)
    assert said == [{"times": [0.5, 0.5]}, {"times": [0.5]}]
    monkeypatch.setattr(sys, "stdin", io.StringIO("jump\n"))
    protocol.serve(lambda: 0.5, said.append)
    assert "unknown command" in said[-1]["error"]


STAND_IN = '''import sys
sys.path.insert(0, {peers!r})
import protocol, torch

class Reference(torch.nn.Module):
    def __init__(self, case, dtype):
        super().__init__()
        dt = torch.float64 if dtype == "fp64" else torch.float32
        self.w = torch.nn.ParameterList([torch.nn.Parameter(case[k].to(dt))
                                         for k in ("router", "w1", "w3", "w2")])
        self.k = case["config"]["top_k"]
    def forward(self, x):
        return protocol._swiglu_moe(x.to(self.w[0].dtype), *self.w, self.k, True)

sys.exit(protocol.run(Reference, sys.argv[1:]))
'''


@pytest.mark.parametrize("perturb", [0.0, 1e-6])
def test_runner_process_reports_parity_and_times(tmp_path, perturb):
    script = tmp_path / "stand_in_runner.py"
    script.write_text(STAND_IN.format(peers=str(ROOT / "benchmarks" / "peers")))
    path = str(tmp_path / "case.pt")
    protocol.write_case(path, _case(perturb))
    runner = RunnerProcess("stand-in", [sys.executable, str(script), path], str(tmp_path),
                           protocol)
    try:
        assert runner.parity["agree"] == (perturb == 0.0)
        assert "rel_l2_diff_y" in runner.parity["timed_dtype_error"]
        times = runner.step(2)
        assert len(times) == 2 and all(t > 0 for t in times)
    finally:
        runner.close()


def test_runner_failure_is_raised_with_its_traceback(tmp_path):
    path = str(tmp_path / "case.pt")
    protocol.write_case(path, _case())
    script = tmp_path / "broken_runner.py"
    script.write_text(STAND_IN.format(peers=str(ROOT / "benchmarks" / "peers"))
                      .replace("self.k = ", "raise ImportError('no peer here'); self.k = "))
    with pytest.raises(RuntimeError, match="no peer here"):
        RunnerProcess("broken", [sys.executable, str(script), path], str(tmp_path), protocol)


@pytest.mark.parametrize("argv,message", [
    ([], "--peer-python PATH"),
    (["--peer-python", "/nonexistent/bin/python"], "not an executable file"),
])
def test_cli_names_the_missing_interpreter(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "layer", "--compare", "torchtitan", "--capacity-factor", "0",
              "--activation", "swiglu", *argv])
    out = capsys.readouterr()
    assert message in out.err + out.out


@pytest.mark.parametrize("argv,message", [
    (["--dtype", "bf16"], "--dtype bf16 is for the peers"),
    (["--peer-python", sys.executable], "runs in this process"),
])
def test_cli_refuses_process_peer_options_for_an_in_process_peer(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "layer", "--compare", "moeflow-fixed", *argv])
    out = capsys.readouterr()
    assert message in out.err + out.out


def test_peer_check_names_what_the_process_peers_need():
    layer = MoELayer(MoEConfig(d_model=8, d_expert=8, num_experts=4, top_k=2,
                               capacity_factor=1.25, activation="gelu"))
    with pytest.raises(ConfigError, match="swiglu.*dropless"):
        TorchtitanPeer().check(layer, 16)
    assert set(PROCESS_PEERS) == {"torchtitan", "megatron"}


PEER_VENVS = [pytest.param("torchtitan", TORCHTITAN_PYTHON, dtype, marks=pytest.mark.skipif(
    not TORCHTITAN_PYTHON.exists(), reason="torchtitan's venv is not built "
    "(docs/benchmarks/install_torchtitan.sh)")) for dtype in ("fp32", "bf16")] + [
    pytest.param("megatron", MEGATRON_PYTHON, "fp32", marks=pytest.mark.skipif(
        not MEGATRON_PYTHON.exists(), reason="Megatron-core's venv is not built "
        "(docs/benchmarks/install_megatron_core.sh)"))]


@pytest.mark.slow
@pytest.mark.parametrize("peer,python,dtype", PEER_VENVS)
def test_peer_computes_the_same_layer(peer, python, dtype):
    from moeflow.bench.compare import compare_worker

    opts = {"tokens": 64, "d_model": 16, "d_expert": 32, "num_experts": 4, "top_k": 2,
            "capacity_factor": None, "activation": "swiglu", "a2a": "direct",
            "schedule": "sequential", "pipeline_degree": 1, "warmup": 1, "reps": 2,
            "peer_python": str(python), "dtype": dtype}
    res = compare_worker(peer, opts)
    assert res["agreement"]["agree"], res["agreement"]
    errors = res["agreement"]["peer_error_vs_fp64"]
    assert 0 < errors["rel_l2_diff_y"] < (3e-2 if dtype == "bf16" else 1e-5)
    assert len(res["samples_ms"][peer]) == 2
