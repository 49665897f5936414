"""The body of one rank of ``benchmarks.hybrid``: ``python -m benchmarks.hybrid.ranks --spec spec.json``.

Two kinds of work, picked by the spec's ``kind``:

- ``pipeline``: the hybrid engine's pipeline (``PipelineStep.train_step``, what ``colossal_hybrid`` runs in place of
  ``training_step``) for several (schedule, micro-batch count) cases, timing per rank the whole schedule step and
  the compute inside it. The compute is timed by wrapping torch's own stage methods (``forward_one_chunk``,
  ``backward_one_chunk``, ``backward_weight_one_chunk``) and the schedule's loss call, in this process only.
- ``training``: a Lightning ``Trainer`` with the configuration's strategy on ``benchmarks.harness.workload.BenchmarkModule``; in
  chosen steps every collective is counted (``CollectiveCounter``) and the bytes of every tensor saved for backward
  are summed (``SavedActivations``).

Each rank writes ``rank<RANK>.json`` into the spec's directory.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.distributed.pipelining import schedules, stage
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

from benchmarks.harness.call_sites import call_site, repository_path
from benchmarks.harness.machine import read_cpu_times
from benchmarks.harness.workload import BenchmarkModule, build_strategy, train_on_cpu
from lightning_colossal.config import HybridConfig
from lightning_colossal.demo.data import RandomTokenDataset
from lightning_colossal.demo.model import GPT, GPTConfig
from lightning_colossal.distributed import ParallelDims
from lightning_colossal.distributed.mesh import build_device_mesh
from lightning_colossal.parallel import HybridEngine, build_groups, find_policy

# ---------------------------------------------------------------------------------------------------------------
# Counting collectives
# ---------------------------------------------------------------------------------------------------------------

# Collective kinds by op name (c10d's in-place ops that torch.distributed calls, and the functional collectives DTensor
# uses), with where the op's whole payload is: "input" (every rank holds the whole tensor), "output" (gathered).
_COLLECTIVES: dict[str, tuple[str, str]] = {
    "c10d.allreduce_": ("all_reduce", "input"),
    "c10d.allreduce_coalesced_": ("all_reduce", "input"),
    "c10d.allgather_": ("all_gather", "output"),
    "c10d._allgather_base_": ("all_gather", "output"),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", "output"),
    "c10d.reduce_scatter_": ("reduce_scatter", "input"),
    "c10d._reduce_scatter_base_": ("reduce_scatter", "input"),
    "c10d.alltoall_": ("all_to_all", "input"),
    "c10d.alltoall_base_": ("all_to_all", "input"),
    "c10d.broadcast_": ("broadcast", "input"),
    "c10d.send": ("send", "input"),
    "c10d.recv_": ("receive", "input"),
    "_c10d_functional.all_reduce": ("all_reduce", "input"),
    "_c10d_functional.all_reduce_coalesced": ("all_reduce", "input"),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", "output"),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_c10d_functional.all_to_all_single": ("all_to_all", "input"),
    "_c10d_functional.broadcast": ("broadcast", "input"),
}

_THIS_MODULE = repository_path(__file__)  # its dispatch mode's frames are plumbing too


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [tensor for item in value for tensor in _tensors(item)]
    return []


class CollectiveCounter(TorchDispatchMode):
    """Records every collective dispatched while active: kind, forward or backward, shape and payload bytes.

    ``torch.distributed.all_reduce`` and friends (how ``lightning_colossal.distributed.collectives`` calls them) reach
    the dispatcher as ``c10d.*`` ops; DTensor redistributions and ``loss_parallel`` as ``_c10d_functional.*`` ops. An
    op on DTensors is handed back (``NotImplemented``) so DTensor turns it into local ops and collectives first, which
    then come through here (as torch's ``CommDebugMode`` does). The payload is the whole tensor the collective reduces
    or assembles: an all-reduce's input, an all-gather's output (``group size`` × its input), a reduce-scatter's input.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(getattr(kind, "__name__", "") == "DTensor" for kind in types):
            return NotImplemented
        output = func(*args, **kwargs)
        name = str(getattr(func, "_overloadpacket", func))
        if name in _COLLECTIVES:
            kind, payload_side = _COLLECTIVES[name]
            group_size = _group_size(func, args, kwargs)
            payload = _payload_tensors(name, args, output, payload_side)
            payload_bytes = sum(tensor.numel() * tensor.element_size() for tensor in payload)
            if name == "_c10d_functional.all_gather_into_tensor":
                payload_bytes = sum(tensor.numel() * tensor.element_size() for tensor in _tensors(args[0])) * group_size
            self.records.append(
                {
                    "op": name,
                    "kind": kind,
                    # Inside backward the autograd engine is running a node; in forward, in the strategy's work after
                    # backward and in the optimizer step it is not.
                    "phase": "backward" if torch._C._current_autograd_node() is not None else "forward or after",
                    "shape": list(payload[0].shape) if payload else [],
                    "dtype": str(payload[0].dtype) if payload else "",
                    "group_size": group_size,
                    "payload_bytes": payload_bytes,
                    "site": call_site(_THIS_MODULE),
                }
            )
        return output


def _payload_tensors(name: str, args: Any, output: Any, side: str) -> list[Tensor]:
    if name.startswith("_c10d_functional."):
        return _tensors(output) if side == "output" else _tensors(args[0])
    # c10d in-place ops: allgather_(output_tensors, input_tensors, ...), _allgather_base_(output, input, ...),
    # reduce_scatter_(output_tensors, input_tensors, ...), alltoall_base_(output, input, ...); the rest (tensors, ...).
    if name in ("c10d.allgather_", "c10d._allgather_base_", "c10d.allgather_into_tensor_coalesced_"):
        return _tensors(args[0])
    if name in ("c10d.reduce_scatter_", "c10d._reduce_scatter_base_", "c10d.alltoall_", "c10d.alltoall_base_"):
        return _tensors(args[1])
    return _tensors(args[0])


def _group_size(func: Any, args: Any, kwargs: dict[str, Any]) -> int:
    """Ranks in the collective's group: c10d ops carry the ProcessGroup, functional ones its name as the last
    argument."""
    for value in [*args, *kwargs.values()]:
        if isinstance(value, dist.ProcessGroup):
            return value.size()
    name = args[-1] if args and isinstance(args[-1], str) else None
    if name is not None:
        return dist.get_world_size(dist.distributed_c10d._resolve_process_group(name))
    return dist.get_world_size()


# ---------------------------------------------------------------------------------------------------------------
# Counting saved activations
# ---------------------------------------------------------------------------------------------------------------


def _local(tensor: Tensor) -> Tensor:
    """The plain tensor holding the data: a DTensor's local shard, an async collective result's value."""
    while True:
        inner = getattr(tensor, "_local_tensor", None)
        if not isinstance(inner, Tensor):
            inner = getattr(tensor, "elem", None)
        if not isinstance(inner, Tensor):
            return tensor
        tensor = inner


class SavedActivations:
    """Bytes of the tensors autograd saves for backward while active, each storage counted once, parameters excluded.

    Every saved tensor stays alive until backward uses it, so at the end of forward the sum is the peak of saved
    activations. A storage is counted whole (a view keeps its whole base alive). Parameters (and views of them, such
    as a transposed weight) are model state, not activations, and are left out.
    """

    def __init__(self, parameters: Iterable[Tensor]) -> None:
        self._parameter_storages = {_local(parameter).untyped_storage().data_ptr() for parameter in parameters}
        self.storages: dict[int, tuple[int, list[int], str]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved)

    def _pack(self, tensor: Tensor) -> Tensor:
        local = _local(tensor)
        storage = local.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self._parameter_storages and pointer not in self.storages and storage.nbytes() > 0:
            self.storages[pointer] = (storage.nbytes(), list(local.shape), str(local.dtype))
        return tensor

    @property
    def total_bytes(self) -> int:
        return sum(size for size, _, _ in self.storages.values())

    def by_shape(self) -> list[dict[str, Any]]:
        """Saved storages grouped by (shape of the first tensor saved from it, dtype), largest total first."""
        groups: dict[tuple[tuple[int, ...], str], list[int]] = {}
        for size, shape, dtype in self.storages.values():
            groups.setdefault((tuple(shape), dtype), []).append(size)
        rows = [
            {"shape": list(shape), "dtype": dtype, "count": len(sizes), "bytes": sum(sizes)}
            for (shape, dtype), sizes in groups.items()
        ]
        return sorted(rows, key=lambda row: -row["bytes"])

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exception: Any) -> None:
        self._hooks.__exit__(*exception)


class StepProbe(Callback):
    """Counts collectives and saved activations over whole training steps (forward, backward, optimizer step)."""

    def __init__(self, probed_steps: list[int]) -> None:
        self.probed_steps = probed_steps
        self.steps: list[dict[str, Any]] = []
        self._stack: ExitStack | None = None
        self._counter: CollectiveCounter | None = None
        self._saved: SavedActivations | None = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx not in self.probed_steps:
            return
        self._stack = ExitStack()
        self._counter = self._stack.enter_context(CollectiveCounter())
        self._saved = self._stack.enter_context(SavedActivations(pl_module.parameters()))

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._stack is None:
            return
        self._stack.close()
        assert self._counter is not None and self._saved is not None
        self.steps.append(
            {
                "step": batch_idx,
                "collectives": self._counter.records,
                "saved_activation_bytes": self._saved.total_bytes,
                "saved_activations_by_shape": self._saved.by_shape(),
                "batch_shape": list(batch[0].shape),
            }
        )
        self._stack = self._counter = self._saved = None


def training_probe(spec: dict[str, Any]) -> dict[str, Any]:
    """Train a few steps of the configuration with Lightning and probe the chosen ones."""
    model_config = GPTConfig(**spec["model_config"])
    torch.manual_seed(spec["seed"])
    world_size = spec["world_size"]
    total_steps = max(spec["probed_steps"]) + 1
    dataset = RandomTokenDataset(
        vocab_size=model_config.vocab_size,
        block_size=spec["sequence_length"],
        num_samples=spec["batch_size_per_rank"] * world_size * total_steps,
        seed=spec["seed"],
    )
    loader = DataLoader(dataset, batch_size=spec["batch_size_per_rank"], shuffle=False, drop_last=True)
    probe = StepProbe(spec["probed_steps"])
    train_on_cpu(
        build_strategy(spec["strategy"], spec["init_args"]),
        world_size,
        total_steps,
        BenchmarkModule(model_config, spec["learning_rate"]),
        loader,
        [probe],
    )
    return {"steps": probe.steps}


# ---------------------------------------------------------------------------------------------------------------
# Timing pipeline schedules
# ---------------------------------------------------------------------------------------------------------------


class ScheduleTimers:
    """Wraps torch's pipeline stage methods, the schedules' loss call and their point-to-point helpers with timers.

    Compute: ``forward_one_chunk``, ``backward_one_chunk`` (a full backward, or only the input gradients when the
    schedule splits the backward, as ZB-V does) and ``backward_weight_one_chunk`` (the weight gradients), plus the loss
    on the last stage. Waiting: ``_wait_batch_p2p``, where a rank blocks until its point-to-point transfers are done
    (transfer time and idle time alike). Also counts the transfers this rank starts and their bytes.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.transfers = 0
        self.transfer_bytes = 0
        self._originals: list[tuple[Any, str, Any]] = []

    def reset(self) -> None:
        self.seconds = {"forward": 0.0, "backward": 0.0, "backward_input": 0.0, "backward_weight": 0.0, "loss": 0.0}
        self.seconds["point_to_point_wait"] = 0.0
        self.transfers = 0
        self.transfer_bytes = 0

    def install(self) -> None:
        base = stage._PipelineStageBase
        self._wrap(base, "forward_one_chunk", lambda *args, **kwargs: "forward")
        self._wrap(
            base,
            "backward_one_chunk",
            lambda *args, **kwargs: "backward" if kwargs.get("full_backward", True) else "backward_input",
        )
        self._wrap(base, "backward_weight_one_chunk", lambda *args, **kwargs: "backward_weight")
        self._wrap(schedules._PipelineSchedule, "_compute_loss", lambda *args, **kwargs: "loss")
        self._wrap(schedules, "_wait_batch_p2p", lambda *args, **kwargs: "point_to_point_wait")
        original_batch = schedules._batch_p2p

        def counted_batch(operations: list[dist.P2POp], *args: Any, **kwargs: Any) -> Any:
            self.transfers += len(operations)
            self.transfer_bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in operations)
            return original_batch(operations, *args, **kwargs)

        self._originals.append((schedules, "_batch_p2p", original_batch))
        schedules._batch_p2p = counted_batch
        self.reset()

    def _wrap(self, owner: Any, name: str, category: Callable[..., str]) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[category(*args, **kwargs)] += time.perf_counter() - start

        self._originals.append((owner, name, original))
        setattr(owner, name, timed)

    def remove(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals = []


class ModelHolder(nn.Module):
    """The root the engine names parameters from (a LightningModule holds the GPT as ``model`` the same way)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model


def _next_token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _pipeline_engine(spec: dict[str, Any], case: dict[str, Any]) -> tuple[ModelHolder, HybridEngine]:
    """A fresh GPT (seeded by the spec) and the hybrid engine pipelining it over every rank with the case's schedule."""
    timeout = timedelta(seconds=spec["process_group_timeout"])
    device = torch.device("cpu")
    config = HybridConfig.from_flat_arguments(
        pp_size=spec["world_size"],
        pp_schedule=case["schedule"],
        num_microbatches=case["microbatches"],
        num_model_chunks=case["chunks"],
    )
    torch.manual_seed(spec["seed"])
    root = ModelHolder(GPT(GPTConfig(**spec["model_config"])))
    model, policy = find_policy(root, None)
    groups = build_groups(
        build_device_mesh(ParallelDims(world_size=spec["world_size"], pp=config.pp_size), device), timeout
    )
    return root, HybridEngine(root, model, policy, config, groups, device, timeout)


def _pipeline_batch(spec: dict[str, Any], microbatches: int, vocab_size: int) -> tuple[Tensor, Tensor]:
    """(inputs, targets) of one step's random tokens, the same on every rank (a generator seeded by the spec)."""
    generator = torch.Generator().manual_seed(spec["seed"])
    tokens = torch.randint(
        0,
        vocab_size,
        (microbatches * spec["microbatch_size"], spec["sequence_length"] + 1),
        generator=generator,
    )
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _window_start() -> dict[str, float]:
    """Clocks at the start of the measured steps: wall, this process's CPU time and the machine's busy CPU time."""
    cpu_times = read_cpu_times()
    return {
        "wall_start": time.perf_counter(),
        "process_cpu_start": time.process_time(),
        "busy_start": cpu_times.busy_seconds if cpu_times else float("nan"),
    }


def _step_record(wall: float, timers: ScheduleTimers) -> dict[str, Any]:
    """One measured step: its wall time, the compute inside it by category and the point-to-point transfers."""
    return {
        "wall_seconds": wall,
        **{f"{key}_seconds": value for key, value in timers.seconds.items()},
        "transfers": timers.transfers,
        "transfer_bytes": timers.transfer_bytes,
    }


def _pipeline_case(spec: dict[str, Any], case: dict[str, Any], timers: ScheduleTimers) -> dict[str, Any]:
    """The case's warm-up then measured steps on this rank: each measured step's times, and the window's clocks."""
    microbatches = case["microbatches"]
    root, engine = _pipeline_engine(spec, case)
    assert engine.pipeline is not None  # pp_size = world_size > 1
    inputs, targets = _pipeline_batch(spec, microbatches, root.model.config.vocab_size)
    steps: list[dict[str, Any]] = []
    window: dict[str, float] = {}
    for step in range(spec["warmup_steps"] + spec["measured_steps"]):
        measured = step >= spec["warmup_steps"]
        for parameter in root.parameters():
            parameter.grad = None
        dist.barrier()  # both ranks start the schedule together, so each one's wall time is the step's
        if step == spec["warmup_steps"]:
            window = _window_start()
        timers.reset()
        start = time.perf_counter()
        engine.pipeline.train_step((inputs, targets), _next_token_loss, 1.0)
        wall = time.perf_counter() - start
        if measured:
            steps.append(_step_record(wall, timers))
    dist.barrier()
    cpu_times = read_cpu_times()
    engine.remove()
    return {
        **case,
        "steps": steps,
        "window": {
            "wall_seconds": time.perf_counter() - window["wall_start"],
            "process_cpu_seconds": time.process_time() - window["process_cpu_start"],
            "system_busy_seconds": (cpu_times.busy_seconds if cpu_times else float("nan")) - window["busy_start"],
        },
    }


def _ping_pong(spec: dict[str, Any], repeats: int = 30) -> dict[str, Any]:
    """One-way time of one activation-sized point-to-point transfer between the two ranks (half a round trip)."""
    model_config = GPTConfig(**spec["model_config"])
    message = torch.ones(spec["microbatch_size"], spec["sequence_length"], model_config.embed_dim)
    rank = dist.get_rank()
    times = []
    for attempt in range(repeats + 5):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(message, dst=1)
            dist.recv(message, src=1)
        else:
            dist.recv(message, src=0)
            dist.send(message, dst=0)
        if attempt >= 5:
            times.append((time.perf_counter() - start) / 2)
    times.sort()
    return {"message_bytes": message.numel() * message.element_size(), "one_way_seconds_median": times[len(times) // 2]}


def pipeline_bubbles(spec: dict[str, Any]) -> dict[str, Any]:
    """Every case of the spec in its order, then the point-to-point latency, on this rank."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec["process_group_timeout"]))
    timers = ScheduleTimers()
    timers.install()
    try:
        cases = []
        for case in spec["cases"]:
            cases.append(_pipeline_case(spec, case, timers))
            # The policy's patched forwards make the model reference itself: collect it before the next case.
            gc.collect()
    finally:
        timers.remove()
    latency = _ping_pong(spec)
    dist.destroy_process_group()
    return {"cases": cases, "point_to_point": latency}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, required=True, help="spec JSON written by benchmarks.hybrid")
    arguments = parser.parse_args(argv)
    spec = json.loads(arguments.spec.read_text())
    torch.set_num_threads(1)  # one core per rank (OMP_NUM_THREADS=1 is set by the launcher too)
    rank = int(os.environ["RANK"])
    result = pipeline_bubbles(spec) if spec["kind"] == "pipeline" else training_probe(spec)
    result["rank"] = rank
    result_path = Path(spec["directory"]) / f"rank{rank}.json"
    temporary_path = result_path.with_suffix(".json.partial")
    temporary_path.write_text(json.dumps(result))
    temporary_path.rename(result_path)


if __name__ == "__main__":
    main()
