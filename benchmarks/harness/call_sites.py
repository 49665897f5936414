"""Where a collective was issued from, for the benchmarks that count collectives by their caller.

A collective reaches torch's dispatcher through several frames that only carry it (c10d, functional collectives,
DTensor, our ``collectives`` module, the counting code itself); its site is the innermost frame outside them.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

from benchmarks.harness.launch import REPOSITORY_ROOT

PLUMBING = (
    "torch/distributed/distributed_c10d.py",
    "torch/distributed/c10d_logger.py",
    "torch/distributed/_functional_collectives",
    "torch/distributed/tensor/_collective_utils.py",
    "torch/utils/_python_dispatch.py",
    "torch/_ops.py",
    "torch/_compile.py",
    "torch/_dynamo/",
    "typing_extensions.py",  # torch's @deprecated wrapper around all_gather_into_tensor and reduce_scatter_tensor
    "lightning_colossal/distributed/collectives.py",
    "benchmarks/harness/call_sites.py",
)


def repository_path(file: str) -> str:
    """``file`` relative to the repository, with ``/`` separators (what ``call_site`` matches against)."""
    return Path(file).resolve().relative_to(REPOSITORY_ROOT).as_posix()


def call_site(counting_module: str) -> str:
    """``file:function`` of the innermost Python frame outside ``PLUMBING`` and ``counting_module`` (the repository
    path of the module whose dispatch mode counts the collective). A collective issued from C++ inside the autograd
    engine (DDP's reducer) has only the frame that started backward above it."""
    root = REPOSITORY_ROOT.as_posix() + "/"
    for frame in reversed(traceback.extract_stack()):
        filename = frame.filename.replace(os.sep, "/")
        if counting_module in filename or any(part in filename for part in PLUMBING):
            continue
        short = filename.split("/site-packages/")[-1]
        return f"{short[len(root) :] if short.startswith(root) else short}:{frame.name}"
    return "unknown"
