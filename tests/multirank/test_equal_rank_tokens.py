"""``MoEConfig.equal_rank_tokens`` on 2 gloo ranks (docs/gpu.md, "CUDA-path review"): capacity
mode's gather of every rank's ``C_p`` (GShard section 2.2, ``moeflow/dispatch/plan.py``) and
Parm ``auto``'s all-reduce of its Algorithm 1 predictions (Parm Section V-B) run once per
distinct call key instead of on every forward, the outputs stay bit-for-bit those of the layer
without the promise (float64), the trimmed-capacity path (data-dependent counts) still gathers
on every call, and a broken promise raises a ConfigError naming the field on every rank."""

from __future__ import annotations

import importlib

import pytest
import torch

from moeflow import Topology
from moeflow.launch import launch_local
from moeflow.measure.linkmodel import AlphaBeta
from moeflow.strategies.parm.fits import ParmFits
from tests.helpers.parity import D_MODEL

WORLD = 2
SIZES = (8, 8, 8, 5, 8, 5)          # tokens of the successive forwards (equal on both ranks)


class Counter:
    """Wraps a module's collective helper and counts its calls."""

    def __init__(self, module, name: str):
        self.module, self.name, self.calls = module, name, 0
        self.real = getattr(module, name)

    def __enter__(self):
        def counted(*args, **kwargs):
            self.calls += 1
            return self.real(*args, **kwargs)
        setattr(self.module, self.name, counted)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.real)


def _forwards(layer, rank: int, sizes) -> list[torch.Tensor]:
    from moeflow.init import seeded_normal
    out = []
    for i, t in enumerate(sizes):
        x = seeded_normal((t, D_MODEL), 1.0, "x", i, rank, dtype=torch.float64)
        x.requires_grad_()
        y = layer(x)
        (y * y).sum().backward()
        out += [y.detach(), x.grad]
    return out


def _ep_runs(topo) -> dict:
    from tests.helpers import parity
    plan = importlib.import_module("moeflow.dispatch.plan")
    out = {}
    for padding in ("pad", "trim"):
        for equal in (False, True):
            layer = parity.make_layer("capacity_k2", topo, capacity_padding=padding,
                                      equal_rank_tokens=equal)
            with Counter(plan, "gather_host_ints") as c:
                ys = _forwards(layer, topo.rank, SIZES)
            out[padding, equal] = (c.calls, ys)
    return out


def _parm_runs(topo) -> dict:
    from tests.helpers import parity
    plan = importlib.import_module("moeflow.dispatch.plan")
    algorithm1 = importlib.import_module("moeflow.strategies.parm.algorithm1")
    cheap, dear = AlphaBeta(1e-6, 1e-12), AlphaBeta(1e-3, 1e-6)
    out = {}
    for equal in (False, True):
        layer = parity.make_layer("capacity_k2", topo, parallel_schedule="auto",
                                  equal_rank_tokens=equal, parm_auto_measure=False)
        layer.strategy.parts.auto.fits = ParmFits(ag_mp=dear, a2a=cheap, overlap=cheap)     # S2
        with Counter(algorithm1, "host_all_reduce") as r, Counter(plan, "gather_host_ints") as g:
            ys = _forwards(layer, 0, SIZES)      # MP ranks hold the same (replicated) batch
        out[equal] = (r.calls, g.calls, ys, layer.strategy.parts.auto.last.schedule)
    return out


def _broken_promise(topo, parm: bool) -> str:
    from tests.helpers import parity
    kw = (dict(parallel_schedule="auto", parm_auto_measure=False) if parm
          else dict(capacity_padding="pad"))
    layer = parity.make_layer("capacity_k2", topo, equal_rank_tokens=True, **kw)
    if parm:
        layer.strategy.parts.auto.fits = ParmFits(*(AlphaBeta(1e-6, 1e-9),) * 3)
    try:
        _forwards(layer, topo.rank, [8 - 2 * topo.rank])      # 8 and 6 tokens
    except Exception as e:                                     # noqa: BLE001 (reported)
        return f"{type(e).__name__}: {e}"
    return "no error"


def worker() -> dict:
    ep = Topology.from_env(ep_size=2)
    mp = Topology.from_env(ep_size=1, mp_size=2, local_size=2)     # Parm S1 / S2 / auto
    esp = Topology.from_env(ep_size=1, esp_size=2, local_size=2)
    return {"ep": _ep_runs(ep), "parm": _parm_runs(mp),
            "broken_ep": _broken_promise(ep, parm=False),
            "broken_parm": _broken_promise(esp, parm=True)}


@pytest.fixture(scope="module")
def results():
    return launch_local(worker, WORLD, timeout_s=300, threads=1)


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.multirank
def test_capacity_gathers_once_per_token_count(results):
    for rank, got in results.items():
        plain, promised = got["ep"]["pad", False], got["ep"]["pad", True]
        assert plain[0] == len(SIZES), rank                     # one gather per forward
        assert promised[0] == len(set(SIZES)), rank             # one per distinct count
        assert _same(plain[1], promised[1]), rank               # outputs and input grads


@pytest.mark.multirank
def test_trimmed_capacity_still_gathers_every_call(results):
    for rank, got in results.items():
        plain, promised = got["ep"]["trim", False], got["ep"]["trim", True]
        assert plain[0] == promised[0] == len(SIZES), rank
        assert _same(plain[1], promised[1]), rank
        assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12)      # trim = pad (function)
                   for a, b in zip(plain[1], got["ep"]["pad", False][1])), rank


@pytest.mark.multirank
def test_parm_auto_agrees_once_per_key(results):
    for rank, got in results.items():
        plain, promised = got["parm"][False], got["parm"][True]
        assert plain[0] == len(SIZES) and promised[0] == len(set(SIZES)), rank
        # the EP&ESP block's C_p gather too (ep_esp.block_counts)
        assert plain[1] == len(SIZES) and promised[1] == len(set(SIZES)), rank
        assert plain[3] == promised[3] == "s2", rank
        assert _same(plain[2], promised[2]), rank


@pytest.mark.multirank
@pytest.mark.parametrize("where", ["broken_ep", "broken_parm"])
def test_broken_promise_raises_on_every_rank(results, where):
    for rank, got in results.items():
        msg = got[where]
        assert msg.startswith("ConfigError") and "equal_rank_tokens=True" in msg, (rank, msg)
        assert "[8, 6]" in msg or "from 6 to 8" in msg, (rank, msg)


def test_equal_rank_tokens_is_validated():
    from moeflow.config import ConfigError, MoEConfig
    with pytest.raises(ConfigError, match="equal_rank_tokens"):
        MoEConfig(d_model=8, d_expert=8, num_experts=4, equal_rank_tokens=1)


def test_trainer_declares_fixed_shape_batches():
    from moeflow.config import model_preset
    from moeflow.trainer import fixed_shape_batches
    cfg = model_preset("tiny")
    built = fixed_shape_batches(cfg)
    assert built.moe_config(1).equal_rank_tokens and not cfg.moe_config(1).equal_rank_tokens
    off = model_preset("tiny", moe={"equal_rank_tokens": False})
    assert not fixed_shape_batches(off).moe_config(1).equal_rank_tokens      # the user's
