"""Probes of the first GPU run (``tests/gpu/first_run.sh``; docs/gpu.md, "First run on one
GPU"): on one CUDA device, in one process, print one JSON object with

* ``nccl``: a world-size-1 NCCL process group bound to the device (``device_id``: the
  communicator formed at once), an all-reduce on it and on a subgroup of its own, and the
  device memory the subgroup's communicator took (``torch.cuda.mem_get_info`` around its
  creation: the per-communicator cost docs/gpu.md records for HECATE's holder groups);
* ``overlap``: two streams at once, the default one running matmuls and moeflow's
  communication stream (``schedule.streams.comm_stream``, high priority) a ``torch.cuda._sleep``
  kernel: the fraction of the shorter one hidden behind the longer (1: full overlap, 0: the
  streams serialised), from CUDA events (ScheMoE section 4's premise: comm and compute overlap);
* ``graph``: a real ``torch.cuda.graph`` capture of ``MoELayer.forward``, which must be refused
  by moeflow's ``RuntimeError`` (docs/gpu.md, "CUDA graphs"), after which the layer still runs.

Each probe reports ``ok`` and its numbers; the script exits 0 when all are ok.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch


def probe_nccl(device: torch.device) -> dict:
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
        try:
            t = torch.full((1 << 20,), 2.0, device=device)
            dist.all_reduce(t)
            torch.cuda.synchronize(device)
            free0, _ = torch.cuda.mem_get_info(device)
            group = dist.new_group([0])
            u = torch.ones(1 << 20, device=device)
            dist.all_reduce(u, group=group)
            torch.cuda.synchronize(device)
            free1, _ = torch.cuda.mem_get_info(device)
            ok = bool((t == 2).all() and (u == 1).all()) and group is not dist.group.WORLD
            return {"ok": ok, "backend": dist.get_backend(), "subgroup_bytes": free0 - free1}
        finally:
            dist.destroy_process_group()


def _timed(device, streams_work) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for stream, work in streams_work:
        stream.wait_event(start)                   # starts after the start event
        with torch.cuda.stream(stream):
            work()
    for stream, _ in streams_work:
        torch.cuda.current_stream(device).wait_stream(stream)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def probe_overlap(device: torch.device) -> dict:
    from moeflow.schedule.streams import comm_stream

    a = torch.randn(4096, 4096, device=device)
    main, comm = torch.cuda.current_stream(device), comm_stream(device)

    def compute():
        for _ in range(20):
            a @ a

    cycles = 200_000_000

    def sleep():
        torch.cuda._sleep(cycles)

    _timed(device, [(main, compute), (comm, sleep)])        # warm-up
    t_c = _timed(device, [(main, compute)])
    t_s = _timed(device, [(comm, sleep)])
    t_both = _timed(device, [(main, compute), (comm, sleep)])
    hidden = (t_c + t_s - t_both) / min(t_c, t_s)
    return {"ok": hidden > 0.5, "compute_s": t_c, "comm_s": t_s, "both_s": t_both,
            "hidden_fraction": hidden, "comm_stream_priority": comm.priority}


def probe_graph(device: torch.device) -> dict:
    from moeflow import MoEConfig, MoELayer, Topology
    from moeflow.devices import CUDA_GRAPH_ERROR

    layer = MoELayer(MoEConfig(d_model=64, d_expert=128, num_experts=4, top_k=2,
                               capacity_factor=1.25, seed=1), Topology.single()).to(device)
    x = torch.randn(32, 64, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.no_grad():
        layer(x)                                   # warm-up off the default stream (torch docs)
    torch.cuda.current_stream(device).wait_stream(side)
    graph, message = torch.cuda.CUDAGraph(), None
    try:
        with torch.no_grad(), torch.cuda.graph(graph):
            layer(x)
    except RuntimeError as e:
        message = str(e)
    want = CUDA_GRAPH_ERROR.split("{where}")[1][:60]
    with torch.no_grad():
        after = layer(x)
    torch.cuda.synchronize(device)
    refused = message is not None and want in message
    return {"ok": refused and bool(torch.isfinite(after).all()), "refused": refused,
            "message": (message or "no error: the capture was not refused")[:300]}


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "needs CUDA (torch.cuda.is_available() is "
                          "False)"}))
        return 2
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    out = {}
    for name, probe in (("nccl", probe_nccl), ("overlap", probe_overlap),
                        ("graph", probe_graph)):
        try:
            out[name] = probe(device)
        except Exception as e:                     # noqa: BLE001 (reported, not hidden)
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
    out["ok"] = all(v["ok"] for v in out.values())
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
