"""Every YAML in examples/ runs a few demo steps through the LightningCLI (in the 1-rank pool)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
# Model-parallel examples need as many ranks as their layout.
WORLD_SIZE = {"colossal_hybrid": 2}


# What every example run overrides: a couple of CPU steps on a little data.
SHORT_RUN = [
    "--trainer.accelerator=cpu",
    "--trainer.max_steps=2",
    "--trainer.limit_val_batches=1",
    "--trainer.val_check_interval=2",
    "--trainer.enable_progress_bar=false",
    "--data.batch_size=2",
    "--data.max_bytes=100000",
]


def run_example_body(config: str, root: str) -> int:
    from lightning_colossal.demo.cli import main

    cli = main(
        [
            "fit",
            f"--config={config}",
            f"--trainer.default_root_dir={root}",
            f"--trainer.devices={torch.distributed.get_world_size()}",
            *SHORT_RUN,
            "--model.num_layers=1",
            "--model.embed_dim=32",
            "--model.num_heads=2",
            "--model.block_size=32",
        ]
    )
    return cli.trainer.global_step


def test_examples_exist():
    assert EXAMPLES, "examples/ must hold one YAML per strategy"


@pytest.mark.parametrize("config", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_example_config_trains(rank_pools, tmp_path, config):
    pool = rank_pools.get(WORLD_SIZE.get(config.stem, 1))
    assert pool.run(run_example_body, str(config), str(tmp_path), timeout=180) == [2] * pool.world_size


FINETUNE_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "huggingface" / "finetune.yaml"


def run_finetune_body(strategy_arguments: list[str], root: str) -> dict[str, float | int]:
    from lightning_colossal.demo.finetune import main

    cli = main(
        [
            "fit",
            f"--config={FINETUNE_CONFIG}",
            *strategy_arguments,
            f"--trainer.default_root_dir={root}",
            f"--trainer.devices={torch.distributed.get_world_size()}",
            *SHORT_RUN,
            "--model.block_size=32",
        ]
    )
    return {"steps": cli.trainer.global_step, "loss": float(cli.trainer.callback_metrics["train_loss"])}


@pytest.mark.parametrize(
    "strategy_arguments",
    [
        [],  # the YAML's colossal_zero2
        ["--trainer.strategy=colossal_gemini"],
        ["--trainer.strategy=colossal_fsdp"],
        [
            "--trainer.strategy.class_path=lightning_colossal.HybridParallelStrategy",
            "--trainer.strategy.init_args.tp_size=2",
        ],
    ],
    ids=["zero2", "gemini", "fsdp", "hybrid_tp2"],
)
def test_huggingface_finetuning_config_trains(rank_pool_2, tmp_path, strategy_arguments):
    results = rank_pool_2.run(run_finetune_body, strategy_arguments, str(tmp_path), timeout=180)
    assert [result["steps"] for result in results] == [2, 2]
    assert all(0 < result["loss"] < 10 for result in results), results  # a byte-level loss starts near ln(256) = 5.5
