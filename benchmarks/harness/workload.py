"""The workload every benchmark study trains: the demo GPT under a strategy built from a registered name.

``BenchmarkModule`` is next-token training with plain AdamW (Lightning's ``ModelParallelStrategy`` peer gets torch's
tensor parallelism or FSDP2 in ``configure_model``, as its docs say); ``build_strategy`` turns a configuration's
name and arguments into what ``Trainer(strategy=...)`` takes; the counts give the model's size.
"""

from __future__ import annotations

import importlib
import math
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy, StrategyRegistry
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.data import DataLoader

import lightning_colossal  # noqa: F401  (registers the colossal_* strategy names)
from lightning_colossal.demo.model import GPT, GPTConfig
from lightning_colossal.strategies import HybridParallelStrategy


class BenchmarkModule(LightningModule):
    """Next-token training of the GPT with plain AdamW: no scheduler and no logging, so nothing but the
    strategy differs between configurations and nothing synchronises outside the strategy."""

    def __init__(
        self,
        model_config: GPTConfig,
        learning_rate: float,
        activation_checkpointing: bool = False,
        meta_init: bool = False,
    ) -> None:
        """``activation_checkpointing``: every block recomputes its activations in backward
        (``torch.utils.checkpoint``, non-reentrant); ``meta_init``: the GPT is built on the meta device, for a strategy
        that materialises it shard by shard (``materialises_meta_models``: Gemini), so no rank ever holds it whole."""
        super().__init__()
        self.model_config = model_config
        self.learning_rate = learning_rate
        self.activation_checkpointing = activation_checkpointing
        self.meta_init = meta_init
        self.model: GPT | None = None
        # Set by configure_model when the logits come out vocabulary-sharded (Lightning's tensor-parallel peer).
        self.loss_parallel = False

    def configure_model(self) -> None:
        # Built here so sharded strategies can build it inside their own init contexts; idempotent.
        if self.model is not None:
            return
        with torch.device("meta") if self.meta_init else nullcontext():
            self.model = GPT(self.model_config)
        if self.activation_checkpointing:
            for block in self.model.blocks:
                checkpoint_blocks_forward(block)
        if isinstance(self.trainer.strategy, ModelParallelStrategy):
            # Lightning's ModelParallelStrategy leaves parallelisation to the user. Its mesh says which: tensor
            # parallelism over the tensor_parallel axis when that has more than one rank, FSDP2 over the
            # data_parallel axis when that does (or when nothing else is asked: the FSDP2 peer at one rank).
            tensor_parallel_size = self.device_mesh["tensor_parallel"].size()
            data_parallel_size = self.device_mesh["data_parallel"].size()
            if tensor_parallel_size > 1:
                apply_tensor_parallel(self.model, self.device_mesh["tensor_parallel"])
                self.loss_parallel = True
            if data_parallel_size > 1 or tensor_parallel_size == 1:
                # FSDP2 on every block, then the model: the units colossal_fsdp picks by itself.
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for block in self.model.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.model is not None, "configure_model() runs before training"
        input_ids, targets = batch
        logits = self.model(input_ids)
        with self._loss_context():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        # A loss computed from vocabulary-sharded logits is a replicated DTensor; Lightning gets the plain local value
        # (equal on every rank), as colossal_hybrid hands it over.
        return loss.to_local() if isinstance(loss, DTensor) else loss

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        # loss_parallel's cross-entropy has a DTensor backward that must run inside the same context.
        with self._loss_context():
            loss.backward(*args, **kwargs)

    def _loss_context(self) -> Any:
        return loss_parallel() if self.loss_parallel else nullcontext()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


def checkpoint_blocks_forward(block: torch.nn.Module) -> None:
    """Run ``block``'s forward under ``torch.utils.checkpoint`` (non-reentrant): only its input is saved, and its
    activations are recomputed in backward. The block's own module hooks run once, around the checkpoint; its
    submodules' hooks run in the forward and again in the recomputation (what the engines' hooks expect of
    ``torch.utils.checkpoint``)."""
    from torch.utils.checkpoint import checkpoint

    forward = block.forward

    def checkpointed(*args: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False)

    block.forward = checkpointed  # type: ignore[method-assign]


def apply_tensor_parallel(model: GPT, mesh: DeviceMesh) -> None:
    """torch's standard tensor parallelism on the GPT over ``mesh``, the plan torchtitan uses for its Llama.

    Megatron's split of every block: ``attn.qkv`` and ``mlp.fc`` column-wise, ``attn.proj`` and ``mlp.proj``
    row-wise (the GPT's fused qkv is head-major and its attention infers the local head count from the qkv width, so
    a column shard holds whole heads). The token embedding is split row-wise (by vocabulary, outputs all-reduced) and
    the LM head column-wise with vocabulary-sharded logits left as a DTensor, for ``loss_parallel``'s cross-entropy:
    the same vocabulary-parallel embedding, head and loss colossal_hybrid uses, so neither side computes a whole
    8192-wide head on every rank. Norms and the position embedding stay whole on every rank, as in colossal_hybrid.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan: dict[str, Any] = {
        # Token ids are the same on every rank (Replicate); RowwiseParallel's default input layout, Shard(-1), is
        # for the activations a row-parallel linear receives.
        "token_embedding": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for index in range(len(model.blocks)):
        plan[f"blocks.{index}.attn.qkv"] = ColwiseParallel()
        plan[f"blocks.{index}.attn.proj"] = RowwiseParallel()
        plan[f"blocks.{index}.mlp.fc"] = ColwiseParallel()
        plan[f"blocks.{index}.mlp.proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)


def build_strategy(name: str, init_args: dict[str, Any]) -> Strategy | str:
    """The strategy of a configuration: a registered name, with ``init_args`` merged over its own, or
    ``module:Class(**init_args)``.

    Raises:
        ValueError: the name is neither registered nor importable.
    """
    if ":" in name:
        module_name, _, class_name = name.partition(":")
        strategy_class = getattr(importlib.import_module(module_name), class_name)
        return strategy_class(**init_args)
    if name not in StrategyRegistry:
        available = ", ".join(sorted(StrategyRegistry.keys()))
        raise ValueError(f"Strategy {name!r} is not registered; registered names: {available}; or use module:Class.")
    if not init_args:
        return name  # let the Trainer resolve it exactly as a user's Trainer(strategy=name) would
    entry = StrategyRegistry[name]
    return entry["strategy"](**{**entry["init_params"], **init_args})


def tensor_parallel_parameter_count(trainer: Trainer, module: LightningModule) -> int:
    """Ψₜ: parameters split by tensor parallelism, counted whole (the rest is held whole on every rank).

    Lightning's tensor-parallel peer holds them as DTensors sharded over its ``tensor_parallel`` mesh axis (FSDP2's
    shards, over ``data_parallel``, are not counted); colossal_hybrid holds plain local shards and its engine's plan
    records which parameters were split and their whole shapes.
    """
    strategy = trainer.strategy
    if isinstance(strategy, HybridParallelStrategy):
        engine = strategy.engine
        if engine is None or engine.context.tp_size == 1:
            return 0
        return sum(
            math.prod(engine.names.full_shapes[id(parameter)])
            for parameter in module.parameters()
            if id(parameter) in engine.plan.placements
        )
    count = 0
    for parameter in module.parameters():
        if not isinstance(parameter, DTensor):
            continue
        names = parameter.device_mesh.mesh_dim_names or ()
        if any(
            isinstance(placement, Shard) and names[dim] == "tensor_parallel"
            for dim, placement in enumerate(parameter.placements)
        ):
            count += parameter.numel()
    return count


def parameter_count(model_config: GPTConfig) -> int:
    """Ψ: parameters of the whole model, from a copy on the meta device (no memory, no RNG draw)."""
    with torch.device("meta"):
        return GPT(model_config).num_parameters()


def train_on_cpu(
    strategy: Strategy | str,
    world_size: int,
    max_steps: int,
    module: LightningModule,
    loader: DataLoader,
    callbacks: list[Callback],
    precision: str = "32-true",
) -> Trainer:
    """Fit ``module`` under ``strategy`` with a quiet Trainer (no logger, checkpoints, progress bar or summary: nothing
    but the strategy differs between configurations); returns the Trainer."""
    trainer = Trainer(
        accelerator="cpu",
        precision=precision,
        devices=world_size,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, train_dataloaders=loader)
    return trainer
