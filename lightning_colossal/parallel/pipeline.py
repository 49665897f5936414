"""Pipeline parallelism: which layers each stage runs, which stages each rank holds, and running a schedule.

The schedules are ``torch.distributed.pipelining``'s (1F1B, interleaved 1F1B, zero-bubble V); this module decides
the split and adapts the step to a training loop: split the batch into micro-batches, run forward and backward of
every micro-batch, and return the mean loss.

[Note: stage placement]
With ``S`` pipeline ranks and ``C`` chunks per rank there are ``S * C`` stages. 1F1B: rank r runs stage r.
Interleaved: rank r runs stages ``r, r + S, r + 2S, ...`` (a loop, so activations always move to the next rank).
ZB-V: rank r runs stages ``r`` and ``2S - 1 - r`` (a V: the last stage is back on rank 0, next to the first, which
lets the zero-bubble schedule start backward early). Layers are split as evenly as possible, extra layers going to
the middle stages: the first stage also embeds and the last also runs the head and the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from lightning_colossal.distributed import collectives


def split_layers(num_layers: int, num_stages: int, layers_per_stage: Sequence[int] | None = None) -> list[range]:
    """Layer index ranges of each stage (see [Note: stage placement]).

    Raises:
        ValueError: fewer layers than stages, or ``layers_per_stage`` not summing to ``num_layers``.
    """
    if layers_per_stage is not None:
        if sum(layers_per_stage) != num_layers or len(layers_per_stage) != num_stages:
            raise ValueError(
                f"layers_per_stage={list(layers_per_stage)} must have {num_stages} entries summing to the model's"
                f" {num_layers} layers."
            )
        counts = list(layers_per_stage)
    else:
        if num_layers < num_stages:
            raise ValueError(
                f"The model has {num_layers} layers but the pipeline has {num_stages} stages (pp_size *"
                " num_model_chunks): every stage needs at least one layer; lower pp_size or num_model_chunks."
            )
        base, extra = divmod(num_layers, num_stages)
        counts = [base] * num_stages
        # Extra layers go to the middle stages: the first and last stages also embed and compute the head/loss.
        middle = (num_stages - extra) // 2
        for index in range(middle, middle + extra):
            counts[index] += 1
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def stages_of_rank(pp_rank: int, pp_size: int, num_model_chunks: int, schedule: str) -> list[int]:
    """Stage indices pipeline rank ``pp_rank`` runs, in chunk order (see [Note: stage placement])."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + chunk * pp_size for chunk in range(num_model_chunks)]


def microbatch_count(batch_size: int, num_microbatches: int | None, microbatch_size: int | None) -> int:
    """How many micro-batches a batch of ``batch_size`` samples splits into; raises when it does not split evenly."""
    if num_microbatches is not None:
        if batch_size % num_microbatches != 0:
            raise ValueError(
                f"A batch of {batch_size} samples does not split into num_microbatches={num_microbatches} equal"
                " micro-batches: use a batch size divisible by it (drop_last=True in the DataLoader for a short"
                " last batch)."
            )
        return num_microbatches
    assert microbatch_size is not None
    if batch_size % microbatch_size != 0:
        raise ValueError(
            f"A batch of {batch_size} samples does not split into micro-batches of microbatch_size={microbatch_size}:"
            " use a batch size divisible by it (drop_last=True in the DataLoader for a short last batch)."
        )
    return batch_size // microbatch_size


@dataclass
class PipelineResult:
    """What one pipeline step produced on this rank."""

    loss: Tensor | None  # mean over micro-batches; only on the rank holding the last stage
    outputs: list[Tensor]  # last-stage outputs per micro-batch (forward-only runs), else empty


class PipelineRunner:
    """Runs one schedule over this rank's stage modules.

    Args:
        stage_modules: this rank's stage modules, in chunk order (``stages_of_rank``).
        stage_indices: their global stage indices.
        num_stages: stages in total.
        group: the pipeline-parallel process group.
        device: where the stages compute.
        schedule: ``"1f1b"``, ``"interleaved"`` or ``"zbv"``.
        loss_function: ``(last-stage output, targets) -> scalar`` for one micro-batch.
    """

    def __init__(
        self,
        stage_modules: list[nn.Module],
        stage_indices: list[int],
        num_stages: int,
        group: ProcessGroup,
        device: torch.device,
        schedule: str,
        loss_function: Callable[[Tensor, Any], Tensor],
    ) -> None:
        self.stage_modules = stage_modules
        self.stage_indices = stage_indices
        self.num_stages = num_stages
        self.group = group
        self.device = device
        self.schedule_name = schedule
        self.loss_function = loss_function
        self.holds_first = 0 in stage_indices
        self.holds_last = num_stages - 1 in stage_indices
        self._schedules: dict[tuple[int, bool], Any] = {}

    def _schedule(self, num_microbatches: int, training: bool) -> Any:
        # Stages record shapes on first use; one schedule per (micro-batch count, mode) keeps that cache valid.
        key = (num_microbatches, training)
        if key not in self._schedules:
            stages = [
                PipelineStage(module, index, self.num_stages, self.device, group=self.group)
                for module, index in zip(self.stage_modules, self.stage_indices, strict=True)
            ]
            loss = _scaled_loss(self.loss_function, num_microbatches) if training else None
            if self.schedule_name == "1f1b":
                schedule: Any = Schedule1F1B(stages[0], num_microbatches, loss_fn=loss, scale_grads=False)
            elif self.schedule_name == "interleaved":
                schedule = ScheduleInterleaved1F1B(stages, num_microbatches, loss_fn=loss, scale_grads=False)
            else:
                schedule = ScheduleZBVZeroBubble(stages, num_microbatches, loss_fn=loss, scale_grads=False)
            self._schedules[key] = schedule
        return self._schedules[key]

    def train_step(self, inputs: Tensor | None, targets: Any, num_microbatches: int) -> PipelineResult:
        """Forward and backward of every micro-batch; gradients accumulate (summed) into the stage parameters.

        The loss of each micro-batch is divided by ``num_microbatches`` before its backward, so the accumulated
        gradients are those of the mean loss over the whole batch, as a single-process step would compute.
        """
        schedule = self._schedule(num_microbatches, training=True)
        losses: list[Tensor] = []
        kwargs: dict[str, Any] = {}
        if self.holds_last:
            kwargs["target"] = targets
            kwargs["losses"] = losses
        arguments = (inputs,) if self.holds_first else ()
        schedule.step(*arguments, **kwargs)
        # Each micro-batch loss was divided by the count already (see _scaled_loss): their sum is the mean.
        loss = torch.stack([value.detach() for value in losses]).sum() if self.holds_last else None
        return PipelineResult(loss=loss, outputs=[])

    def evaluate(self, inputs: Tensor | None, num_microbatches: int, holders: list[int]) -> PipelineResult:
        """Forward only; the last stage's outputs per micro-batch come back on the rank holding it.

        ``holders[s]`` is the pipeline rank running stage ``s``. torch's zero-bubble V schedule has no forward-only
        mode, so under ``zbv`` micro-batches go through the stages one after the other (no overlap; evaluation has
        no backward to overlap with anyway, only the pipeline fill).
        """
        if self.schedule_name == "zbv":
            return self._evaluate_in_order(inputs, num_microbatches, holders)
        schedule = self._schedule(num_microbatches, training=False)
        arguments = (inputs,) if self.holds_first else ()
        with torch.no_grad():
            output = schedule.eval(*arguments)  # the micro-batch outputs concatenated, on the last stage only
        outputs = list(output.chunk(num_microbatches)) if self.holds_last else []
        return PipelineResult(loss=None, outputs=outputs)

    def _evaluate_in_order(self, inputs: Tensor | None, num_microbatches: int, holders: list[int]) -> PipelineResult:
        own = collectives.rank(self.group)
        module_of = dict(zip(self.stage_indices, self.stage_modules, strict=True))
        pieces: list[Tensor | None] = (
            list(inputs.chunk(num_microbatches)) if inputs is not None else [None] * num_microbatches
        )
        outputs = []
        with torch.no_grad():
            for piece in pieces:
                hidden = piece
                for stage in range(self.num_stages):
                    if holders[stage] != own:
                        continue
                    if stage > 0 and holders[stage - 1] != own:
                        hidden = collectives.receive_tensor(holders[stage - 1], self.group, self.device)
                    assert hidden is not None
                    hidden = module_of[stage](hidden)
                    if stage + 1 < self.num_stages and holders[stage + 1] != own:
                        collectives.send_tensor(hidden, holders[stage + 1], self.group)
                if self.holds_last:
                    assert hidden is not None
                    outputs.append(hidden)
        return PipelineResult(loss=None, outputs=outputs)


def _scaled_loss(
    loss_function: Callable[[Tensor, Any], Tensor], num_microbatches: int
) -> Callable[[Tensor, Any], Tensor]:
    # Dividing each loss (not the gradients afterwards, as the schedules' scale_grads does) keeps gradients that
    # Lightning accumulates over several batches intact.
    def scaled(output: Tensor, target: Any) -> Tensor:
        return loss_function(output, target) / num_microbatches

    return scaled


def broadcast_from_last_stage(
    value: Tensor | None, holds_last: bool, group: ProcessGroup, device: torch.device
) -> Tensor:
    """Give every pipeline rank the last stage's scalar (e.g. the loss for logging): one sum all-reduce."""
    scalar = value.detach().float().reshape(()) if holds_last and value is not None else torch.zeros((), device=device)
    scalar = scalar.clone()
    collectives.all_reduce(scalar, op="sum", group=group)
    return scalar
