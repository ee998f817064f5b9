"""Peers that run under an interpreter of their own: torchtitan's and Megatron-core's MoE layers
side by side with moeflow's (``moeflow bench layer --compare torchtitan|megatron
--peer-python PATH``), each in its own virtual environment (their torch and package pins
differ from moeflow's; docs/benchmarks/layer.md, "torchtitan and Megatron-core").

The layer is GShard's top-k MoE (Lepikhin et al., Section 2.2) with dropless SwiGLU experts.
Every moeflow rank writes a case file (``benchmarks/peers/protocol.py``: its router, its local
experts and its input, and moeflow's float64 output and input gradient as the reference,
computed by a float64 copy of the layer with direct / sequential settings), starts the
runner ``benchmarks/peers/NAME_runner.py`` with the peer's interpreter (rank r of the peer's
own gloo group, expert parallel like moeflow's), reads its float64 parity and then drives it
one timed step at a time, so that moeflow's and the peer's steps interleave. The runners live
in the source checkout's ``benchmarks/`` (the package never imports them).
"""

from __future__ import annotations

import importlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from moeflow.bench.peer import Peer
from moeflow.config import ConfigError

INSTALL = {"torchtitan": "docs/benchmarks/install_torchtitan.sh TORCHTITAN_SOURCE [VENV]",
           "megatron": "docs/benchmarks/install_megatron_core.sh [VENV]"}


# the source checkout holding this moeflow (benchmarks/ beside the package, when it is one)
CHECKOUT_ROOT = Path(__file__).resolve().parents[2]
PEERS_DIR = CHECKOUT_ROOT / "benchmarks" / "peers"


def _protocol():
    """``benchmarks/peers/protocol.py`` of the checkout, imported by its path (the package
    never imports benchmarks/ by name)."""
    if str(CHECKOUT_ROOT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT_ROOT))
    return importlib.import_module("benchmarks.peers.protocol")


class ProcessPeer(Peer):
    """A peer whose layer runs in a runner process under ``--peer-python``."""

    in_process = False
    # the runner's module under benchmarks/peers/
    runner = ""

    def missing(self) -> str | None:
        if not (PEERS_DIR / f"{self.runner}.py").is_file():
            return (f"--compare {self.name} runs benchmarks/peers/{self.runner}.py of a source "
                    "checkout; this moeflow is installed without one")
        return None

    def check_python(self, python: str | None) -> str:
        """The peer's interpreter, checked: a clear error when it is not given or not there."""
        how = f"bash {INSTALL[self.name]}"
        if not python:
            raise ConfigError(f"--compare {self.name} runs {self.name} under its own "
                              "interpreter: give --peer-python PATH (the bin/python of the "
                              f"virtual environment that `{how}` builds)")
        path = shutil.which(python) or python
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise ConfigError(f"--peer-python {python!r} is not an executable file; build "
                              f"the {self.name} environment with `{how}` and pass its "
                              "bin/python")
        return path

    def check(self, layer, tokens: int) -> None:
        cfg, topo = layer.cfg, layer.topo
        problems = []
        if cfg.router != "topk" or cfg.structure != "vanilla" or cfg.gate_noise:
            problems.append("router='topk', structure='vanilla' and gate_noise=0")
        if cfg.activation != "swiglu" or cfg.expert_bias or cfg.expert_module != "ffn":
            problems.append("--activation swiglu without expert biases (the peers' experts)")
        if cfg.capacity_factor is not None:
            problems.append("dropless routing (--capacity-factor 0)")
        if topo.esp_size > 1 or topo.mp_size > 1:
            problems.append("esp_size = mp_size = 1")
        if layer.shared is not None:
            problems.append("no shared experts")
        if problems:
            raise ConfigError(f"--compare {self.name} needs " + "; ".join(problems))

    def start(self, layer, x: torch.Tensor, python: str, dtype: str,
              input_grad: bool) -> "RunnerProcess":
        """Write this rank's case, start its runner, return it once its parity is read."""
        proto = _protocol()
        ref_y, ref_dx = _float64_reference(layer, x, proto)
        topo, ex = layer.topo, layer.experts
        folder = tempfile.mkdtemp(prefix=f"moeflow-peer-{self.name}-")
        case = {"config": {"d_model": layer.cfg.d_model, "d_expert": layer.cfg.d_expert,
                           "num_experts": layer.cfg.num_experts, "top_k": layer.cfg.top_k,
                           "renormalize": layer.cfg.renormalizes(layer.cfg.top_k),
                           "threads": torch.get_num_threads(), "dtype": dtype,
                           "rank": topo.rank, "world": topo.world_size,
                           "first_expert": ex.first_expert, "num_local": ex.num_local,
                           "port": _shared_port(topo), "input_grad": input_grad,
                           "addr": os.environ.get("MASTER_ADDR", "127.0.0.1")},
                "router": layer.router.weight.detach().double().cpu(),
                "w1": ex.w1.detach().double().cpu(), "w3": ex.w3.detach().double().cpu(),
                "w2": ex.w2.detach().double().cpu(), "x": x.detach().double().cpu(),
                "ref_y": ref_y, "ref_dx": ref_dx}
        path = os.path.join(folder, f"case.rank{topo.rank}.pt")
        proto.write_case(path, case)
        script = PEERS_DIR / f"{self.runner}.py"
        return RunnerProcess(self.name, [python, str(script), path], folder, proto)


class RunnerProcess:
    """One rank's runner: its parity answer, then ``step()`` -> seconds of one timed step."""

    def __init__(self, name: str, argv: list[str], folder: str, proto):
        self.name, self.folder, self.proto = name, folder, proto
        self.log_path = os.path.join(folder, "runner.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, bufsize=1, env=_runner_env())
        self.parity = self._answer("parity")

    def _answer(self, key: str):
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.close()
                raise RuntimeError(f"the {self.name} runner exited ({self.proc.returncode}) "
                                   f"before answering {key!r}; its log:\n{self._tail()}")
            got = self.proto.read_answer(line)
            if got is None:
                self._log.write(line)
                continue
            if "error" in got:
                self.close()
                raise RuntimeError(f"the {self.name} runner failed:\n{got['error']}")
            return got[key]

    def step(self, n: int = 1) -> list[float]:
        self.proc.stdin.write(f"step {n}\n")
        self.proc.stdin.flush()
        return self._answer("times")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def _tail(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return "".join(f.readlines()[-30:])


# the launcher's variables: a runner inheriting them would rendezvous with moeflow's ranks
# (torch's elastic agent store) instead of the peer's own group
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
              "MASTER_PORT")


def _runner_env() -> dict:
    return {k: v for k, v in os.environ.items()
            if k not in LAUNCH_ENV and not k.startswith("TORCHELASTIC_")}


def _float64_reference(layer, x: torch.Tensor, proto) -> tuple[torch.Tensor, torch.Tensor]:
    """moeflow's float64 output and input gradient of ``mean(y^2)`` on ``x``: a float64 copy
    of ``layer`` with fixed direct / sequential / r = 1 settings and no codec (collective on
    an expert-parallel layer: every rank calls it)."""
    from moeflow.layer import MoELayer

    cfg = layer.requested_cfg.replace(a2a="direct", schedule="sequential", pipeline_degree=1,
                                      codec="none")
    ref = MoELayer(cfg, layer.topo)
    ref.load_state_dict(layer.state_dict())
    ref = ref.double().to(x.device)
    y, dx = proto.loss_and_grad(ref, x.detach().double())
    return y.cpu(), dx.cpu()


def _shared_port(topo) -> int:
    """A free port on rank 0's host for the peer's own process group, the same on all ranks."""
    port = 0
    if topo.rank == 0:
        with socket.socket() as s:
            s.bind((os.environ.get("MASTER_ADDR", "127.0.0.1"), 0))
            port = s.getsockname()[1]
    if topo.world_size > 1:
        import torch.distributed as dist
        box = [port]
        dist.broadcast_object_list(box, src=0, group=topo.world_group)
        port = box[0]
    return port


class TorchtitanPeer(ProcessPeer):
    name, runner = "torchtitan", "torchtitan_runner"


class MegatronPeer(ProcessPeer):
    name, runner = "megatron", "megatron_runner"


PROCESS_PEERS: dict[str, ProcessPeer] = {p.name: p for p in (TorchtitanPeer(), MegatronPeer())}
