"""The demo workload: a small GPT, a built-in byte corpus, their LightningModule and a LightningCLI.

Run it with ``python -m lightning_colossal.demo fit``.
"""

from lightning_colossal.demo.data import ByteCorpusDataModule, RandomTokenDataset, TokenBlockDataset, read_corpus
from lightning_colossal.demo.model import GPT, TRANSFORMER_BLOCK_CLASSES, Block, GPTConfig
from lightning_colossal.demo.module import GPTLightningModule

__all__ = [
    "GPT",
    "TRANSFORMER_BLOCK_CLASSES",
    "Block",
    "ByteCorpusDataModule",
    "GPTConfig",
    "GPTLightningModule",
    "RandomTokenDataset",
    "TokenBlockDataset",
    "read_corpus",
]
