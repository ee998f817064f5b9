"""Rank side of tests/multirank/test_fssdp.py, and the single-process dense reference it is held to.

A toy per-expert computation ``y = gelu(x w1) w2``, loss ``sum(y * c)``, over tokens routed to
experts with skewed counts; each (source rank, expert) token block is computed by the holders
that HECATE's dispatch rule (Section 4.4) picks under the iteration's materialized placement.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from moeflow.init import seeded_normal
from moeflow.strategies.fssdp import Placement, dispatch_plan
from tests.reference.fssdp import ShardedExperts

WORLD, LOCAL, E, D, H = 4, 2, 6, 3, 4
SHAPES = {"w1": (D, H), "w2": (H, D)}
OWNERS = Placement.static([0, 0, 0, 1, 3, 3], WORLD)      # rank 2 owns nothing
HOLDERS = [
    [{0, 2}, {0}, {0, 1, 3}, {1}, {3, 2}, {3}],                # random
    [{0, 1, 2, 3}, {0, 2}, {0}, {1}, {3}, {3, 1}],             # skewed: hot expert 0 everywhere
    [{0}, {0}, {0}, {1}, {3}, {3}],                            # static (EP)
]
STEPS = len(HOLDERS)
LR = 0.05


def init(e, name, shape):
    return seeded_normal(shape, 0.5, "fssdp-test", "expert", e, name, dtype=torch.float64)


def counts(step: int) -> np.ndarray:
    """Tokens rank s routes to expert e at ``step``: Zipf-like skew toward expert ``step``."""
    rng = np.random.default_rng(step)
    weight = 1.0 / (1 + (np.arange(E) - step) % E) ** 1.2
    return rng.poisson(30 * weight, size=(WORLD, E)).astype(np.int64) + 1


def block(step: int, s: int, e: int, n: int):
    x = seeded_normal((n, D), 1.0, "x", step, s, e, dtype=torch.float64)
    c = seeded_normal((n, D), 1.0, "c", step, s, e, dtype=torch.float64)
    return x, c


def expert_loss(p, x, c):
    return (torch.nn.functional.gelu(x @ p["w1"]) @ p["w2"] * c).sum()


def worker() -> dict:
    rank = dist.get_rank()
    mod = ShardedExperts(OWNERS, SHAPES, init, dtype=torch.float64)
    params = list(mod.parameters())
    opt = torch.optim.AdamW(params, lr=LR) if params else None
    out = {"owned": mod.owned(), "n_params": len(params), "steps": [], "computed": []}
    for step in range(STEPS):
        placement = OWNERS.materialize(HOLDERS[step])
        held = mod.materialize(placement)
        cnt = counts(step)
        plan = dispatch_plan(placement, cnt, LOCAL)
        loss, rows = None, 0
        for s in range(WORLD):
            for e in range(E):
                n = int(plan[s, e, rank])
                if n == 0:
                    continue
                start = int(plan[s, e, :rank].sum())
                x, c = block(step, s, e, int(cnt[s, e]))
                term = expert_loss(held[e], x[start:start + n], c[start:start + n])
                loss = term if loss is None else loss + term
                rows += n
        if loss is not None:
            loss.backward()
        mod.reduce_gradients()
        grads = {e: mod.shards[str(e)].grad.clone() for e in mod.owned()}
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
            states = len(opt.state)
        else:
            states = 0
        out["steps"].append(dict(grads=grads, params={e: mod.shards[str(e)].detach().clone()
                                                      for e in mod.owned()},
                                 states=states, bytes=dict(mod.last_bytes)))
        out["computed"].append(rows)
    # errors: owners must match, one materialization at a time
    try:
        mod.materialize(Placement.static([1, 0, 0, 1, 3, 3], WORLD))
        out["wrong_owners"] = "no error"
    except Exception as err:          # noqa: BLE001 (the test checks the type by name)
        out["wrong_owners"] = f"{type(err).__name__}: {err}"
    try:
        mod.reduce_gradients()
        out["no_materialization"] = "no error"
    except Exception as err:          # noqa: BLE001
        out["no_materialization"] = f"{type(err).__name__}: {err}"
    return out


def reference() -> list[dict]:
    """Dense single-process run: every expert one float64 Parameter, every token, AdamW."""
    params = [torch.nn.Parameter(torch.cat([init(e, n, s).reshape(-1)
                                            for n, s in SHAPES.items()])) for e in range(E)]
    opt = torch.optim.AdamW(params, lr=LR)

    def views(flat):
        w1 = flat[:D * H].view(D, H)
        return {"w1": w1, "w2": flat[D * H:].view(H, D)}

    out = []
    for step in range(STEPS):
        cnt = counts(step)
        loss = 0
        for s in range(WORLD):
            for e in range(E):
                x, c = block(step, s, e, int(cnt[s, e]))
                loss = loss + expert_loss(views(params[e]), x, c)
        loss.backward()
        grads = [p.grad.clone() for p in params]
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(dict(grads=grads, params=[p.detach().clone() for p in params]))
    return out
