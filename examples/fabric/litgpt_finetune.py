"""litgpt's own fine-tuning ``main`` under a lightning_colossal Fabric strategy, on two CPU processes.

litgpt fine-tunes with a hand-written Fabric loop: ``litgpt.finetune.full`` and ``litgpt.finetune.lora`` each build a
``Fabric`` in ``setup`` and run ``main(fabric, ...)`` under ``fabric.launch``. This script builds its own ``Fabric``
with one of this package's strategies and launches litgpt's ``main`` unchanged, so litgpt's loop runs over ZeRO or
Gemini: its model built under ``fabric.init_module(empty_init=True)``, ``fabric.setup(model)`` then
``fabric.setup_optimizers``, its pretrained weights loaded with ``model.load_state_dict``, ``fabric.no_backward_sync``
on accumulating micro-batches, and ``fabric.save`` of ``final/lit_model.pth``. Nothing is downloaded: a tiny litgpt
model with random weights, a byte-level tokenizer and a few instruction samples are written into a work directory.

litgpt pins older ``huggingface-hub`` and ``jsonargparse`` than the rest of the test environment, so it lives in a
virtual environment of its own (``examples/fabric/README.md``)::

    python examples/fabric/litgpt_finetune.py finetune WORKDIR --strategy colossal_zero2   # colossal_gemini, ddp, ...
    python examples/fabric/litgpt_finetune.py finetune WORKDIR --strategy colossal_zero2 --method lora
    python examples/fabric/litgpt_finetune.py generate WORKDIR/out/colossal_zero2-full-32-true/final

``finetune`` writes ``WORKDIR/out/<strategy>-<method>-<precision>/``: litgpt's own ``final/`` checkpoint directory
and ``metrics_rank<r>.json`` (each rank's training losses by iteration, the final validation loss, and every record
litgpt's loop logged with ``fabric.log_dict``). ``generate`` loads checkpoint directories with litgpt's own loader
(``litgpt.api.LLM.load``) in a plain process and prints one JSON line after ``RESULT``: for each directory the
logits of a prompt's last position and the tokens and text generated greedily.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.loggers import Logger

import lightning_colossal  # noqa: F401  (registers the colossal_* Fabric strategies)

DEVICES = 2
EOS = "<|endoftext|>"
#: LoRA on the attention's query and value (litgpt.finetune.lora's own default targets), rank 4, no dropout.
LORA = {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_query": True, "lora_value": True}
PROMPT = "12 plus 30 is"


# ---------------------------------------------------------------------------------------------- the work directory
def tiny_config() -> Any:
    from litgpt import Config

    # GPT-NeoX-shaped (litgpt's defaults: parallel residual, LayerNorm, partial rotary), about 46k weights: 256 byte
    # tokens and the end-of-text token, the embedding padded to a multiple of 64.
    return Config(name="tiny-neox", block_size=128, vocab_size=257, padding_multiple=64, n_layer=2, n_head=2, n_embd=32)


def write_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer without merges (one token per byte) plus an end-of-text token, as the
    ``tokenizer.json`` and ``tokenizer_config.json`` that ``litgpt.Tokenizer`` reads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={symbol: index for index, symbol in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS])
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "add_bos_token": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))


def write_samples(directory: Path) -> None:
    """``train.json`` and ``val.json`` for ``litgpt.data.JSON``: short sums as instruction and answer."""
    generator = random.Random(0)

    def sample() -> dict[str, str]:
        a, b = generator.randrange(100), generator.randrange(100)
        return {"instruction": f"{a} plus {b} is", "input": "", "output": f" {a + b}."}

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "train.json").write_text(json.dumps([sample() for _ in range(64)]))
    (directory / "val.json").write_text(json.dumps([sample() for _ in range(4)]))


def prepare(workdir: Path, method: str) -> tuple[Path, Path]:
    """The checkpoint directory litgpt fine-tunes from (``lit_model.pth`` with random weights, ``model_config.yaml``,
    the tokenizer) and the data directory; written where missing. Returns both.

    For LoRA, a second checkpoint directory whose ``lit_model.pth`` also holds initialised LoRA matrices. litgpt's
    LoRA ``main`` builds the model under ``fabric.init_module(empty_init=True)`` whenever there is more than one
    device and loads the base weights with ``strict=False``; under any strategy but litgpt's own FSDP (which
    initialises what it materialises) the LoRA matrices would keep uninitialised memory (NaN losses under Fabric's
    plain ``ddp``)."""
    from litgpt import GPT
    from litgpt.utils import save_config

    base_dir, data_dir = workdir / "checkpoints" / "tiny-neox", workdir / "data"
    if not (base_dir / "lit_model.pth").is_file():
        base_dir.mkdir(parents=True, exist_ok=True)
        config = tiny_config()
        save_config(config, base_dir)
        write_tokenizer(base_dir)
        write_samples(data_dir)
        torch.manual_seed(0)
        _save_last(GPT(config).state_dict(), base_dir / "lit_model.pth")
    if method == "full":
        return base_dir, data_dir
    lora_dir = workdir / "checkpoints" / "tiny-neox-lora"
    if not (lora_dir / "lit_model.pth").is_file():
        from litgpt.lora import GPT as LoRAGPT
        from litgpt.lora import Config as LoRAConfig

        lora_dir.mkdir(parents=True, exist_ok=True)
        for name in ("model_config.yaml", "tokenizer.json", "tokenizer_config.json"):
            (lora_dir / name).write_bytes((base_dir / name).read_bytes())
        torch.manual_seed(1)
        lora_model = LoRAGPT(LoRAConfig.from_file(base_dir / "model_config.yaml", **LORA))
        weights = torch.load(base_dir / "lit_model.pth")
        weights.update({name: value for name, value in lora_model.state_dict().items() if "lora_" in name})
        _save_last(weights, lora_dir / "lit_model.pth")
    return lora_dir, data_dir


def _save_last(weights: dict[str, torch.Tensor], path: Path) -> None:
    """Saved under another name, then renamed: the file's presence says that its directory is complete."""
    partial = path.with_name(path.name + ".partial")
    torch.save(weights, partial)
    partial.rename(path)


# ---------------------------------------------------------------------------------------------- fine-tuning
class MetricsFile(Logger):
    """Writes what litgpt's loop logs with ``fabric.log_dict`` to ``metrics_rank<r>.json`` (Fabric calls its loggers on
    every rank), rewritten at every record so a run that fails later leaves what it had."""

    def __init__(self, out_dir: Path, description: dict[str, str]) -> None:
        super().__init__()
        self.out_dir, self.description = out_dir, description
        self.records: list[dict[str, Any]] = []
        self.rank = 0  # set in each launched process

    @property
    def name(self) -> str:
        return "metrics_file"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.records.append({"step": step, **{key: float(value) for key, value in metrics.items()}})
        summary = {
            **self.description,
            "train_losses": [[int(record["iter"]), record["loss"]] for record in self.records if "loss" in record],
            "val_loss": next((record["val_loss"] for record in reversed(self.records) if "val_loss" in record), None),
            "records": self.records,
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"metrics_rank{self.rank}.json").write_text(json.dumps(summary, indent=1))


def run_litgpt_main(fabric: L.Fabric, method: str, logger: MetricsFile, arguments: dict[str, Any]) -> None:
    """In every launched process: litgpt's own ``main``."""
    logger.rank = fabric.global_rank
    if method == "full":
        from litgpt.finetune.full import main
    else:
        from litgpt.finetune.lora import main
    # At its end litgpt's main writes hyperparameters.yaml by parsing sys.argv as its own `setup` command line
    # (litgpt.parser_config.save_hyperparameters), and LoRA's merge reads the LoRA shape back from that file: give it
    # a command line that `setup` accepts. Changed only here, after Fabric's launcher started the other ranks with
    # this script's own arguments.
    sys.argv = [sys.argv[0], str(arguments["checkpoint_dir"]), "--out_dir", str(arguments["out_dir"])]
    if method == "lora":
        sys.argv += [f"--{name}={value}" for name, value in LORA.items()]
    main(fabric, **arguments)


def finetune(workdir: Path, strategy: str, method: str, precision: str, steps: int) -> Path:
    from litgpt import Config
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.data import JSON
    from litgpt.prompts import Default

    checkpoint_dir, data_dir = prepare(workdir, method)  # before the launch: the other rank finds it written
    out_dir = workdir / "out" / f"{strategy}-{method}-{precision}"
    logger = MetricsFile(out_dir, {"strategy": strategy, "method": method, "precision": precision})
    fabric = L.Fabric(accelerator="cpu", devices=DEVICES, strategy=strategy, precision=precision, loggers=[logger])
    arguments: dict[str, Any] = {
        "devices": DEVICES,
        "seed": 1337,
        "config": Config.from_file(checkpoint_dir / "model_config.yaml"),
        "data": JSON(json_path=data_dir, prompt_style=Default(), num_workers=0),
        "checkpoint_dir": checkpoint_dir,
        "out_dir": out_dir,
        # Two micro-batches per rank and step (the first under fabric.no_backward_sync). litgpt's schedule gives the
        # one warm-up step a learning rate of 0, then decays a cosine over the rest.
        "train": TrainArgs(
            save_interval=None,
            log_interval=1,
            global_batch_size=2 * DEVICES,
            micro_batch_size=1,
            lr_warmup_steps=1,
            epochs=100,
            max_steps=steps,
            max_seq_length=64,
        ),
        "eval": EvalArgs(interval=10_000, max_new_tokens=4, max_iters=2, final_validation=True),
        "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01, "weight_decay": 0.0}},
        "num_nodes": 1,
    }
    if method == "full":
        arguments["resume"] = False
    else:
        from litgpt.lora import Config as LoRAConfig

        arguments["config"] = LoRAConfig.from_file(checkpoint_dir / "model_config.yaml", **LORA)
        arguments["precision"] = precision
    fabric.launch(run_litgpt_main, method, logger, arguments)
    return out_dir


# ---------------------------------------------------------------------------------------------- generation
def generate(checkpoint_dir: Path, max_new_tokens: int) -> dict[str, Any]:
    """Load a litgpt checkpoint directory with litgpt's own loader and generate greedily, in this plain process."""
    from litgpt.api import LLM

    llm = LLM.load(str(checkpoint_dir), distribute=None)
    llm.distribute(accelerator="cpu", precision="32-true")  # litgpt's default on a CPU would be bf16-true
    prompt = llm.preprocessor.encode(PROMPT)
    with torch.no_grad():
        logits = llm.model(prompt.view(1, -1))[0, -1]
    tokens = llm.generate(PROMPT, max_new_tokens=max_new_tokens, top_k=1, return_as_token_ids=True)
    return {
        "checkpoint_dir": str(checkpoint_dir),
        "logits": logits.tolist(),
        "tokens": tokens.view(-1).tolist(),
        "text": llm.preprocessor.decode(tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    tune = commands.add_parser("finetune", help="fine-tune with litgpt's own main under a Fabric strategy")
    tune.add_argument("workdir", type=Path)
    tune.add_argument("--strategy", default="colossal_zero2", help="a Fabric strategy name: colossal_*, ddp, ...")
    tune.add_argument("--method", choices=("full", "lora"), default="full")
    tune.add_argument("--precision", default="32-true", help="Fabric's precision: 32-true, bf16-true, ...")
    tune.add_argument("--steps", type=int, default=4, help="optimizer steps")
    generation = commands.add_parser("generate", help="load litgpt checkpoint directories with litgpt and generate")
    generation.add_argument("checkpoint_dirs", type=Path, nargs="+")
    generation.add_argument("--max-new-tokens", type=int, default=6)
    options = parser.parse_args()
    if options.command == "generate":
        results = [generate(directory, options.max_new_tokens) for directory in options.checkpoint_dirs]
        print("RESULT " + json.dumps(results))
        return
    out_dir = finetune(options.workdir.resolve(), options.strategy, options.method, options.precision, options.steps)
    print(f"litgpt_finetune: wrote {out_dir}")


if __name__ == "__main__":
    main()
