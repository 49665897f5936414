"""The built-in byte corpus, its datasets and its LightningDataModule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_colossal.demo.data import (
    ByteCorpusDataModule,
    RandomTokenDataset,
    TokenBlockDataset,
    read_corpus,
    split_corpus,
)


def test_token_blocks_are_non_overlapping_windows_shifted_by_one() -> None:
    tokens = torch.arange(23, dtype=torch.uint8)
    dataset = TokenBlockDataset(tokens, block_size=5)
    assert len(dataset) == 4  # (23 - 1) // 5: the last window needs one extra target token
    input_ids, targets = dataset[2]
    assert input_ids.dtype == torch.int64 and targets.dtype == torch.int64
    assert input_ids.tolist() == [10, 11, 12, 13, 14]
    assert targets.tolist() == [11, 12, 13, 14, 15]
    assert dataset[-1][1].tolist() == [16, 17, 18, 19, 20]
    with pytest.raises(IndexError):
        dataset[4]


def test_byte_values_above_127_survive_as_token_ids() -> None:
    dataset = TokenBlockDataset(torch.tensor([200, 255, 0, 7], dtype=torch.uint8), block_size=3)
    input_ids, targets = dataset[0]
    assert input_ids.tolist() == [200, 255, 0] and targets.tolist() == [255, 0, 7]


def test_split_keeps_validation_bytes_out_of_training() -> None:
    corpus = torch.arange(1000, dtype=torch.int64)  # every value unique, so overlap would show
    split = split_corpus(corpus, val_fraction=0.1, block_size=8)
    assert split.val.numel() == 100 and split.train.numel() == 900
    assert torch.equal(split.val, corpus[900:])
    train_blocks = TokenBlockDataset(split.train, block_size=8)
    seen_in_training = {
        value for index in range(len(train_blocks)) for part in train_blocks[index] for value in part.tolist()
    }
    assert seen_in_training.isdisjoint(split.val.tolist())


def test_split_too_small_names_the_fix() -> None:
    with pytest.raises(ValueError, match="lower block_size"):
        split_corpus(torch.zeros(100, dtype=torch.uint8), val_fraction=0.05, block_size=64)
    with pytest.raises(ValueError, match="val_fraction must be in"):
        split_corpus(torch.zeros(100, dtype=torch.uint8), val_fraction=0.0, block_size=4)


def test_default_corpus_is_standard_library_python_source() -> None:
    corpus = read_corpus(max_bytes=50_000)
    assert corpus.dtype == torch.uint8 and corpus.numel() == 50_000
    text = bytes(corpus.tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text
    assert torch.equal(corpus, read_corpus(max_bytes=50_000))  # deterministic


def test_text_file_path(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_bytes(b"hello world\n" * 10)
    assert bytes(read_corpus(path).tolist()) == b"hello world\n" * 10
    assert read_corpus(str(path), max_bytes=5).tolist() == list(b"hello")


def test_directory_path_uses_sorted_text_files_and_skips_binary_and_hidden(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_bytes(b"second")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "z.py").write_bytes(b"first")
    (tmp_path / "image.bin").write_bytes(b"\x89PNG\x00\x01\x02")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")  # not UTF-8
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_bytes(b"ref: refs/heads/main")
    assert bytes(read_corpus(tmp_path).tolist()) == b"first\nsecond"


def test_missing_path_and_empty_directory_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="leave data unset"):
        read_corpus(tmp_path / "missing.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="No text found"):
        read_corpus(tmp_path / "empty")


def test_data_module_lengths_and_loaders(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes(range(32, 127)) * 100)  # 9500 bytes
    data_module = ByteCorpusDataModule(data=str(path), block_size=16, batch_size=8, val_fraction=0.1)
    assert data_module.train_dataset is None  # lazy
    data_module.setup("fit")
    train_dataset = data_module.train_dataset
    data_module.setup("fit")
    assert data_module.train_dataset is train_dataset  # second call is free
    assert len(data_module.train_dataset) == (8550 - 1) // 16
    assert len(data_module.val_dataset) == (950 - 1) // 16
    train_loader, val_loader = data_module.train_dataloader(), data_module.val_dataloader()
    assert len(train_loader) == len(data_module.train_dataset) // 8  # drop_last
    assert len(val_loader) == -(-len(data_module.val_dataset) // 8)
    input_ids, targets = next(iter(train_loader))
    assert input_ids.shape == targets.shape == (8, 16)
    assert torch.equal(input_ids[:, 1:], targets[:, :-1])
    first_val_batch = next(iter(val_loader))[0]
    assert torch.equal(first_val_batch[0], data_module.val_dataset[0][0])  # not shuffled


def test_data_module_rejects_fewer_blocks_than_one_batch(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"x" * 400)
    data_module = ByteCorpusDataModule(data=str(path), block_size=16, batch_size=64, val_fraction=0.1)
    data_module.setup("fit")
    with pytest.raises(ValueError, match="smaller batch_size"):
        data_module.train_dataloader()


def test_random_token_dataset_is_seeded_and_order_independent() -> None:
    dataset = RandomTokenDataset(vocab_size=8192, block_size=64, num_samples=10, seed=1)
    input_ids, targets = dataset[3]
    assert input_ids.shape == (64,) and input_ids.dtype == torch.int64
    assert int(input_ids.max()) < 8192 and int(input_ids.min()) >= 0
    assert torch.equal(input_ids[1:], targets[:-1])
    assert torch.equal(dataset[3][0], RandomTokenDataset(8192, 64, 10, seed=1)[3][0])
    assert not torch.equal(dataset[3][0], dataset[4][0])
    assert not torch.equal(dataset[3][0], RandomTokenDataset(8192, 64, 10, seed=2)[3][0])
