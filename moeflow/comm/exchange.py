"""The differentiable all-to-all: codec encode -> algorithm -> codec decode.

Forward moves rows with (send, recv) split sizes; backward is the mirrored exchange of the
gradient with the splits swapped. A codec applies in the forward pass, and in the backward pass
too when ``codec_in_backward`` (ScheMoE section 3.1 discusses compressing both); a lossy codec is
differentiated straight-through (its Jacobian is taken as the identity).
"""

from __future__ import annotations

import torch

from moeflow.comm.alltoall.base import AllToAll
from moeflow.comm.codecs.base import Codec
from moeflow.comm.codecs.none import NoCodec

_IDENTITY = NoCodec()


def coded_exchange(x: torch.Tensor, algo: AllToAll, codec: Codec, send_splits: list[int],
                   recv_splits: list[int]) -> torch.Tensor:
    """Non-differentiable: encode, exchange every payload with the same splits, decode."""
    pending = [algo.start(p, send_splits, recv_splits) for p in codec.encode(x)]
    return codec.decode([p.wait() for p in pending], x.dtype)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, algo, codec, send_splits, recv_splits, codec_in_backward):
        ctx.args = (algo, codec if codec_in_backward else _IDENTITY, send_splits, recv_splits)
        return coded_exchange(x, algo, codec, send_splits, recv_splits)

    @staticmethod
    def backward(ctx, grad):
        algo, codec, send_splits, recv_splits = ctx.args
        return (coded_exchange(grad.contiguous(), algo, codec, recv_splits, send_splits),
                None, None, None, None, None)


def exchange(x: torch.Tensor, algo: AllToAll, codec: Codec, send_splits: list[int],
             recv_splits: list[int], codec_in_backward: bool = False) -> torch.Tensor:
    """Differentiable all-to-all of ``x``'s rows; see the module docstring."""
    return _Exchange.apply(x, algo, codec, list(send_splits), list(recv_splits),
                           codec_in_backward)


def exchange_counts(counts: torch.Tensor, algo: AllToAll) -> torch.Tensor:
    """Send ``counts[j*n:(j+1)*n]`` to rank j; return what every rank sent us, source-major.

    Used before a dropless exchange so every rank knows how many rows it will receive.
    """
    p = algo.topo.ep_size
    n = counts.numel() // p
    return algo.exchange(counts.contiguous(), [n] * p, [n] * p)
