"""Hybrid-parallel layout logic: layer split, stage placement, micro-batches, shards and config validation.

Pure logic, no process group: every rank's view is computed in this process.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_colossal  # noqa: F401  (registers the strategy names)
from lightning_colossal.config import (
    AllToAll,
    GradientAveraging,
    HybridConfig,
    PipelineConfig,
    Ring,
    SplitGather,
    ZeroConfig,
)
from lightning_colossal.distributed.mesh import ParallelDims
from lightning_colossal.parallel.batches import map_tensors, microbatch_count, pipeline_inputs, split_sequence
from lightning_colossal.parallel.stages import split_layers, stage_holders, stages_of_rank
from lightning_colossal.parallel.tensor_parallel import TensorParallelPlacement, shard_of
from lightning_colossal.strategies.hybrid import HybridParallelStrategy


def counts_of(ranges: list[range]) -> list[int]:
    return [len(layer_range) for layer_range in ranges]


# ---------------------------------------------------------------------------------------------------------------
# split_layers
# ---------------------------------------------------------------------------------------------------------------


def test_split_layers_even_split_is_contiguous_and_complete():
    ranges = split_layers(8, 4)
    assert ranges == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [layer for layer_range in ranges for layer in layer_range] == list(range(8))


def test_split_layers_gives_the_remainder_to_the_middle_stages():
    assert counts_of(split_layers(10, 4)) == [2, 3, 3, 2]
    assert split_layers(10, 4) == [range(0, 2), range(2, 5), range(5, 8), range(8, 10)]
    assert counts_of(split_layers(5, 4)) == [1, 2, 1, 1]  # middle = (4 - 1) // 2 = 1
    assert counts_of(split_layers(7, 5)) == [1, 2, 2, 1, 1]  # middle = (5 - 2) // 2 = 1
    assert counts_of(split_layers(11, 4)) == [3, 3, 3, 2]  # extra = 3 covers stages 0..2


@pytest.mark.parametrize("num_stages", [3, 4, 5, 6, 8])
def test_split_layers_never_favours_the_first_or_last_stage(num_stages):
    for num_layers in range(num_stages, 4 * num_stages + 1):
        counts = counts_of(split_layers(num_layers, num_stages))
        assert sum(counts) == num_layers
        assert max(counts) - min(counts) <= 1
        middle_minimum = min(counts[1:-1])
        assert counts[0] <= middle_minimum, (num_layers, counts)
        assert counts[-1] <= middle_minimum, (num_layers, counts)


def test_split_layers_honours_explicit_layers_per_stage():
    assert split_layers(8, 3, layers_per_stage=[1, 5, 2]) == [range(0, 1), range(1, 6), range(6, 8)]


def test_split_layers_rejects_fewer_layers_than_stages():
    with pytest.raises(ValueError, match="lower pp_size or num_model_chunks"):
        split_layers(3, 4)


def test_split_layers_rejects_a_wrong_layers_per_stage():
    with pytest.raises(ValueError, match="must have 3 entries summing"):
        split_layers(8, 3, layers_per_stage=[2, 2, 2])
    with pytest.raises(ValueError, match="must have 3 entries summing"):
        split_layers(8, 3, layers_per_stage=[4, 4])


# ---------------------------------------------------------------------------------------------------------------
# stages_of_rank
# ---------------------------------------------------------------------------------------------------------------


def test_stages_of_rank_for_each_schedule():
    assert [stages_of_rank(rank, 4, 1, "1f1b") for rank in range(4)] == [[0], [1], [2], [3]]
    assert stages_of_rank(0, 2, 2, "interleaved") == [0, 2]
    assert stages_of_rank(1, 2, 2, "interleaved") == [1, 3]
    assert stages_of_rank(0, 2, 2, "zbv") == [0, 3]
    assert stages_of_rank(1, 2, 2, "zbv") == [1, 2]
    assert stages_of_rank(1, 4, 3, "interleaved") == [1, 5, 9]


@pytest.mark.parametrize(
    "schedule, num_model_chunks", [("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zbv", 2)]
)
@pytest.mark.parametrize("pp_size", [2, 3, 4, 8])
def test_schedule_table_places_every_stage_on_exactly_one_rank(schedule, num_model_chunks, pp_size):
    table = [stages_of_rank(rank, pp_size, num_model_chunks, schedule) for rank in range(pp_size)]
    assert all(len(stages) == num_model_chunks for stages in table)
    placed = sorted(stage for stages in table for stage in stages)
    assert placed == list(range(pp_size * num_model_chunks))


def test_zbv_puts_the_last_stage_next_to_the_first():
    for pp_size in (2, 4, 8):
        assert stages_of_rank(0, pp_size, 2, "zbv") == [0, 2 * pp_size - 1]


@pytest.mark.parametrize(
    "schedule, num_model_chunks", [("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zbv", 2)]
)
@pytest.mark.parametrize("pp_size", [2, 3, 4])
def test_stage_holders_invert_the_schedule_table(schedule, num_model_chunks, pp_size):
    holders = stage_holders(pp_size, num_model_chunks, schedule)
    assert len(holders) == pp_size * num_model_chunks
    for rank in range(pp_size):
        assert [stage for stage, holder in enumerate(holders) if holder == rank] == sorted(
            stages_of_rank(rank, pp_size, num_model_chunks, schedule)
        )


# ---------------------------------------------------------------------------------------------------------------
# microbatch_count
# ---------------------------------------------------------------------------------------------------------------


def test_microbatch_count_from_either_setting():
    assert microbatch_count(16, num_microbatches=4, microbatch_size=None) == 4
    assert microbatch_count(16, num_microbatches=None, microbatch_size=2) == 8
    assert microbatch_count(6, num_microbatches=None, microbatch_size=6) == 1


def test_microbatch_count_rejects_an_uneven_batch():
    with pytest.raises(ValueError, match="drop_last"):
        microbatch_count(10, num_microbatches=4, microbatch_size=None)
    with pytest.raises(ValueError, match="divisible"):
        microbatch_count(10, num_microbatches=None, microbatch_size=4)


# ---------------------------------------------------------------------------------------------------------------
# shard_of
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [0, 1])
def test_shards_of_all_ranks_concatenate_back_to_the_tensor(dim):
    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    pieces = [shard_of(full, TensorParallelPlacement(dim), rank, 4) for rank in range(4)]
    assert all(piece.shape[dim] == full.shape[dim] // 4 for piece in pieces)
    assert torch.equal(torch.cat(pieces, dim=dim), full)


def test_fused_shard_takes_its_slice_of_each_block():
    full = torch.arange(12 * 3, dtype=torch.float32).reshape(12, 3)  # q, k, v blocks of 4 rows each
    blocks = full.chunk(3, dim=0)
    for rank in range(2):
        piece = shard_of(full, TensorParallelPlacement(0, fused_parts=3), rank, 2)
        expected = torch.cat([block[2 * rank : 2 * rank + 2] for block in blocks], dim=0)
        assert torch.equal(piece, expected)
    assert shard_of(full, TensorParallelPlacement(0, fused_parts=3), 1, 2)[:, 0].tolist() == [6, 9, 18, 21, 30, 33]


def test_shard_of_rejects_an_indivisible_dimension_and_passes_size_one_through():
    full = torch.zeros(6, 4)
    with pytest.raises(ValueError, match="does not split into 4"):
        shard_of(full, TensorParallelPlacement(0), 0, 4)
    with pytest.raises(ValueError, match="fused blocks"):
        shard_of(full, TensorParallelPlacement(0, fused_parts=3), 0, 4)
    assert shard_of(full, TensorParallelPlacement(0), 0, 1) is full


# ---------------------------------------------------------------------------------------------------------------
# HybridConfig, PipelineConfig, ParallelDims, HybridParallelStrategy
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"zero_stage": 2, "pp_size": 2, "num_microbatches": 4}, "zero_stage=1 with pipelines"),
        ({"zero_stage": 3}, "colossal_gemini"),
        ({"pp_size": 2}, "exactly one of num_microbatches"),
        ({"pp_size": 2, "num_microbatches": 4, "microbatch_size": 2}, "exactly one of num_microbatches"),
        ({"pp_size": 2, "num_microbatches": 4, "pp_schedule": "interleaved"}, "num_model_chunks >= 2"),
        ({"pp_size": 2, "num_microbatches": 4, "pp_schedule": "zbv", "num_model_chunks": 3}, "exactly two chunks"),
        ({"pp_size": 2, "num_microbatches": 4, "num_model_chunks": 2}, "runs one model chunk per rank"),
        ({"sequence_parallel": "split_gather"}, "but tp_size=1"),
        ({"sequence_parallel": "split_gather", "tp_size": 2, "sp_size": 2}, "Ulysses axis"),
        ({"sequence_parallel": "all_to_all"}, "needs sp_size > 1"),
        ({"pp_size": 2, "num_microbatches": 4, "layers_per_stage": (4, 4, 4)}, "pp_size \\* num_model_chunks = 2"),
        ({"pp_size": 2, "num_microbatches": 4, "layers_per_stage": (8, 0)}, "positive entries"),
        ({"num_model_chunks": 2}, "but pp_size=1"),
        ({"layers_per_stage": (4,)}, "but pp_size=1"),
        ({"tp_size": 0}, "tp_size=0"),
        ({"sp_size": True}, "sp_size=True"),
        ({"pp_size": 2, "microbatch_size": 0}, "microbatch_size=0"),
        ({"bucket_size_mb": 0}, "bucket_size_mb"),
        ({"bucket_size_mb": float("inf")}, "finite positive"),
        ({"pp_schedule": "gpipe"}, "pp_schedule='gpipe'"),
    ],
)
def test_hybrid_config_rejects_invalid_settings(arguments, message):
    # The strategy's flat keyword arguments, the pipeline's among them.
    with pytest.raises(ValueError, match=message):
        HybridConfig.from_flat_arguments(**arguments)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: HybridConfig(pipeline=PipelineConfig(pp_size=2)), "exactly one of num_microbatches"),
        (lambda: HybridConfig(pipeline=PipelineConfig(pp_size=1, num_microbatches=4)), "but pp_size=1"),
        (
            lambda: HybridConfig(pipeline=PipelineConfig(pp_size=2, num_microbatches=4, layers_per_stage=(4, 4, 4))),
            "= 2 positive",
        ),
        (
            lambda: HybridConfig(
                pipeline=PipelineConfig(pp_size=2, num_microbatches=4), data_parallel=ZeroConfig(stage=2)
            ),
            "zero_stage=1 with pipe",
        ),
        (lambda: HybridConfig(sequence_parallelism=SplitGather()), "but tp_size=1"),
        (lambda: HybridConfig(sequence_parallelism=AllToAll(sp_size=1)), "needs sp_size > 1"),
        (lambda: HybridConfig(sequence_parallelism=Ring(sp_size=1)), "'ring' needs sp_size > 1"),
        (lambda: HybridConfig.from_flat_arguments(sequence_parallel="rings"), "'all_to_all' or 'ring'"),
    ],
)
def test_nested_hybrid_config_checks_the_pipeline_against_pp_size(build, message):
    # The parts own their sizes (the pipeline its pp_size, Ulysses its sp_size), so a pipeline of one rank or a
    # pipeline without its micro-batch setting cannot be built at all.
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({}, "exactly one of num_microbatches"),
        ({"num_microbatches": 4, "microbatch_size": 2}, "exactly one of num_microbatches"),
        ({"num_microbatches": 0}, "num_microbatches=0"),
        ({"num_microbatches": 4, "pp_schedule": "gpipe"}, "pp_schedule='gpipe'"),
        ({"num_microbatches": 4, "num_model_chunks": 0}, "num_model_chunks=0"),
        ({"num_microbatches": 4, "pp_schedule": "interleaved"}, "num_model_chunks >= 2"),
        ({"num_microbatches": 4, "layers_per_stage": (8, 0)}, "positive entries"),
        ({"num_microbatches": 4, "layers_per_stage": (8, 8, 8)}, "pp_size \\* num_model_chunks = 2"),
        ({"num_microbatches": 4, "pp_size": 1}, "but pp_size=1"),
        ({"num_microbatches": 4, "pp_size": 0}, "pp_size=0"),
    ],
)
def test_pipeline_config_rejects_invalid_settings(arguments, message):
    with pytest.raises(ValueError, match=message):
        PipelineConfig(**{"pp_size": 2, **arguments})


def test_hybrid_config_defaults_sequence_parallel_to_all_to_all_with_sp():
    assert HybridConfig.from_flat_arguments(sp_size=2).sequence_parallelism == AllToAll(sp_size=2)
    assert HybridConfig.from_flat_arguments(sp_size=2).sp_size == 2
    assert HybridConfig().sequence_parallelism is None
    assert HybridConfig.from_flat_arguments().sequence_parallelism is None
    split_gather = HybridConfig.from_flat_arguments(tp_size=2, sequence_parallel="split_gather")
    assert split_gather.sequence_parallelism == SplitGather()
    assert split_gather.sp_size == 1
    ring = HybridConfig.from_flat_arguments(sp_size=4, tp_size=2, zero_stage=1, sequence_parallel="ring")
    assert ring.sequence_parallelism == Ring(sp_size=4) and ring.sp_size == 4 and ring.model_parallel_size == 8


def test_hybrid_config_holds_a_whole_zero_config():
    """zero_stage > 0 builds a ZeroConfig from the flat arguments, the further ZeRO settings included; zero_stage=0
    averages gradients and refuses ZeRO settings that are not at their defaults."""
    zero = HybridConfig.from_flat_arguments(zero_stage=1, bucket_size_mb=4.0, communication="all_reduce")
    assert zero.data_parallel == ZeroConfig(stage=1, bucket_size_mb=4.0, communication="all_reduce")
    assert zero.zero_stage == 1
    averaging = HybridConfig.from_flat_arguments(bucket_size_mb=4.0)
    assert averaging.data_parallel == GradientAveraging(bucket_size_mb=4.0)
    assert averaging.zero_stage == 0
    assert HybridConfig.from_flat_arguments(communication="auto").data_parallel == GradientAveraging()
    with pytest.raises(ValueError, match="configures ZeRO, but zero_stage=0: set zero_stage=1"):
        HybridConfig.from_flat_arguments(communication="all_reduce")
    with pytest.raises(ValueError, match="communication='gather'"):
        HybridConfig.from_flat_arguments(zero_stage=1, communication="gather")
    with pytest.raises(TypeError, match="zero_stage"):
        HybridConfig.from_flat_arguments(stage=1)
    with pytest.raises(TypeError, match="not a setting"):
        HybridConfig.from_flat_arguments(zero_stage=1, overlap=False)


def test_hybrid_config_sizes_of_valid_settings():
    config = HybridConfig.from_flat_arguments(tp_size=2, pp_size=2, sp_size=2, num_microbatches=4)
    assert (config.model_parallel_size, config.num_stages) == (8, 2)
    interleaved = HybridConfig.from_flat_arguments(
        pp_size=4, pp_schedule="interleaved", num_model_chunks=3, microbatch_size=2
    )
    assert (interleaved.model_parallel_size, interleaved.num_stages) == (4, 12)
    zbv = HybridConfig.from_flat_arguments(
        pp_size=2, pp_schedule="zbv", num_model_chunks=2, num_microbatches=4, layers_per_stage=[1, 2, 2, 1]
    )
    assert zbv.num_stages == 4
    assert zbv.pipeline is not None and zbv.pipeline.layers_per_stage == (1, 2, 2, 1)  # a list is stored as a tuple
    assert (HybridConfig().model_parallel_size, HybridConfig().num_stages) == (1, 1)
    # pp_size=1 has no pipeline part; its micro-batch settings are ignored, as before the pipeline had its own type.
    assert HybridConfig.from_flat_arguments(tp_size=2, num_microbatches=4).pipeline is None
    nested = HybridConfig(pipeline=PipelineConfig(pp_size=2, pp_schedule="zbv", num_model_chunks=2, microbatch_size=1))
    assert (nested.pp_size, nested.num_stages) == (2, 4)


def test_parallel_dims_need_sizes_that_divide_the_world():
    with pytest.raises(ValueError, match="does not divide the world size 4"):
        ParallelDims(world_size=4, tp=3)
    dims = ParallelDims(world_size=8, tp=2, pp=2)
    assert dims.data_parallel_size == 2
    assert dims.axis_sizes() == {"pp": 2, "dp": 2, "sp": 1, "tp": 2}
    with pytest.raises(ValueError, match="dp_size=4"):
        ParallelDims(world_size=8, tp=2, pp=2, dp=4)


def test_strategy_validates_its_arguments_at_construction():
    with pytest.raises(ValueError, match="exactly one of num_microbatches"):
        HybridParallelStrategy(pp_size=2)
    with pytest.raises(ValueError, match="exactly two chunks"):
        HybridParallelStrategy(pp_size=2, pp_schedule="zbv", num_model_chunks=3, num_microbatches=2)
    strategy = HybridParallelStrategy(tp_size=2, pp_size=2, num_microbatches=4, layers_per_stage=[3, 5])
    assert strategy.hybrid_config.pipeline is not None
    assert strategy.hybrid_config.pipeline.layers_per_stage == (3, 5)
    assert strategy.hybrid_config.model_parallel_size == 4
    assert strategy.pipelined
    # The ZeRO arguments reach the one ZeroConfig the engine is given.
    zero = HybridParallelStrategy(zero_stage=1, bucket_size_mb=2.0, communication="all_reduce")
    assert zero.hybrid_config.data_parallel == ZeroConfig(stage=1, bucket_size_mb=2.0, communication="all_reduce")


def test_strategy_names_are_registered():
    assert StrategyRegistry["colossal_hybrid"]["strategy"] is HybridParallelStrategy
    assert StrategyRegistry["colossal_hybrid_notebook"]["strategy"] is HybridParallelStrategy
    assert StrategyRegistry["colossal_hybrid_notebook"]["init_params"] == {"start_method": "fork"}


def test_pipeline_batches_with_left_padding_are_refused_right_padding_accepted():
    input_ids = torch.arange(8).view(2, 4)
    labels = input_ids.clone()
    right_padded = {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
    }
    inputs, targets = pipeline_inputs(right_padded)
    assert inputs is input_ids and targets is labels
    left_padded = {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]),
    }
    with pytest.raises(ValueError, match="padding_side = 'right'"):
        pipeline_inputs(left_padded)


def test_ulysses_split_takes_each_rank_slice_of_every_sequence_tensor_in_any_container():
    from collections import OrderedDict, namedtuple
    from dataclasses import dataclass

    Pair = namedtuple("Pair", ["tokens", "labels"])

    @dataclass(frozen=True)
    class Batch:
        tokens: torch.Tensor
        lengths: torch.Tensor

    tokens = torch.arange(16).view(2, 8)
    lengths = torch.tensor([8, 8])  # 1-D: no sequence dimension, kept whole
    batch = [Pair(tokens, tokens), OrderedDict(input_ids=tokens, name="x"), Batch(tokens, lengths), (tokens,)]
    split = split_sequence(batch, sp_size=2, sp_rank=1)
    assert isinstance(split, list) and isinstance(split[0], Pair) and type(split[1]) is OrderedDict
    assert torch.equal(split[0].labels, tokens[:, 4:]) and torch.equal(split[1]["input_ids"], tokens[:, 4:])
    assert split[1]["name"] == "x"
    assert isinstance(split[2], Batch) and torch.equal(split[2].tokens, tokens[:, 4:]) and split[2].lengths is lengths
    assert torch.equal(split[3][0], tokens[:, 4:])
    assert split_sequence(batch, sp_size=1, sp_rank=0) is batch
    with pytest.raises(ValueError, match="sequence length divisible by 3"):
        split_sequence(tokens, sp_size=3, sp_rank=0)
    assert map_tensors("text", lambda tensor: tensor) == "text"


def test_gradient_stash_sets_gradients_aside_across_zero_grad_and_puts_them_back():
    from lightning_colossal.parallel import GradientStash

    layer = torch.nn.Linear(2, 2)
    layer(torch.ones(1, 2)).sum().backward()
    weight_gradient = layer.weight.grad
    layer.bias.grad = None
    stash = GradientStash()
    stash.set_aside(layer.parameters())
    assert layer.weight.grad is None
    stash.put_back()
    assert layer.weight.grad is weight_gradient and layer.bias.grad is None
