"""Every private Lightning name lightning_colossal uses, imported here and nowhere else.

Lightning may rename or move a private name in any release. Importing them all in this one module means such an
upgrade breaks here, at import, naming the symbol, instead of somewhere inside a run; ``tests/unit/
test_lightning_private.py`` imports each name from the installed Lightning and checks that no other module of the
package imports a private Lightning name. Each name says why it is needed; all of them were checked against
Lightning 2.5.0 (the lowest version ``pyproject.toml`` allows) and 2.6.6, with the signatures used here.

To add one: import it below with its reason, add it to ``__all__``, and to ``PRIVATE_NAMES`` in the test.
"""

from __future__ import annotations

# Fabric's own launchers, subclassed for the Fabric strategies (fabric/launcher.py): the multiprocessing one (spawn,
# fork for notebooks) here, the popen one (scripts, torchrun, SLURM) below. Fabric has no public way to reuse them;
# constructed with (strategy, start method) and (cluster environment, processes per node, nodes) in 2.5.0 and 2.6.6.
from lightning.fabric.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher as _FabricMultiProcessingLauncher,
)

# The popen launcher's thread in rank 0's process that SIGKILLs every rank (itself included) within 5 s of a child
# rank exiting with an error; launcher.py finds it among the threads to say which rank died before that happens
# (rank 0 may not reach a collective, and so never print our own report, before it is killed). Its attributes
# `_child_processes` and `_terminate_all` are used; both exist with these names in 2.5.0 and 2.6.6.
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as _FabricSubprocessScriptLauncher,
)

# What `fabric.no_backward_sync(model)` asks of a strategy: its `_backward_sync_control`, an instance of this class
# with `no_backward_sync(module, enabled)` (2.5.0 and 2.6.6). Without one Fabric only warns and syncs anyway.
from lightning.fabric.strategies.strategy import _BackwardSyncControl

# Loads a checkpoint file the way Trainer(ckpt_path=...) does (local path or fsspec URL, weights_only handling):
# a single-file full checkpoint handed to a sharded strategy goes through the same reader.
from lightning.fabric.utilities.cloud_io import _load as lightning_load

# Lightning's own process-group start-up: the default backend for a device (gloo on CPU, nccl on CUDA) and the
# initialisation that reads the cluster environment's address and ranks. Reused so every launcher Lightning supports
# (popen, torchrun, SLURM, spawn, fork) starts our process group exactly as it starts its own; only the collective
# timeout and the device id are ours.
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection

# Moves optimizer state to the device after setup (what Lightning's DDPStrategy does): state built on the CPU by a
# checkpoint or before setup must follow the model.
from lightning.fabric.utilities.optimizer import _optimizers_to_device

# Every rank's random state, in the format Lightning saves it: checkpoints store and restore each rank's state so a
# resumed run draws the same numbers.
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states

# Broadcasts rank 0's parameters and buffers: outside fitting no engine or DDP wrapper does it, and every rank must
# evaluate the same model.
from lightning.pytorch.overrides.distributed import _sync_module_states

# The launchers: popen for scripts, torchrun and SLURM; the multiprocessing one (spawn, fork for notebooks) is
# subclassed in launcher.py to send full weights back, and its return value (_WorkerOutput) must keep its layout.
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput

# Lightning routes training_step through the DDP wrapper with this class; ddp.py subclasses it to keep DDP from
# expecting a second backward under manual optimization.
from lightning.pytorch.strategies.strategy import _ForwardRedirection

__all__ = [
    "_BackwardSyncControl",
    "_ChildProcessObserver",
    "_FabricMultiProcessingLauncher",
    "_FabricSubprocessScriptLauncher",
    "_ForwardRedirection",
    "_MultiProcessingLauncher",
    "_SubprocessScriptLauncher",
    "_WorkerOutput",
    "_collect_rng_states",
    "_get_default_process_group_backend_for_device",
    "_init_dist_connection",
    "_optimizers_to_device",
    "_set_rng_states",
    "_sync_module_states",
    "lightning_load",
]
