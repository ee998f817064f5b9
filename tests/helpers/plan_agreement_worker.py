"""Spawned ranks of tests/multirank/test_plan_agreement.py: Parm S2 on (N_MP, N_EP, N_ESP) = (2, 2, 1),
with the MP ranks' tokens equal (the plans agree) or perturbed on MP rank 1 (they differ)."""

from __future__ import annotations

from tests.helpers import parity
from tests.helpers.parm_cases import batch_index, topology


def run(perturb: bool) -> str:
    topo = topology("mp2_ep2")
    layer = parity.make_layer("capacity_k2", topo, parallel_schedule="s2",
                              parm_check_plan=True)
    x, _ = parity.make_batch("capacity_k2", batch_index(topo.rank, topo.mp_size))
    if perturb and topo.mp_rank == 1:
        x = x.flip(0)                  # the same tokens in another order: another plan
    try:
        layer(x)
    except RuntimeError as err:
        return str(err)
    return "ok"
