"""Real text with nothing downloaded: the source of the running Python's standard library, as
bytes (one byte, one token), split into training and validation files, and the batches
``dmuon demo`` and ``dmuon quality`` train and evaluate on (their method: the docstring of
:mod:`dmuon.tools.quality`)."""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_SIZE = 256  # byte-level tokens
VAL_EVERY = 20  # every 20th file is validation
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})


@dataclass(frozen=True)
class Corpus:
    """Training and validation bytes (uint8 tensors) and the files each came from."""

    root: str
    train: torch.Tensor
    val: torch.Tensor
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]


def default_corpus_root() -> str:
    """The running Python's standard library folder."""
    return sysconfig.get_paths()["stdlib"]


def source_files(root: str) -> list[str]:
    """Relative paths of the ``*.py`` files under ``root``, sorted; without installed packages or
    the top-level ``test`` package (see the module docstring)."""
    base = Path(root)
    paths = []
    for path in base.rglob("*.py"):
        parts = path.relative_to(base).parts
        if EXCLUDED_DIRS.isdisjoint(parts[:-1]) and parts[0] != "test" and path.is_file():
            paths.append(path.relative_to(base).as_posix())
    return sorted(paths)


def split_files(paths: Sequence[str], val_every: int = VAL_EVERY) -> tuple[list[str], list[str]]:
    """``(train, val)``: every ``val_every``-th path (the last of each group) is validation."""
    val = [p for i, p in enumerate(paths) if i % val_every == val_every - 1]
    train = [p for i, p in enumerate(paths) if i % val_every != val_every - 1]
    return train, val


def _read_bytes(root: str, paths: Sequence[str]) -> torch.Tensor:
    data = b"".join(Path(root, p).read_bytes() for p in paths)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def load_corpus(root: str | None = None) -> Corpus:
    """The corpus under ``root`` (default: :func:`default_corpus_root`), split into train and val."""
    root = root or default_corpus_root()
    train_files, val_files = split_files(source_files(root))
    return Corpus(root, _read_bytes(root, train_files), _read_bytes(root, val_files),
                  tuple(train_files), tuple(val_files))


# ---------------------------------------------------------------------------- batches


Batch = tuple[torch.Tensor, torch.Tensor]


def _windows(text: torch.Tensor, offsets: torch.Tensor, seq_len: int) -> Batch:
    """``(inputs, targets)`` of the ``seq_len + 1``-byte windows at ``offsets``, as token ids."""
    window = text[offsets[:, None] + torch.arange(seq_len + 1)].long()
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def train_batch(text: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int) -> Batch:
    """Training batch ``step``: a pure function of its arguments, whatever was drawn before it."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + step) % 2**63)
    offsets = torch.randint(len(text) - seq_len, (batch_size,), generator=generator)
    return _windows(text, offsets, seq_len)


def val_batches(text: torch.Tensor, n_batches: int, batch_size: int, seq_len: int) -> list[Batch]:
    """The fixed validation set: windows at evenly spaced offsets over all of ``text``."""
    offsets = torch.linspace(0, len(text) - seq_len - 1, n_batches * batch_size).long()
    return [_windows(text, chunk, seq_len) for chunk in offsets.split(batch_size)]
