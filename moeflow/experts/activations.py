"""Expert activations by name: a registry, like routers and codecs.

``MoEConfig.activation`` names a registered :class:`Activation` (``gelu``, ``relu``,
``swiglu``, ``clamped_swiglu``, or one a user registers with
``@moeflow.register_activation("name")``), or any elementwise function of one tensor in
``torch.nn.functional`` (``silu``, ``mish``, ``leaky_relu``, ...; checked by the config).
``MoEConfig.activation_options`` holds the activation's own settings, checked against its
:attr:`Activation.OPTIONS` like ``router_options`` against a router's.

A *gated* activation (``gated = True``) combines two projections of the token: the expert then
holds ``W3`` (and ``b3``) beside ``W1`` and computes ``W2 act(W1 x + b1, W3 x + b3)``.

* ``swiglu``: ``silu(h) * up`` (Shazeer, "GLU Variants Improve Transformer"; Mixtral, Qwen,
  OLMoE, DeepSeek-V3 experts).
* ``clamped_swiglu``: GPT-OSS's gate, as transformers' ``GptOssExperts._apply_gate``:
  ``h = min(h, limit)``, ``up = clamp(up, -limit, limit)``,
  ``(up + 1) * h * sigmoid(alpha * h)``; options ``alpha`` (1.702) and ``limit`` (7.0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeflow.errors import ConfigError
from moeflow.registry import Registry, completed_options


class Activation:
    """``act(h)`` (or ``act(h, up)`` when :attr:`gated`) applied to an expert's hidden units."""

    name: str = "?"
    gated: bool = False
    #: The activation's settings (``MoEConfig.activation_options``) and their defaults.
    OPTIONS: dict = {}

    def __init__(self, **options):
        self.options = {**self.OPTIONS, **options}

    def __call__(self, h: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def check_options(cls, name: str, given: dict | None) -> dict:
        """``given`` completed with :attr:`OPTIONS`' defaults; ConfigError for an unknown name
        or (through :meth:`validate_options`) a bad value."""
        opts = completed_options("activation_options", "activation", name, given, cls.OPTIONS)
        cls.validate_options(opts)
        return opts

    @classmethod
    def validate_options(cls, opts: dict) -> None:
        """Raise ConfigError for an invalid value in ``opts`` (all names known)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options})" if self.options else self.name


ACTIVATIONS = Registry("activation", Activation)
register_activation = ACTIVATIONS.register


@register_activation("gelu")
class GELU(Activation):
    def __call__(self, h, up=None):
        return F.gelu(h)


@register_activation("relu")
class ReLU(Activation):
    def __call__(self, h, up=None):
        return F.relu(h)


@register_activation("swiglu")
class SwiGLU(Activation):
    gated = True

    def __call__(self, h, up=None):
        return F.silu(h) * up


@register_activation("clamped_swiglu")
class ClampedSwiGLU(Activation):
    """GPT-OSS: ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = min(h, l)``."""

    gated = True
    OPTIONS = {"alpha": 1.702, "limit": 7.0}

    @classmethod
    def validate_options(cls, opts: dict) -> None:
        for key in ("alpha", "limit"):
            v = opts[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ConfigError(f"MoEConfig.activation_options[{key!r}]={v!r} is invalid: it "
                                  "must be a number > 0 (GPT-OSS: alpha 1.702, limit 7.0)")

    def __call__(self, h, up=None):
        a, lim = self.options["alpha"], self.options["limit"]
        h = h.clamp(max=lim)
        up = up.clamp(min=-lim, max=lim)
        return (up + 1) * (h * torch.sigmoid(h * a))


class Functional(Activation):
    """An elementwise function of ``torch.nn.functional`` named in the config (not registered:
    the config checks that the name is one, see ``moeflow.config.moe._elementwise_in_F``)."""

    def __init__(self, fn_name: str):
        super().__init__()
        self.name, self.fn = fn_name, getattr(F, fn_name)

    def __call__(self, h, up=None):
        return self.fn(h)


def build_activation(name: str, options: dict | None = None) -> Activation:
    """The activation ``name`` with its options (validated by ``MoEConfig``)."""
    if name in ACTIVATIONS:
        cls = ACTIVATIONS[name]
        return cls(**cls.check_options(name, options))
    if options:
        raise ConfigError(f"MoEConfig.activation_options={options!r} is invalid for activation "
                          f"{name!r} (a torch.nn.functional function takes no options); "
                          "leave activation_options unset")
    return Functional(name)
