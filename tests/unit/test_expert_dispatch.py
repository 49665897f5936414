"""Expert parallelism without processes: its settings, which modules count as experts, the dispatch's sort and
combine (at one ep rank it must give the experts module's own output bit for bit), and the planner's numbers."""

from __future__ import annotations

import pytest
import torch

from lightning_colossal.config import ExpertParallel, HybridConfig
from lightning_colossal.parallel.experts import experts_modules, parallelize_experts
from lightning_colossal.parallel.groups import ExpertGroups
from lightning_colossal.planning.experts import (
    all_to_all_bytes_per_step,
    expert_parallel_ddp_state,
    expert_parallel_numels,
)
from lightning_colossal.planning.model_shape import Architecture, ModelShape, ParameterShape
from lightning_colossal.planning.model_state import OPTIMIZERS, Training
from lightning_colossal.planning.units import format_bytes

transformers = pytest.importorskip("transformers")


def _mixtral(num_experts: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=num_experts,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
    )
    return transformers.MixtralForCausalLM(config)


def _groups(ep_size: int, ep_rank: int) -> ExpertGroups:
    """Groups for slicing only (no process group: the exchanges are the identity)."""
    return ExpertGroups(
        ep_size=ep_size,
        ep_rank=ep_rank,
        ep_group=None,
        ep_mesh=None,  # type: ignore[arg-type]  # only checkpoints describe pieces over it
        expert_data_group=None,
        expert_data_size=1,
        expert_data_rank=0,
    )


def test_ep_size_is_its_own_part_of_the_config():
    assert HybridConfig.from_flat_arguments(ep_size=2).expert_parallelism == ExpertParallel(ep_size=2)
    assert HybridConfig.from_flat_arguments(ep_size=2).ep_size == 2
    assert HybridConfig.from_flat_arguments().expert_parallelism is None
    with pytest.raises(ValueError, match="expert_parallelism=None"):
        ExpertParallel(ep_size=1)
    with pytest.raises(ValueError, match="integer >= 1"):
        HybridConfig.from_flat_arguments(ep_size=0)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"tp_size": 2}, "tp_size=2 is not supported yet"),
        ({"pp_size": 2, "num_microbatches": 2}, "pp_size=2 is not supported yet"),
        ({"sp_size": 2}, "sp_size=2 is not supported yet"),
    ],
)
def test_combinations_not_built_yet_are_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        HybridConfig.from_flat_arguments(ep_size=2, **arguments)


def test_the_experts_modules_of_a_hugging_face_moe_are_found_and_nothing_else():
    model = _mixtral()
    found = [name for name, _ in experts_modules(model)]
    assert found == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def test_a_model_without_experts_is_refused():
    with pytest.raises(ValueError, match="no experts module"):
        parallelize_experts(torch.nn.Linear(4, 4), _groups(2, 0))


def test_experts_that_do_not_split_evenly_are_refused():
    with pytest.raises(ValueError, match="pick an ep_size that divides 4"):
        parallelize_experts(_mixtral(4), _groups(3, 0))


def test_each_rank_keeps_its_experts_rows():
    whole = _mixtral()
    model = _mixtral()
    shards = parallelize_experts(model, _groups(2, 1))
    experts = model.model.layers[0].mlp.experts
    assert experts.num_experts == 2
    torch.testing.assert_close(experts.gate_up_proj, whole.model.layers[0].mlp.experts.gate_up_proj[2:], rtol=0, atol=0)
    assert len(shards.slices) == 4  # two fused weights in each of two layers
    piece = next(iter(shards.slices.values()))
    assert (piece.start, piece.count, piece.whole_shape[0]) == (2, 2, 4)


def test_the_dispatch_at_one_rank_gives_the_modules_own_output_and_gradients():
    """The sort by expert, the unit weights, the unsort and the ordered weighted sum reproduce the module: the same
    loss bit for bit, and the same gradients but for rounding (the experts' matmuls run on other row orders, and
    on more than one thread their reductions split differently)."""
    reference, model = _mixtral(), _mixtral()
    parallelize_experts(model, _groups(1, 0))
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(3))
    expected = reference(input_ids=tokens, labels=tokens, output_router_logits=True)
    got = model(input_ids=tokens, labels=tokens, output_router_logits=True)
    torch.testing.assert_close(got.loss, expected.loss, rtol=0, atol=0)
    expected.loss.backward()
    got.loss.backward()
    for (name, parameter), wanted in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(parameter.grad, wanted.grad, rtol=1e-5, atol=1e-7, msg=name)


def _model_shape(model: torch.nn.Module) -> ModelShape:
    architecture = Architecture(
        layers=2, hidden=16, heads=2, kv_heads=1, intermediate=24, vocab=32, gated_mlp=True, norm="rmsnorm",
        attention="sdpa", dropout=0.0, attention_input_matmuls=3, mlp_input_matmuls=1, activation_saves=1,
        max_sequence=None, tensor_parallel_policy=None, vocab_parallel=False,
    )  # fmt: skip
    parameters = tuple(ParameterShape(name, tuple(p.shape), None, False) for name, p in model.named_parameters())
    return ModelShape("tiny mixtral", parameters, architecture, "module")


@pytest.mark.parametrize("ep_size", [2, 4])
def test_the_planner_counts_the_parameters_a_rank_keeps(ep_size):
    whole = _mixtral()
    shape = _model_shape(whole)
    split = _mixtral()
    shards = parallelize_experts(split, _groups(ep_size, ep_size - 1))
    kept_experts = sum(parameter.numel() for parameter in shards.parameters.values())
    kept_total = sum(parameter.numel() for parameter in split.parameters())
    experts, other = expert_parallel_numels(shape, 4, ep_size)
    assert (experts, experts + other) == (kept_experts, kept_total)
    whole_experts, _ = expert_parallel_numels(shape, 4, 1)
    assert experts * ep_size == whole_experts
    state = expert_parallel_ddp_state(shape, 4, ep_size, Training("32-true", OPTIMIZERS["adamw"], "cpu"))
    assert state.parameters.device == 4 * kept_total
    assert state.optimizer_state.device >= 2 * 4 * kept_total  # two fp32 moments (plus step counters)


def test_the_all_to_all_bytes_follow_the_formula():
    """T x k x h x b x 2 (dispatch, combine) x 2 (forward, backward) x (ep-1)/ep per MoE layer."""
    traffic = all_to_all_bytes_per_step(tokens=4096, top_k=2, hidden=1024, element_bytes=2, ep_size=4, moe_layers=3)
    assert traffic.rows == 4096 * 2 * 1024 * 2 * 2 * 2 * 3 // 4 * 3
    recomputed = all_to_all_bytes_per_step(4096, 2, 1024, 2, 4, 3, activation_checkpointing=True)
    assert recomputed.rows * 2 == traffic.rows * 3
    assert all_to_all_bytes_per_step(4096, 2, 1024, 2, 1, 3).total == 0


def test_the_planner_weighs_expert_parallel_rows_for_a_mixture_of_experts(tmp_path):
    from lightning_colossal.plan import build_parser, plan_from_arguments

    transformers.MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, num_local_experts=8, num_experts_per_tok=2,
    ).save_pretrained(tmp_path)  # fmt: skip
    argv = ["--model", str(tmp_path), "--devices", "8", "--precision", "32-true", "--sequence-length", "128"]
    plan = plan_from_arguments(build_parser().parse_args(argv))
    rows = {evaluation.setting.ep_size: evaluation for evaluation in plan.evaluations if evaluation.setting.ep_size > 1}
    assert sorted(rows) == [2, 4, 8]  # the divisors of both 8 experts and 8 devices
    shape = plan.model
    for ep_size, evaluation in rows.items():
        experts, other = expert_parallel_numels(shape, 8, ep_size)
        # Parameters: the rank's experts whole plus the rest whole (ZeRO-1 shards only the optimizer state), fp32.
        assert evaluation.model_state.parameters.total == 4 * (experts + other)
        # Optimizer state: Adam's two fp32 moments of the rank's experts, and 1/8 of the rest's (ZeRO-1 over 8 ranks).
        assert evaluation.model_state.optimizer_state.total >= 8 * experts
        traffic = all_to_all_bytes_per_step(128, 2, 64, 4, ep_size, 2)
        assert any(f"{format_bytes(traffic.total)} per micro-batch" in note for note in evaluation.notes)
    dense = tmp_path / "dense"
    transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256
    ).save_pretrained(dense)
    dense_plan = plan_from_arguments(build_parser().parse_args(["--model", str(dense), "--devices", "8"]))
    assert not any(evaluation.setting.ep_size > 1 for evaluation in dense_plan.evaluations)
