"""``moeflow bench layer --nproc 2 --compare torchtitan|megatron``: two gloo ranks, each driving
its runner, the runners expert parallel over their own gloo group (a second rendezvous; the
launcher's variables are not passed on, else the runners would join moeflow's store and hang).
Runs when the peer's venv is built (docs/benchmarks/install_*.sh), else it is skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENVS = {"torchtitan": Path("/opt/torchtitan-venv/bin/python"),
         "megatron": Path("/opt/megatron-core-venv/bin/python")}


@pytest.mark.slow
@pytest.mark.parametrize("peer", sorted(VENVS))
def test_two_ranks_against_an_expert_parallel_peer(peer, tmp_path):
    if not VENVS[peer].exists():
        pytest.skip(f"{peer}'s venv is not built (docs/benchmarks/layer.md)")
    out = tmp_path / "res.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "moeflow.cli", "bench", "layer", "--nproc", "2",
                    "--compare", peer, "--peer-python", str(VENVS[peer]),
                    "--capacity-factor", "0", "--activation", "swiglu", "--tokens", "64",
                    "--d-model", "16", "--d-expert", "32", "--num-experts", "4",
                    "--warmup", "1", "--reps", "2", "--input-grad", "--out", str(out)],
                   check=True, timeout=600, env=env, cwd=ROOT)
    res = json.loads(out.read_text())
    assert res["world_size"] == 2 and res["agreement"]["agree"], res["agreement"]
    assert len(res["samples_ms"][peer]) == 2 and res["spread_ms"][peer][0] > 0
