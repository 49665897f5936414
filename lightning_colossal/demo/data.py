"""Byte-level training data that needs no download and ships no text.

The default corpus is the Python standard library's own ``.py`` sources found on the running machine: every
Python installation has them, they are plain text, and a byte-level model learns their structure
(indentation, keywords, identifiers) quickly, which is what a demo needs. ``data=PATH`` swaps in any text
file or directory of text files. Token ids are bytes (vocabulary 256).

The corpus differs between Python versions, so runs are reproducible on one machine, not across them.
"""

from __future__ import annotations

import codecs
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "ByteCorpusDataModule",
    "CorpusSplit",
    "RandomTokenDataset",
    "TokenBlockDataset",
    "read_corpus",
    "split_corpus",
]

_FILE_SEPARATOR = b"\n"
_SKIPPED_DIRECTORIES = frozenset({"site-packages", "dist-packages", "__pycache__"})


class CorpusSplit(NamedTuple):
    """A corpus cut into a training head and a validation tail (uint8 tensors, no shared bytes)."""

    train: torch.Tensor
    val: torch.Tensor


def _standard_library_sources() -> Iterator[Path]:
    """The standard library's ``.py`` files, sorted by relative path, third-party packages left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    relative_paths = sorted(path.relative_to(root).as_posix() for path in root.rglob("*.py"))
    for relative_path in relative_paths:
        if _SKIPPED_DIRECTORIES.isdisjoint(relative_path.split("/")):
            yield root / relative_path


def _directory_files(directory: Path) -> Iterator[Path]:
    """Every file under ``directory``, sorted by relative path, hidden files and folders (``.git``) left out."""
    relative_paths: list[str] = []
    for folder, subfolders, files in os.walk(directory):
        # Pruned in place so os.walk never descends into e.g. a large .git folder.
        subfolders[:] = [name for name in subfolders if not name.startswith(".")]
        relative_folder = Path(folder).relative_to(directory)
        relative_paths.extend((relative_folder / name).as_posix() for name in files if not name.startswith("."))
    for relative_path in sorted(relative_paths):
        yield directory / relative_path


def _is_text(content: bytes, *, truncated: bool) -> bool:
    """Whether ``content`` looks like UTF-8 text; if ``truncated``, a character cut at the end is allowed."""
    if b"\0" in content:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(content, final=not truncated)
    except UnicodeDecodeError:
        return False
    return True


def _concatenate_text_files(paths: Iterator[Path], max_bytes: int) -> bytes:
    """Join text files with a newline until ``max_bytes``, skipping binary or non-UTF-8 files."""
    pieces: list[bytes] = []
    total = 0
    for path in paths:
        if total >= max_bytes:
            break
        try:
            with open(path, "rb") as handle:
                content = handle.read(max_bytes - total)
                truncated = bool(handle.read(1))
        except OSError:
            continue  # unreadable (permissions, broken link): a corpus is still possible from the rest
        if not content or not _is_text(content, truncated=truncated):
            continue
        pieces.append(content)
        total += len(content) + len(_FILE_SEPARATOR)
    return _FILE_SEPARATOR.join(pieces)[:max_bytes]


def read_corpus(data: str | os.PathLike[str] | None = None, max_bytes: int = 8_000_000) -> torch.Tensor:
    """Read a byte corpus as a 1-D ``torch.uint8`` tensor.

    Args:
        data: ``None`` for the Python standard library sources of this machine, a text file, or a directory
            whose text files (recursive, sorted by path, hidden and binary files skipped) are concatenated.
        max_bytes: Upper bound on the corpus size; reading stops there.

    Raises:
        FileNotFoundError: ``data`` does not exist.
        ValueError: ``max_bytes`` is not positive, or ``data`` holds no text.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}; pass e.g. max_bytes=8_000_000.")
    if data is None:
        content = _concatenate_text_files(_standard_library_sources(), max_bytes)
        source = f"the Python standard library sources under {sysconfig.get_paths()['stdlib']}"
    else:
        path = Path(data).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"data={str(data)!r} does not exist. Pass an existing text file or directory of text files, "
                "or leave data unset to train on the Python standard library sources."
            )
        if path.is_dir():
            content = _concatenate_text_files(_directory_files(path), max_bytes)
        else:
            with open(path, "rb") as handle:
                content = handle.read(max_bytes)
        source = f"data={str(data)!r}"
    if not content:
        raise ValueError(f"No text found in {source}. Pass a UTF-8 text file or a directory that contains some.")
    # bytearray: torch.frombuffer needs a writable buffer; clone so the tensor owns its memory.
    return torch.frombuffer(bytearray(content), dtype=torch.uint8).clone()


def split_corpus(corpus: torch.Tensor, val_fraction: float, block_size: int) -> CorpusSplit:
    """Cut ``corpus`` into a training head and the last ``val_fraction`` of its bytes for validation.

    The two parts share no byte, so no validation text is seen in training (up to text that repeats in
    the corpus itself).

    Raises:
        ValueError: ``val_fraction`` is outside (0, 1), or either part is too short for one block of
            ``block_size + 1`` bytes.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}; pass e.g. val_fraction=0.05.")
    num_bytes = corpus.numel()
    val_size = int(num_bytes * val_fraction)
    train_size = num_bytes - val_size
    needed = block_size + 1
    if train_size < needed or val_size < needed:
        minimum = int(needed / min(val_fraction, 1.0 - val_fraction)) + 1
        raise ValueError(
            f"The corpus has {num_bytes} bytes, which gives {train_size} training and {val_size} validation "
            f"bytes with val_fraction={val_fraction}; each part needs at least block_size + 1 = {needed}. "
            f"Provide at least {minimum} bytes of text (data=..., max_bytes=...), or lower block_size."
        )
    return CorpusSplit(train=corpus[:train_size], val=corpus[train_size:])


class TokenBlockDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping next-token windows over a 1-D token tensor.

    Item ``i`` reads the ``block_size + 1`` tokens starting at ``i * block_size`` and returns
    ``(input_ids, targets)``, both int64 of length ``block_size``, with ``targets`` shifted by one.

    Args:
        tokens: 1-D tensor of token ids (``torch.uint8`` for bytes).
        block_size: Sequence length of one item.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}; flatten it first.")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}.")
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        # The last window needs one extra token for its final target.
        return max(0, (self.tokens.numel() - 1) // self.block_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for TokenBlockDataset of length {len(self)}")
        index %= len(self)
        start = index * self.block_size
        window = self.tokens[start : start + self.block_size + 1].long()
        return window[:-1], window[1:]


class RandomTokenDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Seeded random token ids, for benchmarks that need a vocabulary larger than bytes.

    Item ``i`` is drawn from a generator seeded from ``seed`` and ``i``, so it is the same whatever the
    access order, the number of workers or the process. Nothing is stored.

    Args:
        vocab_size: Token ids are drawn uniformly from ``[0, vocab_size)``.
        block_size: Sequence length of one item.
        num_samples: Length of the dataset.
        seed: Base seed.
    """

    def __init__(self, vocab_size: int, block_size: int, num_samples: int, seed: int = 0) -> None:
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size), ("num_samples", num_samples)):
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}.")
        if not 0 <= seed < 2**31:
            raise ValueError(f"seed must be in [0, 2**31), got {seed}.")
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.num_samples = num_samples
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for RandomTokenDataset of length {self.num_samples}")
        index %= self.num_samples
        # torch's CPU generator keeps only 32 bits of a seed. Within one seed, index -> stream is one-to-one;
        # the odd multiplier (Knuth's) puts nearby seeds about 2.6e9 items apart.
        generator = torch.Generator().manual_seed((self.seed * 2_654_435_761 + index) % 2**32)
        window = torch.randint(0, self.vocab_size, (self.block_size + 1,), generator=generator, dtype=torch.long)
        return window[:-1], window[1:]


class ByteCorpusDataModule(LightningDataModule):
    """Byte-level next-token data from the built-in corpus or a user path.

    Args:
        data: ``None`` for the Python standard library sources of this machine, or a path to a text file or a
            directory of text files.
        block_size: Sequence length; must not exceed the model's ``block_size``.
        batch_size: Sequences per batch and per process.
        num_workers: DataLoader worker processes.
        max_bytes: Upper bound on the corpus size.
        val_fraction: Share of the corpus (its tail) held out for validation.
    """

    def __init__(
        self,
        data: str | None = None,
        block_size: int = 128,
        batch_size: int = 16,
        num_workers: int = 0,
        max_bytes: int = 8_000_000,
        val_fraction: float = 0.05,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}; pass e.g. batch_size=16.")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}.")
        self.save_hyperparameters()
        self.data = data
        self.block_size = block_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.train_dataset: TokenBlockDataset | None = None
        self.val_dataset: TokenBlockDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        """Read and split the corpus once; later calls return at once."""
        if self.train_dataset is not None:
            return
        split = split_corpus(read_corpus(self.data, self.max_bytes), self.val_fraction, self.block_size)
        self.train_dataset = TokenBlockDataset(split.train, self.block_size)
        self.val_dataset = TokenBlockDataset(split.val, self.block_size)

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        dataset = self._require(self.train_dataset)
        if len(dataset) < self.batch_size:
            raise ValueError(
                f"The training split has {len(dataset)} blocks, fewer than batch_size={self.batch_size}, so every "
                "batch would be dropped. Use more text (data=..., max_bytes=...) or a smaller batch_size."
            )
        # Lightning swaps in a DistributedSampler (keeping shuffle) under distributed strategies.
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        return DataLoader(
            self._require(self.val_dataset),
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    @staticmethod
    def _require(dataset: TokenBlockDataset | None) -> TokenBlockDataset:
        if dataset is None:
            raise RuntimeError("ByteCorpusDataModule.setup() must run before its dataloaders are requested.")
        return dataset
