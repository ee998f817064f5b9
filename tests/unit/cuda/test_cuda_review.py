"""CPU proofs of the fixes from the CUDA-path review (docs/gpu.md, "CUDA-path review").

No GPU is needed: CUDA objects (NCCL work handles, streams, device capability, the current
device) are replaced by recording fakes, so each test fails if the CUDA branch regresses.
"""

from __future__ import annotations

import datetime
import types

import pytest
import torch

from moeflow.comm import sparse as sparse_mod
from moeflow.strategies.fssdp import reshard as reshard_mod

TIMEOUT = datetime.timedelta(seconds=7)


class FakeWork:
    """A ProcessGroupNCCL work handle that records the arguments ``wait`` got."""

    def __init__(self, log):
        self.log = log

    def wait(self, *args):
        self.log.append(args)
        return True


# -- 1. sparse collectives: a stream wait on CUDA, a bounded host wait on gloo ----------------

@pytest.mark.parametrize("device, expect", [("cuda", ()), ("cuda:1", ()), ("cpu", (TIMEOUT,))])
def test_wait_work_passes_timeout_only_off_cuda(device, expect):
    log = []
    sparse_mod.wait_work(FakeWork(log), TIMEOUT, device)
    assert log == [expect]


def _fake_dist(log, n_works=3):
    return types.SimpleNamespace(
        isend="isend", irecv="irecv",
        P2POp=lambda op, t, group=None, group_peer=None, tag=0: (op, group_peer, tag),
        batch_isend_irecv=lambda ops: [FakeWork(log) for _ in range(n_works)])


@pytest.mark.parametrize("device, expect", [("cuda", ()), ("cpu", (TIMEOUT,))])
def test_sparse_exchange_waits_without_timeout_on_cuda(monkeypatch, device, expect):
    log = []
    monkeypatch.setattr(sparse_mod, "dist", _fake_dist(log))
    obj = object.__new__(sparse_mod.SparseAllGather)
    obj.group, obj.timeout, obj.device = None, TIMEOUT, torch.device(device)
    t = torch.zeros(2)
    obj._exchange([(0, 1, t)], [(1, 1, t.clone())])
    assert log == [expect] * 3


@pytest.mark.parametrize("device, expect", [("cuda", ()), ("cpu", (TIMEOUT,))])
def test_sparse_agree_waits_without_timeout_on_cuda(monkeypatch, device, expect):
    """The pre-condition all-gather: the device of its tensors decides the wait (the tensors
    themselves are made on CPU here; only the wait is under test)."""
    log = []
    obj = object.__new__(sparse_mod.SparseAllGather)
    obj.group, obj.timeout, obj.world = None, TIMEOUT, 1
    obj.p0, obj.p1, obj.shape, obj.dtype, obj.rank = [[0]], [[0]], torch.Size([2]), \
        torch.float32, 0
    obj.device = torch.device(device)
    real_tensor = torch.tensor
    monkeypatch.setattr(sparse_mod.torch, "tensor",
                        lambda data, dtype=None, device=None: real_tensor(data, dtype=dtype))

    def fake_gather(out, inp, group=None, async_op=False):
        out.copy_(inp)
        return FakeWork(log)
    monkeypatch.setattr(sparse_mod, "_all_gather", fake_gather)
    obj._agree(None)
    assert log == [expect]


@pytest.mark.parametrize("device, expect", [("cuda", ()), ("cpu", (TIMEOUT,))])
def test_reshard_move_rows_waits_without_timeout_on_cuda(monkeypatch, device, expect):
    """Algorithm 2's row moves: the wait follows the moved tensors' device."""
    log, seen = [], []
    monkeypatch.setattr(reshard_mod, "dist", _fake_dist(log, n_works=2))
    monkeypatch.setattr(reshard_mod, "group_timeout", lambda group: TIMEOUT)
    real_wait = sparse_mod.wait_work

    def spy(work, timeout, dev):
        seen.append(torch.device(dev).type)
        real_wait(work, timeout, device)         # the device the tensors would live on
    monkeypatch.setattr(reshard_mod, "wait_work", spy)
    rows = torch.arange(4.0).view(2, 2)          # rank 0 owns experts 0 and 1 of one layer
    reshard_mod._move_rows([rows], old=[[0, 0, 1]], new=[[1, 0, 0]], rank=0, world=2,
                           group=None)
    assert seen == ["cpu", "cpu"] and log == [expect] * 2


# -- 2. fp8 kernels: hardware e4m3 only from compute capability 8.9 ----------------------------

tq = pytest.importorskip("moeflow.comm.codecs.triton_quant")


@pytest.mark.parametrize("capability, soft", [((8, 0), True), ((8, 6), True), ((8, 9), False),
                                              ((9, 0), False), ((10, 0), False)])
def test_fp8_kernels_choose_integer_casts_below_sm89(monkeypatch, capability, soft):
    if not tq.available():
        pytest.skip("triton not installed")
    asked = []
    monkeypatch.setattr(tq, "_FP8_HW", {})
    monkeypatch.setattr(tq.torch.cuda, "get_device_capability",
                        lambda i=None: asked.append(i) or capability)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert tq._soft(None, torch.device("cuda", 1)) is soft
    assert tq._soft(None, "cuda:1") is soft                       # cached per device
    assert asked == [1]
    if soft:                                                     # the hardware path won't build
        with pytest.raises(ValueError, match="soft_cast=False needs hardware float8"):
            tq._soft(False, "cuda:1")
    else:
        assert tq._soft(False, "cuda:1") is False
    assert tq._soft(True, "cuda:1") is True


def test_fp8_kernels_interpreter_stays_soft(monkeypatch):
    if not tq.available():
        pytest.skip("triton not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(tq.torch.cuda, "get_device_capability",
                        lambda i=None: pytest.fail("the interpreter needs no device query"))
    assert tq._soft(None, "cpu") is True and tq._soft(False, "cpu") is False


_SM80_CHECK = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moeflow.comm.codecs import triton_quant as tq

def build(fn, ptrs, const):
    sig = {a: ("constexpr" if a in const else ptrs.get(a, "i32")) for a in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 80, 32),
                       options={"num_warps": 4, "enable_fp_fusion": False})
    return k.asm["ptx"]

f32 = "*fp32"
for fn, ptrs, const in [
        (tq._fp8_block_encode_kernel, {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": f32},
         {"BLOCK": 128, "GROUP": 8}),
        (tq._fp8_decode_kernel, {"q_ptr": "*u8", "s_ptr": f32, "out_ptr": "*bf16"},
         {"BLOCK": 128, "TILE": 1024})]:
    ptx = build(fn, ptrs, dict(const, SOFT=True))
    assert "e4m3" not in ptx, fn.__name__
    try:
        build(fn, ptrs, dict(const, SOFT=False))
    except Exception:
        print("hardware path rejected on sm_80:", fn.__name__)
    else:
        raise SystemExit(f"{fn.__name__}: tl.float8e4nv compiled for sm_80; the gate is moot")
print("sm_80 integer path compiles")
'''


def test_fp8_kernels_compile_for_sm80_on_the_integer_path():
    """What the gate is for, without a GPU: for an A100 (sm_80) the hardware-cast kernels do
    not compile, the integer-cast ones (what :func:`_soft` picks there) do."""
    if not tq.available():
        pytest.skip("triton not installed")
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root
    proc = subprocess.run([sys.executable, "-c", _SM80_CHECK], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("hardware path rejected on sm_80") == 2, proc.stdout
    assert "sm_80 integer path compiles" in proc.stdout


# -- 3./4. the communication lane: one high-priority stream per device, no set_device ----------

from moeflow.schedule import streams as streams_mod          # noqa: E402


class FakeCuda:
    """Just enough of ``torch.cuda`` for the lane: streams that record their priority, and a
    current device that ``set_device`` changes and ``device(...)`` changes and restores."""

    def __init__(self):
        self.current = 0
        self.made = []
        self.set_calls = []
        fake = self

        class Stream:
            def __init__(self, device=None, priority=0):
                self.device = torch.device("cuda", device)
                self.priority = priority
                fake.made.append(self)

        class device:                                  # noqa: N801 (torch's name)
            def __init__(self, d):
                self.d = torch.device(d).index

            def __enter__(self):
                self.prev, fake.current = fake.current, self.d

            def __exit__(self, *exc):
                fake.current = self.prev

        self.Stream, self.device = Stream, device

    def set_device(self, d):
        self.set_calls.append(d)
        self.current = torch.device(d).index if not isinstance(d, int) else d

    def current_device(self):
        return self.current

    def stream(self, s):
        import contextlib
        return contextlib.nullcontext()


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    for name in ("Stream", "device", "set_device", "current_device", "stream"):
        monkeypatch.setattr(streams_mod.torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(streams_mod, "_COMM_STREAMS", {})
    return fake


def test_comm_streams_do_not_grow_with_layers(fake_cuda):
    """One lane per layer (as MoELayer makes them): 100 layers on two devices share two
    high-priority streams, not 200 from torch's pool of 32."""
    lanes = [streams_mod.CommLane() for _ in range(100)]
    s0 = {id(lane.stream(torch.device("cuda", 0))) for lane in lanes}
    s1 = {id(lane.stream(torch.device("cuda", 1))) for lane in lanes}
    assert len(s0) == len(s1) == 1 and s0 != s1
    assert len(fake_cuda.made) == 2
    assert [s.priority for s in fake_cuda.made] == [streams_mod.COMM_PRIORITY] * 2 == [-1, -1]
    assert [s.device.index for s in fake_cuda.made] == [0, 1]
    # "cuda" without an index is the current device's stream
    assert lanes[0].stream(torch.device("cuda")) is lanes[5].stream(torch.device("cuda", 0))
    assert streams_mod.CommLane().stream(torch.device("cpu")) is None
    # Handoff of any layer's lane on the same device uses the same stream
    assert len(fake_cuda.made) == 2


def test_comm_lane_keeps_the_callers_current_device(fake_cuda):
    fake_cuda.current = 0
    lane = streams_mod.CommLane()
    seen = []
    out = lane.run(lambda: seen.append(fake_cuda.current) or "done", torch.device("cuda", 1))
    assert out == "done" and seen == [1]            # the task ran on the stream's device
    assert fake_cuda.current == 0                   # ... and the caller's device is back
    assert fake_cuda.set_calls == []


def test_comm_lane_thread_keeps_its_device_too(fake_cuda):
    lane = streams_mod.CommLane()
    try:
        seen = lane.submit(lambda: fake_cuda.current, torch.device("cuda", 1)).result(timeout=30)
    finally:
        lane.close()
    assert seen == 1 and fake_cuda.current == 0 and fake_cuda.set_calls == []


# -- 5. HECATE's host integers reach the device through pinned memory --------------------------

def test_kept_choices_sends_extras_through_the_pinned_helper(monkeypatch):
    from moeflow.strategies.fssdp import token_plan as tp
    calls = []
    real = tp.to_device_async

    def spy(values, device, dtype=torch.int64):
        calls.append((list(values), torch.device(device), dtype))
        return real(values, device, dtype)
    monkeypatch.setattr(tp, "to_device_async", spy)
    monkeypatch.setattr(tp, "gather_device_counts",
                        lambda mine, group, world: mine.view(1, -1).cpu().numpy())
    experts = torch.tensor([[0, 1], [2, 3], [1, 0]])
    kept = tp.KeptChoices(experts, num_experts=4, capacity=None, group=None, world=1,
                          extras=[7, 9])
    assert calls == [([7, 9], torch.device("cpu"), kept.counts.dtype)]
    assert kept.extras.tolist() == [[7, 9]] and kept.every.tolist() == [[2, 2, 1, 1]]


def test_to_device_async_pins_and_does_not_block_on_cuda(monkeypatch):
    """The helper itself: on a CUDA device the host tensor is pinned and copied with
    non_blocking=True (recorded on a fake), on CPU it is a plain tensor."""
    from moeflow import devices
    log = []

    class Host(torch.Tensor):
        def pin_memory(self):
            log.append("pin")
            return self

        def to(self, *args, **kwargs):
            if args and torch.device(args[0]).type == "cuda":
                log.append(("to", str(args[0]), kwargs.get("non_blocking")))
                return torch.Tensor(self)
            return super().to(*args, **kwargs)
    real = torch.as_tensor
    monkeypatch.setattr(devices.torch, "as_tensor",
                        lambda v, dtype=None: real(v, dtype=dtype).as_subclass(Host))
    devices.to_device_async([1, 2], torch.device("cuda", 0))
    assert log == ["pin", ("to", "cuda:0", True)]
    assert devices.to_device_async([1, 2], "cpu").tolist() == [1, 2]


# -- 8. CUDA graphs: a clear error instead of a failed capture ----------------------------------

class _CudaLooking(torch.Tensor):
    """A CPU tensor that says it is on CUDA (only ``is_cuda`` is read before the check)."""

    @property
    def is_cuda(self):
        return True


def test_moe_layer_refuses_cuda_graph_capture(monkeypatch):
    import moeflow as mf
    layer = mf.MoELayer(mf.MoEConfig(d_model=8, d_expert=16, num_experts=4, top_k=2))
    x = torch.randn(6, 8)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert layer(x).shape == x.shape               # CPU input: never asks (no CUDA build needed)
    with pytest.raises(RuntimeError, match=r"MoELayer.forward .* CUDA graph .*"
                                           r"make_graphed_callables.*reduce-overhead"):
        layer(x.as_subclass(_CudaLooking))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    from moeflow import devices
    devices.check_not_capturing("anything")       # not capturing: no error
