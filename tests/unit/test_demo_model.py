"""The demo GPT, its LightningModule and the demo CLI (single process, no process group)."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.accelerators import CPUAccelerator

from lightning_colossal.demo import cli as demo_cli
from lightning_colossal.demo.model import GPT, TRANSFORMER_BLOCK_CLASSES, Block, GPTConfig
from lightning_colossal.demo.module import GPTLightningModule, warmup_cosine_lr_ratio

TINY = GPTConfig(vocab_size=32, block_size=16, num_layers=2, num_heads=2, embed_dim=16)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_forward_shape_and_initial_loss_is_uniform() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    input_ids = torch.randint(0, 256, (3, 128))
    logits = model(input_ids)
    assert logits.shape == (3, 128, 256)
    # Small init: the untrained model predicts close to uniform, ln(256) = 5.55 nats.
    loss = F.cross_entropy(logits.flatten(0, 1), torch.randint(0, 256, (3 * 128,)))
    assert abs(loss.item() - math.log(256)) < 0.1


def test_forward_rejects_sequences_longer_than_block_size() -> None:
    model = GPT(TINY)
    with pytest.raises(ValueError, match="block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_changing_a_future_token_leaves_earlier_logits_unchanged() -> None:
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    input_ids = torch.randint(0, TINY.vocab_size, (2, TINY.block_size))
    changed = input_ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % TINY.vocab_size
    logits, changed_logits = model(input_ids), model(changed)
    torch.testing.assert_close(logits[:, :10], changed_logits[:, :10])
    assert not torch.allclose(logits[:, 10:], changed_logits[:, 10:])


def test_submodule_names_that_parallel_plans_rely_on() -> None:
    names = {name for name, _ in GPT(TINY).named_modules()}
    for expected in (
        "token_embedding",
        "position_embedding",
        "final_norm",
        "lm_head",
        "blocks.1.attn_norm",
        "blocks.1.attn.qkv",
        "blocks.1.attn.proj",
        "blocks.1.mlp_norm",
        "blocks.1.mlp.fc",
        "blocks.1.mlp.proj",
    ):
        assert expected in names
    assert TRANSFORMER_BLOCK_CLASSES == (Block,)
    assert all(isinstance(block, TRANSFORMER_BLOCK_CLASSES) for block in GPT(TINY).blocks)


def test_qkv_is_head_major_so_colwise_shards_hold_whole_heads() -> None:
    # Head-major layout with head_dim=8: head h owns qkv rows [24h, 24h + 24). Re-drawing head 1's rows must
    # leave head 0's output unchanged; with GPT-2's q|k|v layout those rows would hold head 0's values.
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    attention = model.blocks[0].attn
    hidden = torch.randn(1, 5, TINY.embed_dim)
    with torch.no_grad():
        attention.proj.weight.zero_()
        attention.proj.weight[:8, :8] = torch.eye(8)  # read back head 0's output channels only
        attention.proj.bias.zero_()
        before = attention(hidden)
        attention.qkv.weight[24:48].normal_()
        after = attention(hidden)
    torch.testing.assert_close(before, after)


def test_tied_weights_are_shared_and_counted_once() -> None:
    tied = GPT(TINY)
    untied = GPT(GPTConfig(**{**TINY.__dict__, "tie_weights": False}))
    assert tied.lm_head.weight is tied.token_embedding.weight
    assert untied.lm_head.weight is not untied.token_embedding.weight
    head_size = TINY.vocab_size * TINY.embed_dim
    assert untied.num_parameters() - tied.num_parameters() == head_size
    assert tied.num_parameters() == sum(tensor.numel() for tensor in tied.state_dict().values()) - head_size


def test_benchmark_config_has_27_4_million_parameters() -> None:
    config = GPTConfig(vocab_size=8192, block_size=128, num_layers=6, num_heads=8, embed_dim=512, tie_weights=False)
    with torch.device("meta"):
        model = GPT(config)
    assert model.num_parameters() == 27_369_472


def test_reset_parameters_is_deterministic_and_gpt2_scaled() -> None:
    torch.manual_seed(7)
    first = GPT(TINY)
    torch.manual_seed(7)
    second = GPT(TINY)
    for name, tensor in _state(first).items():
        torch.testing.assert_close(tensor, _state(second)[name], rtol=0, atol=0)
    big = GPT(GPTConfig(num_layers=8))
    assert big.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert big.blocks[0].mlp.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert torch.all(big.blocks[0].attn.qkv.bias == 0)
    assert torch.all(big.final_norm.weight == 1)


def test_meta_build_then_to_empty_then_reset_matches_a_direct_build() -> None:
    torch.manual_seed(3)
    reference = GPT(TINY)
    with torch.device("meta"):
        model = GPT(TINY)
    assert model.token_embedding.weight.is_meta
    model.to_empty(device="cpu")
    torch.manual_seed(3)
    model.reset_parameters()
    assert model.lm_head.weight is model.token_embedding.weight
    for name, tensor in _state(reference).items():
        torch.testing.assert_close(_state(model)[name], tensor, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"embed_dim": 100, "num_heads": 8}, r"not divisible by num_heads=8.*96 or 104"),
        ({"num_layers": 0}, "num_layers must be a positive integer"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
    ],
)
def test_config_errors_name_the_fix(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPTConfig(**overrides)  # type: ignore[arg-type]


def test_warmup_cosine_schedule() -> None:
    ratio = [warmup_cosine_lr_ratio(step, warmup_steps=10, total_steps=110, min_lr_ratio=0.1) for step in range(120)]
    assert ratio[0] == pytest.approx(0.1)
    assert ratio[9] == pytest.approx(1.0)
    assert ratio[10] == pytest.approx(1.0)
    assert ratio[60] == pytest.approx(0.55)
    assert ratio[110] == pytest.approx(0.1) and ratio[119] == pytest.approx(0.1)
    assert all(later <= earlier for earlier, later in zip(ratio[10:], ratio[11:], strict=False))
    assert warmup_cosine_lr_ratio(500, warmup_steps=10, total_steps=None, min_lr_ratio=0.1) == 1.0


def test_lightning_module_builds_lazily_and_decays_only_matrices() -> None:
    module = GPTLightningModule(vocab_size=32, block_size=16, num_layers=2, num_heads=2, embed_dim=16)
    assert module.model is None
    module.configure_model()
    model = module.model
    module.configure_model()
    assert module.model is model  # idempotent
    module.trainer = SimpleNamespace(max_steps=100, estimated_stepping_batches=100)  # type: ignore[assignment]
    config = module.configure_optimizers()
    decay_group, no_decay_group = config["optimizer"].param_groups
    assert decay_group["weight_decay"] == 0.1 and no_decay_group["weight_decay"] == 0.0
    assert all(parameter.dim() >= 2 for parameter in decay_group["params"])
    assert all(parameter.dim() < 2 for parameter in no_decay_group["params"])
    assert sum(parameter.numel() for group in (decay_group, no_decay_group) for parameter in group["params"]) == (
        model.num_parameters()
    )
    assert config["lr_scheduler"]["interval"] == "step"


def test_lightning_module_rejects_a_bad_shape_at_construction() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        GPTLightningModule(embed_dim=100, num_heads=8)


def test_limit_cpu_threads_splits_cores_between_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    environment: dict[str, str] = {}
    requested: list[int] = []
    monkeypatch.setattr(os, "environ", environment)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(torch, "set_num_threads", requested.append)
    demo_cli.limit_cpu_threads(SimpleNamespace(accelerator=CPUAccelerator(), num_devices=2))  # type: ignore[arg-type]
    assert environment["OMP_NUM_THREADS"] == "2" and requested == [2]
    demo_cli.limit_cpu_threads(SimpleNamespace(accelerator=CPUAccelerator(), num_devices=1))  # type: ignore[arg-type]
    assert requested == [2]  # one process keeps every core


def test_cli_smoke_run(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(left, right):\n    return left + right\n" * 200)
    cli = demo_cli.main(
        [
            "fit",
            "--trainer.strategy=auto",
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            "--trainer.max_steps=3",
            "--trainer.val_check_interval=3",
            "--trainer.limit_val_batches=2",
            "--trainer.log_every_n_steps=1",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.default_root_dir={tmp_path}",
            "--model.block_size=32",
            "--model.num_layers=1",
            "--model.embed_dim=32",
            "--model.num_heads=2",
            f"--data.data={corpus}",
            "--data.batch_size=4",
        ]
    )
    assert cli.trainer.global_step == 3
    assert cli.datamodule.block_size == 32  # linked to the model's block size
    assert cli.datamodule.train_dataset is not None and cli.datamodule.train_dataset.block_size == 32
    (metrics_file,) = tmp_path.rglob("metrics.csv")
    rows = list(csv.DictReader(metrics_file.open()))
    assert any(row.get("train/loss") for row in rows)
    assert any(row.get("val/loss") for row in rows)
    assert list(tmp_path.rglob("last.ckpt"))
