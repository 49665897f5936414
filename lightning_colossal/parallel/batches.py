"""What the hybrid engine reads from a training loop's batch: a pipeline's inputs, targets and micro-batch count, and
each sequence-parallel rank's share of the sequence."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from torch import Tensor

from lightning_colossal.config import PipelineConfig
from lightning_colossal.parallel.sequence_layout import shard_sequence


class PipelineBatch(NamedTuple):
    """One batch as the pipeline schedule takes it."""

    inputs: Tensor  # read by the first stage
    targets: Any  # passed with the last stage's outputs to the loss; None for prediction batches without them
    num_microbatches: int


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


def pipeline_inputs(batch: Any, targets_required: bool = True) -> tuple[Tensor, Any]:
    """(inputs, targets) of an ``(inputs, targets)`` pair or a dict with ``input_ids`` and ``labels``."""
    if isinstance(batch, (tuple, list)) and (len(batch) == 2 or (batch and not targets_required)):
        return batch[0], batch[1] if len(batch) > 1 else None
    if isinstance(batch, Mapping) and "input_ids" in batch and ("labels" in batch or not targets_required):
        mask = batch.get("attention_mask")
        # Stages receive token ids only. Right padding is harmless under causal attention (no real token attends
        # to a later pad; give pads the label -100); padding before real tokens would be attended silently.
        if isinstance(mask, Tensor) and mask.dim() == 2 and bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ValueError(
                "With pp_size > 1 the pipeline stages get no attention_mask, but this batch has padding before real"
                " tokens (left padding): pad on the right (tokenizer.padding_side = 'right', labels -100 on the"
                " pads) or pack sequences without padding."
            )
        return batch["input_ids"], batch.get("labels")
    raise TypeError(
        "With pp_size > 1 a batch must be an (inputs, targets) pair or a dict with 'input_ids' and 'labels': the"
        " first stage reads the inputs and the last stage passes the targets to `pipeline_loss`."
    )


def pipeline_batch(batch: Any, config: PipelineConfig, targets_required: bool = True) -> PipelineBatch:
    """Inputs, targets and micro-batch count of a pipeline batch; a bare tensor is inputs only (prediction)."""
    if isinstance(batch, Tensor) and not targets_required:
        inputs, targets = batch, None
    else:
        inputs, targets = pipeline_inputs(batch, targets_required)
    count = microbatch_count(inputs.shape[0], config.num_microbatches, config.microbatch_size)
    return PipelineBatch(inputs, targets, count)


def split_sequence(batch: Any, sp_size: int, sp_rank: int, layout: str = "contiguous") -> Any:
    """This sequence-parallel rank's tokens of every ``[batch, sequence, ...]`` tensor in ``batch``: a contiguous slice
    (Ulysses) or the two zigzag chunks (ring attention), [Note: sequence layouts] in ``sequence_layout.py``."""
    if sp_size == 1:
        return batch

    def split(tensor: Tensor) -> Tensor:
        if tensor.dim() < 2:
            return tensor
        return shard_sequence(tensor, 1, sp_size, sp_rank, layout)

    return map_tensors(batch, split)


def map_tensors(data: Any, function: Callable[[Tensor], Any]) -> Any:
    """``data`` with ``function`` applied to every tensor inside mappings, lists, tuples (named too) and dataclasses,
    each rebuilt as its own type; anything else is kept as is.

    (What Lightning's ``apply_to_collection`` does for batches, without importing Lightning here. torch's pytree
    would pass over mapping types it does not know, such as Hugging Face's ``BatchEncoding``.)
    """
    if isinstance(data, Tensor):
        return function(data)
    if isinstance(data, Mapping):
        mapped = {key: map_tensors(value, function) for key, value in data.items()}
        if isinstance(data, defaultdict):
            return type(data)(data.default_factory, mapped)
        mapping_type: Any = type(data)  # a Mapping subclass built from a dict (OrderedDict, BatchEncoding, ...)
        return mapped if mapping_type is dict else mapping_type(mapped)
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # a named tuple takes its fields as arguments
        return type(data)(*(map_tensors(value, function) for value in data))
    if isinstance(data, (list, tuple)):
        return type(data)(map_tensors(value, function) for value in data)
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        changed = {
            field.name: map_tensors(getattr(data, field.name), function)
            for field in dataclasses.fields(data)
            if field.init
        }
        return dataclasses.replace(data, **changed)
    return data
