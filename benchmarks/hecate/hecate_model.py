"""Whole-model HECATE measurements: a GPT of several MoE layers under skewed expert loads,
trained under EP or FSSDP variants (HECATE Sections 3.2, 4.2 and 5.3-5.4). Shared by
``moeflow bench hecate-fit`` (peak memory per rank and the largest batch under a budget,
:mod:`benchmarks.hecate.hecate_fit`, a Fig. 13 / Fig. 14 analog) and ``moeflow bench hecate-model``
(interleaved step times with the chosen ``P'`` of every layer, :func:`time_worker`).

* **Modes** (:func:`parse_mode`): ``ep``; ``fssdp:static``; ``fssdp:t=T,m=M`` (Algorithm 1 with
  ``t`` and ``m`` as counts); ``fssdp:t=T,budget=B`` (``m`` from a per-layer byte budget,
  ``fssdp.memory_budget_bytes``, Section 4.2's memory capacity; ``B`` in bytes, or with a
  ``k`` / ``M`` suffix for KiB / MiB); ``,cal`` adds calibration after the gate, ``,rm``
  re-materialization (HECATE-RM).
* **Skew**: every MoE layer's router gets a fixed logit bias ``-s * log(rank_e)`` (``rank_e``
  the expert's popularity rank, a per-layer shuffle; ``router_options={"bias": True}``, the
  bias frozen), so the router favours expert ``e`` by ``rank_e^-s``; the measured tokens per
  rank are reported, not assumed. Dropless routing, so an overloaded rank really computes
  (and stores activations for) its extra tokens, as in HECATE's dynamic batch sizes.
* **A step** (:func:`train_step`): forward (cross-entropy + the layers' auxiliary loss),
  backward, ``sync_gradients``, AdamW (``moeflow.trainer.make_optimizer``), gradients set to
  None; the materialized experts still held at the end of the forward are counted
  (:class:`~benchmarks.hecate.hecate_memory.MaterializedProbe`: a HECATE-RM layer's freed ones
  count 0 bytes).
"""

from __future__ import annotations

import statistics

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.hecate.hecate_memory import MaterializedProbe, state_bytes
from moeflow.config import ModelConfig, TrainConfig, model_preset
from moeflow.measure.timing import slowest, start_aligned
from moeflow.models.gpt import GPT
from moeflow.parallel.grad_sync import sync_gradients
from moeflow.strategies.fssdp.layer_experts import FSSDPExperts
from moeflow.topology import Topology
from moeflow.trainer import make_optimizer


def _bytes(text: str) -> int:
    mult = {"k": 1 << 10, "K": 1 << 10, "m": 1 << 20, "M": 1 << 20}
    if text and text[-1] in mult:
        return int(float(text[:-1]) * mult[text[-1]])
    return int(float(text))


def parse_mode(spec: str) -> dict:
    """A mode spec -> ``{"placement": ..., "fssdp": {...}}`` overrides of the MoEConfig
    (module docstring); raises ValueError naming the spec and the fix."""
    if spec == "ep":
        return {"placement": "ep"}
    head, _, rest = spec.partition(":")
    if head != "fssdp" or not rest:
        raise ValueError(f"mode {spec!r}: use 'ep', 'fssdp:static' or 'fssdp:t=T,m=M|budget=B"
                         "[,cal][,rm]'")
    fssdp: dict = {}
    for part in rest.split(","):
        key, eq, val = part.partition("=")
        if key == "static" and not eq:
            fssdp["materialize"] = "static"
        elif key in ("cal", "rm") and not eq:
            fssdp["calibrate" if key == "cal" else "rematerialize"] = True
        elif key == "t" and eq:
            fssdp.update(materialize="sparse", overlap_degree=int(val))
        elif key == "m" and eq:
            fssdp["memory_capacity"] = int(val)
        elif key == "budget" and eq:
            fssdp["memory_budget_bytes"] = _bytes(val)
        else:
            raise ValueError(f"mode {spec!r}: unknown part {part!r}; parts are static, t=T, "
                             "m=M, budget=BYTES (k/M suffix), cal, rm")
    if fssdp.get("calibrate"):
        # calibration compares the extra spAG's time with the load it removes; with t given
        # as a count no link was measured, so the extra spAG is costed at 1 Gbit/s
        fssdp.setdefault("bandwidth_Bps", 125e6)
    return {"placement": "fssdp", "fssdp": fssdp}


def model_config(preset: str, overrides: dict, mode: str) -> ModelConfig:
    """The preset with the overrides, dropless, a frozen-bias router (the skew), and the
    mode's placement."""
    base = dict(capacity_factor=None, router_options={"bias": True})
    moe = {**base, **overrides.get("moe", {}), **parse_mode(mode)}
    return model_preset(preset, **{**overrides, "moe": moe})


def skew(model: GPT, s: float) -> None:
    """Each MoE layer's router bias := ``-s * log(rank_e)`` (a per-layer shuffle of the
    popularity ranks), frozen (no gradient, so the optimizer leaves it)."""
    for i, layer in enumerate(model.moe_layers()):
        E = layer.cfg.num_experts
        ranks = np.random.default_rng(100 + i).permutation(E) + 1
        with torch.no_grad():
            layer.router.bias.copy_(torch.tensor(-s * np.log(ranks), dtype=torch.float32))
        layer.router.bias.requires_grad_(False)


def build(preset: str, overrides: dict, mode: str, s: float, topo: Topology):
    """(model, optimizer) of one mode; the same weights in every mode (seeded by name)."""
    model = GPT(model_config(preset, overrides, mode), topo)
    skew(model, s)
    return model, make_optimizer(model, TrainConfig(lr=1e-4, warmup_steps=0))


def batch(model: GPT, size: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random byte sequences (seeded by rank and step): ``size`` x ``seq_len`` tokens."""
    gen = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randint(0, model.cfg.vocab_size, (size, model.cfg.seq_len + 1), generator=gen)
    return x[:, :-1], x[:, 1:]


def _route_counts(model: GPT) -> tuple[list, list]:
    """Forward hooks recording each MoE layer's per-expert counts of this rank's tokens."""
    counts: list = [None] * len(model.moe_layers())
    handles = []
    for i, layer in enumerate(model.moe_layers()):
        def hook(_mod, _inp, out, i=i, E=layer.cfg.num_experts):
            counts[i] = torch.bincount(out.experts.reshape(-1), minlength=E).to(torch.float64)
        handles.append(layer.router.register_forward_hook(hook))
    return counts, handles


def rank_tokens(model: GPT, counts: list, topo: Topology) -> list[list[int]]:
    """Tokens each rank computed in each MoE layer: FSSDP's measured loads, or for EP the
    global per-expert counts (one all-reduce) summed over each rank's contiguous experts."""
    layers = model.moe_layers()
    if all(isinstance(m.experts, FSSDPExperts) for m in layers):
        return [[int(n) for n in m.experts.last_loads] for m in layers]
    c = torch.stack(counts)
    if topo.distributed:
        dist.all_reduce(c, group=topo.world_group)
    per = c.shape[1] // topo.world_size
    return [[int(x) for x in row.reshape(topo.world_size, per).sum(1)] for row in c]


def train_step(model: GPT, opt, size: int, topo: Topology, step: int,
               measure: bool = False, after_forward=None) -> dict:
    """One training step on ``size`` sequences per rank. With ``measure``: this rank's counted
    bytes of the materialized experts held at the end of the forward and, after the step, of
    the parameters, gradients and optimizer state, and every layer's tokens per rank;
    ``after_forward()`` (a dict) is called between the forward and the backward. Nothing here
    changes what the step keeps (no saved-tensor hooks: with them the experts would save only
    their inputs and recompute, ``moeflow.schedule.pipeline``)."""
    x, y = batch(model, size, topo.rank, step)
    rec: dict = {}
    if not measure:
        _, ce = model(x, y)
        (ce + model.aux_loss).backward()
    else:
        probes = [MaterializedProbe(m.experts) for m in model.moe_layers()]
        counts, handles = _route_counts(model)
        _, ce = model(x, y)
        loss = ce + model.aux_loss
        if after_forward is not None:
            rec.update(after_forward())
        rec["materialized_held"] = sum(p.held_bytes() for p in probes)
        loss.backward()
        for h in handles:
            h.remove()
        for p in probes:                 # the probes wrap each layer's end hook: unwrap
            if p.experts is not None:
                del p.experts.end
    sync_gradients(model, topo)
    opt.step()
    if measure:
        rec.update(state_bytes(model, opt))
        rec["tokens_per_rank"] = rank_tokens(model, counts, topo)
    opt.zero_grad(set_to_none=True)
    return rec


def placements(model: GPT) -> list[dict]:
    """Every FSSDP layer's last ``P'``: owners, the replicas (expert -> ranks holding it
    without owning it), Algorithm 1's branch, the agreed ``m``, ``t`` and calibrations."""
    out = []
    for i, layer in enumerate(model.moe_layers()):
        ex = layer.experts
        if not isinstance(ex, FSSDPExperts):
            continue
        p = ex.last_placement
        st = ex.stats()
        out.append({"layer": i, "owners": list(p.owners),
                    "replicas": {int(e): sorted(set(h) - {p.owners[e]})
                                 for e, h in enumerate(p.holders) if len(h) > 1},
                    "branch": getattr(ex, "last_branch", None),
                    "t": getattr(ex, "last_t", None), "m": ex.memory_capacity,
                    "calibrated": ex.calibrated,
                    "spag_bytes_all_ranks": st.get("spag_bytes_all_ranks", 0.0),
                    "sprs_bytes_all_ranks": st.get("sprs_bytes_all_ranks", 0.0)})
    return out


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def time_worker(opts: dict) -> dict:
    """``moeflow bench hecate-model``: every mode's model built in this process, one training
    step of each in turn (round-robin, ranks aligned, the slowest rank's time), ``warmup``
    untimed rounds first; then one measured step per mode for the tokens per rank, the
    counted bytes and the chosen ``P'``."""
    topo = Topology.from_env()
    torch.manual_seed(0)
    models = [build(opts["preset"], opts["overrides"], m, opts["zipf"], topo)
              for m in opts["modes"]]
    times: list[list[float]] = [[] for _ in models]
    for i in range(opts["warmup"] + opts["reps"]):
        for (model, opt), ts in zip(models, times):
            watch = start_aligned(topo, torch.device("cpu"))
            train_step(model, opt, opts["batch"], topo, i)
            t = slowest(watch.stop(), topo)
            if i >= opts["warmup"]:
                ts.append(t)
    rows = []
    step = opts["warmup"] + opts["reps"]
    for mode, (model, opt), ts in zip(opts["modes"], models, times):
        rec = train_step(model, opt, opts["batch"], topo, step, measure=True)
        tokens = rec.pop("tokens_per_rank")
        every = [rec]
        if topo.distributed:
            every = [None] * topo.world_size
            dist.all_gather_object(every, rec, group=topo.world_group)
        rows.append({"mode": mode, "step_ms": [1e3 * t for t in ts],
                     "step_ms_spread": _spread([1e3 * t for t in ts]),
                     "tokens_per_rank": tokens,
                     "max_over_mean": [max(r) / (sum(r) / len(r)) for r in tokens],
                     "bytes_per_rank": {k: [r[k] for r in every] for k in rec},
                     "placements": placements(model)})
    ep = [r for r in rows if r["mode"] == "ep"]
    if ep:                                 # paired by round: EP's step over the mode's
        for r in rows:
            ratios = [a / b for a, b in zip(ep[0]["step_ms"], r["step_ms"])]
            r["ep_over_mode"] = _spread(ratios)
    for model, _ in models:
        for m in model.moe_layers():
            m.lane.close()
    return {"topology": repr(topo), "options": opts, "rows": rows}


def format_placements(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        for p in r.get("placements", []):
            reps = " ".join(f"e{e}->{','.join(map(str, d))}" for e, d in p["replicas"].items())
            lines.append(f"  {r['mode']:<34} layer {p['layer']}: branch {p['branch']}, t "
                         f"{p['t']}, m {p['m']}, calibrated {p['calibrated']}; replicas "
                         f"{reps or '-'}")
    return lines


def format_time(res: dict) -> str:
    lines = [res["topology"],
             f"{'mode':<34} {'ms/step min/med/max':>24} {'EP/mode med [min,max]':>24} "
             f"{'max/mean per layer':>26}", "-" * 112]
    for r in res["rows"]:
        s = r["step_ms_spread"]
        ratio = r.get("ep_over_mode")
        rt = (f"{ratio['median']:.2f} [{ratio['min']:.2f},{ratio['max']:.2f}]" if ratio
              else "-")
        mm = " ".join(f"{v:.2f}" for v in r["max_over_mean"])
        lines.append(f"{r['mode']:<34} {s['min']:>7.0f}/{s['median']:>6.0f}/{s['max']:>7.0f}"
                     f"   {rt:>24} {mm:>26}")
    return "\n".join(lines + ["P' (last step):"] + format_placements(res["rows"]))


__all__ = ["build", "format_placements", "format_time", "model_config", "parse_mode",
           "placements", "skew", "time_worker", "train_step"]
