"""Run on every rank of an emulated 2-node job: topology as seen from inside a node, then the
float64 layout-parity cases (``tests/helpers/parity.py``) checked against the single-process reference.

Prints ``TOPO rank nodes node local ifname`` and ``PARITY OK <n> cases`` (or raises), then runs
``bench links`` at two tiny sizes and prints the fitted (group/op/group size) on rank 0."""

from __future__ import annotations

import os

import torch.distributed as dist

from moeflow.bench.links import links_worker
from moeflow.launch import init_from_env
from moeflow.topology import Topology
from tests.helpers import parity



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
        parity.assert_rank_matches(res, parity.reference(name, world), topo.rank, world,
                                   f"(ep {ep})")
        checked += 1
    print(f"PARITY OK {checked} cases", flush=True)
    res = links_worker([4096, 65536], 0, 1)      # every link class of a real 2-node layout
    if res is not None:
        print("LINKS " + " ".join(f"{f['group']}/{f['op']}/{f['group_size']}"
                                  for f in res["fits"]), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
