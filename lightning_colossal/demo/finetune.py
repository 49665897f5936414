"""``python -m lightning_colossal.demo.finetune fit``: fine-tune a Hugging Face causal LM through the LightningCLI.

The same run as ``examples/finetune.ipynb``, as a script with a YAML config (``examples/huggingface/finetune.yaml``)
that any strategy name or class plugs into. The model is ``AutoModelForCausalLM.from_pretrained(model)``, a local
directory or a Hub name; without one, a tiny Llama with a 256-token byte vocabulary is built from its config, so the
command runs offline. The data is the demo's byte corpus (``ByteCorpusDataModule``): a token is a byte, which any
model with at least 256 token ids can train on; bring a tokenized ``LightningDataModule`` for real text
(``--data=your.module.DataModule``).

The model is built in ``configure_model``, where sharded strategies build it (``colossal_gemini``,
``colossal_fsdp`` and ``colossal_hybrid`` split it there); ``save_hyperparameters`` keeps ``model`` in every
checkpoint, so ``CausalLMFineTuning.load_from_checkpoint(path)`` rebuilds it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import ArgsType
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_colossal.demo.cli import DemoCLI, run_summary, trainer_defaults
from lightning_colossal.demo.data import ByteCorpusDataModule

__all__ = ["CausalLMFineTuning", "main", "tiny_byte_llama"]


def tiny_byte_llama(block_size: int) -> torch.nn.Module:
    """A small Llama over a byte vocabulary (256 ids), initialised from a fixed seed: the offline stand-in for a
    pretrained model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(256, block_size),
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


class CausalLMFineTuning(LightningModule):
    """Next-token fine-tuning of a Hugging Face causal language model with AdamW.

    Args:
        model: a directory written by ``save_pretrained`` or a Hub name (read by ``from_pretrained``); ``None``
            builds the tiny byte-level Llama of ``tiny_byte_llama``.
        block_size: sequence length of the training data (tied to ``data.block_size`` by the CLI).
        learning_rate: AdamW's learning rate.
        weight_decay: AdamW's weight decay.
    """

    def __init__(
        self,
        model: str | None = None,
        block_size: int = 128,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return  # a later stage of the same run: the (possibly sharded) model exists
        name = self.hparams["model"]
        if name is None:
            self.model = tiny_byte_llama(self.hparams["block_size"])
        else:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(name)
        vocabulary = self.model.get_input_embeddings().num_embeddings
        if vocabulary < 256:
            raise ValueError(
                f"The model has {vocabulary} token ids, but the byte data needs 256: pass a model with a larger"
                " vocabulary, or a tokenized LightningDataModule with --data."
            )
        self.model.train()  # from_pretrained returns the model in evaluation mode

    def _loss(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        assert self.model is not None
        logits = self.model(input_ids=inputs).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(), lr=self.hparams["learning_rate"], weight_decay=self.hparams["weight_decay"]
        )


class FinetuneCLI(DemoCLI):
    """The demo's LightningCLI (one ``block_size`` for data and model, CPU threads shared) over a Hugging Face model;
    its run summary names this command and the ``--format huggingface`` export."""

    def after_fit(self) -> None:
        summary = run_summary(
            self.trainer,
            command="python -m lightning_colossal.demo.finetune",
            module="CausalLMFineTuning (lightning_colossal.demo.finetune)",
            export="finetuned_model --format huggingface  (a from_pretrained directory)",
            other_modes="--trainer.strategy=colossal_gemini | colossal_fsdp | colossal_ddp | colossal_hybrid",
        )
        rank_zero_info(summary)


def main(args: ArgsType = None) -> FinetuneCLI:
    """Run the fine-tuning CLI (``args`` as for ``lightning_colossal.demo.cli.main``)."""
    import lightning_colossal  # noqa: F401  (registers the strategy names the config may use)

    return FinetuneCLI(
        CausalLMFineTuning,
        ByteCorpusDataModule,
        trainer_defaults=trainer_defaults(),
        seed_everything_default=1234,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
