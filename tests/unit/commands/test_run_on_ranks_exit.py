"""Under torchrun (or ``moeflow cluster run``) a command's rank destroys its process group
once its work returns, as :func:`moeflow.launch.launch_local`'s ranks do: a group left to the
interpreter's exit can abort the rank there ("terminate called without an active exception",
gloo's worker threads torn down while still joinable)."""

from __future__ import annotations

import argparse
import socket

import torch.distributed as dist

from moeflow.commands.common import run_on_ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _work(x: int) -> tuple[int, bool]:
    return x + 1, dist.is_initialized()


def test_a_torchrun_rank_destroys_its_process_group(monkeypatch):
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                 ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port()))):
        monkeypatch.setenv(k, v)
    args = argparse.Namespace(device="cpu", timeout=60.0, nproc=1)
    try:
        assert run_on_ranks(_work, args, 41) == (42, True)   # ran inside the group
        assert not dist.is_initialized()                      # and left none behind
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
