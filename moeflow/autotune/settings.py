"""Applying a concrete setting to a layer while the tuner measures it, and putting back what a
tuning run must not change (ScheMoE section 3.2: the profiler times candidate settings on the
running layer). Shared by the tuner (:mod:`moeflow.autotune.tuner`) and the lossy codecs'
error probe (:mod:`moeflow.autotune.lossy`), below both."""

from __future__ import annotations

import torch

from moeflow.config import MoEConfig


class _Preserved:
    """Save and restore what a tuning run must not change: gradients, RNG states, the
    layer's timer / timeline, its last forward's aux_loss and stats, and the settings in
    force (strategy included) until the tuner fixes its choice."""

    def __init__(self, layer):
        self.layer = layer

    def __enter__(self):
        L = self.layer
        self.grads = {id(p): p.grad for p in L.parameters()}
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.state = (L.cfg, L.algo, L.strategy, L.scheduler, L.codec, L.backward_codec,
                      L.timer, L.timeline, L.aux_loss, dict(L._stats))
        L.timer, L.timeline = None, None
        return self

    def __exit__(self, *exc):
        L = self.layer
        for p in L.parameters():
            p.grad = self.grads.get(id(p))
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        (L.cfg, L.algo, L.strategy, L.scheduler, L.codec, L.backward_codec, L.timer,
         L.timeline, L.aux_loss, stats) = self.state
        L._stats = stats
        return False


def apply(layer, cfg: MoEConfig) -> None:
    """Run ``layer`` with the concrete settings of ``cfg`` (algorithm, scheduler and codecs
    rebuilt only when they change; the codecs as ``MoELayer.__init__`` builds them). A new
    ``placement`` (``MoEConfig(placement="auto")``: one of ``AUTO_PLACEMENTS``) replaces the
    layer's strategy object; its experts stay, since every such strategy holds the same whole
    experts on the same ranks (``ExpertStrategy.build_experts``), so parameters, optimizer
    state and checkpoints are those of either."""
    from moeflow.comm.alltoall import ALLTOALLS
    from moeflow.comm.codecs import CODECS
    from moeflow.schedule import SCHEDULERS
    from moeflow.strategies import strategy_for

    if cfg.placement != layer.cfg.placement:
        layer.strategy = strategy_for(cfg, layer.topo)(layer)

    if (cfg.codec, cfg.codec_backward) != (layer.cfg.codec, layer.cfg.codec_backward):
        layer.codec = CODECS[cfg.codec]()
        layer.backward_codec = layer.codec if cfg.codec_backward else CODECS["none"]()
    if cfg.a2a != layer.cfg.a2a:
        layer.algo = ALLTOALLS[cfg.a2a](layer.topo)
    if cfg.schedule != layer.cfg.schedule:
        layer.scheduler = SCHEDULERS[cfg.schedule]()
    layer.cfg = cfg
