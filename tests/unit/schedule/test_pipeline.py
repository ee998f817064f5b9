"""The scheduled exchange + experts block: payload packing, chunk bookkeeping on the host,
eval without autograd graphs, and non-finite payloads counted instead of raised."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moeflow as mf
from moeflow.comm.codecs import CODECS
from moeflow.schedule.chunks import ChunkPlan, Grouping, block_rows, chunk_counts
from moeflow.schedule.pipeline import _assemble, pack, unpack


@pytest.mark.parametrize("codec", ["none", "int8", "fp8", "fp8-row", "zfp"])
def test_payloads_pack_into_one_tensor_and_back(codec):
    c = CODECS[codec]()
    x = torch.randn(7, 24)
    payloads = c.encode(x)
    buf, layout = pack(payloads)
    assert buf.shape[0] == 7 and (layout is None) == (len(payloads) == 1)
    for a, b in zip(unpack(buf, layout), payloads):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_an_empty_payload_with_odd_strides_packs():
    # a rank or chunk with no rows: a codec's empty payload may carry strides that a byte
    # view refuses ("stride(-1) must be 1", int8's (0, 1) scales); empty, any layout is equal
    odd = torch.empty_strided((0, 1), (1, 2))
    buf, layout = pack([torch.empty(0, 24, dtype=torch.int8), odd])
    assert buf.shape == (0, 28)
    a, b = unpack(buf, layout)
    assert (a.shape, a.dtype, b.shape, b.dtype) == ((0, 24), torch.int8, (0, 1), torch.float32)


def test_chunks_split_every_block_and_cover_all_rows():
    counts = np.array([[5, 0, 3, 1], [2, 2, 7, 0]])
    parts = chunk_counts(counts, 3)
    assert (sum(parts) == counts).all()
    starts = np.array([0, 5, 5, 8])
    rows = np.concatenate([block_rows(starts + (counts[0] * i) // 3, parts[i][0])
                           for i in range(3)])
    assert sorted(rows.tolist()) == list(range(9))


def test_grouping_equal_counts_is_a_transpose():
    recv = np.full((2, 3), 4)                         # 2 sources x 3 local experts, 4 rows each
    g = Grouping.build(recv, torch.device("cpu"))
    assert g.perm is None and g.shape == (2, 3, 4) and g.offsets is None
    x = torch.arange(24.0).unsqueeze(1)
    grouped = g.group(x)
    assert grouped[:8, 0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]   # expert 0 from both
    assert torch.equal(g.ungroup(grouped), x)
    uneven = Grouping.build(np.array([[1, 2, 0], [3, 0, 1]]), torch.device("cpu"))
    assert uneven.counts == [4, 2, 1] and uneven.offsets.tolist() == [4, 6, 7]
    y = torch.arange(7.0).unsqueeze(1)
    assert torch.equal(uneven.ungroup(uneven.group(y)), y)


def test_uneven_grouping_gathers_both_ways():
    g = Grouping.build(np.array([[1, 2, 0], [3, 0, 1]]), torch.device("cpu"))
    y = torch.randn(7, 3)
    scattered = y.new_empty(y.shape).index_copy(0, g.perm, y)      # what ungroup must equal
    assert torch.equal(g.ungroup(y), scattered)
    assert torch.equal(g.inverse[g.perm], torch.arange(7))


@pytest.mark.parametrize("r", [2, 3, 5])
def test_assemble_puts_chunk_rows_back_in_send_order(r):
    class Plan:                                       # the fields ChunkPlan.build reads
        counts = np.array([[3, 0, 4, 2], [1, 5, 2, 2]])   # 2 ranks x 4 experts
        ep_rank, num_local = 1, 2
    cp = ChunkPlan.build(Plan(), r, torch.device("cpu"))
    send = torch.randn(int(Plan.counts[1].sum()), 4)
    chunks = [send.index_select(0, rows) * 2 for rows in cp.rows]   # row-wise "experts"
    assert torch.equal(_assemble(chunks, cp, send), send * 2)
    assert ChunkPlan.build(Plan(), 1, torch.device("cpu")).assemble is None


def test_eval_builds_no_expert_graph():
    layer = mf.MoELayer(mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2))
    seen = []
    real = layer.experts.forward
    layer.experts.forward = lambda *a, **k: seen.append(torch.is_grad_enabled()) or real(*a, **k)
    with torch.no_grad():
        layer(torch.randn(6, 8))
    layer(torch.randn(6, 8, requires_grad=True))
    assert seen == [False, True]


# int8: the two rows decode to NaN, so both tokens' expert outputs (8 values each) are
# non-finite on the way back too; zfp decodes such a block to finite garbage (as LLNL zfp).
@pytest.mark.parametrize("codec,count", [("int8", 2 + 2 * 8), ("zfp", 2)])
def test_nonfinite_payloads_are_counted_not_raised(codec, count):
    layer = mf.MoELayer(mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=1,
                                     capacity_factor=None, codec=codec))
    x = torch.randn(6, 8)
    x[2, 3] = float("nan")
    x[4, 0] = float("inf")
    layer(x)
    assert layer.stats["nonfinite_payload"] == count
    layer(torch.randn(6, 8))
    assert layer.stats["nonfinite_payload"] == 0
    plain = mf.MoELayer(mf.MoEConfig(d_model=8, d_expert=16, num_experts=4))
    plain(x)                                          # "none" carries inf/NaN as they are
    assert "nonfinite_payload" not in plain.stats


def test_grouped_mm_only_where_torch_computes_it(monkeypatch):
    """CPU: fp32/bf16/fp16 with 16-byte aligned rows; never float64; on CUDA only bf16 on
    sm80+ (checked here by faking a CUDA tensor's properties)."""
    from moeflow.experts.ffn import grouped_mm_fits

    w = torch.zeros(2, 16, 32)
    assert grouped_mm_fits(torch.zeros(3, 16), w)
    assert not grouped_mm_fits(torch.zeros(3, 16, dtype=torch.float64), w.double())
    assert not grouped_mm_fits(torch.zeros(3, 16), torch.zeros(2, 16, 5))     # 20-byte rows
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert grouped_mm_fits(torch.zeros(3, 16), w)

    class FakeCuda(torch.Tensor):
        is_cuda = True

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    x32 = torch.zeros(3, 16).as_subclass(FakeCuda)
    assert not grouped_mm_fits(x32, w)                      # fp32 on CUDA: the loop
    assert grouped_mm_fits(torch.zeros(3, 16, dtype=torch.bfloat16).as_subclass(FakeCuda),
                           w.bfloat16())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5))
    assert not grouped_mm_fits(torch.zeros(3, 16, dtype=torch.bfloat16).as_subclass(FakeCuda),
                               w.bfloat16())


@pytest.mark.parametrize("counts", [[3, 0, 4], [2, 2, 2], [0, 0, 5], [0, 0]])
def test_row_expert_index_without_host_copies(counts):
    """Per-row expert ids for biases come from device offsets (searchsorted) or int repeats,
    never from a tensor built of host counts at call time (a pageable copy waits on CUDA)."""
    import itertools

    from moeflow.experts.ffn import _row_expert

    want = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    offsets = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32)
    assert torch.equal(_row_expert(counts, offsets, torch.device("cpu")), want)
    assert torch.equal(_row_expert(counts, None, torch.device("cpu")), want)


@pytest.mark.parametrize("schedule,r", [("sequential", 1), ("optsche", 2)])
def test_backward_without_input_grad_skips_the_way_back(schedule, r):
    """A leaf input without grad: same parameter gradients, and the backward's C2/A2/D2
    carry nothing (Tutel's backward skips that exchange too)."""
    from moeflow import MoEConfig, MoELayer
    from moeflow.schedule.executor import Timeline

    torch.manual_seed(0)
    cfg = MoEConfig(d_model=8, d_expert=12, num_experts=4, top_k=2, capacity_factor=1.25,
                    schedule=schedule, pipeline_degree=r)
    layer, x = MoELayer(cfg).double(), torch.randn(10, 8, dtype=torch.float64)
    grads = []
    for needs in (True, False):
        layer.zero_grad(set_to_none=True)
        layer.timeline = Timeline()
        layer(x.clone().requires_grad_(needs)).square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in layer.named_parameters()})
        back = [rec.size for rec in layer.timeline.records
                if rec.phase == "backward" and rec.task.kind in ("C2", "A2", "D2")]
        assert (min(back) > 0) if needs else (max(back) == 0)
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=1e-14)


def test_grouping_permutation_backward_is_the_inverse_gather():
    """Unequal counts per (source, expert): group/ungroup permute rows, and their backward
    gathers the gradient by the inverse permutation (no scatter), exactly."""
    import numpy as np

    from moeflow.schedule.chunks import Grouping

    g = Grouping.build(np.array([[2, 1, 0], [1, 3, 2]]), torch.device("cpu"))
    assert g.perm is not None
    x = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, 4, dtype=torch.float64)
    (g.ungroup(g.group(x) * 2.0) * w).sum().backward()
    torch.testing.assert_close(x.grad, 2.0 * w)
    x.grad = None
    (g.group(x) * w).sum().backward()
    torch.testing.assert_close(x.grad, w[g.inverse])
    v = torch.randn(9, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(g.group, (v,)) and torch.autograd.gradcheck(g.ungroup, (v,))
