"""Preference tuning (DPO) with two models in one LightningModule: a trained policy and a frozen reference.

    python examples/huggingface/dpo.py --strategy colossal_gemini --devices 2
    python examples/huggingface/dpo.py --strategy colossal_zero2 --devices 2

Direct Preference Optimization (Rafailov et al., 2023) trains a causal LM on pairs of completions of one prompt, one
preferred ("chosen") and one not ("rejected"). Each step runs the policy and a frozen copy of its starting weights
(the reference) on both completions and minimises

    -logsigmoid(beta * ((log p(chosen) - log p(rejected)) - (log p_ref(chosen) - log p_ref(rejected))))

where ``log p`` is the sum of the completion tokens' log-probabilities. The reference is never trained: it has
``requires_grad_(False)``, stays out of the optimizer and runs under ``torch.no_grad()``, so the strategy gives it no
gradient and no optimizer state. ``colossal_gemini`` shards it too, in chunks of its own (frozen chunks: gathered for
its forward, released after); ``colossal_zero1/2`` and ``colossal_ddp`` keep it whole on every rank;
``colossal_fsdp`` shards it like the policy. ``docs/huggingface.md`` ("Two models in one step") has the figures.

Nothing is downloaded: without ``--model`` the policy is a tiny Llama built from its configuration with a fixed seed,
and the data is a built-in synthetic preference set (the chosen completion counts up from the prompt's last token,
the rejected one is random), which the policy learns in a few dozen steps: the reward accuracy (how often the
policy prefers the chosen completion more than the reference does) climbs from 0 (at the start the two models agree)
to 1. ``--model DIR`` starts both
models from a local ``save_pretrained`` directory through ``lightning_colossal.huggingface.pretrained_on_meta``: each
rank reads only the rows it keeps (Gemini, FSDP) or the whole model (DDP, ZeRO).

On CPU (no GPU) the ranks are processes sharing the cores; ``--devices 2`` takes about 15 s on two cores. Needs the
package installed (``pip install -e ".[hf]"`` from the repository root) for ``import lightning_colossal``.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, Dataset

VOCAB_SIZE = 32
PAD = 0  # padding id (masked out); never a prompt or completion token
BOS = 1  # every prompt starts with it
FIRST_TOKEN = 2  # prompt and completion tokens are FIRST_TOKEN .. VOCAB_SIZE - 1
MODEL_SEED = 1234
DEFAULT_LEARNING_RATE = {"adamw": 1e-2, "sgd": 1.0}


# ------------------------------------------------------------------------------------------------- data
class SyntheticPreferences(Dataset):
    """Pairs of completions of one prompt, the chosen one preferred.

    A prompt is ``BOS`` and a few random tokens; the chosen completion counts up from the prompt's last token
    (wrapping around), the rejected one is random tokens. ``padded=True``: prompts of 2-5 tokens and completions of
    2-4, right-padded with ``PAD`` to one length, with attention masks. ``padded=False``: every prompt 4 tokens and
    every completion 3, no padding and no attention mask (the model is called without one).

    Each item: ``chosen_ids``, ``rejected_ids`` (``[length]`` token ids), ``chosen_completion``,
    ``rejected_completion`` (1 where the token belongs to the completion), and with ``padded`` ``chosen_attention``,
    ``rejected_attention`` (1 where the token is not padding).
    """

    def __init__(self, num_pairs: int = 64, padded: bool = True, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        span = VOCAB_SIZE - FIRST_TOKEN
        self.padded = padded
        self.length = 1 + 5 + 4 if padded else 1 + 4 + 3
        self.items: list[dict[str, torch.Tensor]] = []

        def draw(low: int, high: int) -> int:
            return int(torch.randint(low, high + 1, (1,), generator=generator))

        for _ in range(num_pairs):
            prompt_length = draw(2, 5) if padded else 4
            prompt = [BOS, *(FIRST_TOKEN + torch.randint(span, (prompt_length,), generator=generator)).tolist()]
            chosen_length = draw(2, 4) if padded else 3
            rejected_length = draw(2, 4) if padded else 3
            last = prompt[-1] - FIRST_TOKEN
            chosen = [FIRST_TOKEN + (last + step) % span for step in range(1, chosen_length + 1)]
            rejected = (FIRST_TOKEN + torch.randint(span, (rejected_length,), generator=generator)).tolist()
            item: dict[str, torch.Tensor] = {}
            for name, completion in (("chosen", chosen), ("rejected", rejected)):
                tokens = prompt + completion
                padding = self.length - len(tokens)
                item[f"{name}_ids"] = torch.tensor(tokens + [PAD] * padding)
                item[f"{name}_completion"] = torch.tensor([0] * len(prompt) + [1] * len(completion) + [0] * padding)
                if padded:
                    item[f"{name}_attention"] = torch.tensor([1] * len(tokens) + [0] * padding)
            self.items.append(item)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]


# ------------------------------------------------------------------------------------------------- the loss
def completion_log_probs(
    model: torch.nn.Module, input_ids: torch.Tensor, completion: torch.Tensor, attention: torch.Tensor | None
) -> torch.Tensor:
    """Per sequence, the sum of the log-probabilities the model gives the completion's tokens (fp32)."""
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float()
    targets = input_ids[:, 1:]
    token_log_probs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (token_log_probs * completion[:, 1:]).sum(dim=-1)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DPO loss (mean over the pairs) and the implicit reward margins ``beta * (policy - reference ratio)``."""
    margins = beta * ((policy_chosen - policy_rejected) - (reference_chosen - reference_rejected))
    return -F.logsigmoid(margins).mean(), margins.detach()


def tiny_llama(hidden_size: int = 64) -> torch.nn.Module:
    """A small Llama over ``VOCAB_SIZE`` tokens, the same weights on every call (a fixed seed, the caller's random
    state untouched): the offline stand-in for a pretrained model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=BOS,
        eos_token_id=None,
        pad_token_id=PAD,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED)
        return LlamaForCausalLM(config)


# ------------------------------------------------------------------------------------------------- the module
class DPOModule(LightningModule):
    """A policy trained with the DPO loss against a frozen reference copy of its starting weights.

    Args:
        model: a local ``save_pretrained`` directory both models start from (read with ``pretrained_on_meta``);
            ``None`` builds ``tiny_llama(hidden_size)``.
        beta: the DPO temperature.
        learning_rate: the optimizer's learning rate.
        optimizer: ``"adamw"`` or ``"sgd"``.
        padded: variable-length pairs with padding and attention masks, or equal lengths without either.
        batch_size: pairs per rank and step.
        num_pairs: size of the synthetic training set (a fifth of it again for validation).
        shuffle: shuffle the training pairs every epoch.
        hidden_size: width of the tiny Llama.
    """

    def __init__(
        self,
        model: str | None = None,
        beta: float = 0.1,
        learning_rate: float = 1e-2,
        optimizer: str = "adamw",
        padded: bool = True,
        batch_size: int = 8,
        num_pairs: int = 256,
        shuffle: bool = True,
        hidden_size: int = 64,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.policy: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None
        self.step_losses: list[float] = []  # this rank's loss at every training step

    def configure_model(self) -> None:
        if self.policy is not None:
            return  # a later stage of the same run: the (possibly sharded) models exist
        directory = self.hparams["model"]
        if directory is None:
            self.policy = tiny_llama(self.hparams["hidden_size"])
            reference = copy.deepcopy(self.policy)
        else:
            from transformers import AutoModelForCausalLM

            from lightning_colossal.huggingface import pretrained_on_meta

            # Both on the meta device, each recording where its weights are; the strategy reads each rank's pieces.
            self.policy = pretrained_on_meta(directory, AutoModelForCausalLM)
            reference = pretrained_on_meta(directory, AutoModelForCausalLM)
        # Frozen before the strategy sees it: no gradient, no optimizer state, Gemini's frozen chunks.
        self.reference = reference.requires_grad_(False).eval()

    def train(self, mode: bool = True) -> DPOModule:
        """Lightning sets the whole module to training mode; the reference stays in evaluation mode (dropout off)."""
        super().train(mode)
        if self.reference is not None:
            self.reference.eval()
        return self

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.policy is not None and self.reference is not None
        # Chosen and rejected in one forward per model (same length by construction).
        input_ids = torch.cat([batch["chosen_ids"], batch["rejected_ids"]])
        completion = torch.cat([batch["chosen_completion"], batch["rejected_completion"]])
        attention = None
        if "chosen_attention" in batch:
            attention = torch.cat([batch["chosen_attention"], batch["rejected_attention"]])
        pairs = batch["chosen_ids"].shape[0]
        with torch.no_grad():
            reference = completion_log_probs(self.reference, input_ids, completion, attention)
        policy = completion_log_probs(self.policy, input_ids, completion, attention)
        return dpo_loss(policy[:pairs], policy[pairs:], reference[:pairs], reference[pairs:], self.hparams["beta"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_index: int) -> torch.Tensor:
        loss, margins = self._loss(batch)
        self.step_losses.append(loss.detach().item())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.log("train_reward_accuracy", (margins > 0).float().mean(), prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_index: int) -> None:
        loss, margins = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_reward_accuracy", (margins > 0).float().mean(), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.policy is not None
        parameters = self.policy.parameters()  # the policy only: the reference is never stepped
        if self.hparams["optimizer"] == "sgd":
            return torch.optim.SGD(parameters, lr=self.hparams["learning_rate"])
        return torch.optim.AdamW(parameters, lr=self.hparams["learning_rate"], weight_decay=0.0)

    def train_dataloader(self) -> DataLoader:
        dataset = SyntheticPreferences(self.hparams["num_pairs"], self.hparams["padded"], seed=0)
        return DataLoader(dataset, batch_size=self.hparams["batch_size"], shuffle=self.hparams["shuffle"])

    def val_dataloader(self) -> DataLoader:
        dataset = SyntheticPreferences(max(self.hparams["num_pairs"] // 5, 1), self.hparams["padded"], seed=1)
        return DataLoader(dataset, batch_size=self.hparams["batch_size"])


# ------------------------------------------------------------------------------------------------- the run
def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--strategy", default="colossal_gemini", help="any registered name (default: %(default)s)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="auto", help="auto: the GPU when there is one, else CPU processes")
    parser.add_argument("--precision", default="32-true", help="e.g. bf16-mixed on GPUs")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8, help="pairs per rank and step")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--learning-rate", type=float, default=None, help="default: 1e-2 for AdamW, 1.0 for SGD")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--no-padding", action="store_true", help="equal-length pairs, no attention masks")
    parser.add_argument("--model", default=None, help="a local save_pretrained directory (default: a tiny Llama)")
    parser.add_argument("--root", default=None, help="Trainer.default_root_dir (logs)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train, and return what rank 0 prints: the steps run, the last losses and reward accuracies, and this rank's
    model-state bytes as the strategy's engine counts them (where it has a count)."""
    import lightning_colossal  # noqa: F401  (registers the colossal_* strategy names)
    from lightning_colossal.demo.cli import limit_cpu_threads

    arguments = parse_arguments(argv)
    seed_everything(0, verbose=False)
    module = DPOModule(
        model=arguments.model,
        beta=arguments.beta,
        learning_rate=arguments.learning_rate or DEFAULT_LEARNING_RATE[arguments.optimizer],
        optimizer=arguments.optimizer,
        padded=not arguments.no_padding,
        batch_size=arguments.batch_size,
    )
    trainer = Trainer(
        strategy=arguments.strategy,
        accelerator=arguments.accelerator,
        devices=arguments.devices,
        precision=arguments.precision,
        max_steps=arguments.max_steps,
        val_check_interval=max(arguments.max_steps // 2, 1),
        check_val_every_n_epoch=None,  # validate every val_check_interval steps, across epochs
        limit_val_batches=4,
        num_sanity_val_steps=0,
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=arguments.root,
    )
    limit_cpu_threads(trainer)
    trainer.fit(module)
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    memory = model_state_bytes(trainer)
    result: dict[str, Any] = {"steps": trainer.global_step, **metrics, "memory": memory}
    if trainer.is_global_zero:
        print(f"{arguments.strategy}, {trainer.world_size} rank(s), {trainer.global_step} steps:")
        for name in ("train_loss", "train_reward_accuracy", "val_loss", "val_reward_accuracy"):
            if name in metrics:
                print(f"  {name:22s} {metrics[name]:.4f}")
        for name, value in memory.items():
            print(f"  rank 0 {name:28s} {value:,} bytes")
    return result


def model_state_bytes(trainer: Trainer) -> dict[str, int]:
    """This rank's parameter, gradient and optimizer-state bytes from the engine's own accounting (ZeRO, Gemini)."""
    engine: Any = getattr(trainer.strategy, "engine", None)
    if not hasattr(engine, "memory_report"):
        return {}
    report = engine.memory_report()
    if hasattr(report, "chunks"):  # Gemini
        return {
            "policy shards": report.chunks.shard - report.frozen_shard_bytes,
            "reference shards (frozen)": report.frozen_shard_bytes,
            "gradients": report.chunks.gradient,
            "optimizer state": report.chunks.optimizer_state,
        }
    return {  # ZeRO: whole parameters on every rank, sharded gradients (stage 2) and optimizer state
        "parameters (both models)": report.parameter_bytes,
        "gradients": report.gradient_bytes,
        "optimizer state": report.optimizer_state_bytes,
    }


if __name__ == "__main__":
    main()
