"""Where the time of one MoE layer step goes, moeflow vs Tutel (docs/benchmarks/layer.md,
"The 100 Mbit/s gap to Tutel"): every torch.distributed call inside a step (name, bytes of its
tensors, call and completion time) and the node link's bytes (/proc/self/net/dev of the rank's
network namespace, loopback excluded), 2 blocks of DBG_STEPS steps per layer. Benchmark tool,
not part of the library. Run inside the emulated cluster:

    PYTHONPATH=$PWD python -m moeflow.cli cluster run --nodes 2 --ranks-per-node 2 \
        --inter-bw 100mbit -- env DBG_OUT=out.json PYTHONPATH=$PWD \
        python docs/benchmarks/scripts/tutel_gap_timeline.py
"""
import json, os, statistics, sys, time, threading
import torch, torch.distributed as dist
from moeflow.launch import init_from_env
from moeflow.topology import Topology
from moeflow.config import MoEConfig
from moeflow.layer import MoELayer
from moeflow.bench.peer import PEERS

STEPS = int(os.environ.get("DBG_STEPS", "4"))
TOKENS = int(os.environ.get("DBG_TOKENS", "512"))
A2A = os.environ.get("DBG_A2A", "direct")
init_from_env(600)
topo = Topology.from_env()
rank = topo.rank

LOG = []          # (name, nbytes, t_call, t_done, thread)
ON = [False]
def wrap(mod, name):
    orig = getattr(mod, name)
    def f(*a, **k):
        if not ON[0]:
            return orig(*a, **k)
        nb = 0
        for x in list(a) + list(k.values()):
            if isinstance(x, torch.Tensor):
                nb += x.numel() * x.element_size()
            elif isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
                nb += sum(t.numel() * t.element_size() for t in x)
        t0 = time.perf_counter()
        rec = [name, nb, t0, None, threading.current_thread().name]
        LOG.append(rec)
        w = orig(*a, **k)
        if k.get("async_op") and w is not None:
            ow = w.wait
            def wait(*aa, **kk):
                r = ow(*aa, **kk); rec[3] = time.perf_counter(); return r
            class W:
                def __getattr__(s, n): return getattr(w, n)
                def wait(s, *aa, **kk): return wait(*aa, **kk)
            return W()
        rec[3] = time.perf_counter()
        return w
    setattr(mod, name, f)
for n in ("all_to_all_single", "all_gather_into_tensor", "all_gather_single", "all_reduce",
          "broadcast", "all_gather", "all_to_all", "reduce_scatter_tensor", "send", "recv",
          "isend", "irecv", "barrier"):
    if hasattr(dist, n):
        wrap(dist, n)
# moeflow binds _all_gather at import
import moeflow.comm.exchange as ex
ex._all_gather = dist.all_gather_single if hasattr(dist, "all_gather_single") else dist.all_gather_into_tensor

def netdev():
    tx = rx = 0
    for line in open("/proc/self/net/dev").read().splitlines()[2:]:
        ifn, rest = line.split(":", 1)
        if ifn.strip() == "lo":
            continue
        v = rest.split()
        rx += int(v[0]); tx += int(v[8])
    return tx, rx

cfg = MoEConfig(d_model=1024, d_expert=1024, num_experts=8, top_k=2, capacity_factor=1.25,
                activation="gelu",
                seed=1, a2a=A2A, schedule="sequential", pipeline_degree=1,
                capacity_padding=os.environ.get("DBG_PADDING", "pad"))
layer = MoELayer(cfg, topo)
peer = PEERS["tutel"]; peer.check(layer, TOKENS); other = peer.build(layer)
gen = torch.Generator().manual_seed(1000 + rank)
x = torch.randn(TOKENS, 1024, generator=gen)

def ours(v): return layer(v), layer.aux_loss
def theirs(v): return peer.forward(other, v)

def step(fn, mod, record):
    dist.barrier()
    ON[0] = record
    t0 = time.perf_counter()
    y, a = fn(x)
    t1 = time.perf_counter()
    (y.square().mean() + a).backward()
    t2 = time.perf_counter()
    ON[0] = False
    mod.zero_grad(set_to_none=True)
    return t0, t1, t2

for _ in range(2):
    step(ours, layer, False); step(theirs, other, False)
res = {}
for name, fn, mod in (("moeflow", ours, layer), ("tutel", theirs, other),
                      ("moeflow2", ours, layer), ("tutel2", theirs, other)):
    dist.barrier(); time.sleep(0.5)
    n0 = netdev(); LOG.clear(); steps = []
    for _ in range(STEPS):
        s = len(LOG)
        t0, t1, t2 = step(fn, mod, True)
        evs = [(r[0], r[1], round(1e3 * (r[2] - t0), 1), None if r[3] is None else round(1e3 * (r[3] - t0), 1), r[4]) for r in LOG[s:]]
        steps.append({"fwd_ms": 1e3 * (t1 - t0), "bwd_ms": 1e3 * (t2 - t1), "events": evs})
    dist.barrier(); time.sleep(0.5)
    n1 = netdev()
    res[name] = {"tx_per_step": (n1[0] - n0[0]) / STEPS, "rx_per_step": (n1[1] - n0[1]) / STEPS,
                 "step_ms": [s["fwd_ms"] + s["bwd_ms"] for s in steps], "steps": steps}
out = [None] * topo.world_size
dist.all_gather_object(out, res)
if rank == 0:
    json.dump(out, open(os.environ.get("DBG_OUT", "/tmp/gapdbg.json"), "w"), indent=1)
    for r, d in enumerate(out):
        for nm, v in d.items():
            print(r, nm, "tx/step %.0f rx/step %.0f" % (v["tx_per_step"], v["rx_per_step"]),
                  "step_ms", [round(t) for t in v["step_ms"]])
    for nm in out[0]:
        print("==", nm, "rank0 step0 events:")
        s = out[0][nm]["steps"][-1]
        print(" fwd %.0f bwd %.0f" % (s["fwd_ms"], s["bwd_ms"]))
        for e in s["events"]: print("  ", e)
dist.barrier()
dist.destroy_process_group()
