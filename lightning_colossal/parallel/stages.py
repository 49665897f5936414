"""Which layers each pipeline stage runs and which pipeline rank runs each stage.

[Note: stage placement]
With ``S`` pipeline ranks and ``C`` chunks per rank there are ``S * C`` stages. 1F1B: rank r runs stage r.
Interleaved: rank r runs stages ``r, r + S, r + 2S, ...`` (a loop, so activations always move to the next rank).
ZB-V: rank r runs stages ``r`` and ``2S - 1 - r`` (a V: the last stage is back on rank 0, next to the first, which
lets the zero-bubble schedule start backward early). Layers are split as evenly as possible, extra layers going to
the middle stages: the first stage also embeds and the last also runs the head and the loss.
"""

from __future__ import annotations

from collections.abc import Sequence


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


def stage_holders(pp_size: int, num_model_chunks: int, schedule: str) -> list[int]:
    """The pipeline rank running each stage, by stage index (the inverse of ``stages_of_rank``)."""
    holders: dict[int, int] = {}
    for rank in range(pp_size):
        for stage in stages_of_rank(rank, pp_size, num_model_chunks, schedule):
            holders[stage] = rank
    return [holders[stage] for stage in range(len(holders))]
