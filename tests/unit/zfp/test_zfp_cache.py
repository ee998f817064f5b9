"""The compiled ZFP coder's on-disk cache (zfp.numba_backend): a damaged cache file is recovered
from, a read-only package directory works, processes compiling at once share one compile, and
coders compiled in different processes load together (the "'descr' is NULL" report, docs/codecs.md)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import torch

from moeflow.comm.codecs import zfp
from moeflow.comm.codecs.zfp import numba_backend

ROOT = Path(__file__).resolve().parents[3]
# A child process codes a fixed 1-D array and prints its bytes' sum and the coder's cache
# misses and hits (the cache root is argv[1], or the default when it is empty).
CHILD = """
import sys, torch
from moeflow.comm.codecs import zfp
from moeflow.comm.codecs.zfp import numba_backend as nb
if sys.argv[1]:
    nb.set_cache_dir(sys.argv[1])
x = torch.arange(111, dtype=torch.float32).sin().reshape(3, 37)
c = zfp.compress(x, 8, dims=1)
st = nb._coders[(1, 0)].stats
print(zfp.__file__, int(c.sum()), sum(st.cache_misses.values()), sum(st.cache_hits.values()))
"""


def _child(cache: str, **env) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.Popen([sys.executable, "-c", CHILD, cache], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> list[str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return out.split()


def _expected_sum() -> int:
    x = torch.arange(111, dtype=torch.float32).sin().reshape(3, 37)
    return int(zfp.compress(x, 8, dims=1).sum())


def test_a_damaged_cache_warns_once_with_its_path_and_is_compiled_afresh(tmp_path):
    x = torch.randn(3, 37)
    numba_backend.set_cache_dir(tmp_path)
    try:
        ref = zfp.compress(x, 8, dims=1)                  # compiled and saved
        want = zfp.decompress(ref, x.shape, 8, dims=1)
        where = numba_backend.cache_dir()
        damaged = sorted(where.glob("*encode_1d*.nbc")) + sorted(where.glob("*decode_1d*.nbi"))
        assert len(damaged) == 2, sorted(where.iterdir())
        for f in damaged:                                 # the tail overwritten, as in that report
            data = f.read_bytes()
            f.write_bytes(data[:-64] + b"\xff" * 64)
        numba_backend.set_cache_dir(tmp_path)             # a new process, as far as zfp knows
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = zfp.compress(x, 8, dims=1)
            out = zfp.decompress(got, x.shape, 8, dims=1)
            zfp.compress(x, 8, dims=1)                    # the next calls are quiet
        msgs = [str(w.message) for w in caught if w.category is RuntimeWarning]
        assert len(msgs) == 2 and all(str(where) in m for m in msgs), msgs
        assert torch.equal(got, ref) and torch.equal(out, want)
        numba_backend.set_cache_dir(tmp_path)             # the rewritten entries load cleanly
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert torch.equal(zfp.compress(x, 8, dims=1), ref)
        assert sum(numba_backend._coders[(1, 0)].stats.cache_hits.values()) == 1
    finally:
        numba_backend.set_cache_dir(None)


def test_a_read_only_package_directory_works(tmp_path):
    """The package is copied and made read-only (as a site-packages install owned by another
    user); coding works and writes nothing into it. The copy has the same sources, so it shares
    this environment's cache entries (root may write anywhere, so nothing is written is what the
    test checks)."""
    pkg = tmp_path / "site"
    shutil.copytree(ROOT / "moeflow", pkg / "moeflow",
                    ignore=shutil.ignore_patterns("__pycache__"))
    before = sorted(p for p in pkg.rglob("*"))
    for p in [pkg, *before]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        env = {**os.environ, "PYTHONPATH": f"{pkg}{os.pathsep}{ROOT}",
               "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.run([sys.executable, "-c", CHILD, ""], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        where, total = proc.stdout.split()[:2]
        assert where.startswith(str(pkg)) and int(total) == _expected_sum()
        assert sorted(p for p in pkg.rglob("*")) == before
    finally:
        for p in [pkg, *pkg.rglob("*")]:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)


@pytest.mark.slow          # the lock's single-process paths: the damaged / read-only cache tests above
def test_two_processes_compiling_at_once_compile_once_and_leave_a_valid_cache(tmp_path):
    procs = [_child(str(tmp_path)) for _ in range(2)]
    results = sorted(_result(p)[1:] for p in procs)
    total = str(_expected_sum())
    # one compiled it (a cache miss); the other waited on the lock, then loaded it (a hit)
    assert results == [[total, "0", "1"], [total, "1", "0"]], results
    assert _result(_child(str(tmp_path)))[1:] == [total, "0", "1"]


@pytest.mark.slow
def test_coders_compiled_in_different_processes_load_together(tmp_path):
    """The "'descr' is NULL" report: process A compiles the 1-D encoder, B loads it and
    compiles the 2-D one, C loads both. When every dimensionality's coder had one name, A's and
    B's first compiles got the same symbol and environment names (numba numbers functions per
    process), and C failed in every call of the 2-D coder; this sequence reproduced it."""
    code = ("import sys, torch\n"
            "from moeflow.comm.codecs import zfp\n"
            "from moeflow.comm.codecs.zfp import numba_backend as nb\n"
            "nb.set_cache_dir(sys.argv[1])\n"
            "for d in map(int, sys.argv[2:]):\n"
            "    x = torch.arange(4 ** (2 * d), dtype=torch.float32).cos().reshape([16] * d)\n"
            "    print(int(zfp.compress(x, 8, dims=d).sum()))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    outs = []
    for dims in (["1"], ["1", "2"], ["1", "2"]):
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path), *dims], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        outs.append(proc.stdout.split())
    assert outs[2] == outs[1] and outs[1][:1] == outs[0]
