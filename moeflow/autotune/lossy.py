"""The error of each lossy codec, for ``MoEConfig(codec="auto:lossy")`` (ScheMoE section 3.1).

ScheMoE (section 3.1) lets the compressor trade accuracy for bytes on the wire; moeflow only
lets the tuner make that trade when asked to, within ``lossy_error_budget``. The error of a
codec is measured, not assumed: on the tuning batch, with the layer's own weights, one forward
+ backward with the lossless exchange (codec ``none``) gives the reference output ``y0`` and
input gradient ``dx0`` (the backward's incoming gradient is ``y0`` itself, so every codec is
differentiated against the same cotangent); each candidate codec runs the same step from the
same random state. Its error is

    max( ||y - y0|| / ||y0||,  ||dx - dx0|| / ||dx0|| )      (relative L2, per rank)

maximised over every rank (one host all-reduce per codec), so all ranks hold the same numbers
and keep the same codecs. The tuner runs these probe steps as the warm-up steps of its screen
(:class:`ErrorProbe`), so measuring the errors costs no step of its own. The router runs
before the exchange, so the routing is the same for every codec; what differs is only what
the codec did to the payload (and, with ``codec_backward=True``, to the gradients on their
way back). The all-to-all algorithms move the encoded payloads exactly, so the error does
not depend on the algorithm it was probed with.
"""

from __future__ import annotations

import math

import torch

from moeflow.autotune.settings import apply
from moeflow.config import MoEConfig


# Registered codecs that only re-implement another one for reference: "zfpy" is LLNL's zfp on
# CPU, the same payload bytes as "zfp" and slower; the tuner does not spend steps on it.
REFERENCE_ONLY = ("zfpy",)


def lossy_candidates(dtype: torch.dtype, device: torch.device) -> list[str]:
    """Every registered lossy codec that takes ``dtype`` payloads on ``device`` (but for
    ``REFERENCE_ONLY`` ones)."""
    from moeflow.comm.codecs import CODECS

    out = []
    for name, cls in sorted(CODECS.items()):
        codec = cls()
        if name not in REFERENCE_ONLY and not codec.lossless and codec.supports(dtype, device):
            out.append(name)
    return out


def gentlest_first(names: list[str], cols: int, dtype: torch.dtype) -> list[str]:
    """``names`` with the most wire bytes per row first (ties by name): the order in which
    the tuner screens them. The codecs that compress least are the most accurate, so the
    most likely to be within the error budget; under a time budget that cuts the screen
    short, the probes it can afford go to them rather than to codecs likely to be refused."""
    from moeflow.comm.codecs import CODECS

    return sorted(names, key=lambda n: (-CODECS[n]().wire_bytes(1, cols, dtype), n))


def _relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    diff = float((a.double() - ref.double()).norm())
    norm = float(ref.double().norm())
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


class ErrorProbe:
    """One forward + backward per codec that measures its error (see the module docstring);
    the tuner runs these as the warm-up steps of its screen, so the errors cost no extra
    steps. :meth:`reference` must run first, with the lossless codec applied to the layer;
    :meth:`error` then with the codec to measure applied. Both are collective."""

    def __init__(self, layer, x: torch.Tensor):
        self.layer, self.x = layer, x.detach()
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.ref = None

    def _run(self, cotangent: torch.Tensor | None):
        torch.set_rng_state(self.cpu_rng)              # e.g. gate noise: the same draws
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        xi = self.x.clone().requires_grad_(True)
        y = self.layer(xi)
        g = y.detach().clone() if cotangent is None else cotangent
        y.backward(g)
        self.layer.zero_grad(set_to_none=True)
        return y.detach(), xi.grad, g

    def reference(self) -> None:
        if not self.layer.codec.lossless:
            raise ValueError(f"ErrorProbe.reference needs the lossless codec applied, not "
                             f"{self.layer.cfg.codec!r}")
        self.ref = self._run(None)

    def local_error(self) -> float:
        y0, dx0, g = self.ref
        y, dx, _ = self._run(g)
        return max(_relative(y, y0), _relative(dx, dx0))

    def error(self) -> float:
        """The applied codec's error, the worst rank's (the same number on every rank)."""
        from moeflow.devices import host_all_reduce

        return host_all_reduce([self.local_error()], "max", self.layer.topo.world_group)[0]


def codec_errors(layer, base: MoEConfig, x: torch.Tensor, codecs: list[str]) -> dict[str, float]:
    """The error of each codec of ``codecs`` (see the module docstring), one probe step each
    after the lossless reference; collective over the layer's ranks. ``base`` is the concrete
    config to run with (its codec is replaced); the caller restores the layer's state
    (moeflow.autotune.settings._Preserved)."""
    probe = ErrorProbe(layer, x)
    apply(layer, base.replace(codec="none"))
    probe.reference()
    out = {}
    for name in codecs:
        apply(layer, base.replace(codec=name))
        out[name] = probe.error()
    return out
