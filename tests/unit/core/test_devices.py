"""Devices on CPU: --device/--dtype validation, the process-group backend string, host-side
collectives on every group, the device stopwatch, bf16 autocast training, and the train step's
host-synchronisation budget (zero outside logging)."""

from __future__ import annotations

import math
import traceback

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from moeflow import devices
from moeflow.cli import main
from moeflow.config import ConfigError, ModelConfig, TrainConfig
from moeflow.launch import launch_local
from moeflow.topology import Topology
from moeflow.trainer import Trainer

MICRO = ModelConfig(seq_len=32, d_model=32, n_layers=2, n_heads=2, d_ff=64, moe_every=1,
                    moe=dict(num_experts=4, d_expert=32, top_k=2))
DENSE = ModelConfig(seq_len=32, d_model=32, n_layers=2, n_heads=2, d_ff=64, moe_every=3)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(devices, "cuda_available", lambda: False)


# ---- options ------------------------------------------------------------------------------
def test_device_and_dtype_names_resolve(no_cuda):
    assert devices.check_device("auto") == "cpu"
    assert devices.resolve_device("cpu") == torch.device("cpu")
    cpu = torch.device("cpu")
    assert devices.resolve_dtype("auto", cpu) == torch.float32
    assert devices.resolve_dtype("bf16", cpu) == torch.bfloat16
    assert devices.resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert devices.resolve_dtype("fp32", torch.device("cuda", 0)) == torch.float32


def test_auto_is_cuda_when_visible(monkeypatch):
    monkeypatch.setattr(devices, "cuda_available", lambda: True)
    assert devices.check_device("auto") == "cuda"


@pytest.mark.parametrize("call,message", [
    (lambda: devices.check_device("cuda"), "--device cuda is invalid here"),
    (lambda: devices.check_device("tpu"), "--device 'tpu' is invalid"),
    (lambda: devices.check_dtype("fp16"), "--dtype 'fp16' is invalid"),
    (lambda: devices.resolve_device("cuda", "TrainConfig.device"),
     "TrainConfig.device cuda is invalid here"),
    (lambda: TrainConfig(device="gpu"), "TrainConfig.device='gpu' is invalid"),
    (lambda: TrainConfig(dtype="half"), "TrainConfig.dtype='half' is invalid"),
])
def test_bad_device_or_dtype_is_a_clear_error(no_cuda, call, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        call()


def test_too_few_gpus_for_the_local_ranks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="--nproc 2 is invalid with --device cuda"):
        devices.check_local_ranks("cuda", 2)
    devices.check_local_ranks("cuda", 1)
    devices.check_local_ranks("cpu", 8)


@pytest.mark.parametrize("argv", [
    ["train", "--device", "cuda"],
    ["bench", "layer", "--device", "cuda"],
    ["bench", "schedule", "--device", "cuda"],
    ["bench", "bigmac", "--device", "cuda"],
    ["bench", "a2a", "--device", "cuda"],
    ["bench", "links", "--device", "cuda"],
    ["bench", "codecs", "--device", "cuda"],
    ["bench", "zfp-arrays", "--device", "cuda"],
])
def test_cli_device_cuda_without_cuda_fails_naming_the_flag(no_cuda, capsys, argv):
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    assert "--device cuda is invalid here" in capsys.readouterr().err


@pytest.mark.parametrize("argv,flag", [(["train", "--dtype", "fp16"], "--dtype"),
                                       (["train", "--device", "gpu"], "--device"),
                                       (["bench", "a2a", "--device", "tpu"], "--device")])
def test_cli_rejects_unknown_device_or_dtype(capsys, argv, flag):
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    assert f"argument {flag}: invalid choice" in capsys.readouterr().err


# ---- process groups -----------------------------------------------------------------------
def test_pg_backend_string():
    assert devices.pg_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert devices.pg_backend("cpu") == "gloo"
    with pytest.raises(ConfigError):
        devices.pg_backend("mps")


def test_run_on_ranks_builds_the_backend_from_device(monkeypatch):
    """--device cuda starts the ranks with cpu:gloo,cuda:nccl; cpu with gloo."""
    import argparse

    from moeflow.commands import common

    seen = []
    monkeypatch.setattr(common, "launch_local",
                        lambda fn, n, *a, timeout_s, backend, log_dir=None, max_restarts=0,
                        quota=None: seen.append(backend) or {0: "ok"})
    monkeypatch.setattr(common, "under_torchrun", lambda: False)
    monkeypatch.setattr(devices, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for device in ("cuda", "auto", "cpu"):
        args = argparse.Namespace(device=device, nproc=2, timeout=5.0)
        assert common.run_on_ranks(print, args) == "ok"
    assert seen == ["cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl", "gloo"]


def test_init_from_env_default_backend_on_cuda(monkeypatch):
    from moeflow import launch

    calls = []
    monkeypatch.setattr(launch.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(launch.dist, "init_process_group",
                        lambda backend, timeout, device_id=None: calls.append((backend,
                                                                               device_id)))
    monkeypatch.setattr(launch.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launch.torch.cuda, "set_device", lambda i: calls.append(("device", i)))
    monkeypatch.setenv("LOCAL_RANK", "3")
    launch.init_from_env(10.0)
    # the process group is bound to the rank's device: eager NCCL communicators (docs/gpu.md)
    assert calls == [("device", 3), ("cpu:gloo,cuda:nccl", launch.torch.device("cuda", 3))]


def _groups_and_host_collectives():
    topo = Topology.from_env(ep_size=1, local_size=1)     # every subgroup is a new group
    world = dist.get_backend_config()
    configs = {name: dist.get_backend_config(getattr(topo, name))
               for name in ("ep_group", "intra_node_group", "lane_group")}
    from moeflow.measure.timing import slowest

    return {"world": world, "groups": configs,
            "max": slowest(float(topo.rank + 1), topo),
            "mean": devices.host_all_reduce([topo.rank, 10.0], "mean"),
            "sum_lane": devices.host_all_reduce([1.0], "sum", topo.lane_group)}


@pytest.mark.multirank
def test_subgroups_carry_the_world_backend_and_host_collectives_work():
    out = launch_local(_groups_and_host_collectives, 2, timeout_s=60)
    for r in (0, 1):
        assert set(out[r]["groups"].values()) == {out[r]["world"]}
        assert out[r]["max"] == 2.0
        assert out[r]["mean"] == [0.5, 10.0]
        assert out[r]["sum_lane"] == [2.0]


def test_host_tensor_device_follows_the_group(monkeypatch):
    monkeypatch.setattr(devices, "group_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert devices.host_tensor_device() == torch.device("cpu")
    monkeypatch.setattr(devices, "group_backend", lambda group=None: None)
    assert devices.host_tensor_device() == torch.device("cpu")
    monkeypatch.setattr(devices, "group_backend", lambda group=None: "cuda:nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert devices.host_tensor_device() == torch.device("cuda", 1)


def test_stopwatch_on_cpu_times_the_host():
    import time

    watch = devices.Stopwatch("cpu").start()
    time.sleep(0.02)
    assert 0.015 < watch.stop() < 1.0


# ---- training -----------------------------------------------------------------------------
def _trainer(tmp_path, model=MICRO, **kw) -> Trainer:
    cfg = TrainConfig(**{**dict(steps=3, batch_size=2, warmup_steps=1, eval_every=3,
                                eval_batches=1, log_every=3), **kw})
    return Trainer(model, cfg, tmp_path, Topology.single(), progress=False)


def test_bf16_autocast_training_on_cpu(tmp_path):
    t = _trainer(tmp_path, dtype="bf16")
    assert t.dtype == torch.bfloat16 and t.device == torch.device("cpu")
    x, _ = t.corpus.batch("train", 2, 32, 0, 0, 0)
    with devices.autocast(t.device, t.dtype):
        logits, _ = t.model(x)
    assert logits.dtype == torch.bfloat16                  # autocast is really on
    result = t.run()
    assert result["step"] == 3
    losses = [r["loss"] for r in result["history"] if "loss" in r]
    assert losses and all(math.isfinite(v) for v in losses)
    assert math.isfinite(result["final_val_loss"])
    assert all(p.dtype == torch.float32 for p in t.model.parameters())


# Operations that make the host wait for the device on CUDA.
_ATEN = torch.ops.aten
_SYNC_OPS = {_ATEN._local_scalar_dense.default, _ATEN.nonzero.default,
             _ATEN.masked_select.default}
_BOOL_INDEX_OPS = {_ATEN.index.Tensor, _ATEN.index_put.default, _ATEN.index_put_.default}
# The MoE layer's own engine (dispatch, schedule, comm, experts): its budget is the layer's
# (docs/gpu.md: zero in capacity mode, one in dropless), asserted with the layer, not here.
_LAYER_ENGINE = ("moeflow/layer.py", "moeflow/dispatch/", "moeflow/schedule/", "moeflow/comm/",
                 "moeflow/experts/", "moeflow/routing/")


class SyncCounter(TorchDispatchMode):
    """Records every operation that would synchronise host and device on CUDA, with the
    moeflow frames that issued it. ``.tolist()`` bypasses the dispatcher, so it is wrapped."""

    def __init__(self, host_scalars=()):
        super().__init__()
        self.host_scalars = list(host_scalars)     # CPU tensors by design (optimizer steps)
        self.hits: list[tuple[str, list[str]]] = []
        self._tolist = torch.Tensor.tolist

    def _record(self, what: str) -> None:
        frames = [f"{f.filename.split('moeflow/', 1)[-1]}:{f.lineno}" if "moeflow" in
                  f.filename else f.filename for f in traceback.extract_stack()
                  if "/moeflow/" in f.filename and "tests/" not in f.filename]
        full = [f.filename for f in traceback.extract_stack()]
        if any("moeflow/data.py" in f for f in full):
            return              # batch sampling: host tensors built before the copy to device
        self.hits.append((what, frames, full))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _ATEN._local_scalar_dense.default and any(
                args[0] is s for s in self.host_scalars):
            pass
        elif func in _SYNC_OPS or (func in _BOOL_INDEX_OPS and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool
                for i in (args[1] or ()))):
            self._record(str(func))
        return func(*args, **kwargs)

    def __enter__(self):
        counter, tolist = self, self._tolist

        def counted_tolist(t):
            counter._record("Tensor.tolist")
            return tolist(t)
        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def outside_layer(self) -> list:
        return [(w, f) for w, f, full in self.hits
                if not any(e in name for name in full for e in _LAYER_ENGINE)]


def _optimizer_steps(t: Trainer) -> list[torch.Tensor]:
    return [s["step"] for s in t.opt.state.values() if "step" in s]


def test_sync_counter_sees_syncs():
    """The counter is not blind: item, float, tolist and boolean masks are all caught."""
    x = torch.arange(4.0)
    with SyncCounter() as c:
        x.sum().item()
        float(x.max())
        x.tolist()
        x[x > 1].sum()
    assert [w for w, _, _ in c.hits] == ["aten._local_scalar_dense.default"] * 2 + [
        "Tensor.tolist", "aten.index.Tensor"]
    assert torch.Tensor.tolist is SyncCounter()._tolist


@pytest.mark.parametrize("model", [DENSE, MICRO], ids=["dense", "moe"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_train_step_makes_no_host_sync(tmp_path, model, dtype):
    """Outside the MoE layer's engine, a training step (forward, backward, gradient sync,
    clipping, optimizer, statistics) never waits for the device; the dense model has no
    layer engine, so there the whole step is sync-free."""
    t = _trainer(tmp_path, model=model, dtype=dtype, grad_clip=0.01)   # clipping is active
    t.train_step()                                      # creates the optimizer state
    with SyncCounter(_optimizer_steps(t)) as counter:
        stats = [t.train_step() for _ in range(2)]
    assert counter.outside_layer() == []
    if model is DENSE:
        assert counter.hits == []
    assert all(s.shape == (3,) and s.dtype == torch.float64 for s in stats)
    # what the logging step reads is the same loss the model computes
    assert math.isfinite(float(stats[-1][0])) and float(stats[-1][0]) > 1.0


def test_logging_reads_the_device_once_per_interval(tmp_path):
    """run() reads statistics only at log points: with log_every=4 over 4 steps, the reads are
    the world mean's tolist and the evaluations' (no per-step reads)."""
    t = _trainer(tmp_path, model=DENSE, steps=4, log_every=4, eval_every=4)
    t.train_step()
    t.step = 0
    with SyncCounter(_optimizer_steps(t)) as counter:
        t.run()
    reads = [w for w, f in counter.outside_layer()]
    # step-0 evaluation, step-4 training mean, step-4 evaluation: one tolist each
    assert reads == ["Tensor.tolist"] * 3, counter.outside_layer()


# ---- on a GPU (skipped without one) -------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_train_on_cuda_and_checkpoints_across_device_types(tmp_path):
    """3 steps on cuda:0 in bf16, then the checkpoint resumes on CPU with the same weights,
    and a CPU checkpoint resumes on CUDA."""
    gpu = _trainer(tmp_path / "gpu", device="cuda")
    assert gpu.device == torch.device("cuda", 0) and gpu.dtype == torch.bfloat16
    assert all(p.is_cuda for p in gpu.model.parameters())
    result = gpu.run()
    assert math.isfinite(result["final_val_loss"])
    on_cpu = _trainer(tmp_path / "gpu", device="cpu")
    on_cpu.resume()
    assert on_cpu.step == 3
    for (name, a), (_, b) in zip(gpu.model.named_parameters(), on_cpu.model.named_parameters()):
        assert torch.equal(a.detach().cpu(), b.detach()), name
    cpu = _trainer(tmp_path / "cpu", device="cpu")
    cpu.run()
    on_gpu = _trainer(tmp_path / "cpu", device="cuda")
    on_gpu.resume()
    for (name, a), (_, b) in zip(cpu.model.named_parameters(), on_gpu.model.named_parameters()):
        assert b.is_cuda and torch.equal(a.detach(), b.detach().cpu()), name
