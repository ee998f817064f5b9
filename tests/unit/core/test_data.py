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


BINARY = b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4


def test_binary_files_are_skipped_and_counted(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 50)
    (tmp_path / "c.txt").write_bytes(BINARY)                    # a text suffix, binary content
    corpus = Corpus.load(tmp_path)                              # one text file is left
    assert corpus.skipped == (str(tmp_path / "c.txt"),)
    assert corpus.train.numel() + corpus.val.numel() == 600     # a.txt only
    (tmp_path / "b.md").write_text("more words " * 50)
    skipped = []
    assert sorted(read_documents(tmp_path, skipped)) == [str(tmp_path / "a.txt"),
                                                         str(tmp_path / "b.md")]
    assert skipped == [str(tmp_path / "c.txt")]


def test_binary_only_data_is_refused(tmp_path):
    import sys

    with pytest.raises(ValueError, match="not UTF-8 text"):
        Corpus.load(sys.executable)                             # the reproduction
    (tmp_path / "c.txt").write_bytes(BINARY)
    with pytest.raises(ValueError, match="skipped 1 file that is not UTF-8 text"):
        Corpus.load(tmp_path)
