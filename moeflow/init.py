"""Layout-independent parameter initialisation.

A parameter's initial value depends only on the config's seed and its global identity (a tuple
of names and ids such as ``("layer", 3, "expert", 17, "w1")``), never on the number of ranks:
each identity gets its own generator, so rank 5 can create expert 17 without creating 0-16.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*identity) -> int:
    """A 63-bit seed from an identity tuple (stable across processes and Python versions)."""
    digest = hashlib.sha256(repr(identity).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_normal(shape: tuple[int, ...], std: float, *identity,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normal(0, std) values of ``shape`` drawn from the generator of ``identity``, on CPU."""
    gen = torch.Generator().manual_seed(derive_seed(*identity))
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * std).to(dtype)


def seeded_uniform(shape: tuple[int, ...], bound: float, *identity,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uniform(-bound, bound) values of ``shape`` from the generator of ``identity``, on CPU
    (``nn.Linear``'s bias init with ``bound = 1/sqrt(fan_in)``)."""
    gen = torch.Generator().manual_seed(derive_seed(*identity))
    return ((torch.rand(shape, generator=gen, dtype=torch.float32) * 2 - 1) * bound).to(dtype)
