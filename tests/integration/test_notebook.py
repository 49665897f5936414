"""``examples/finetune.ipynb`` executed end to end in a real Jupyter kernel (nbclient + ipykernel), as a user runs it.

The kernel is a fresh ``python3`` ipykernel on this interpreter, with the repository importable, running in a
temporary directory (the notebook writes under ``lightning_logs/`` of its working directory). The ranks are forked
from the kernel by ``colossal_zero2_notebook``, so this is the one test of the fork launcher inside Jupyter, threads
of the kernel included. The checks read what the final cells printed. About 30-50 s on 2 shared cores.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.fresh_interpreter import REPOSITORY_ROOT

NOTEBOOK = REPOSITORY_ROOT / "examples" / "finetune.ipynb"
CELL_TIMEOUT_S = 240


def _python3_kernel_on_this_interpreter(directory: Path) -> dict[str, str]:
    """A ``python3`` kernelspec for ``sys.executable`` under ``directory``, and the environment that selects it.

    A ``python3`` kernelspec installed elsewhere on the machine may point at another interpreter; ``JUPYTER_PATH``
    is searched first, so the kernel always runs the Python (and the packages) of this test.
    """
    from ipykernel.kernelspec import write_kernel_spec

    write_kernel_spec(directory / "kernels" / "python3")  # its argv starts with sys.executable
    environment = {**os.environ, "JUPYTER_PATH": str(directory), "PYTHONPATH": str(REPOSITORY_ROOT)}
    environment.pop("LOCAL_RANK", None)  # set, it would tell Lightning that the ranks already exist
    return environment


def _printed(cell) -> str:
    return "".join(output.get("text", "") for output in cell.get("outputs", []) if output.output_type == "stream")


def test_notebook_is_committed_small_and_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    assert notebook.metadata.kernelspec.name == "python3"
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code_cells, "the notebook has no code cells"
    for cell in code_cells:
        assert not cell.outputs and cell.execution_count is None, "clear the notebook's outputs before committing"
    assert NOTEBOOK.stat().st_size < 64_000


@pytest.mark.slow
@pytest.mark.timeout(CELL_TIMEOUT_S + 120)
def test_finetune_notebook_runs_end_to_end(tmp_path):
    for module in ("nbclient", "nbformat", "ipykernel", "matplotlib", "transformers"):
        pytest.importorskip(module)
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    environment = _python3_kernel_on_this_interpreter(tmp_path / "jupyter")
    work = tmp_path / "work"
    work.mkdir()
    client = NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(work)}},  # the kernel's working directory
    )
    client.execute(env=environment)  # a failing cell raises CellExecutionError with its traceback

    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    printed = "\n".join(_printed(cell) for cell in code_cells)
    errors = [output for cell in code_cells for output in cell.outputs if output.output_type == "error"]
    assert not errors, errors

    # The forked ranks trained, and their weights came back into the kernel.
    assert "the ranks sent them back" in printed, printed[-4000:]
    changed = float(re.search(r"changed by up to (\S+):", printed).group(1))
    assert changed > 1e-3
    # The loss from the CSV file the ranks wrote went down, and both plots were drawn.
    assert "loss went down: True" in printed, printed[-4000:]
    first, last = map(float, re.search(r"train loss: (\S+) at the first step -> (\S+) ", printed).groups())
    assert last < first - 1.0
    images = [output for cell in code_cells for output in cell.outputs if "image/png" in output.get("data", {})]
    assert len(images) >= 2, "the loss and memory plots were not shown"
    # ZeRO-2 halves the optimizer state on each of the 2 ranks.
    memory_files = sorted((work / "lightning_logs" / "finetune_notebook" / "memory").glob("rank*.json"))
    assert [path.name for path in memory_files] == ["rank0.json", "rank1.json"]
    for path in memory_files:
        last_row = json.loads(path.read_text())[-1]
        assert 0 < last_row["optimizer_state_bytes"] < 1.2 * last_row["parameter_bytes"]
    # Text was generated in the kernel process.
    generation_cell = next(cell for cell in code_cells if "model.generate(" in cell.source)
    generated = _printed(generation_cell)
    assert "--- generated 120 new tokens" in generated
    assert len(generated.split("--- generated")[0].strip()) > 60
    # The checkpoint is a file plus its shards, and load_from_checkpoint opens it.
    assert re.search(r"finetuned\.ckpt\.shards/\w+/__1_0\.distcp", printed), printed[-4000:]
    assert "the checkpoint holds the weights the notebook got back: True" in printed
    # Both exports load back.
    assert "the exported dir loads back with from_pretrained and gives the same logits: True" in printed
    assert "the consolidated weights equal the fine-tuned model's: True" in printed
    assert "missing [], unexpected []" in printed
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(work / "lightning_logs" / "finetune_notebook" / "finetuned_hf")
    assert sum(parameter.numel() for parameter in exported.parameters()) > 50_000
