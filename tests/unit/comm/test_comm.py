"""The differentiable exchange and user-registered parts plugged into the layer."""

from __future__ import annotations

import pytest
import torch

import moeflow as mf
from moeflow.comm.codecs import CODECS


def test_none_codec_wire_size():
    assert CODECS["none"]().wire_bytes(10, 4, torch.float32) == 160


def test_user_registered_codec_runs_in_the_layer():
    calls = []

    @mf.register_codec("test-halves")
    class Halves(mf.Codec):
        def encode(self, x):
            calls.append(x.shape)
            return [x.half()]

        def decode(self, payloads, dtype):
            return payloads[0].to(dtype)

        def wire_bytes(self, rows, cols, dtype):
            return 2 * rows * cols

    cfg = mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, codec="test-halves")
    layer = mf.MoELayer(cfg)
    x = torch.randn(6, 8, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert len(calls) == 2 and x.grad is not None         # dispatch and combine, forward only
    ref = mf.MoELayer(cfg.replace(codec="none"))
    torch.testing.assert_close(y, ref(x), atol=2e-2, rtol=2e-2)
    calls.clear()
    both = mf.MoELayer(cfg.replace(codec_backward=True))
    both(x).sum().backward()
    assert len(calls) == 4                                # and the two backward exchanges


def test_registry_rejects_wrong_types_and_taken_names():
    with pytest.raises(TypeError, match="must subclass"):
        mf.register_codec("bad")(int)
    with pytest.raises(ValueError, match="already taken"):
        @mf.register_alltoall("direct")
        class Other(mf.AllToAll):
            def start(self, x, send_splits, recv_splits, matrix=None):
                raise NotImplementedError


def test_layer_copies_and_pickles_after_a_forward():
    import copy
    import pickle

    layer = mf.MoELayer(mf.MoEConfig(d_model=8, d_expert=8, num_experts=2, schedule="optsche",
                                     pipeline_degree=2))
    x = torch.randn(4, 8)
    y = layer(x)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        torch.testing.assert_close(clone(x), y)
    assert layer.aux_loss is not None
