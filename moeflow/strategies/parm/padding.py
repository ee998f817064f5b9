"""Which of Parm's schedules send only the kept rows of a capacity plan
(``MoEConfig.capacity_padding``; beyond the Parm paper).

Parm (Section III, Eq. 2-14) and DeepSpeed-TED / DeepSpeed-MoE count capacity-padded buffers:
every expert's ``C`` slots cross the links and go through the experts, empty or not. Trimming
keeps the same kept choices (the same drops, the same outputs) and sends each expert's ``min(n_e,
C)`` kept rows only (:func:`moeflow.dispatch.plan.make_plan` with ``trim=True``, as Tutel,
Megatron-core and DeepEP do). The schedules below are driven by count matrices gathered from
the plan (:func:`.ep_esp.block_counts`), so they carry the kept rows unchanged:

* ``ted`` and the pipelined ted (:mod:`.ted`, :mod:`.ted_pipelined`): the MP drop splits each
  expert's kept rows over the MP group (:func:`.baseline_mp.mp_shares`), the EP-AlltoAll, the
  ESP collectives and the MP-AllGather are sized from them;
* S1 (Fig. 3b): MP-Split before the gate, then the EP&ESP exchange of each rank's own plan;
* the baseline with whole experts (``N_ESP = 1``): plain EP, or 0.8.1's MP-duplicate drop
  (:mod:`.baseline_mp`).

These pad (the plan keeps its ``E C`` rows):

* the baseline with ESP shards: where the ESP group lies inside the MP group the shards'
  ESP-AllReduce sums the peers' partial outputs row by row, which the capacity layout keeps
  aligned whatever the routing; where the peers hold other tokens, Eq. 1's ESP-AllGather
  rebuilds the peers' buffers from their capacity layout;
* S2 (Fig. 3c): not extended here; its SAA phases (Fig. 5) have not been checked with trimmed
  counts, so it keeps the capacity layout that Eq. 7 / 14 model.
"""

from __future__ import annotations

from moeflow.strategies.parm.ted_pipelined import pipelined_chunks
from moeflow.topology import Topology

#: the paused-MP schedules (and ``auto``'s candidates) that trim; the pipelined ted's names
#: (``ted-r<chunks>``) trim as ``ted`` does
TRIMMING_SCHEDULES = ("ted", "s1")


def schedule_trims(sched: str | None, topo: Topology) -> bool:
    """Whether Parm's exchange with schedule ``sched`` (None: the baseline) carries a trimmed
    plan on ``topo`` (module docstring). The same on every rank: it depends on the schedule
    (agreed by Algorithm 1) and the layout only."""
    if sched is None:                 # whole experts: plain EP, or 0.8.1's MP drop
        return topo.esp_size == 1
    return sched in TRIMMING_SCHEDULES or pipelined_chunks(sched) is not None
