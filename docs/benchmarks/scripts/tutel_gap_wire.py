"""A/B of moeflow variants and Tutel at the bench's timing (barrier, step, slowest rank),
interleaved, with each variant's bytes on the node link and the TCP loss counters of the rank's
network namespace (/proc/self/net/{dev,snmp,netstat}) summed over its steps
(docs/benchmarks/layer.md, "The 100 Mbit/s gap to Tutel"). Benchmark tool, not library code.
Variants (DBG_VARIANTS): moeflow (capacity_padding "auto": trim on CPU), pad, nocount (pad,
with the count all-gather replaced by a local fill: valid only with equal token counts, a
what-if), tutel, raw_even / raw_split (one bare all_to_all_single of the layer's size, without
/ with split sizes). Run:

    PYTHONPATH=$PWD python -m moeflow.cli cluster run --nodes 2 --ranks-per-node 2 \
        --inter-bw 100mbit -- env DBG_REPS=10 DBG_VARIANTS=moeflow,pad,tutel \
        DBG_OUT=out.json PYTHONPATH=$PWD python docs/benchmarks/scripts/tutel_gap_wire.py
"""
import json, os, statistics as st, time
import numpy as np
import torch, torch.distributed as dist
from moeflow.launch import init_from_env
from moeflow.topology import Topology
from moeflow.config import MoEConfig
from moeflow.layer import MoELayer
from moeflow.bench.peer import PEERS
import moeflow.dispatch.plan as planmod
import moeflow.schedule.pipeline as pipe

REPS = int(os.environ.get("DBG_REPS", "15"))
TOKENS = int(os.environ.get("DBG_TOKENS", "512"))
VARIANTS = os.environ.get("DBG_VARIANTS", "moeflow,tutel,nocount").split(",")
init_from_env(900)
topo = Topology.from_env(); rank = topo.rank

def counters():
    tx = rx = 0
    for line in open("/proc/self/net/dev").read().splitlines()[2:]:
        ifn, rest = line.split(":", 1)
        if ifn.strip() == "lo": continue
        v = rest.split(); rx += int(v[0]); tx += int(v[8])
    d = {"tx": tx, "rx": rx}
    for fn in ("/proc/self/net/snmp", "/proc/self/net/netstat"):
        lines = open(fn).read().splitlines()
        for a, b in zip(lines[::2], lines[1::2]):
            ks, vs = a.split()[1:], b.split()[1:]
            pre = a.split()[0]
            for k, v in zip(ks, vs):
                if pre == "Tcp:" and k == "RetransSegs" or pre == "TcpExt:" and k in (
                        "TCPTimeouts", "TCPLossProbes", "TCPFastRetrans", "TCPSlowStartRetrans", "TCPSynRetrans"):
                    d[k] = int(v)
    return d

cfg = MoEConfig(d_model=1024, d_expert=1024, num_experts=8, top_k=2, capacity_factor=1.25,
                activation="gelu", seed=1, a2a="direct", schedule="sequential", pipeline_degree=1)
layer = MoELayer(cfg, topo)                       # capacity_padding "auto": trim on CPU
padded = MoELayer(cfg.replace(capacity_padding="pad"), topo)
padded.load_state_dict(layer.state_dict())
peer = PEERS["tutel"]; peer.check(layer, TOKENS); other = peer.build(layer)
x = torch.randn(TOKENS, 1024, generator=torch.Generator().manual_seed(1000 + rank))
orig_exchange = pipe.exchange_counts

def nocount_exchange(plan, topo):          # debug only: assume every rank has the same C
    plan.counts = np.full((topo.ep_size, plan.num_experts), plan.capacity, dtype=np.int64)
    plan.ep_rank = topo.ep_rank

def run(v):
    if v == "tutel":
        y = other(x); loss = y.square().mean() + other.l_aux; mod = other
    else:
        pipe.exchange_counts = nocount_exchange if v == "nocount" else orig_exchange
        mod = padded if v in ("pad", "nocount") else layer
        y = mod(x); loss = y.square().mean() + mod.aux_loss
    loss.backward(); mod.zero_grad(set_to_none=True)

def raw(v):                       # pure comm: one a2a of the layer's size, splits or not
    n = 8 * 160
    src = torch.randn(n, 1024); out = torch.empty_like(src)
    if v == "raw_even":
        dist.all_to_all_single(out, src)
    else:
        s = [n // topo.world_size] * topo.world_size
        dist.all_to_all_single(out, src, output_split_sizes=s, input_split_sizes=s)

times = {v: [] for v in VARIANTS}
stats = {v: {} for v in VARIANTS}
for i in range(2 + REPS):
    for v in VARIANTS:
        fn = raw if v.startswith("raw") else run
        c0 = counters()
        dist.barrier(); t0 = time.perf_counter()
        fn(v)
        t = torch.tensor([time.perf_counter() - t0]); dist.all_reduce(t, op=dist.ReduceOp.MAX)
        c1 = counters()
        if i >= 2:
            times[v].append(1e3 * t.item())
            for k in c1: stats[v][k] = stats[v].get(k, 0) + c1[k] - c0[k]
res = {"times": times, "stats": stats}
out = [None] * topo.world_size
dist.all_gather_object(out, res)
if rank == 0:
    json.dump(out, open(os.environ.get("DBG_OUT", "/tmp/gapab.json"), "w"))
    for v in VARIANTS:
        s = sorted(times[v])
        print(f"{v:9s} median {st.median(s):7.0f} min {s[0]:7.0f} q1 {s[len(s)//4]:7.0f} q3 {s[3*len(s)//4]:7.0f}")
    base = st.median(times["tutel"]) if "tutel" in times else None
    for v in VARIANTS:
        if base: print(f"  tutel/{v} = {base / st.median(times[v]):.3f}")
    for r in (0, 2):
        for v in VARIANTS:
            print("node", r // 2, v, {k: round(val / REPS, 1) for k, val in out[r]["stats"][v].items()})
dist.barrier(); dist.destroy_process_group()
