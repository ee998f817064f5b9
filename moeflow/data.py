"""Text data as bytes: the embedded default corpus, user files, a fixed split, batch sampling.

The default corpus is the documentation text that ships inside CPython (``pydoc_data.topics``,
about 0.46 MB), so it exists wherever Python does. Tokens are UTF-8 bytes (vocabulary 256).
A file is text when it decodes as UTF-8; other files are skipped and listed in
``Corpus.skipped`` (a single file that is not text is refused).
The train/validation split is fixed per document (a hash of its name), and batches are drawn
from a generator seeded by (seed, step, rank): training is reproducible and a resumed run
draws exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from moeflow.init import derive_seed

VAL_EVERY = 10          # one document in ten (by name hash) is validation
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".csv", ".html", ".tex", ".c", ".h"}


def default_documents() -> dict[str, str]:
    import pydoc_data.topics

    return dict(sorted(pydoc_data.topics.topics.items()))


def read_documents(path: str | Path, skipped: list[str] | None = None) -> dict[str, str]:
    """A text file, or every text file under a folder (by suffix), as name -> text.

    Files that do not decode as UTF-8 are left out and their names appended to ``skipped``;
    a single such file, or a folder with no text left, raises ``ValueError``.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--data {path}: no such file or folder")
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    docs, binary = {}, []
    for p in files:
        try:
            docs[str(p)] = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            if path.is_file():
                raise ValueError(f"--data {path}: not UTF-8 text (byte {err.object[err.start]:#04x}"
                                 f" at offset {err.start}); moeflow trains on text files") from None
            binary.append(str(p))
    if skipped is not None:
        skipped.extend(binary)
    docs = {k: v for k, v in docs.items() if v}
    if not docs:
        raise ValueError(f"--data {path}: found no non-empty text files (suffixes: "
                         f"{', '.join(sorted(TEXT_SUFFIXES))})"
                         f"{'; ' + skipped_note(binary) if binary else ''}")
    return docs


def skipped_note(skipped: list[str] | tuple[str, ...]) -> str:
    """``"skipped 2 files that are not UTF-8 text: a.txt, b.md"``."""
    names = ", ".join(skipped[:3]) + (", ..." if len(skipped) > 3 else "")
    files = "file that is" if len(skipped) == 1 else "files that are"
    return f"skipped {len(skipped)} {files} not UTF-8 text: {names}"


def _is_val(name: str) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % VAL_EVERY == 0


@dataclass
class Corpus:
    train: torch.Tensor     # uint8 bytes
    val: torch.Tensor
    skipped: tuple[str, ...] = ()       # files under --data left out: not UTF-8 text

    @classmethod
    def load(cls, path: str | Path | None = None) -> "Corpus":
        skipped: list[str] = []
        docs = default_documents() if path is None else read_documents(path, skipped)
        if len(docs) == 1:                       # one file: last tenth is validation
            data = next(iter(docs.values())).encode()
            cut = len(data) * (VAL_EVERY - 1) // VAL_EVERY
            return cls(_bytes(data[:cut]), _bytes(data[cut:]), tuple(skipped))
        train = b"\n\n".join(v.encode() for k, v in docs.items() if not _is_val(k))
        val = b"\n\n".join(v.encode() for k, v in docs.items() if _is_val(k))
        if not val or not train:
            raise ValueError("the corpus needs at least two documents, or one file, to split "
                             "into training and validation")
        return cls(_bytes(train), _bytes(val), tuple(skipped))

    def batch(self, split: str, batch_size: int, seq_len: int, seed: int, step: int,
              rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` windows of ``seq_len + 1`` bytes -> (inputs, next-byte targets)."""
        data = self.train if split == "train" else self.val
        if data.numel() <= seq_len + 1:
            raise ValueError(f"the {split} split has {data.numel()} bytes, fewer than "
                             f"seq_len + 1 = {seq_len + 1}; use more data or a shorter seq_len")
        gen = torch.Generator().manual_seed(derive_seed(seed, split, step, rank))
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
        windows = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()]).long()
        return windows[:, :-1], windows[:, 1:]


def _bytes(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)
