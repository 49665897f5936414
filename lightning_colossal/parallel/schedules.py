"""Running one of ``torch.distributed.pipelining``'s schedules (1F1B, interleaved 1F1B, zero-bubble V) over this
rank's stage modules: split the batch into micro-batches, run forward (and backward) of every micro-batch, and return
the mean loss or the last stage's outputs. Which stages a rank runs is ``stages.py``'s ([Note: stage placement]).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
from lightning_colossal.distributed.in_flight import Activity
from lightning_colossal.engine_parts.running_statistics import running_statistics_kept


class _Stage(PipelineStage):
    """torch's ``PipelineStage``, without the start-up messages a rank would send itself, and without the trace its
    trial forward leaves in running statistics (``_prepare_forward_infra``).

    torch 2.11 opens a zero-bubble V schedule with a handshake between neighbouring stages, and in the V the two
    middle stages sit on the same rank: that rank sends to itself, which gloo refuses ("Pair is not connected").
    Those messages carry nothing the rank does not have. Later torch replaced the handshake and never calls this.
    """

    def _get_init_p2p_neighbors_ops(self) -> list[Any]:
        own = collectives.rank(self.group)
        return [operation for operation in super()._get_init_p2p_neighbors_ops() if operation.group_peer != own]

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        # Before a schedule's first step torch runs the stage's forward once, here, to learn its output shapes (in
        # `_forward_metadata_inference` in torch 2.13, `_shape_inference` in older versions, both called from this
        # method): engine_parts/running_statistics.py [Note: a trial forward leaves no statistics].
        with running_statistics_kept(self.submod):
            return super()._prepare_forward_infra(*args, **kwargs)


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
        self._stepped: set[int] = set()  # ids of the schedules that have run a step (their stages are initialised)

    def _schedule(self, num_microbatches: int, training: bool) -> Any:
        # Stages record shapes on first use; one schedule per (micro-batch count, mode) keeps that cache valid.
        key = (num_microbatches, training)
        if key not in self._schedules:
            stages = [
                _Stage(module, index, self.num_stages, self.device, group=self.group)
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
        with _without_anomaly_detection_while_stages_initialise(id(schedule) not in self._stepped):
            schedule.step(*arguments, **kwargs)
        self._stepped.add(id(schedule))
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
            for micro_batch, piece in enumerate(pieces):
                hidden = piece
                for stage in range(self.num_stages):
                    if holders[stage] != own:
                        continue
                    with Activity("evaluating pipeline stage {}, micro-batch {}", stage, micro_batch):
                        hidden = self._run_stage_in_order(stage, hidden, holders, module_of)
                if self.holds_last:
                    assert hidden is not None
                    outputs.append(hidden)
        return PipelineResult(loss=None, outputs=outputs)

    def _run_stage_in_order(
        self, stage: int, hidden: Tensor | None, holders: list[int], module_of: dict[int, nn.Module]
    ) -> Tensor:
        """One stage of ``_evaluate_in_order``: receive from the previous stage's rank, run, send to the next."""
        own = collectives.rank(self.group)
        if stage > 0 and holders[stage - 1] != own:
            hidden = collectives.receive_tensor(holders[stage - 1], self.group, self.device)
        assert hidden is not None
        hidden = module_of[stage](hidden)
        if stage + 1 < self.num_stages and holders[stage + 1] != own:
            collectives.send_tensor(hidden, holders[stage + 1], self.group)
        return hidden


def _scaled_loss(
    loss_function: Callable[[Tensor, Any], Tensor], num_microbatches: int
) -> Callable[[Tensor, Any], Tensor]:
    # Dividing each loss (not the gradients afterwards, as the schedules' scale_grads does) keeps gradients that
    # Lightning accumulates over several batches intact.

    def scaled(output: Tensor, target: Any) -> Tensor:
        return loss_function(output, target) / num_microbatches

    return scaled


@contextmanager
def _without_anomaly_detection_while_stages_initialise(first_step: bool) -> Iterator[None]:
    """Turn ``Trainer(detect_anomaly=True)`` off for a schedule's first step, which initialises its stages.

    torch's pipelining infers the gradients' shapes there with a backward over buffers it never fills, and anomaly
    mode reads the garbage in them as NaN: the stage that sees one raises while its peers wait for it forever. Every
    later step (and so every real gradient after the first) is checked.
    """
    if not (first_step and torch.is_anomaly_enabled()):
        yield
        return
    if collectives.rank() == 0:
        warnings.warn(
            "detect_anomaly=True: the first pipeline step runs without anomaly detection (torch's pipelining infers"
            " gradient shapes on uninitialised buffers there, which anomaly mode reports as NaN); later steps are"
            " checked.",
            stacklevel=2,
        )
    with torch.autograd.set_detect_anomaly(False):
        yield
