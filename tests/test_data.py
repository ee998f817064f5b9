"""Corpus loading, the fixed split, and reproducible batches."""

from __future__ import annotations

import pytest
import torch

from moeflow.data import Corpus, read_documents


def test_default_corpus_is_embedded_and_split():
    c = Corpus.load()
    assert c.train.numel() > 300_000 and c.val.numel() > 20_000
    assert c.train.dtype == torch.uint8


def test_batches_depend_on_seed_step_rank_only():
    c = Corpus.load()
    a = c.batch("train", 3, 16, seed=1, step=5, rank=0)
    b = c.batch("train", 3, 16, seed=1, step=5, rank=0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])               # targets are the next bytes
    assert not torch.equal(a[0], c.batch("train", 3, 16, seed=1, step=5, rank=1)[0])


def test_user_files_and_folders(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 50)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("more text " * 50)
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    assert sorted(read_documents(tmp_path)) == [str(tmp_path / "a.txt"),
                                                 str(tmp_path / "sub" / "b.md")]
    one = Corpus.load(tmp_path / "a.txt")                       # one file: last tenth is val
    assert one.val.numel() == 60 and one.train.numel() == 540


def test_bad_data_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        Corpus.load(tmp_path / "missing")
    with pytest.raises(ValueError, match="no non-empty text files"):
        Corpus.load(tmp_path)
    (tmp_path / "t.txt").write_text("short")
    with pytest.raises(ValueError, match="seq_len"):
        Corpus.load(tmp_path / "t.txt").batch("train", 1, 64, 0, 0, 0)
