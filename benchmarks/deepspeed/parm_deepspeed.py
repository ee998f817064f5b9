"""``moeflow bench parm --compare deepspeed``: Parm's schedules against DeepSpeed-MoE's own layer.

The Parm paper's baseline is DeepSpeed-MoE
(Section V, footnote 1: v0.8.1). When ``deepspeed`` is importable (an optional peer for this
benchmark only, never a dependency of moeflow), every rank builds ``deepspeed.moe.layer.MoE``
with tensor-parallel experts (``enable_expert_tensor_parallelism=True``) over a small
Megatron-style mpu made of moeflow's own groups, in the layout of Parm's Fig. 2:
``N_MP = N_EP = N_ESP = 2`` on 4 ranks, the MP group is the ESP group (the only ESP DeepSpeed
has: expert tensor parallelism over the mpu's tensor-parallel group); on 8 ranks the same with
``N_EP = 4`` (:func:`ep_for_world`), e.g. 4 nodes x 2, where the EP all-to-all crosses nodes.

Aligned with moeflow's ``baseline`` layer on the same rank (so the outputs can be compared):

* gate: DeepSpeed's ``wg.weight`` (E, M) is the transpose of moeflow's router weight (M, E);
  no jitter / RSample (``noisy_gate_policy=None``), no random token selection (``use_rts``),
  and for top-2 the Gumbel noise on the second expert is switched off with DeepSpeed's own
  ``top2_2nd_expert_sampling=False`` (0.19.8; in 0.8.1 it is always on: zeroed for the
  numeric check by :func:`no_second_expert_noise`);
* capacity: both ``ceil(k f T / E)`` per local batch with GShard's priority (all first choices
  before the second ones); ``min_capacity=0``;
* experts: DeepSpeed's ``Experts`` deep-copies one module per local expert; each copy here is
  :class:`ShardFFN`, Megatron's column/row-parallel MLP over the mpu's group holding this
  rank's shard of moeflow's ``w1`` / ``w2`` (``gelu``, no biases, as the bench's layers).

Not aligned (stated in the result): DeepSpeed renormalises the top-2 gates *after* capacity
drops, moeflow before; so outputs are compared at a drop-free capacity factor (``E / k``), where
both are the same function. The timed grid uses the requested factors.

Gloo: DeepSpeed 0.19.8's ``_gather_tokens`` (``deepspeed/moe/mappings.py``) hands a flat 1-D
output to ``all_gather_into_tensor``, which gloo rejects (it wants ``world * input.shape[0]``
rows). :func:`patch_gather_tokens` replaces that module function (visibly, in this process
only) by the same gather into an output shaped ``(world * rows, ...)``, whose memory order is
the flat buffer's, then continues exactly as DeepSpeed does.

Both DeepSpeed 0.19.8 and 0.8.1 (the paper's version, in its own venv: see
docs/benchmarks/install_deepspeed_081.sh) run here; where their APIs differ the adapter asks
the installed code, not its version string:

* 0.19.8 has ``MoE(top2_2nd_expert_sampling=False)``; 0.8.1's ``top2gating`` always adds
  Gumbel noise (``sharded_moe.gumbel_rsample``) to the logits that pick the second expert.
  :func:`no_second_expert_noise` makes that sample zeros, during the numeric check only; the
  timed 0.8.1 steps keep the noise (0.8.1 as the paper ran it: one (T, E) sample per step,
  and the dispatch buffers are capacity-sized either way);
* 0.19.8's ``_gather_tokens`` needs the gloo patch above; 0.8.1's uses a list ``all_gather``,
  which gloo takes, so it is left alone;
* 0.8.1 runs no MP collective with tensor-parallel experts, 0.19.8 drops / gathers the MP
  duplicates around the all-to-alls (:func:`drops_mp_duplicates`). Under 0.19.8,
  :class:`Order081` also times the same layer in 0.8.1's order (an emulation, labelled so);
  under 0.8.1 that label is the real thing and the emulation is not run.

Both versions ask the mpu the same questions (``TopoMPU``). DeepSpeed creates its EP /
expert-DP groups itself (``dist.new_group`` without a timeout): their collectives are bounded by
torch's default process-group timeout, not by the command's ``--timeout``. Results and the
install steps: docs/benchmarks/parm.md, "Against DeepSpeed-MoE" and "DeepSpeed 0.8.1 itself".
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.parm.parm import PIPELINED, PIPELINED_CONFIG, trimmed_variants
from moeflow.bench.schedule_bench import step_once
from moeflow.measure.timing import slowest, start_aligned
from moeflow.config import MoEConfig
from moeflow.devices import resolve_device
from moeflow.layer import MoELayer
from moeflow.strategies.parm.algorithm1 import use_fits
from moeflow.strategies.parm.fits import measure_parm_fits
from moeflow.parallel.tensor_parallel import copy_to_mp, reduce_from_mp
from moeflow.topology import Topology

MOEFLOW_VARIANTS = [("baseline", dict(parallel_schedule="baseline")),
                    ("s1", dict(parallel_schedule="s1")),
                    ("s2", dict(parallel_schedule="s2")),
                    ("ted", dict(parallel_schedule="ted")),
                    (PIPELINED, PIPELINED_CONFIG),     # the pipelined ted, 4 chunks
                    ("auto", dict(parallel_schedule="auto"))]
ORDER_081 = "deepspeed-0.8.1-order"
TOLERANCE = 1e-5      # float32: |y_moeflow - y_deepspeed| <= 1e-5 max(1, max|y|), and of dL/dx
LAYOUT = dict(mp=2, esp=2)      # Parm Fig. 2: N_MP = N_ESP = 2; N_EP: ep_for_world


def ep_for_world(world_size: int) -> int:
    """N_EP of the compared layout on ``world_size`` ranks: the MP group is the ESP group (the
    only ESP DeepSpeed has, Parm Fig. 2), so N_EP = world / N_ESP (2 on 4 ranks as in Fig. 2,
    4 on 8 ranks as 4 nodes x 2, where the EP all-to-all crosses the nodes)."""
    esp = LAYOUT["esp"]
    if world_size < 2 * esp or world_size % esp:
        raise SystemExit(f"moeflow bench parm --compare deepspeed runs N_MP = N_ESP = {esp} with "
                         f"the MP group as the ESP group: it needs a multiple of {esp} ranks, at "
                         f"least {2 * esp}, not {world_size}; run it with --nproc 4 or 8, or "
                         "under 4 / 8 torchrun / cluster ranks")
    return world_size // esp


SKIP_MESSAGE = ("moeflow bench parm --compare deepspeed: skipped, deepspeed is not importable. "
                "Install it for this benchmark only (not a moeflow dependency), see "
                "docs/benchmarks/parm.md, section 'Against DeepSpeed-MoE'.")


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def drops_mp_duplicates() -> bool:
    """Whether the installed DeepSpeed drops / gathers the MP duplicates around its all-to-alls
    also when the experts are tensor parallel (0.19.8: yes; 0.8.1: no, its ``MOELayer.forward``
    calls ``drop_tokens`` / ``gather_tokens`` only under
    ``groups._get_expert_model_parallel_world_size() == 1``). Read from the installed code."""
    from deepspeed.moe import sharded_moe
    return "_get_expert_model_parallel_world_size() == 1" not in inspect.getsource(
        sharded_moe.MOELayer.forward)


def ds_labels() -> list[str]:
    """The DeepSpeed columns: the installed layer, plus 0.8.1's order emulated where the
    installed version has another order."""
    return ["deepspeed"] + ([ORDER_081] if drops_mp_duplicates() else [])


def short_names(version: str) -> dict[str, str]:
    return {"deepspeed": f"ds {version}", ORDER_081: "ds 0.8.1 ord"}


def has_sampling_switch() -> bool:
    """0.19.8's ``MoE(top2_2nd_expert_sampling=...)``; 0.8.1 has no such argument."""
    from deepspeed.moe.layer import MoE
    return "top2_2nd_expert_sampling" in inspect.signature(MoE.__init__).parameters


@contextlib.contextmanager
def no_second_expert_noise():
    """Zero 0.8.1's always-on Gumbel noise on the second expert's logits (``top2gating`` adds
    ``gumbel_rsample(logits.shape)``, a module-level name in ``deepspeed.moe.sharded_moe``)
    while the block runs; restored afterwards. Nothing to do where the layer was built with
    ``top2_2nd_expert_sampling=False``."""
    if has_sampling_switch():
        yield
        return
    from deepspeed.moe import sharded_moe
    saved = sharded_moe.gumbel_rsample
    sharded_moe.gumbel_rsample = lambda shape, device: torch.zeros(shape, device=device)
    try:
        yield
    finally:
        sharded_moe.gumbel_rsample = saved


def capacity_divides(tokens: int, top_k: int, num_experts: int, factor: float, mp: int) -> bool:
    """DeepSpeed's drop_tokens splits the capacity dimension over the MP group: C % mp == 0."""
    import math
    return math.ceil(round(factor * top_k * tokens / num_experts, 9)) % mp == 0


class TopoMPU:
    """The Megatron-style mpu DeepSpeed asks for, answered from moeflow's groups."""

    def __init__(self, topo: Topology):
        self.topo = topo

    def get_tensor_model_parallel_group(self):
        return self.topo.mp_group

    def get_tensor_model_parallel_world_size(self):
        return self.topo.mp_size

    def get_tensor_model_parallel_rank(self):
        return self.topo.mp_rank

    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_rank = get_tensor_model_parallel_rank

    def get_data_parallel_group(self):
        return self.topo.dp_group

    def get_data_parallel_world_size(self):
        return self.topo.dp_size

    def get_data_parallel_rank(self):
        return self.topo.dp_rank

    def get_data_parallel_group_ranks(self):
        return dist.get_process_group_ranks(self.topo.dp_group)


class _Shared:
    """Holds the topology in a module DeepSpeed deep-copies (process groups don't copy)."""

    def __init__(self, topo: Topology):
        self.topo = topo

    def __deepcopy__(self, memo):
        return self


class ShardFFN(nn.Module):
    """Megatron's tensor-parallel MLP for one expert shard: f (copy_to_mp), gelu(x W1) W2, g
    (reduce_from_mp), the expert of DeepSpeed's tensor-parallel experts."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, topo: Topology):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(w1.clone()), nn.Parameter(w2.clone())
        self.shared = _Shared(topo)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topo = self.shared.topo
        h = F.gelu(copy_to_mp(x, topo) @ self.w1)
        return reduce_from_mp(h @ self.w2, topo)


class WholeFFN(nn.Module):
    """One whole expert, gelu(x W1) W2: DeepSpeed's expert when the experts are not tensor
    parallel (N_ESP = 1; the MP duplicates are then dropped around the all-to-alls)."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(w1.clone()), nn.Parameter(w2.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x @ self.w1) @ self.w2


def patch_gather_tokens() -> None:
    """Work around DeepSpeed 0.19.8's flat all_gather_into_tensor output (gloo rejects it).
    Versions whose ``_gather_tokens`` gathers into a list (0.8.1) are left as they are."""
    import deepspeed
    from deepspeed.moe import mappings

    if getattr(mappings._gather_tokens, "_moeflow_gloo_patch", False):
        return
    if "all_gather_into_tensor" not in inspect.getsource(mappings._gather_tokens):
        return
    from deepspeed.utils.bwc import (bwc_tensor_model_parallel_group,
                                     bwc_tensor_model_parallel_world_size)

    def _gather_tokens(input_, dim=0):
        mpu = deepspeed.utils.groups.mpu
        input_ = input_.contiguous()
        world_size = bwc_tensor_model_parallel_world_size(mpu)
        if world_size == 1:
            return input_
        # the one change: rows-shaped output (same memory as DeepSpeed's flat buffer)
        gather_buffer = torch.empty((world_size * input_.shape[0], *input_.shape[1:]),
                                    dtype=input_.dtype, device=input_.device)
        deepspeed.comm.all_gather_into_tensor(gather_buffer, input_,
                                              group=bwc_tensor_model_parallel_group(mpu))
        gather_buffer = gather_buffer.view(-1)
        if dim == 0:
            shape = list(input_.size())
            shape[0] = shape[0] * world_size
            return gather_buffer.view(shape)
        parts = [gather_buffer.narrow(0, input_.numel() * i, input_.numel()).view_as(input_)
                 for i in range(world_size)]
        return torch.cat(parts, dim=dim).contiguous()

    _gather_tokens._moeflow_gloo_patch = True
    mappings._gather_tokens = _gather_tokens


def build_deepspeed_layer(ref: MoELayer, topo: Topology):
    """DeepSpeed-MoE's layer holding ``ref``'s gate and this rank's expert shards: tensor
    parallel over the MP group (the ESP group) when ``topo.esp_size > 1``, whole experts
    (``enable_expert_tensor_parallelism=False``) when ``topo.esp_size == 1``."""
    import deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    cfg = ref.cfg
    deepspeed.init_distributed(dist_backend=dist.get_backend())   # wraps the running group
    groups.mpu = TopoMPU(topo)
    patch_gather_tokens()
    w1, w2 = ref.experts.w1.detach(), ref.experts.w2.detach()      # (E_l, M, H/esp), (E_l, H/esp, M)
    extra = dict(top2_2nd_expert_sampling=False) if has_sampling_switch() else {}
    sharded = topo.esp_size > 1
    expert = ShardFFN(w1[0], w2[0], topo) if sharded else WholeFFN(w1[0], w2[0])
    layer = MoE(cfg.d_model, expert, num_experts=cfg.num_experts,
                ep_size=topo.ep_size, k=cfg.top_k, capacity_factor=cfg.capacity_factor,
                eval_capacity_factor=cfg.capacity_factor, min_capacity=0,
                noisy_gate_policy=None, drop_tokens=True, use_rts=False,
                enable_expert_tensor_parallelism=sharded, **extra)
    layer.set_deepspeed_parallelism()
    moe = layer.deepspeed_moe
    ep_group = moe.ep_group
    if dist.get_rank(ep_group) != topo.ep_rank:
        raise RuntimeError(f"DeepSpeed's EP rank {dist.get_rank(ep_group)} differs from moeflow's "
                           f"{topo.ep_rank}: the expert weights would not line up")
    with torch.no_grad():
        moe.gate.wg.weight.copy_(ref.router.weight.detach().t())
        for e, ex in enumerate(moe.experts.deepspeed_experts):
            ex.w1.copy_(w1[e])
            ex.w2.copy_(w2[e])
    return layer


class Order081(nn.Module):
    """DeepSpeed 0.19.8's layer run in 0.8.1's MP collective order (an emulation, labelled so).

    0.8.1's ``MOELayer.forward`` (deepspeed/moe/sharded_moe.py; run in its own venv by
    docs/benchmarks/install_deepspeed_081.sh) calls ``drop_tokens`` before the first
    all-to-all and ``gather_tokens`` after the second only when the experts are *not* tensor
    parallel; with tensor-parallel experts every MP rank sends its own (duplicate) copy of the
    tokens through both EP all-to-alls and the experts' all-reduce sums the shards. 0.19.8
    always drops before the first all-to-all and gathers after it (and again around the
    second). Making ``drop_tokens`` / ``gather_tokens`` the identity in
    ``deepspeed.moe.sharded_moe`` during this layer's forward gives 0.8.1's order with the same
    gate, dispatch and experts (the other DeepSpeed layer is untouched: the names are restored
    after the call, and the identity leaves nothing for backward to call). Only the collective
    order is 0.8.1's: the dispatch stays 0.19.8's sparse ``index_select`` encode / decode,
    where 0.8.1 multiplies dense (S, E, C) one-hot tensors (``einsum("sec,sm->ecm")``), which
    on CPU costs far more at large S (docs/benchmarks/parm.md, "DeepSpeed 0.8.1 itself")."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        from deepspeed.moe import sharded_moe
        saved = sharded_moe.drop_tokens, sharded_moe.gather_tokens
        sharded_moe.drop_tokens = sharded_moe.gather_tokens = lambda t, dim=0: t
        try:
            return self.layer(x)
        finally:
            sharded_moe.drop_tokens, sharded_moe.gather_tokens = saved


def ds_step(layer, x: torch.Tensor, topo: Topology) -> float:
    """One forward + backward of DeepSpeed's layer (the loss of moeflow's step_once)."""
    watch = start_aligned(topo, x.device)
    y, l_aux, _ = layer(x)
    (y.square().mean() + 0.01 * l_aux).backward()
    elapsed = slowest(watch.stop(), topo)
    layer.zero_grad(set_to_none=True)
    return elapsed


def compare_outputs(base: MoEConfig, topo: Topology, x: torch.Tensor) -> dict:
    """moeflow baseline vs DeepSpeed at a drop-free factor E / k: max |diff| of y and dL/dx."""
    cfg = base.replace(parallel_schedule="baseline",
                       capacity_factor=base.num_experts / base.top_k)
    ref = MoELayer(cfg, topo).to(x.device)
    ds = build_deepspeed_layer(ref, topo).to(x.device)
    xa = x.clone().requires_grad_()
    ya = ref(xa)
    ya.square().mean().backward()
    got = {"capacity_factor": cfg.capacity_factor,
           "second_expert_noise": ("off: top2_2nd_expert_sampling=False" if has_sampling_switch()
                                   else "zeroed: sharded_moe.gumbel_rsample -> zeros")}
    layers = {"deepspeed": ds, ORDER_081: Order081(ds)}
    for name in ds_labels():
        xb = x.clone().requires_grad_()
        with no_second_expert_noise():
            yb, _, _ = layers[name](xb)
        yb.square().mean().backward()
        out = torch.tensor([(ya - yb).abs().max().item(),
                            (xa.grad - xb.grad).abs().max().item(), ya.abs().max().item()])
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        got[name] = {"max_abs_diff_output": out[0].item(),
                     "max_abs_diff_input_grad": out[1].item(), "max_abs_output": out[2].item(),
                     "tolerance": TOLERANCE,
                     "agrees": bool(out[0] <= TOLERANCE * max(1.0, out[2].item())
                                    and out[1] <= TOLERANCE)}
    ref.lane.close()
    return got


def auto_choice(layer) -> str:
    """Algorithm 1's own choice (the prediction alone) at ``layer``'s last call
    (``parallel_schedule="auto"``); "baseline" where the layout runs no paused-MP schedule
    (no MP / ESP). With the measured confirmation (``MoEConfig.parm_auto_measure``) the
    schedule the layer ran is its ``choice_record()["auto_confirmed"]``."""
    parts = layer.strategy.parts
    if parts is None:
        return "baseline"
    if parts.auto is None or parts.auto.last is None:
        raise ValueError("auto_choice: the layer is not parallel_schedule='auto' or has not run")
    return parts.auto.last.schedule


def compare_worker(opts: dict) -> dict:
    world = Topology.from_env()
    device = resolve_device(opts.get("device", "cpu"))
    mp, esp = LAYOUT["mp"], LAYOUT["esp"]
    ep = ep_for_world(world.world_size)
    topo = Topology.from_env(ep_size=ep, mp_size=mp, esp_size=esp, esp_in_node=True)
    fits = measure_parm_fits(topo, device=device)
    use_fits(topo, fits)
    import deepspeed

    rows, checks = [], []
    for tokens in opts["tokens"]:
        M = opts["d_model"]
        padding = opts.get("capacity_padding")      # None: the config's default
        base = MoEConfig(d_model=M, d_expert=2 * M, num_experts=ep * opts["experts_per_ep"],
                         top_k=opts["top_k"], capacity_factor=1.0, seed=1,
                         **({} if padding is None else {"capacity_padding": padding}))
        gen = torch.Generator().manual_seed(4000 + topo.rank // mp)   # MP ranks: same tokens
        x = torch.randn(tokens, M, generator=gen).to(device)
        checks.append({"tokens_per_rank": tokens, **compare_outputs(base, topo, x)})
        for f in opts["capacity_factors"]:
            cfg = base.replace(capacity_factor=f)
            dsl = ds_labels()
            labels = dsl + [v for v, _ in MOEFLOW_VARIANTS]
            layers = [MoELayer(cfg.replace(**v), topo).to(device) for _, v in MOEFLOW_VARIANTS]
            ds = build_deepspeed_layer(layers[0], topo).to(device)
            times: list[list[float]] = [[] for _ in labels]
            for i in range(opts["warmup"] + opts["reps"]):       # round-robin, interleaved
                got = ([ds_step(ds if v == "deepspeed" else Order081(ds), x, topo) for v in dsl]
                       + [step_once(l, x, topo) for l in layers])
                if i >= opts["warmup"]:
                    for ts, t in zip(times, got):
                        ts.append(t)
            auto_layer = layers[labels.index("auto") - len(dsl)]
            chosen = auto_choice(auto_layer)
            # the schedule it ran after the measured confirmation, the confirmation's median
            # step per candidate (ms), wall time (s) and what the budget left unmeasured
            confirmed = auto_layer.strategy.choice_record()
            trimmed = {v: bool(l.stats["parm_trimmed"]) for (v, _), l
                       in zip(MOEFLOW_VARIANTS, layers) if "parm_trimmed" in l.stats}
            for layer in layers:
                layer.lane.close()
            med = {v: 1e3 * statistics.median(ts) for v, ts in zip(labels, times)}
            rows.append({"n_mp": mp, "n_ep": ep, "n_esp": esp, "tokens_per_rank": tokens,
                         "d_model": M, "d_expert": 2 * M, "num_experts": cfg.num_experts,
                         "top_k": cfg.top_k, "capacity_factor": f, "auto_choice": chosen,
                         **{k: v for k, v in confirmed.items() if k != "auto_algorithm1"},
                         "capacity_padding": cfg.capacity_padding, "trimmed": trimmed,
                         "step_ms": med,
                         "speedup_over_deepspeed": {v: med["deepspeed"] / med[v] for v in labels},
                         "samples_ms": {v: [1e3 * t for t in ts]
                                        for v, ts in zip(labels, times)}})
    return {"topology": repr(topo), "deepspeed_version": deepspeed.__version__,
            "capacity_padding": base.capacity_padding,
            "deepspeed_labels": ds_labels(),
            "deepspeed_drops_mp_duplicates": drops_mp_duplicates(),
            "numpy_version": __import__("numpy").__version__,
            "torch_version": torch.__version__, "fits": fits.to_json(),
            "numeric_check": checks, "rows": rows}


def format_compare(res: dict) -> str:
    dsl = res.get("deepspeed_labels", ["deepspeed", ORDER_081])
    labels = dsl + [v for v, _ in MOEFLOW_VARIANTS]
    short = short_names(res["deepspeed_version"])
    trimmed = trimmed_variants(res)
    lines = [f"{res['topology']}  deepspeed {res['deepspeed_version']}  moeflow "
             f"capacity_padding={res.get('capacity_padding', '- (Parm padded)')}"
             + (f" (trimmed: {','.join(trimmed)})" if trimmed else ""),
             f"{'BL':>5} {'f':>5} " + " ".join(f"{short.get(v, v):>12}" for v in labels)
             + f"   speedup over {short['deepspeed']}: "
             + " ".join(short.get(v, v) for v in labels[1:]), "-" * 140]
    for r in res["rows"]:
        t, s = r["step_ms"], r["speedup_over_deepspeed"]
        lines.append(f"{r['tokens_per_rank']:>5} {r['capacity_factor']:>5} "
                     + " ".join(f"{t[v]:>12.1f}" for v in labels) + "   "
                     + " ".join(f"{s[v]:.2f}x" for v in labels[1:])
                     + f"   Algorithm 1 took {r.get('auto_choice', '-')}"
                     + (f", auto ran {r['auto_confirmed']} (measured ms: "
                        + ", ".join(f"{c} {t:.0f}" for c, t in r["auto_measured_ms"].items())
                        + ")" if r.get("auto_confirmed") else ""))
    lines.append("step ms: median forward + backward, slowest rank; Algorithm 1 took: its "
                 "prediction's schedule for the case (- in results recorded before it was "
                 "kept); auto ran: the schedule after its measured confirmation")
    if ORDER_081 in dsl:
        lines.append(f"{ORDER_081}: the {res['deepspeed_version']} layer with its MP drop/gather "
                     "off (0.8.1's order for tensor-parallel experts, emulated)")
    else:
        lines.append(f"deepspeed {res['deepspeed_version']}: no MP collective with tensor-parallel "
                     "experts (0.8.1's order, run); timed with its Gumbel noise on the 2nd expert")
    for c in res["numeric_check"]:
        for name in dsl:
            d = c[name]
            lines.append(f"numeric check BL={c['tokens_per_rank']} f={c['capacity_factor']} "
                         f"(drop-free) baseline vs {name}: max|y diff| "
                         f"{d['max_abs_diff_output']:.2e} (max|y| {d['max_abs_output']:.2e}), "
                         f"max|dx diff| {d['max_abs_diff_input_grad']:.2e}: "
                         + ("AGREE" if d["agrees"] else "DIFFER")
                         + f" (tolerance {d['tolerance']:g}; 2nd-expert noise "
                         + c.get("second_expert_noise", "off") + ")")
    return "\n".join(lines)
