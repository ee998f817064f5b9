"""Run on every rank of an emulated 2-node job: topology as seen from inside a node, then the
float64 layout-parity cases (``tests/parity.py``) checked against the single-process reference.

Prints ``TOPO rank nodes node local ifname`` and ``PARITY OK <n> cases`` (or raises)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from moeflow.launch import init_from_env
from moeflow.topology import Topology
from tests import parity

TOL = dict(rtol=1e-9, atol=1e-12)


def main() -> None:
    init_from_env(timeout_s=120)
    topo = Topology.from_env()
    print(f"TOPO {topo.rank} {topo.num_nodes} {topo.node_rank} {topo.local_rank} "
          f"{os.environ.get('GLOO_SOCKET_IFNAME')}", flush=True)
    world = topo.world_size
    eps = [world, world // 2]
    got = parity.rank_worker(list(parity.CASES), eps)
    checked = 0
    for (name, ep), res in got.items():
        ref = parity.reference(name, world)
        r = topo.rank
        torch.testing.assert_close(res["y"], ref["y"][r], **TOL)
        torch.testing.assert_close(res["x_grad"], world * ref["x_grad"][r], **TOL)
        lo, n = res["first_expert"], res["num_local"]
        for what in ("grads", "params"):
            for pname, value in res[what].items():
                expect = ref[what][pname]
                if pname.startswith("experts."):
                    expect = expect[lo:lo + n]
                torch.testing.assert_close(value, expect, **TOL)
        checked += 1
    print(f"PARITY OK {checked} cases", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
