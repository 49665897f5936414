"""``python -m lightning_colossal.demo fit``: the README's main command, a LightningCLI over the demo GPT.

Defaults train the small byte-level GPT on the Python standard library sources with ``colossal_ddp``: on a
GPU machine on every visible GPU, elsewhere on two CPU processes. Every setting can be changed from the
command line or a YAML file (``--config``), e.g. ``--trainer.strategy=colossal_zero2 --model.num_layers=6``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.trainer import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_colossal.callbacks import TokenThroughput
from lightning_colossal.demo.data import ByteCorpusDataModule
from lightning_colossal.demo.module import GPTLightningModule
from lightning_colossal.distributed import device as devices

__all__ = ["DemoCLI", "limit_cpu_threads", "main", "run_summary", "trainer_defaults"]


def trainer_defaults() -> dict[str, Any]:
    """The Trainer settings of the demo; all but the callbacks can be overridden with ``--trainer.NAME=VALUE``.

    A function, so every CLI run gets fresh callback instances.
    """
    on_gpu = devices.accelerator_available()
    # On CPU a step takes about 1 s on two cores: 100 steps keep the README's first command near two minutes.
    steps = 300 if on_gpu else 100
    return {
        "strategy": "colossal_ddp",
        "accelerator": "auto",
        # Two CPU processes show data parallelism on any laptop; on GPUs use all of them.
        "devices": "auto" if on_gpu else 2,
        "max_steps": steps,
        "val_check_interval": steps // 3 if on_gpu else steps // 2,
        "limit_val_batches": 16,
        "log_every_n_steps": 10,
        "gradient_clip_val": 1.0,
        # LightningCLI appends these instances to the Trainer's callbacks (they are not parsed, so a lazy
        # instance would stay uninstantiated); --trainer.callbacks adds more next to them.
        "callbacks": [
            ModelCheckpoint(save_last=True, every_n_train_steps=steps // 2, save_top_k=1),
            TokenThroughput(log_every_n_steps=10),
            LearningRateMonitor(logging_interval="step"),
        ],
    }


def limit_cpu_threads(trainer: Trainer) -> None:
    """Share the CPU cores among the training processes of this machine.

    Every process of a multi-process CPU run would otherwise start one thread per core, and the processes
    would fight over the cores (several times slower on a 2-core machine). Leaves an explicit
    ``OMP_NUM_THREADS`` alone. The environment variable is set too, so processes the launcher starts later
    inherit it.
    """
    num_processes = trainer.num_devices
    if not isinstance(trainer.accelerator, CPUAccelerator) or num_processes <= 1:
        return
    if "OMP_NUM_THREADS" in os.environ:
        return
    available_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    num_threads = max(1, available_cores // num_processes)
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    torch.set_num_threads(num_threads)
    rank_zero_info(f"{num_processes} CPU processes on {available_cores} cores: {num_threads} thread(s) each.")


class DemoCLI(LightningCLI):
    """LightningCLI for the demo: ties the data's block size to the model's and shares CPU cores."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The data windows must fit the model's position table; one setting drives both.
        parser.link_arguments("model.block_size", "data.block_size")

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        limit_cpu_threads(self.trainer)

    def after_fit(self) -> None:
        """Tell the user where the run's outputs went and what to run next."""
        rank_zero_info(run_summary(self.trainer))


def run_summary(
    trainer: Trainer,
    command: str = "python -m lightning_colossal.demo",
    module: str = "GPTLightningModule (lightning_colossal.demo.module)",
    export: str = "model.safetensors",
    other_modes: str = "--trainer.strategy=colossal_zero2 | colossal_gemini | colossal_fsdp, or --config"
    " examples/colossal_hybrid.yaml",
) -> str:
    """Where a finished run left its checkpoint, logs and metrics, and the commands that use them.

    Args:
        command: the command that ran (its ``fit`` resumes).
        module: the LightningModule class that loads the checkpoint, and its module.
        export: the arguments after the checkpoint path in the export command.
        other_modes: how to run the same with other strategies.
    """
    lines = ["", "Finished. Outputs:"]
    checkpoint = trainer.checkpoint_callback
    last = getattr(checkpoint, "last_model_path", "") or getattr(checkpoint, "best_model_path", "")
    if last:
        lines.append(f"  checkpoint: {last} (+ {Path(last).name}.shards/, the sharded training state)")
    if trainer.log_dir is not None:
        lines.append(f"  logs:       {trainer.log_dir}")
        metrics = Path(trainer.log_dir) / "metrics.csv"
        if metrics.is_file():
            lines.append(f"  metrics:    {metrics}")
    if last:
        class_name, _, module_path = module.partition(" ")
        lines += [
            "Next:",
            f"  resume:      {command} fit --ckpt_path {last} --trainer.max_steps {2 * trainer.global_step}",
            f"  load it:     {class_name}.load_from_checkpoint('{last}')  {module_path}",
            f"  export:      python -m lightning_colossal.consolidate {last} {export}",
            f"  other modes: {other_modes}",
        ]
    return "\n".join(lines)


def main(args: ArgsType = None) -> DemoCLI:
    """Run the demo CLI.

    Args:
        args: Command-line arguments (e.g. ``["fit", "--trainer.max_steps=10"]``); ``None`` reads ``sys.argv``.

    Returns:
        The CLI, whose ``trainer``, ``model`` and ``datamodule`` can be inspected after the run.
    """
    return DemoCLI(
        GPTLightningModule,
        ByteCorpusDataModule,
        trainer_defaults=trainer_defaults(),
        seed_everything_default=1234,
        save_config_kwargs={"overwrite": True},
        args=args,
    )
