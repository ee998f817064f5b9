"""One collective order per rank (docs/design.md): NCCL requires every rank to issue the
operations of one communicator in the same order, and collectives of different communicators
issued from two threads in a rank-dependent order can deadlock. gloo tolerates both, so these
tests record the order (tests/helpers/collective_order_worker.py) on 4 float64 ranks with random
per-rank sleeps on the communication lane and on the issuing threads, and check:

* per group: every member rank issued the identical sequence of (op, element count);
* per rank: every collective issued while a communication lane has work in flight is issued
  by the lane thread itself. Otherwise two threads issue into two communicators with no order
  between them, which the sleeps make rank-dependent. This is the assertion that fails when
  Parm's ESP-AllReduce (Fig. 3a, inside the experts task E) runs on the computing thread while
  the lane still carries the next chunk's EP-AlltoAll (ScheMoE section 3.2's task queue).
"""

from __future__ import annotations

import pytest

from moeflow.launch import launch_local
from tests.helpers import collective_order_worker as worker

WORLD = 4


@pytest.fixture(scope="module")
def events():
    return launch_local(worker.worker, WORLD, list(worker.CASES), timeout_s=240)


def _by_group(evs: list[tuple]) -> dict[tuple, list[tuple]]:
    out: dict[tuple, list[tuple]] = {}
    for ranks, op, count, _thread, _busy in evs:
        if op not in worker.P2P:        # point-to-point: each pair its own sizes and peers
            out.setdefault(ranks, []).append((op, count))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(worker.CASES))
def test_every_group_sees_one_order(events, case):
    seqs = {rank: _by_group(events[rank][case]) for rank in range(WORLD)}
    groups = {g for s in seqs.values() for g in s}
    assert groups, f"{case}: no collective was recorded"
    for group in groups:
        members = [r for r in group if r < WORLD]
        first = seqs[members[0]].get(group, [])
        assert first, f"{case}: group {group} recorded nothing on rank {members[0]}"
        for r in members[1:]:
            assert seqs[r].get(group, []) == first, (
                f"{case}: group {group} issued in a different order on rank {r} than on rank "
                f"{members[0]}:\n{seqs[r].get(group)}\nvs\n{first}")


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(worker.CASES))
def test_only_the_lane_issues_while_it_has_work(events, case):
    lane_used = False
    for rank in range(WORLD):
        evs = events[rank][case]
        bad = [(ranks, op, thread) for ranks, op, _c, thread, busy in evs
               if busy and not thread.startswith(worker.LANE_THREAD)]
        assert not bad, (f"{case}, rank {rank}: collectives issued off the communication lane "
                         f"while it had work in flight: {bad}")
        lane_used |= any(t.startswith(worker.LANE_THREAD) for *_x, t, _b in evs)
    assert lane_used or case == "parm_s2_saa", f"{case}: the lane issued nothing"


@pytest.mark.multirank
def test_the_esp_all_reduce_is_a_lane_task(events):
    """Parm's ESP-AllReduce (Fig. 3a, inside task E) is issued by the lane, once per chunk of
    each forward (2 chunks x 2 steps), queued behind the all-to-alls issued before it."""
    case = "parm_baseline_esp2_r2_optsche"
    for rank in range(WORLD):
        group = events[rank]["esp_group"][case]
        assert len(group) == 2 and rank in group
        threads = [t for ranks, op, _c, t, _b in events[rank][case]
                   if ranks == group and op == "all_reduce"]
        assert len(threads) == 4 and all(t.startswith(worker.LANE_THREAD) for t in threads), \
            f"rank {rank}: ESP-AllReduce issued by {threads}"


@pytest.mark.multirank
def test_the_early_spag_runs_on_the_lane(events):
    """HECATE's early spAG (Fig. 1c) is issued by the lane (its point-to-point batch), and
    the computing thread issues nothing while it is in flight (checked above)."""
    for rank in range(WORLD):
        p2p = [t for _r, op, _c, t, _b in events[rank]["fssdp_prefetch_rm_r2"]
               if op == "batch_isend_irecv"]
        assert any(t.startswith(worker.LANE_THREAD) for t in p2p), (rank, p2p)


@pytest.mark.multirank
@pytest.mark.parametrize("plain, ckpt", [
    ("ep_r2_optsche", "ep_r2_optsche_checkpoint"),
    ("ep_r2_optsche", "ep_r2_optsche_checkpoint_reentrant"),
    ("ep_r4_pipelined", "ep_r4_pipelined_checkpoint"),
    ("fssdp_prefetch_rm_r2", "fssdp_prefetch_rm_r2_checkpoint"),
    ("node_dedup_r2_optsche", "node_dedup_r2_optsche_checkpoint_reentrant"),
    ("node_dedup_pad_r2", "node_dedup_pad_r2_checkpoint_reentrant")])
def test_recomputation_repeats_the_exchange_only(events, plain, ckpt):
    """Under torch.utils.checkpoint the recomputation replays the first forward's plan
    (moeflow/plan_record.py): its collectives are the plain layer's plus the forward's
    all-to-alls once more, nothing else (the count matrix travels once per call; FSSDP's
    recomputed spAG of the recorded P' takes the place of HECATE-RM's backward one, and the
    same P' is used; node_dedup's counts, gathered inside its exchange, are kept on its plan
    and not gathered again). The per-group checks above hold them identical across ranks."""
    a2a = "all_to_all_single"
    for rank in range(WORLD):
        ref = [e[:3] for e in events[rank][plain]]
        got = [e[:3] for e in events[rank][ckpt]]
        assert [e for e in got if e[1] != a2a] == [e for e in ref if e[1] != a2a], rank
        n_ref = sum(e[1] == a2a for e in ref)
        assert n_ref and sum(e[1] == a2a for e in got) * 2 == n_ref * 3, rank


@pytest.mark.multirank
def test_node_dedup_r2_under_a_non_reentrant_checkpoint_keeps_its_scheduled_backward(events):
    """node_dedup at r >= 2 under saved-tensor hooks keeps its scheduled backward, its tasks'
    graphs saved as they are (moeflow/strategies/node_dedup/backward.py): the checkpoint has
    nothing of the layer to recompute, so the collectives are exactly the plain layer's, in
    the same order on every group."""
    for rank in range(WORLD):
        ref = [e[:3] for e in events[rank]["node_dedup_r2_optsche"]]
        got = [e[:3] for e in events[rank]["node_dedup_r2_optsche_checkpoint"]]
        assert ref and got == ref, rank


@pytest.mark.multirank
def test_parm_s1_recomputation_exchanges_no_counts(events):
    """Parm's S1 under a checkpoint: the recomputation reuses the recorded schedule and plan
    (its EP&ESP block counts included), so its gathers of the counts (16 elements: 8 experts
    from each of the block's 2 slots) are the plain run's; the all-to-alls and the
    MP-AllGather of the layer's output run again."""
    def count_gathers(evs):
        return sum(op.startswith("all_gather") and n == 16 for _g, op, n, *_ in evs)

    for rank in range(WORLD):
        ref, got = events[rank]["parm_s1_r2"], events[rank]["parm_s1_r2_checkpoint"]
        assert len(got) > len(ref) and count_gathers(got) == count_gathers(ref) > 0, rank


@pytest.mark.multirank
def test_moe_act_issues_the_plain_collectives(events):
    """moe_act recomputes the experts only, so it issues exactly what the plain layer issues."""
    for rank in range(WORLD):
        for case in ("ep_r2_optsche", "fssdp_prefetch_rm_r2"):
            plain = [e[:3] for e in events[rank][case]]
            assert [e[:3] for e in events[rank][f"{case}_moe_act"]] == plain, (rank, case)


NODE_DEDUP = ("node_dedup_r2_optsche", "node_dedup_pad_r2")


def _inter(ranks: tuple) -> bool:
    """On 2 nodes x 2 the inter-node group joins the ranks of one local rank: (0, 2), (1, 3)."""
    return len(ranks) == 2 and ranks[1] - ranks[0] == 2


@pytest.mark.multirank
@pytest.mark.parametrize("case", NODE_DEDUP)
def test_node_dedup_backward_hops_are_lane_tasks_in_schedule_order(events, case):
    """node_dedup's backward is scheduled like its forward (ScheMoE section 4, Eq. 12 on the
    mirrored tasks; moeflow/strategies/node_dedup/backward.py): every all-to-all of a step,
    backward included, is issued by the lane; the backward's lane tasks run in OptSche's
    order of the chunks; and each issues its chunk's hops in the mirror of its forward
    task's (backward A1, the partial sums' gradients: inter-node then the fan-in's reverse;
    backward A2: the fan-out's reverse, then inter-node; in trimmed mode the relay's hops per
    source node, overlapped)."""
    from moeflow.schedule import SCHEDULERS
    order = SCHEDULERS["optsche"]().order(2)
    want = [("A1" if t.kind == "C1" else "A2", t.chunk) for t in order
            if t.kind in ("C1", "C2")]
    if case == "node_dedup_pad_r2":
        hops = {"A1": [True, False], "A2": [False, True]}     # inter-node first, or second
    else:
        # trimmed mode overlaps the relay's hops (strategies/node_dedup/relay_overlap.py): on 2
        # nodes the dispatch's inter-node step, then one intra-node all-to-all for its own
        # node's rows and one for the other node's as they land; the combine gathers the other
        # node's sums, sends them back, then gathers its own node's
        hops = {"A1": [True, False, False], "A2": [False, True, False]}
    for rank in range(WORLD):
        a2a = [e for e in events[rank][case] if e[1] == "all_to_all_single"]
        off = [e[3] for e in a2a if not e[3].startswith(worker.LANE_THREAD)]
        assert not off, f"rank {rank}: all-to-alls issued off the lane: {off}"
        back = [(kind, chunk) for kind, chunk, phase, lane, *_ in events[rank]["tasks"][case]
                if phase == "backward" and lane == "comm"]
        assert back == want * 2, f"rank {rank}: backward lane tasks {back}, want {want} x 2"
        # per step: the forward's lane tasks, then the backward's, each with its hops
        steps = [_inter(e[0]) for e in a2a]
        per_step = [h for kind, _c in want for h in hops[kind]]
        assert steps == per_step * 4, f"rank {rank}: inter-node hops at {steps}"

