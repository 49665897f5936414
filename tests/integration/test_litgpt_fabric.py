"""litgpt as a client: litgpt's own fine-tuning ``main`` (full and LoRA) under the colossal Fabric strategies.

``examples/fabric/litgpt_finetune.py`` launches ``litgpt.finetune.full.main`` / ``litgpt.finetune.lora.main``
unchanged on two CPU processes, on a tiny random litgpt model it writes itself (nothing is downloaded). Each run is a
fresh interpreter. The per-iteration training losses (each rank's own, as litgpt logs them) and the final
validation loss under ``colossal_zero2`` and ``colossal_gemini`` must equal those under Fabric's own ``ddp``; the
``final/lit_model.pth`` that litgpt saves through ``fabric.save`` must load with litgpt's own loader in a plain
process and compute and generate what the ``ddp`` one does.

litgpt pins an older huggingface-hub and jsonargparse than the main test environment, so this runs only where litgpt
is installed (its own virtual environment, ``examples/fabric/README.md``); elsewhere it is skipped.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("litgpt")

import torch  # noqa: E402

from tests.fresh_interpreter import REPOSITORY_ROOT, run_python  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLE = REPOSITORY_ROOT / "examples" / "fabric" / "litgpt_finetune.py"
RANKS = 2
STEPS = 4  # optimizer steps: 2 micro-batches each per rank, so 8 logged iterations
TIMEOUT = 240


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``finetuned(strategy, method, precision)``: the run's output directory; each run once per module."""
    workdir = tmp_path_factory.mktemp("litgpt")
    runs: dict[tuple[str, str, str], subprocess.CompletedProcess[str]] = {}

    def finetuned(strategy: str, method: str = "full", precision: str = "32-true") -> Path:
        key = (strategy, method, precision)
        if key not in runs:
            arguments = ["finetune", str(workdir), "--strategy", strategy, "--method", method, "--precision", precision]
            runs[key] = run_python([str(EXAMPLE), *arguments, "--steps", str(STEPS)], workdir, timeout=TIMEOUT)
        result = runs[key]
        assert result.returncode == 0, (
            f"litgpt's {method} main under {strategy} ({precision}) failed:\n"
            + result.stdout[-2000:]
            + _rank_zero_traceback(result.stderr)[-8000:]
        )
        return workdir / "out" / f"{strategy}-{method}-{precision}"

    return finetuned


def _rank_zero_traceback(stderr: str) -> str:
    """Rank 0's traceback (torch prefixes each rank's lines with ``[rank<r>]:``), else the end of stderr."""
    lines = [line for line in stderr.splitlines() if line.startswith("[rank0]:")]
    return "\n".join(lines) if lines else stderr[-6000:]


def _metrics(out_dir: Path, rank: int) -> dict[str, Any]:
    return json.loads((out_dir / f"metrics_rank{rank}.json").read_text())


def _assert_losses_match(out_dir: Path, reference_dir: Path, rel: float) -> None:
    for rank in range(RANKS):
        reference, run = _metrics(reference_dir, rank), _metrics(out_dir, rank)
        iterations = [iteration for iteration, _ in reference["train_losses"]]
        assert iterations == list(range(1, 2 * STEPS + 1)), reference["train_losses"]
        assert [iteration for iteration, _ in run["train_losses"]] == iterations
        expected = [loss for _, loss in reference["train_losses"]] + [reference["val_loss"]]
        actual = [loss for _, loss in run["train_losses"]] + [run["val_loss"]]
        assert actual == pytest.approx(expected, rel=rel, abs=0), (
            f"rank {rank}: {run['strategy']} {actual} vs ddp {expected}"
        )


@pytest.mark.parametrize("strategy", ["colossal_zero2", "colossal_gemini"])
def test_full_finetuning_losses_match_ddp(finetuned, strategy):
    reference_dir = finetuned("ddp", "full")
    for rank in range(RANKS):  # ddp learned (6.06 -> 4.5), so equal losses mean equal steps, not no steps
        reference = _metrics(reference_dir, rank)
        assert reference["val_loss"] < reference["train_losses"][0][1] - 0.5, reference
    _assert_losses_match(finetuned(strategy, "full"), reference_dir, rel=1e-5)


@pytest.mark.parametrize("strategy", ["colossal_zero2", "colossal_gemini"])
def test_lora_finetuning_losses_match_ddp(finetuned, strategy):
    """Frozen base weights, trained LoRA matrices (litgpt loads the base with strict=False and saves the LoRA
    matrices from ``model.state_dict()``, not through fabric.save)."""
    reference_dir, out_dir = finetuned("ddp", "lora"), finetuned(strategy, "lora")
    _assert_losses_match(out_dir, reference_dir, rel=1e-5)
    initial = torch.load(out_dir.parents[1] / "checkpoints" / "tiny-neox-lora" / "lit_model.pth", weights_only=True)
    reference, saved = (
        _plain_weights(directory / "final" / "lit_model.pth.lora") for directory in (reference_dir, out_dir)
    )
    assert sorted(saved) == sorted(reference) and all("lora_" in name for name in reference) and reference
    for name, value in reference.items():
        assert (value - initial[name]).abs().max() > 1e-3, f"ddp did not train {name}"
        torch.testing.assert_close(
            saved[name], value, rtol=1e-4, atol=1e-6, msg=lambda text, name=name: f"{name}: {text}"
        )


def test_zero2_bf16_true_trains_from_the_weights_litgpt_loaded(finetuned):
    """In 32-true ZeRO's fp32 masters are the parameters themselves, so a ``model.load_state_dict`` after set-up
    that missed the masters would still pass the tests above. In bf16-true the masters are separate fp32 copies: had
    they kept the uninitialised values of litgpt's ``empty_init`` model, the first step with a learning rate would
    train from those (non-finite losses). The losses follow ddp's fp32 ones within bf16's rounding."""
    _assert_losses_match(finetuned("colossal_zero2", "full", "bf16-true"), finetuned("ddp", "full"), rel=5e-3)


def _plain_weights(path: Path) -> dict[str, torch.Tensor]:
    contents = torch.load(path, weights_only=True)
    return contents.get("model", contents)  # as litgpt.utils.load_checkpoint reads it


@pytest.mark.parametrize(
    ("strategy", "method"),
    [
        ("colossal_zero2", "full"),
        ("colossal_zero2", "lora"),  # litgpt merges the LoRA checkpoint it saved into a full lit_model.pth
        ("colossal_gemini", "full"),
        ("colossal_gemini", "lora"),
    ],
)
def test_saved_lit_model_loads_with_litgpt_and_generates_as_ddps(finetuned, strategy, method, tmp_path):
    pairs = [(finetuned("ddp", method) / "final", finetuned(strategy, method) / "final")]
    for reference, saved in pairs:
        # Plain weights (under litgpt's "model" key where fabric.save wrote them), readable with weights_only.
        reference_weights, saved_weights = (_plain_weights(path / "lit_model.pth") for path in (reference, saved))
        assert sorted(saved_weights) == sorted(reference_weights)
    directories = [str(directory) for pair in pairs for directory in pair]
    result = run_python([str(EXAMPLE), "generate", *directories], tmp_path, timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    results = json.loads(result.stdout.split("RESULT ", 1)[1])
    for reference, saved in zip(results[0::2], results[1::2], strict=True):
        # Equal up to rounding: AdamW turns the rounding noise in gradients that are zero in exact arithmetic (the
        # key bias) into different updates, which the function the model computes does not see.
        torch.testing.assert_close(
            torch.tensor(saved["logits"]), torch.tensor(reference["logits"]), rtol=1e-4, atol=1e-5
        )
        assert saved["tokens"] and saved["tokens"] == reference["tokens"], (saved, reference)


TRAINER_SCRIPT = """
import sys
import torch
import lightning as L
import lightning_colossal  # noqa: F401
from litgpt import Config
from litgpt.api import LLM
from litgpt.model import GPT

CONFIG = dict(name="tiny-neox", block_size=32, vocab_size=64, padding_multiple=64, n_layer=2, n_head=2, n_embd=32)


class Module(L.LightningModule):
    # litgpt's Trainer pattern: an LLM whose state_dict() drops the `model.` level of its parameters' names.
    def __init__(self):
        super().__init__()
        config = Config(**CONFIG)
        self.llm = LLM(model=GPT(config), config=config)

    def training_step(self, batch, batch_index):
        logits = self.llm.model(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        tokens = torch.randint(0, 64, (16, 17), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(tokens, batch_size=4)


if __name__ == "__main__":
    strategy, path = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    module = Module()
    trainer.fit(module)
    trainer.save_checkpoint(path)
    if trainer.global_rank == 0:
        llm = LLM(model=GPT(Config(**CONFIG)), config=Config(**CONFIG))
        llm.trainer_setup(trainer_ckpt=path)  # litgpt's own strict load of a Trainer checkpoint
        print("LOADED", sorted(llm.state_dict()) == sorted(module.llm.state_dict()))
"""


@pytest.mark.parametrize("strategy", ["colossal_zero2", "colossal_gemini"])
def test_litgpts_llm_trained_by_the_trainer_loads_with_its_own_strict_loader(strategy, tmp_path):
    script = tmp_path / "llm_trainer.py"
    script.write_text(TRAINER_SCRIPT)
    result = run_python([str(script), strategy, str(tmp_path / "llm.ckpt")], tmp_path, timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "LOADED True" in result.stdout, result.stdout[-3000:]
