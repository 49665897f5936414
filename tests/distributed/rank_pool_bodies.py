"""Bodies run inside the rank pool by ``test_rank_pool.py``: module-level so that every worker can import them."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
import torch.distributed

from tests.harness.rank_pool import current_rank, current_world_size


def all_reduce_rank_plus_one() -> list[float]:
    """Every rank contributes ``[rank + 1, 10 * (rank + 1)]``; returns the summed tensor as seen on this rank."""
    rank = current_rank()
    tensor = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    torch.distributed.all_reduce(tensor)
    return tensor.tolist()


def return_rank_and_arguments(*args: Any, **kwargs: Any) -> tuple[int, tuple[Any, ...], dict[str, Any]]:
    """Echo the arguments back with the rank, proving they reach every rank intact."""
    return current_rank(), args, kwargs


def print_greeting() -> None:
    """Print to stdout and stderr, which the pool relays to the test's captured stderr with a rank prefix."""
    print(f"greeting on stdout from rank {current_rank()}")
    print(f"greeting on stderr from rank {current_rank()}", file=sys.stderr)


def describe_worker() -> dict[str, Any]:
    """The process, environment and thread settings a body runs under."""
    return {
        "process_id": os.getpid(),
        "rank": torch.distributed.get_rank(),
        "world_size": torch.distributed.get_world_size(),
        "backend": torch.distributed.get_backend(),
        "environment": {
            name: os.environ.get(name)
            for name in (
                "LOCAL_RANK",
                "RANK",
                "WORLD_SIZE",
                "NODE_RANK",
                "MASTER_ADDR",
                "MASTER_PORT",
                "OMP_NUM_THREADS",
            )
        },
        "num_threads": torch.get_num_threads(),
        "repository_on_path": any(
            os.path.isfile(os.path.join(entry, "tests", "harness", "rank_pool.py")) for entry in sys.path
        ),
    }


def change_process_state() -> None:
    """Change state that the pool must undo between runs; ``describe_process_state`` then reads it back."""
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    os.environ["RANK_POOL_TEST_LEAK"] = "1"
    del os.environ["WORLD_SIZE"]  # Lightning's LightningEnvironment.teardown does this.
    os.chdir("/")
    torch.distributed.new_group(list(range(current_world_size())))


def describe_process_state() -> dict[str, Any]:
    """Read back what ``change_process_state`` changed."""
    from torch.distributed import distributed_c10d

    return {
        "default_dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
        "leaked_variable": os.environ.get("RANK_POOL_TEST_LEAK"),
        "world_size_variable": os.environ.get("WORLD_SIZE"),
        "working_directory": os.getcwd(),
        "num_process_groups": len(distributed_c10d._world.pg_map),
    }


def raise_on_rank_one() -> str:
    """Rank 1 raises; the others wait at a barrier that rank 1 never reaches."""
    if current_rank() == 1:
        raise ValueError("rank one fails on purpose")
    torch.distributed.barrier()
    return "unreachable while rank 1 fails"


def hang_on_rank_zero() -> None:
    """Rank 0 sleeps far past any timeout; the others wait at a barrier that rank 0 never reaches."""
    if current_rank() == 0:
        time.sleep(3600)
    torch.distributed.barrier()


def exit_on_rank_one(exit_code: int) -> str:
    """Rank 1 exits abruptly (no exception, no reply), as a segfault or an OOM kill would; the others return."""
    if current_rank() == 1:
        print("rank one is about to exit", flush=True)
        os._exit(exit_code)
    return "fine"


def fit_boring_model_with_ddp(root_directory: str) -> dict[str, Any]:
    """Run Lightning's own ``BoringModel`` for two steps with ``strategy="ddp"`` inside the pool.

    Returns what the rank's Trainer saw, whether it reused the pool's process group, and a checksum of the trained
    weights (equal on all ranks only if DDP really averaged the gradients across the pool).
    """
    import lightning
    from lightning.pytorch.demos.boring_classes import BoringModel

    group_before = torch.distributed.group.WORLD
    torch.manual_seed(current_rank())  # Different initial weights per rank: DDP must broadcast rank 0's.
    model = BoringModel()
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=current_world_size(),
        strategy="ddp",
        max_steps=2,
        default_root_dir=root_directory,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    return {
        "trainer_world_size": trainer.world_size,
        "trainer_global_rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "same_process_group": torch.distributed.group.WORLD is group_before,
        "weight_checksum": sum(parameter.detach().double().sum().item() for parameter in model.parameters()),
    }
