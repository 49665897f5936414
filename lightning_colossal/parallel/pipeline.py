"""The pipeline part of the hybrid engine (``pp_size > 1`` only): cutting the model into this rank's stages, the
weights tied across stages, and one training, evaluation or prediction step of the schedule, whose result every
pipeline rank receives. Which stages a rank runs: ``stages.py``; running torch's schedules: ``schedules.py``.

[Note: tied weights across stages]
The embedding (first stage) and a tied LM head (last stage) are one parameter in the user's model and two copies
under pipelining. Their gradients are summed over the stages that hold them before the data-parallel reduction,
so both copies take identical steps. Optimizer state is saved under the parameter's first name (its canonical
name), which both copies share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_colossal.config import PipelineConfig
from lightning_colossal.distributed import collectives
from lightning_colossal.distributed.in_flight import Activity
from lightning_colossal.parallel.batches import pipeline_batch
from lightning_colossal.parallel.groups import HybridGroups, stage_tie_group
from lightning_colossal.parallel.names import ParameterNames
from lightning_colossal.parallel.policy import ModelPolicy
from lightning_colossal.parallel.schedules import PipelineRunner
from lightning_colossal.parallel.stages import split_layers, stage_holders, stages_of_rank
from lightning_colossal.parallel.tensor_parallel import ParallelContext, loss_context, vocab_sharded

LossFunction = Callable[[Tensor, Any], Tensor]


class PipelineStep:
    """Cuts ``model`` into this rank's stages (in place) and runs the schedule's steps over them.

    Args:
        root: the module whose parameter names checkpoints use (the LightningModule).
        model: the model the policy knows (``root`` itself or one of its submodules), already tensor-parallel.
        policy: the model's policy (it knows the layer stack, the embedding and the head).
        config: the pipeline settings.
        groups: process groups from ``groups.build_groups``.
        context: the tensor-parallel groups (the last stage may return vocabulary-sharded logits).
        names: the whole model's names (weights tied across stages have several).
        device: where the stages compute.
        timeout: timeout of the group created here for the tied weights.
        reduction_deferred: a context in which the data-parallel reduction waits: the schedule runs backward
            micro-batch by micro-batch, and the engine reduces once, after the step.
    """

    def __init__(
        self,
        root: nn.Module,
        model: nn.Module,
        policy: ModelPolicy,
        config: PipelineConfig,
        groups: HybridGroups,
        context: ParallelContext,
        names: ParameterNames,
        device: torch.device,
        timeout: timedelta,
        reduction_deferred: Callable[[], AbstractContextManager[Any]],
    ) -> None:
        assert groups.pp_group is not None
        self.config = config
        self.group = groups.pp_group
        self.context = context
        self.device = device
        self._reduction_deferred = reduction_deferred
        schedule, chunks = self.config.pp_schedule, self.config.num_model_chunks
        stage_indices = stages_of_rank(groups.pp_rank, groups.pp_size, chunks, schedule)
        modules = self._cut(model, policy, config.num_stages, stage_indices)
        #: Pipeline rank running each stage.
        self.stage_holders = stage_holders(groups.pp_size, chunks, schedule)
        self.tied, self.tie_group = self._join_tied_weights(root, names, groups, timeout)
        self._tied_keys = {id(parameter) for parameter in self.tied}
        self.runner = PipelineRunner(
            modules, stage_indices, config.num_stages, self.group, device, schedule, self._stage_loss
        )
        # The user's per-micro-batch loss and the factor (accumulation, loss scale) of the running step.
        self._loss_function: LossFunction | None = None
        self._loss_multiplier = 1.0

    def _cut(self, model: nn.Module, policy: ModelPolicy, num_stages: int, stage_indices: list[int]) -> list[nn.Module]:
        """This rank's stage modules; the layers, embedding and head of other ranks' stages are pruned."""
        ranges = split_layers(len(policy.layers(model)), num_stages, self.config.layers_per_stage)
        last = num_stages - 1
        modules = [
            policy.stage_module(model, list(ranges[index]), index == 0, index == last, self.context)
            for index in stage_indices
        ]
        keep = {layer for index in stage_indices for layer in ranges[index]}
        policy.prune(model, keep, first=0 in stage_indices, last=last in stage_indices)
        # Whether the last stage returns this rank's vocabulary slice of the logits (a vocabulary-parallel head).
        self._stage_logits_sharded = any(getattr(module, "vocab_parallel_output", False) for module in modules)
        return modules

    def _join_tied_weights(
        self, root: nn.Module, names: ParameterNames, groups: HybridGroups, timeout: timedelta
    ) -> tuple[list[nn.Parameter], Any]:
        """The weights this rank shares with another stage, and the group summing their gradients (see [Note: tied
        weights across stages])."""
        # The first and last stage's ranks (0 and S-1; both 0 under the V schedule) share the tied weights.
        holders = sorted({0, self.stage_holders[-1]})
        tie_group = stage_tie_group(groups.mesh, holders, timeout) if len(holders) > 1 else None
        if tie_group is None:
            return [], None
        # Parameters that had several names in the whole model and survived pruning on this rank.
        return [parameter for parameter in root.parameters() if len(names.names_of[id(parameter)]) > 1], tie_group

    @property
    def holds_first(self) -> bool:
        return self.runner.holds_first

    @property
    def holds_last(self) -> bool:
        return self.runner.holds_last

    # ---------------------------------------------------------------------------------------------- gradients
    def sum_tied_gradients(self) -> None:
        """Sum the gradients of the weights tied across stages, so both copies take the same step."""
        if self.tie_group is None:
            return
        for parameter in self.tied:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            with Activity("summing the gradients of weights tied across pipeline stages"):
                collectives.sum_within_group(parameter.grad, self.tie_group)

    def counts_in_norm(self, parameter_key: int) -> bool:
        """Whether this rank's stages count parameter ``parameter_key`` in the gradient norm: a weight tied across
        stages is counted by the first stage only."""
        return parameter_key not in self._tied_keys or self.holds_first

    # ---------------------------------------------------------------------------------------------- steps
    def _stage_loss(self, output: Tensor, target: Any) -> Tensor:
        """The user's loss on the last stage's output (runs inside ``loss_context``)."""
        assert self._loss_function is not None
        if self._stage_logits_sharded and output.dim() >= 1:
            loss = self._loss_function(vocab_sharded(output, self.context), target)
            if isinstance(loss, DTensor):
                loss = loss.to_local()
        else:
            loss = self._loss_function(output, target)
        return loss * self._loss_multiplier

    def train_step(self, batch: Any, loss_function: LossFunction, loss_multiplier: float) -> Tensor:
        """Forward and backward of every micro-batch of ``batch``; the batch's mean loss, on every pipeline rank.

        ``loss_multiplier`` scales each micro-batch loss before backward (loss scale / accumulation), not the result.
        """
        inputs, targets, num_microbatches = pipeline_batch(batch, self.config)
        self._loss_function = loss_function
        self._loss_multiplier = loss_multiplier
        with self._reduction_deferred(), loss_context(self.context):
            result = self.runner.train_step(inputs, targets, num_microbatches)
        return self._loss_from_last_stage(None if result.loss is None else result.loss / loss_multiplier)

    def evaluate(self, batch: Any, loss_function: LossFunction) -> Tensor:
        """Forward-only schedule; the mean loss over the micro-batches of ``batch``, on every pipeline rank."""
        inputs, targets, num_microbatches = pipeline_batch(batch, self.config)
        result = self.runner.evaluate(inputs if self.holds_first else None, num_microbatches, self.stage_holders)
        if not self.holds_last:
            return self._loss_from_last_stage(None)
        self._loss_function = loss_function
        self._loss_multiplier = 1.0
        target_pieces = targets.chunk(num_microbatches) if isinstance(targets, Tensor) else [targets]
        with torch.no_grad(), loss_context(self.context):
            losses = [
                self._stage_loss(output, target) for output, target in zip(result.outputs, target_pieces, strict=True)
            ]
        return self._loss_from_last_stage(torch.stack(losses).mean())

    def predict(self, batch: Any) -> Tensor | None:
        """Forward-only schedule; the whole batch's last-stage outputs (logits gathered over the vocabulary
        shards) on the rank holding the last stage, ``None`` elsewhere (``share_from_last_stage`` sends them on)."""
        inputs, _, num_microbatches = pipeline_batch(batch, self.config, targets_required=False)
        result = self.runner.evaluate(inputs if self.holds_first else None, num_microbatches, self.stage_holders)
        if not self.holds_last:
            return None
        outputs = torch.cat(result.outputs)
        if self._stage_logits_sharded:
            outputs = collectives.gather_along(outputs.contiguous(), outputs.dim() - 1, self.context.tp_group)
        return outputs

    def share_from_last_stage(self, value: Any) -> Any:
        """The last stage's ``value`` (any picklable object) on every pipeline rank."""
        return collectives.broadcast_object(value, source_rank=self.stage_holders[-1], group=self.group)

    def _loss_from_last_stage(self, loss: Tensor | None) -> Tensor:
        """Give every pipeline rank the last stage's scalar (the loss, for logging): one sum all-reduce."""
        if self.holds_last and loss is not None:
            scalar = loss.detach().float().reshape(()).clone()
        else:
            scalar = torch.zeros((), device=self.device)
        with Activity("sharing the last pipeline stage's loss"):
            collectives.all_reduce(scalar, op="sum", group=self.group)
        return scalar


class GradientStash:
    """Gradients set aside across a training loop's ``zero_grad`` between a step that already ran backward (the
    pipeline schedule) and the loop's own backward call, where they are put back. (Lightning zeroes gradients
    between ``training_step`` and ``backward``.)"""

    def __init__(self) -> None:
        self._stashed: list[tuple[nn.Parameter, Tensor]] = []

    def set_aside(self, parameters: Iterable[nn.Parameter]) -> None:
        self._stashed = [(parameter, parameter.grad) for parameter in parameters if parameter.grad is not None]
        for parameter, _ in self._stashed:
            parameter.grad = None

    def put_back(self) -> None:
        for parameter, gradient in self._stashed:
            parameter.grad = gradient
        self._stashed = []
