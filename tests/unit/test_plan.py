"""``python -m lightning_colossal.plan``: parsing, the model sources, the per-rank formulas, fits and the
recommendation, JSON, errors that name the fix, the activation estimate against measured saved tensors, and a light
import. The byte-exact check against live engines is ``tests/distributed/test_plan_against_engines.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_colossal.callbacks.memory_accounting import covered_bytes
from lightning_colossal.demo.model import GPT, GPTConfig
from lightning_colossal.plan import build_parser, main, plan_from_arguments
from lightning_colossal.planning.activations import Workload, activation_estimate
from lightning_colossal.planning.model_state import OPTIMIZERS, Training, model_state, owned_numel
from lightning_colossal.planning.planner import Hardware, make_plan
from lightning_colossal.planning.settings import setting_named, tensor_parallel_sizes
from lightning_colossal.planning.sources import DemoOverrides, LayerShape, demo_model, parameter_count_model
from lightning_colossal.planning.units import format_bytes, parse_bytes, parse_count
from tests.fresh_interpreter import REPOSITORY_ROOT, run_python

GIB = 2**30
ADAMW = OPTIMIZERS["adamw"]
# The activation estimate must be within this share of the measured saved bytes (docs/planner.md reports the error).
ACTIVATION_TOLERANCE = 0.03


def plan_of(*argv: str) -> Any:
    return plan_from_arguments(build_parser().parse_args(list(argv)))


def evaluation_of(plan: Any, label: str) -> Any:
    return next(evaluation for evaluation in plan.evaluations if evaluation.setting.label == label)


# ---------------------------------------------------------------------------------------------- parsing and units
def test_defaults_and_units():
    arguments = build_parser().parse_args(["--model", "demo"])
    assert (arguments.devices, arguments.nodes, arguments.precision, arguments.optimizer) == (
        1,
        1,
        "bf16-mixed",
        "adamw",
    )
    assert parse_bytes("80GiB", "x") == parse_bytes("80G", "x") == 80 * GIB
    assert parse_bytes("80GB", "x") == 80 * 10**9 and parse_bytes("512 MiB", "x") == 512 * 2**20
    assert parse_bytes("0", "x", allow_zero=True) == 0
    assert parse_count("7e9", "x") == parse_count("7B", "x") == 7 * 10**9 and parse_count("125M", "x") == 125 * 10**6
    assert format_bytes(23 * GIB + GIB // 2) == "23.5 GiB" and format_bytes(512) == "512 B"


@pytest.mark.parametrize(
    ("argv", "fix"),
    [
        (["--model", "demo", "--parameters", "7e9"], "either --model or --parameters"),
        ([], "--model demo, --model path/to/config.json, or --parameters"),
        (["--parameters", "7e9", "--layers", "32"], "add --hidden"),
        (["--parameters", "7 billion", "--layers", "32", "--hidden", "4096"], "pass e.g. 7e9"),
        (["--parameters", "1e6", "--layers", "32", "--hidden", "4096"], "raise --parameters or lower --layers"),
        (["--parameters", "7e9", "--layers", "32", "--hidden", "4000"], "pass --heads"),
        (["--parameters", "7e9", "--layers", "32", "--hidden", "4096", "--heads", "30"], "divisor of the width"),
        (["--model", "demo", "--device-memory", "80 gigs"], "80GiB (2**30 bytes)"),
        (["--model", "demo", "--host-memory", "0GiB"], "pass a positive size"),
        (["--model", "demo", "--sequence-length", "4096"], "pass --block-size 4096"),
        (["--model", "demo", "--heads", "3"], "pass --heads dividing --hidden"),
        (["--model", "demo", "--micro-batch-size", "0"], "must be positive"),
        (["--model", "demo", "--devices", "0"], "pass positive counts"),
        (["--model", "no/such/config.json"], "a config.json file, or a directory holding one"),
        (["--model", "demo", "--kv-heads", "2"], "apply to --parameters only"),
        (["--parameters", "7e9", "--layers", "32", "--hidden", "4096", "--block-size", "64"], "--sequence-length only"),
        (["--parameters", "7e9", "--layers", "32", "--hidden", "4096", "--vocab", "0"], "must be positive integers"),
    ],
)
def test_bad_input_exits_with_a_message_naming_the_fix(capsys, argv, fix):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert fix in capsys.readouterr().err


def test_a_config_without_model_type_or_a_directory_without_config_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path / "config.json")])
    assert "names no model_type" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path / "empty")])
    assert "directory without config.json" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- model sources
def test_demo_layout_is_the_real_demo_gpt():
    # The planner restates the demo's layout (the library never imports the demo); it must be the real one.
    assert demo_model().architecture.hidden == GPTConfig().embed_dim
    for overrides, config in [
        (DemoOverrides(), GPTConfig()),
        (
            DemoOverrides(layers=2, hidden=21, heads=3, vocab=65, block_size=17),
            GPTConfig(num_layers=2, embed_dim=21, num_heads=3, vocab_size=65, block_size=17),
        ),
    ]:
        with torch.device("meta"):
            model = GPT(config)
        planned = demo_model(overrides)
        assert [(p.name, p.shape) for p in planned.parameters] == [
            (name, tuple(parameter.shape)) for name, parameter in model.named_parameters()
        ]
        assert planned.numel == model.num_parameters()
        assert planned.block_numels() == [sum(p.numel() for p in block.parameters()) for block in model.blocks]


def test_parameter_count_layout_comes_close_to_the_count():
    model = parameter_count_model(LayerShape(parameters=7 * 10**9, layers=32, hidden=4096))
    assert abs(model.numel - 7 * 10**9) <= 1.5 * 4096 * 32, "the MLP width rounds to the nearest element"
    assert model.architecture.heads == 32 and model.architecture.gated_mlp
    assert len(model.parameters) == 1 + 32 * 9 + 2


def _tiny_llama_directory(tmp_path: Path) -> tuple[Path, Any]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    config.save_pretrained(tmp_path)
    return tmp_path, config


def test_huggingface_config_file_and_directory(tmp_path):
    directory, config = _tiny_llama_directory(tmp_path)
    import transformers

    real = transformers.AutoModelForCausalLM.from_config(config)
    for location in (directory, directory / "config.json"):
        plan = plan_of("--model", str(location), "--devices", "2")
        assert plan.model.numel == sum(parameter.numel() for parameter in real.parameters())
        shape = plan.model.architecture
        assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.intermediate) == (2, 64, 4, 2, 172)
        assert shape.gated_mlp and shape.norm == "rmsnorm" and shape.attention_input_matmuls == 3
        assert plan.model.block_numels() == [sum(p.numel() for p in layer.parameters()) for layer in real.model.layers]
        assert plan.workload.sequence_length == 2048 and any("longer than the model's 256" in n for n in plan.notes)
    with pytest.raises(SystemExit):
        main(["--model", str(directory), "--layers", "4"])


def test_a_non_causal_config_is_built_as_the_bare_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4).save_pretrained(
        tmp_path
    )
    plan = plan_of("--model", str(tmp_path))
    assert plan.model.description.startswith("T5Model from")
    assert plan.model.numel == sum(
        p.numel() for p in transformers.T5Model(transformers.T5Config.from_pretrained(tmp_path)).parameters()
    )


# ---------------------------------------------------------------------------------------------- formulas
def test_even_shards_follow_the_documented_per_rank_formulas():
    # docs/choosing-a-strategy.md: 16Ψ (DDP), 8Ψ + 8Ψ/N (ZeRO-1), 4Ψ + 12Ψ/N (ZeRO-2), 16Ψ/N (Gemini, FSDP),
    # each plus Adam's 4-byte step per tensor; bf16-true ZeRO-2: 2Ψ + 20Ψ/N.
    shapes, world = [(64, 32), (32,), (128, 64)], 8
    psi, steps = sum(math.prod(shape) for shape in shapes), 4 * len(shapes)
    fp32 = Training("32-true", ADAMW)
    expected = {
        "colossal_ddp": 16 * psi,
        "colossal_zero1": 8 * psi + 8 * psi // world,
        "colossal_zero2": 4 * psi + 12 * psi // world,
        "colossal_zero2_offload": 4 * psi
        + 20 * psi // world,  # + accumulator on the device, master gradient on the host
        "colossal_gemini": 16 * psi // world,
        "colossal_gemini_offload": 16 * psi // world + 4 * psi // world,  # the offloaded master is a second copy
        "colossal_fsdp": 16 * psi // world,
    }
    for label, total in expected.items():
        assert model_state(shapes, setting_named(label), fp32, world, 0).placed.total == total + steps, label
    bf16 = Training("bf16-true", ADAMW)
    assert model_state(shapes, setting_named("colossal_zero2"), bf16, world, 0).placed.total == (
        2 * psi + 20 * psi // world + steps
    )
    assert model_state(shapes, setting_named("colossal_ddp"), bf16, world, 0).placed.total == 8 * psi + steps
    # Mixed precision is autocast: the same fp32 state as 32-true.
    mixed = Training("bf16-mixed", ADAMW)
    for label in expected:
        setting = setting_named(label)
        assert model_state(shapes, setting, mixed, world, 0) == model_state(shapes, setting, fp32, world, 0)


def test_uneven_rows_and_placement():
    # 31 rows over 4 ranks: torch.chunk gives 8, 8, 8, 7 rows; rank 0 (the one the planner reports) holds the most.
    shapes = [(31, 10)]
    assert [owned_numel(shapes, 4, rank) for rank in range(4)] == [80, 80, 80, 70]
    state = model_state(shapes, setting_named("colossal_zero2_offload"), Training("32-true", ADAMW), 4, 3)
    assert state.parameters.device == 4 * 310 and state.parameters.host == 4 * 70  # whole weights + fp32 master
    assert (state.gradients.device, state.gradients.host) == (4 * 70, 4 * 70)  # accumulator + master gradient
    assert (state.optimizer_state.device, state.optimizer_state.host) == (0, 8 * 70 + 4)
    # On CPU ranks an offloaded fp32 Gemini shard stays its own master; on GPUs the host master is a second copy.
    gemini = setting_named("colossal_gemini_offload")
    assert model_state(shapes, gemini, Training("32-true", ADAMW, "cpu"), 4, 0).parameters.total == 4 * 80
    assert model_state(shapes, gemini, Training("32-true", ADAMW, "cuda"), 4, 0).parameters.total == 8 * 80
    sgd = Training("32-true", OPTIMIZERS["sgd-momentum"])
    assert model_state(shapes, setting_named("colossal_ddp"), sgd, 4, 0).optimizer_state.total == 4 * 310


def test_zero_buffer_counts_mirror_the_engine():
    from lightning_colossal.planning.working import EXCHANGES_IN_FLIGHT, STAGE2_BUCKETS_IN_FLIGHT
    from lightning_colossal.zero.exchange import MAX_EXCHANGES_IN_FLIGHT
    from lightning_colossal.zero.stages import MAX_STAGE2_BUCKETS_IN_FLIGHT

    assert STAGE2_BUCKETS_IN_FLIGHT == MAX_STAGE2_BUCKETS_IN_FLIGHT
    assert EXCHANGES_IN_FLIGHT == MAX_EXCHANGES_IN_FLIGHT


def test_gemini_working_memory_holds_every_chunk_for_backward_unless_checkpointed_or_cast():
    # gemini/manager.py [Note: weights autograd saved]: without activation checkpointing and autocast, every chunk's
    # gathered weights stay held from its forward to its backward.
    shape = ("--model", "demo", "--layers", "16", "--hidden", "512", "--vocab", "1024", "--devices", "2")
    plain = plan_of(*shape, "--precision", "32-true")
    gemini = evaluation_of(plain, "colossal_gemini").working
    assert gemini.placed.device >= 4 * plain.model.numel, gemini
    assert "every chunk gathered" in gemini.what
    checkpointed = evaluation_of(
        plan_of(*shape, "--precision", "32-true", "--activation-checkpointing"), "colossal_gemini"
    )
    cast = evaluation_of(plan_of(*shape, "--precision", "bf16-mixed"), "colossal_gemini")
    for evaluation in (checkpointed, cast):
        assert evaluation.working.what.startswith("2 gathered chunks"), evaluation.working
        assert evaluation.working.placed.device < gemini.placed.device


# ---------------------------------------------------------------------------------------------- fits and recommendation
SEVEN_B = ("--parameters", "7e9", "--layers", "32", "--hidden", "4096", "--devices", "8")


def test_device_total_adds_up_and_ddp_needs_its_16_psi():
    plan = plan_of(*SEVEN_B, "--device-memory", "80GiB", "--sequence-length", "4096")
    ddp = evaluation_of(plan, "colossal_ddp")
    psi = plan.model.numel
    # Gradients are views into DDP's buckets (colossal_ddp's default gradient_as_bucket_view=True): no second copy.
    assert ddp.model_state.placed.device == 16 * psi and ddp.working.placed.device == 0
    assert ddp.device_bytes == 16 * psi + ddp.activations.total + 2 * GIB
    assert not ddp.fits_device and ddp.fits_host
    fsdp = evaluation_of(plan, "colossal_fsdp")
    assert fsdp.fits and fsdp.activations.weight_copies == 0, "FSDP gathers bf16 weights: autocast casts nothing"
    assert evaluation_of(plan, "colossal_zero2").activations.weight_copies == 2 * plan.model.matmul_weight_numel()


def test_recommendation_names_the_headroom_and_why_earlier_settings_lost():
    plan = plan_of(*SEVEN_B, "--device-memory", "80GiB", "--sequence-length", "1024")
    recommendation = plan.recommendation
    assert recommendation.label == "colossal_zero2"
    assert recommendation.reason.startswith("colossal_zero2: fits with ")
    assert "headroom per GPU" in recommendation.reason
    assert "colossal_ddp does not fit (needs " in recommendation.reason
    assert "colossal_zero1 does not fit (needs " in recommendation.reason
    assert recommendation.how == 'Trainer(strategy="colossal_zero2")'


def test_tight_fits_are_passed_over_and_nothing_fitting_says_what_to_change():
    plan = plan_of(*SEVEN_B, "--device-memory", "80GiB", "--sequence-length", "3072")
    assert evaluation_of(plan, "colossal_zero2").fits, "fits, but with less than 10% headroom"
    assert plan.recommendation.label == "colossal_fsdp"
    assert "colossal_zero2 fits with only" in plan.recommendation.reason
    assert any("with --activation-checkpointing colossal_zero1 would fit" in note for note in plan.notes)
    nothing = plan_of(*SEVEN_B, "--device-memory", "8GiB", "--host-memory", "16GiB", "--sequence-length", "4096")
    assert nothing.recommendation.label is None
    assert nothing.recommendation.reason.startswith("nothing fits: the smallest is ")
    assert "--activation-checkpointing" in nothing.recommendation.reason


def test_offload_moves_state_to_the_host_of_each_node():
    plan = plan_of(*SEVEN_B, "--device-memory", "24GiB", "--host-memory", "64GiB", "--sequence-length", "512")
    offloaded = evaluation_of(plan, "colossal_fsdp_offload")
    assert offloaded.model_state.placed.device == 0
    assert offloaded.host_bytes == 8 * offloaded.model_state.placed.host, "8 ranks share the node's host memory"
    assert not offloaded.fits_host


def test_hybrid_sizes_divide_devices_and_heads_and_cpu_ranks_skip_offload():
    model = demo_model()  # 4 heads, vocabulary 256
    assert tensor_parallel_sizes(model, 8) == [2, 4]
    assert tensor_parallel_sizes(model, 6) == [2]
    hardware = Hardware(devices_per_node=2, nodes=1, device_memory=GIB, host_memory=64 * GIB, device_type="cpu")
    plan = make_plan(model, hardware, Training("32-true", ADAMW, "cpu"), Workload(1, 128))
    labels = [evaluation.setting.label for evaluation in plan.evaluations]
    assert not any("offload" in label for label in labels) and "colossal_hybrid tp=2 zero1" in labels
    assert all(evaluation.device_bytes == 0 for evaluation in plan.evaluations), "one memory: the host's"
    assert "host headroom per node" in plan.recommendation.reason


def test_checkpointing_knobs_per_strategy():
    plan = plan_of(*SEVEN_B, "--activation-checkpointing")
    assert evaluation_of(plan, "colossal_fsdp").how == "ColossalFSDPStrategy(activation_checkpointing=True)"
    assert evaluation_of(plan, "colossal_hybrid tp=2 zero1").how == (
        "HybridParallelStrategy(tp_size=2, zero_stage=1, activation_checkpointing=True)"
    )
    assert "torch.utils.checkpoint" in evaluation_of(plan, "colossal_zero2").notes[0]
    without = plan_of(*SEVEN_B)
    assert (
        evaluation_of(plan, "colossal_zero2").activations.total
        < evaluation_of(without, "colossal_zero2").activations.total / 4
    )


# ---------------------------------------------------------------------------------------------- output
def test_table_and_json(capsys):
    assert main(["--model", "demo", "--devices", "8", "--device-memory", "80GiB"]) == 0
    table = capsys.readouterr().out
    for label in ("colossal_ddp", "colossal_zero2_offload", "colossal_gemini (all offloaded)", "tp=4 zero1"):
        assert label in table
    assert "Recommendation: colossal_ddp: fits with" in table
    assert main(["--model", "demo", "--devices", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommendation"]["label"] == "colossal_ddp"
    assert data["model"]["parameters"] == demo_model().numel
    zero2 = next(entry for entry in data["settings"] if entry["setting"] == "colossal_zero2")
    state = model_state(demo_model().shapes, setting_named("colossal_zero2"), Training("bf16-mixed", ADAMW), 8, 0)
    assert zero2["model_state"]["gradients"] == {
        "device": state.gradients.device,
        "host": state.gradients.host,
        "disk": 0,
    }
    assert isinstance(zero2["device_bytes"], int) and zero2["fits"] is True


def test_the_module_runs_as_a_command(tmp_path):
    result = run_python(["-m", "lightning_colossal.plan", "--model", "demo", "--devices", "2", "--json"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["recommendation"]["label"] == "colossal_ddp"


def test_importing_the_planner_loads_neither_lightning_nor_transformers_nor_the_demo(tmp_path):
    # The package root imports Lightning to register the strategies; the planner itself must not add to that.
    source = f"""
import json, sys, types
root = types.ModuleType("lightning_colossal")
root.__path__ = [{str(REPOSITORY_ROOT / "lightning_colossal")!r}]
sys.modules["lightning_colossal"] = root
import lightning_colossal.plan
heavy = ("lightning", "lightning_fabric", "pytorch_lightning", "transformers", "lightning_colossal.demo",
         "lightning_colossal.gemini")
print(json.dumps(sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy))))
"""
    result = run_python(["-c", source], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


# ---------------------------------------------------------------------------------------------- activations
def saved_bytes(model: torch.nn.Module, forward: Any, precision: str) -> int:
    """Bytes of the tensors autograd saves for backward in ``forward()`` (shared storage once, parameters left out)."""
    parameters = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=precision == "bf16-mixed")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast:
        forward()
    return covered_bytes(tensor for tensor in saved if tensor.untyped_storage().data_ptr() not in parameters)


def _relative_error(model_shape: Any, measured: int, precision: str, workload: Workload) -> float:
    estimate = activation_estimate(model_shape, Training(precision, ADAMW, "cpu"), workload).total
    return estimate / measured - 1


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_activation_estimate_of_the_demo_gpt(precision, checkpointing):
    torch.manual_seed(0)
    overrides = DemoOverrides(layers=3, hidden=64, heads=4, vocab=256, block_size=64)
    model = GPT(GPTConfig(num_layers=3, embed_dim=64, num_heads=4, vocab_size=256, block_size=64))
    model = model.to(torch.bfloat16) if precision == "bf16-true" else model
    if checkpointing:  # non-reentrant checkpointing: a block saves only its input during forward
        for block in model.blocks:
            block.forward = _checkpointed(block.forward)
    tokens = torch.randint(0, 256, (4, 64))

    def forward() -> None:
        F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())

    workload = Workload(4, 64, activation_checkpointing=checkpointing)
    shape = demo_model(overrides)
    estimate = activation_estimate(shape, Training(precision, ADAMW, "cpu"), workload)
    if checkpointing:
        # The estimate includes the layer recomputed in backward (its activations and autocast's copies of its
        # weights), which forward never holds; the head's weight copy is saved in forward.
        from lightning_colossal.planning.activations import layer_bytes_per_token

        one_layer = 4 * 64 * layer_bytes_per_token(shape, Training(precision, ADAMW, "cpu"), 1, 64)
        layer_copies = estimate.weight_copies - (2 * 256 * 64 if precision == "bf16-mixed" else 0)
        expected = estimate.total - one_layer - layer_copies
    else:
        expected = estimate.total
    measured = saved_bytes(model, forward, precision)
    assert abs(expected / measured - 1) <= ACTIVATION_TOLERANCE, (precision, expected, measured)


def _checkpointed(function: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    return lambda hidden: checkpoint(function, hidden, use_reentrant=False)


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_activation_estimate_of_huggingface_models(tmp_path, architecture, precision):
    # Llama: RMSNorm in Python, separate q/k/v and gate/up projections, grouped-query attention. GPT-2: fused
    # Conv1D projections, the Python tanh-GELU, and dropout (on the CPU: noise masks, SDPA's fp32 math path).
    transformers = pytest.importorskip("transformers")
    if architecture == "llama":
        directory, config = _tiny_llama_directory(tmp_path)
    else:
        config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256)
        config.save_pretrained(tmp_path)
        directory = tmp_path
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    model = model.to(torch.bfloat16) if precision == "bf16-true" else model
    tokens = torch.randint(0, 128, (4, 128))
    measured = saved_bytes(model, lambda: model(input_ids=tokens, labels=tokens), precision)
    error = _relative_error(plan_of("--model", str(directory)).model, measured, precision, Workload(4, 128))
    assert abs(error) <= ACTIVATION_TOLERANCE, (architecture, precision, error)
