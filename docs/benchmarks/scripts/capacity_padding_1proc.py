"""One process, 2 threads: moeflow's layer with capacity_padding "pad" vs "trim", same weights,
interleaved forward + backward steps (2 warm-up + 15), medians and minima
(docs/benchmarks/layer.md). Benchmark tool, not library code:
``PYTHONPATH=$PWD python docs/benchmarks/scripts/capacity_padding_1proc.py``."""
import torch, time, statistics as st, moeflow as mf
torch.set_num_threads(2)
cfg = dict(d_model=1024, d_expert=2048, num_experts=8, top_k=2, capacity_factor=1.25, seed=1)
L = {p: mf.MoELayer(mf.MoEConfig(capacity_padding=p, **cfg)) for p in ("pad", "trim")}
L["trim"].load_state_dict(L["pad"].state_dict())
x = torch.randn(512, 1024, generator=torch.Generator().manual_seed(1000))
T = {p: [] for p in L}
for i in range(17):
    for p, l in L.items():
        t = time.perf_counter(); y = l(x); (y.square().mean() + l.aux_loss).backward(); l.zero_grad(set_to_none=True)
        if i >= 2: T[p].append(time.perf_counter() - t)
for p in T: print(p, "median %.1f min %.1f ms" % (1e3 * st.median(T[p]), 1e3 * min(T[p])))
print("pad/trim median %.3f min %.3f" % (st.median(T["pad"]) / st.median(T["trim"]), min(T["pad"]) / min(T["trim"])))
