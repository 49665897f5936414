"""Communication volume per optimizer step per rank, counted exactly, for every strategy, next to the formulas.

    python -m benchmarks.communication                       # every configuration, 2 gloo ranks, small GPT
    python -m benchmarks.communication --configurations colossal_ddp,colossal_fsdp
    python -m benchmarks.communication --world-size 4 --configurations colossal_ddp,colossal_fsdp   # scaling shape

Each configuration is one launch of 2 rank processes (``--world-size``) (``python -m benchmarks.communication --rank-spec ...``,
started like ``benchmarks.peers`` starts its workers: gloo, ``OMP_NUM_THREADS=1``) training the demo GPT with Lightning
for ``--steps`` steps. A probed step k (by default 2, 3 and 4: after the first steps' bucket rebuilds, chunk tracing
and warnings) runs from the end of step k − 1 to the end of step k, so Lightning's loop between batches counts too; in
it each rank records:

- every collective dispatched, through a ``TorchDispatchMode`` that sees every ``c10d.*`` op (what
  ``torch.distributed.*`` calls, and what the C++ ``ProcessGroup`` methods dispatch to, so DDP's reducer and FSDP2
  show up) and every ``_c10d_functional.*`` op (DTensor): kind, phase of the step, shape, group, payload bytes, call
  site ([Note: two conventions for communication bytes] in ``benchmarks/communication_counting.py``);
- the bytes the process wrote to its sockets in the step (``wchar`` of ``/proc/self/io``: gloo's TCP transport
  sends with ``writev``), whatever issued them: the check that nothing escaped the dispatch mode, and the real wire
  figure of gloo's algorithms;
- for DDP, the bucket sizes DDP's reducer reports (``_get_ddp_logging_data()``), a second count of its gradients;
  for Gemini, the engine's chunk count and size.

Before the configurations, one launch measures gloo's own bytes for each collective by itself (4 MiB of payload,
socket bytes around each call): how gloo's algorithms compare with the ring model.

Writes every record to ``--output`` (default ``benchmarks/out/communication.json``) and a markdown block to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.communication.counting import (
    CONTROL_MAX_BYTES,
    NOT_COLLECTIVES,
    OP_RULES,
    analyse_rank,
    formula,
    markdown,
    point_to_point_kind,
    wire_bytes,
)
from benchmarks.harness.call_sites import call_site, repository_path
from benchmarks.harness.launch import REPOSITORY_ROOT, RunFailed, launch_ranks
from benchmarks.harness.machine import cpu_description, git_revision, software_versions

# The workload: the demo GPT at a few million parameters (d256, 2 layers, vocabulary 2048, untied head: Ψ =
# 2,644,992), 4 sequences of 64 tokens per rank, fp32, AdamW. Bytes scale with Ψ (and b·s·h), not with time.
DEFAULT_MODEL: dict[str, Any] = {
    "vocab_size": 2048,
    "block_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "embed_dim": 256,
    "tie_weights": False,
}

# label: (strategy, constructor arguments, formula mode)
CONFIGURATIONS: dict[str, tuple[str, dict[str, Any], str]] = {
    "colossal_ddp": ("colossal_ddp", {}, "ddp"),
    "lightning_ddp": ("ddp", {}, "ddp"),  # Lightning's own DDP: the reference for what a step needs besides DDP
    "colossal_zero1_all_reduce": ("colossal_zero1", {"communication": "all_reduce"}, "zero"),
    "colossal_zero1_scatter_gather": ("colossal_zero1", {"communication": "scatter_gather"}, "zero"),
    "colossal_zero2_all_reduce": ("colossal_zero2", {"communication": "all_reduce"}, "zero"),
    "colossal_zero2_scatter_gather": ("colossal_zero2", {"communication": "scatter_gather"}, "zero"),
    # The default route ("auto"): on gloo, point-to-point gathers (and ZeRO's reduce-scatter), see collectives.py.
    "colossal_zero1": ("colossal_zero1", {}, "zero"),
    "colossal_zero2": ("colossal_zero2", {}, "zero"),
    "colossal_gemini": ("colossal_gemini", {}, "zero3"),
    "colossal_gemini_all_reduce": ("colossal_gemini", {"communication": "all_reduce"}, "zero3"),
    "colossal_gemini_scatter_gather": ("colossal_gemini", {"communication": "scatter_gather"}, "zero3"),
    # The chunk-size search packs this model into one chunk, which stays gathered from forward into backward; chunks
    # of the largest parameter's size (2048 × 256) give 7, all but the last one used in forward gathered twice.
    "colossal_gemini_all_reduce_chunk512k": (
        "colossal_gemini",
        {"communication": "all_reduce", "chunk_numel": 2**19},
        "zero3",
    ),
    "colossal_gemini_scatter_gather_chunk512k": (
        "colossal_gemini",
        {"communication": "scatter_gather", "chunk_numel": 2**19},
        "zero3",
    ),
    "colossal_fsdp": ("colossal_fsdp", {}, "zero3"),
    "colossal_hybrid_tp2": ("colossal_hybrid", {"tp_size": 2}, "tp"),
    "colossal_hybrid_tp2_split_gather": (
        "colossal_hybrid",
        {"tp_size": 2, "sequence_parallel": "split_gather"},
        "tp_sequence_parallel",
    ),
}


# ---------------------------------------------------------------------------------------------------------------
# Orchestrator
# ---------------------------------------------------------------------------------------------------------------

_THIS_MODULE = repository_path(__file__)  # its dispatch mode's frames are plumbing too


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.communication", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configurations",
        default=",".join(CONFIGURATIONS),
        help=f"comma-separated labels (default all: {', '.join(CONFIGURATIONS)})",
    )
    parser.add_argument("--model-config", default="{}", help="JSON overriding GPTConfig fields of the small GPT")
    parser.add_argument("--batch-size-per-rank", type=int, default=4, help="sequences per rank (4)")
    parser.add_argument("--sequence-length", type=int, default=64, help="tokens per sequence (64)")
    parser.add_argument("--steps", type=int, default=5, help="training steps per launch (5)")
    parser.add_argument(
        "--world-size",
        type=int,
        default=2,
        help="ranks per launch (2); other than 2 only for the data-parallel configurations (the scaling shape)",
    )
    parser.add_argument("--probed-steps", default="2,3,4", help="steps whose collectives are counted (2,3,4)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a launch is killed (300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-primitives", action="store_true", help="do not measure gloo's primitives first")
    parser.add_argument("--output", type=Path, default=REPOSITORY_ROOT / "benchmarks" / "out" / "communication.json")
    parser.add_argument("--rank-spec", type=Path, help=argparse.SUPPRESS)  # set by the launcher for rank processes
    arguments = parser.parse_args(argv)
    if arguments.rank_spec is None:
        labels = [label for label in arguments.configurations.split(",") if label]
        unknown = [label for label in labels if label not in CONFIGURATIONS]
        if unknown:
            parser.error(f"unknown configurations {unknown}; known: {', '.join(CONFIGURATIONS)}")
        arguments.labels = labels
        if arguments.world_size < 1:
            parser.error(f"--world-size {arguments.world_size}: pass 1 or more ranks")
        tensor_parallel = [label for label in labels if CONFIGURATIONS[label][2].startswith("tp")]
        if arguments.world_size != 2 and tensor_parallel:
            # Their formulas count one tensor-parallel group of 2 with no data-parallel axis.
            parser.error(
                f"{', '.join(tensor_parallel)} are measured at --world-size 2 only; leave them out of --configurations"
                f" to measure the data-parallel ones at {arguments.world_size} ranks"
            )
        arguments.model = {**DEFAULT_MODEL, **json.loads(arguments.model_config)}
        arguments.probed = [int(step) for step in arguments.probed_steps.split(",") if step]
        if not arguments.probed or max(arguments.probed) >= arguments.steps or min(arguments.probed) < 1:
            # A probed step starts where the step before it ends, so step 0 cannot be probed.
            parser.error(f"--probed-steps {arguments.probed_steps} must lie in [1, --steps={arguments.steps})")
    return arguments


def _launch(spec: dict[str, Any], directory: Path, timeout: float) -> list[dict[str, Any]]:
    directory.mkdir(parents=True)
    spec = {**spec, "directory": str(directory)}
    spec_path = directory / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    launch_ranks("benchmarks.communication", ["--rank-spec", str(spec_path)], spec["world_size"], directory, timeout)
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(spec["world_size"])]


def parameter_count(model: dict[str, Any]) -> int:
    """Ψ of the GPT, from a copy on the meta device."""
    import torch

    from lightning_colossal.demo.model import GPT, GPTConfig

    with torch.device("meta"):
        return GPT(GPTConfig(**model)).num_parameters()


def analyse(label: str, ranks: list[dict[str, Any]], context: dict[str, Any]) -> dict[str, Any]:
    """A launch's ranks against the formula of its mode."""
    strategy, init_args, mode = CONFIGURATIONS[label]
    model, settings = context["model"], context["settings"]
    formula_arguments: dict[str, Any] = {"parameters": context["parameters"], "group_size": len(ranks)}
    if mode.startswith("tp"):
        formula_arguments["activation_elements"] = (
            settings["batch_size_per_rank"] * settings["sequence_length"] * model["embed_dim"]
        )
        formula_arguments["layers"] = model["num_layers"]
    return {
        "label": label,
        "strategy": strategy,
        "init_args": init_args,
        "mode": mode,
        "formula": formula(mode, **formula_arguments).__dict__,
        "ranks": [analyse_rank(rank, context["control_max_bytes"]) for rank in ranks],
        "unknown_ops": sorted({name for rank in ranks for name in rank["unknown_ops"]}),
        "ddp_bucket_bytes": ranks[0].get("ddp_bucket_bytes"),
        "gemini_chunks": ranks[0].get("gemini_chunks"),
    }


def _context(arguments: argparse.Namespace, command_arguments: list[str]) -> dict[str, Any]:
    """What the document records about the measurement besides the launches: command, machine, model, settings."""
    return {
        "command": " ".join(["python", "-m", "benchmarks.communication", *command_arguments]),
        "machine": cpu_description(),
        "started_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "git": git_revision(REPOSITORY_ROOT),
        "software": software_versions(),
        "model": arguments.model,
        "parameters": parameter_count(arguments.model),
        "settings": {
            "batch_size_per_rank": arguments.batch_size_per_rank,
            "sequence_length": arguments.sequence_length,
            "steps": arguments.steps,
            "probed_steps": arguments.probed,
            "world_size": arguments.world_size,
            "seed": arguments.seed,
        },
        "control_max_bytes": CONTROL_MAX_BYTES,
    }


def _training_spec(label: str, arguments: argparse.Namespace) -> dict[str, Any]:
    """The spec the rank processes of one configuration's launch read."""
    strategy, init_args, _ = CONFIGURATIONS[label]
    return {
        "kind": "training",
        "world_size": arguments.world_size,
        "strategy": strategy,
        "init_args": init_args,
        "model_config": arguments.model,
        "batch_size_per_rank": arguments.batch_size_per_rank,
        "sequence_length": arguments.sequence_length,
        "learning_rate": 3e-4,
        "seed": arguments.seed,
        "steps": arguments.steps,
        "probed_steps": arguments.probed,
        "process_group_timeout": arguments.timeout,
    }


def _launch_all(
    arguments: argparse.Namespace, context: dict[str, Any]
) -> tuple[dict[str, Any] | None, dict[str, Any]] | None:
    """(gloo primitives or ``None`` when skipped, every configuration's ranks and analysis), launched one after the
    other; ``None`` as soon as a launch fails (reported on stderr)."""
    results: dict[str, Any] = {}
    primitives = None
    with tempfile.TemporaryDirectory(prefix="lightning_colossal_communication_") as scratch:
        if not arguments.skip_primitives:
            spec = {"kind": "primitives", "world_size": 2, "numel": PRIMITIVE_NUMEL, "timeout": arguments.timeout}
            try:
                primitives = primitive_rows(_launch(spec, Path(scratch) / "primitives", arguments.timeout))
            except RunFailed as error:
                print(f"gloo primitives: launch failed: {error}", file=sys.stderr)
                return None
            print("  gloo primitives measured", flush=True)
        for label in arguments.labels:
            spec = _training_spec(label, arguments)
            launched = time.perf_counter()
            try:
                ranks = _launch(spec, Path(scratch) / label, arguments.timeout)
            except RunFailed as error:
                print(f"{label}: launch failed: {error}", file=sys.stderr)
                return None
            results[label] = {"raw": ranks, "analysis": analyse(label, ranks, context)}
            print(f"  {label}: {time.perf_counter() - launched:.0f} s", flush=True)
    return primitives, results


def main(argv: Sequence[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    if arguments.rank_spec is not None:
        rank_main(arguments.rank_spec)
        return 0
    context = _context(arguments, list(sys.argv[1:] if argv is None else argv))
    start = time.perf_counter()
    launched = _launch_all(arguments, context)
    if launched is None:
        return 1
    primitives, results = launched
    document = {
        **context,
        "wall_seconds": time.perf_counter() - start,
        "primitives": primitives,
        "configurations": results,
    }
    arguments.output.parent.mkdir(parents=True, exist_ok=True)
    arguments.output.write_text(json.dumps(document, indent=2, default=str))
    print(markdown(document))
    print(f"raw measurements written to {arguments.output}")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# Rank side
# ---------------------------------------------------------------------------------------------------------------


def cpu_clocks() -> tuple[float, float, float]:
    """(this thread's CPU seconds, the whole process's CPU seconds, wall seconds) now.

    [Note: CPU time per rank]
    With more ranks than cores (4 on 2), wall time measures the scheduler. CPU seconds do not: each rank's main
    thread runs the model, the optimizer and the buffer work around collectives (flattening, copies), and gloo runs
    every collective on its own worker threads while the main thread waits without spending CPU. So per rank and
    step, the main thread's CPU time is the compute side and the other threads' CPU time the communication side
    (plus a heartbeat thread's few microseconds). Both include the counting dispatch mode's own overhead, the same at
    every world size.
    """
    return time.thread_time(), time.process_time(), time.perf_counter()


def resident_bytes() -> int:
    """This process's resident memory now (``VmRSS`` of ``/proc/self/status``).

    [Note: training memory per rank]
    A rank's training memory is its peak resident memory (``ru_maxrss``, over the whole process) less its resident
    memory just before the model is built: what the model, its gradients, the optimizer state, the strategy's buffers
    and the activations added to an interpreter that had already imported torch and Lightning. On CPU ranks that is
    the figure the planner's ``host_bytes_per_rank`` predicts. It also holds what the allocator keeps and does not
    return (glibc arenas), so it is an upper figure, and the counting dispatch mode's records of the probed steps
    (a few MB).
    """
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS line in /proc/self/status: these measurements need Linux")


def peak_resident_bytes() -> int:
    """The most resident memory this process has had so far (``ru_maxrss``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def socket_counters() -> tuple[int, int]:
    """(bytes, calls) this process (every thread, living or gone) passed to write-family system calls: ``wchar`` and
    ``syscw`` of ``/proc/self/io``. gloo's TCP pairs send with ``writev``, which both count; nothing else writes
    during a step (the ranks' logs get nothing then)."""
    values: dict[str, int] = {}
    with open("/proc/self/io") as io:
        for line in io:
            key, _, value = line.partition(":")
            values[key] = int(value)
    return values["wchar"], values["syscw"]


# Payload of each primitive collective measured by itself: 2**20 fp32 values, 4 MiB.
PRIMITIVE_NUMEL = 2**20


def primitive_rows(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' measurements of each gloo primitive, side by side."""
    rows = []
    for index, row in enumerate(ranks[0]["rows"]):
        per_rank = [rank["rows"][index] for rank in ranks]
        rows.append(
            {
                "name": row["name"],
                "payload_bytes": row["payload_bytes"],
                "ring_model_bytes": [entry["ring_model_bytes"] for entry in per_rank],
                "socket_bytes_sent": [entry["socket_bytes_sent"] for entry in per_rank],
                "socket_writes": [entry["socket_writes"] for entry in per_rank],
            }
        )
    return {"payload_bytes": PRIMITIVE_NUMEL * 4, "rows": rows}


def _primitive_cases(whole: Any, rank: int) -> list[tuple[str, str, Any, str | None]]:
    """(name, kind, call, role) of each gloo collective on the fp32 tensor ``whole``, in table order."""
    import torch
    import torch.distributed as dist

    n, numel = dist.get_world_size(), whole.numel()

    def all_reduce() -> None:
        dist.all_reduce(whole)

    def reduce_scatter() -> None:
        dist.reduce_scatter_tensor(torch.empty(numel // n), whole)

    def reduce_scatter_list() -> None:
        dist.reduce_scatter(torch.empty(numel // n), list(whole.chunk(n)))

    def all_gather() -> None:
        dist.all_gather_into_tensor(torch.empty(numel), whole[: numel // n].clone())

    def all_gather_list() -> None:
        dist.all_gather(list(torch.empty(numel).chunk(n)), whole[: numel // n].clone())

    def broadcast() -> None:
        dist.broadcast(whole, src=0)

    def all_to_all() -> None:
        dist.all_to_all_single(torch.empty(numel), whole)

    def send_receive() -> None:
        if rank == 0:
            dist.send(whole, dst=1)
        elif rank == 1:
            dist.recv(whole, src=0)

    return [
        ("all_reduce", "all_reduce", all_reduce, None),
        ("reduce_scatter_tensor", "reduce_scatter", reduce_scatter, None),
        ("reduce_scatter (list)", "reduce_scatter", reduce_scatter_list, None),
        ("all_gather_into_tensor", "all_gather", all_gather, None),
        ("all_gather (list)", "all_gather", all_gather_list, None),
        ("broadcast from rank 0", "broadcast", broadcast, "root" if rank == 0 else "other"),
        ("all_to_all_single", "all_to_all", all_to_all, None),
        ("send 0 → recv 1", "send" if rank == 0 else "receive", send_receive, None),
    ]


def primitives_main(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    """Each gloo collective once on ``numel`` fp32 values (after one unmeasured call), socket bytes around it."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=spec["timeout"]))
    n = dist.get_world_size()
    whole = torch.ones(spec["numel"])
    payload = whole.numel() * whole.element_size()
    rows = []
    for name, kind, call, role in _primitive_cases(whole, rank):
        call()  # unmeasured: any first-call set-up
        dist.barrier()
        before_bytes, before_writes = socket_counters()
        call()
        after_bytes, after_writes = socket_counters()
        dist.barrier()
        rows.append(
            {
                "name": name,
                "payload_bytes": payload,
                "ring_model_bytes": wire_bytes(kind, payload, n, role) if n > 1 and kind != "receive" else 0.0,
                "socket_bytes_sent": after_bytes - before_bytes,
                "socket_writes": after_writes - before_writes,
            }
        )
    dist.destroy_process_group()
    return {"rank": rank, "rows": rows}


def _flatten(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [tensor for item in value for tensor in _flatten(item)]
    return []


def _bind(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments by schema name."""
    named = {argument.name: value for argument, value in zip(func._schema.arguments, args, strict=False)}
    named.update(kwargs)
    return named


def _group(named: dict[str, Any]) -> tuple[int, int]:
    """(size, this rank's index) of the op's group: c10d ops carry the ProcessGroup, functional ones its name."""
    import torch.distributed as dist

    group = named.get("process_group")
    if group is None and "group_name" in named:
        group = dist.distributed_c10d._resolve_process_group(named["group_name"])
    if group is None:
        return dist.get_world_size(), dist.get_rank()
    if not isinstance(group, dist.ProcessGroup):
        # Ops dispatched from C++ (DDP's reducer) carry the group as a TorchScript object.
        group = dist.ProcessGroup.unbox(group)
    return group.size(), group.rank()


def _collective_record(
    name: str,
    kind: str,
    payload: list[Any],
    times: int,
    group_size: int,
    role: str | None,
    phase: str,
    site: str,
) -> dict[str, Any]:
    """The record of one collective: ``times`` × the payload tensors' bytes, and the wire bytes of its kind."""
    payload_bytes = times * sum(tensor.numel() * tensor.element_size() for tensor in payload)
    return {
        "op": name,
        "kind": kind,
        "phase": phase,
        "shapes": [list(tensor.shape) for tensor in payload[:4]],
        "tensors": len(payload),
        "dtype": str(payload[0].dtype) if payload else "",
        "group_size": group_size,
        "role": role,
        "payload_bytes": payload_bytes,
        "wire_bytes": wire_bytes(kind, payload_bytes, group_size, role),
        "site": site,
    }


def _record_collective(
    records: list[dict[str, Any]], func: Any, name: str, args: Any, kwargs: dict[str, Any], phase: str
) -> None:
    """Append the records of one dispatched collective op that has a rule in ``OP_RULES``.

    ``phase`` is the one the hooks set; an op inside a running autograd node is "backward" whatever it says.
    """
    import torch

    rule = OP_RULES[name]
    named = _bind(func, args, kwargs)
    group_size, group_rank = _group(named)
    phase = "backward" if torch._C._current_autograd_node() is not None else phase
    site = call_site(_THIS_MODULE)
    payload = _flatten(named[rule.payload])
    if rule.operations is not None:
        # A batch of sends and receives: one record per tensor.
        for operation, tensor in zip(named[rule.operations], payload, strict=True):
            records.append(
                _collective_record(name, point_to_point_kind(operation), [tensor], 1, group_size, None, phase, site)
            )
        return
    role = None
    if rule.kind in ("broadcast", "reduce", "gather", "scatter"):
        role = "root" if named[rule.peer] == group_rank else "other"
    times = group_size if rule.times_group else 1
    records.append(_collective_record(name, rule.kind, payload, times, group_size, role, phase, site))


def _make_counter() -> Any:
    """A ``TorchDispatchMode`` recording every collective (built here so the orchestrator never imports torch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveCounter(TorchDispatchMode):
        """Records every ``c10d.*`` / ``_c10d_functional.*`` op dispatched while active.

        An op on DTensors is handed back (``NotImplemented``) so DTensor lowers it to local ops and collectives
        first, which then come through here (as torch's ``CommDebugMode`` does). ``phase`` is set by the Lightning
        callback from its hooks; an op inside a running autograd node is "backward" whatever the hook said.
        """

        def __init__(self) -> None:
            super().__init__()
            self.records: list[dict[str, Any]] = []
            self.unknown: list[str] = []
            self.phase = "forward"

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if any(getattr(kind, "__name__", "") == "DTensor" for kind in types):
                return NotImplemented
            output = func(*args, **kwargs)
            name = str(getattr(func, "_overloadpacket", func))
            if not name.startswith(("c10d.", "_c10d_functional.")) or name in NOT_COLLECTIVES:
                return output
            if name not in OP_RULES:
                self.unknown.append(name)  # reported, never silently dropped
                return output
            _record_collective(self.records, func, name, args, kwargs, self.phase)
            return output

    return CollectiveCounter()


class _CommunicationRecorder:
    """The state and bookkeeping of ``_make_probe``'s ``CommunicationProbe``, which only adds Lightning's hooks (kept
    apart so that this module imports neither Lightning nor torch until a rank trains).

    Counting starts at the end of the step before the first probed one; the end of each probed step closes its
    record and opens the next one's, and the end of the last probed step stops counting.
    """

    def __init__(self, probed_steps: list[int]) -> None:
        self.steps: list[dict[str, Any]] = []
        self.ddp_bucket_bytes: list[int] | None = None
        self.unknown_ops: list[str] = []
        self.gemini_chunks: dict[str, int] | None = None
        # [Note: training memory per rank]: the peak by the start of training (set-up: the model built, sharded,
        # the optimizer made) and the resident memory at the end of the last probed step (the steady state).
        self.peak_resident_bytes_at_train_start = 0
        self.resident_bytes_after_probed_steps = 0
        self._probed_steps = probed_steps
        self._first, self._last = min(probed_steps), max(probed_steps)
        self._counter: Any = None
        self._socket_mark = (0, 0)
        self._record_mark = 0
        self._cpu_mark = (0.0, 0.0, 0.0)

    def _phase(self, phase: str) -> None:
        if self._counter is not None:
            self._counter.phase = phase

    def _step_ended(self, batch_idx: int) -> None:
        if batch_idx == self._first - 1:
            self._counter = _make_counter()
            self._counter.__enter__()
            self._socket_mark = socket_counters()
            self._cpu_mark = cpu_clocks()
        elif self._counter is not None and batch_idx in self._probed_steps:
            self._close_step(batch_idx)
        self._phase("between steps")

    def _close_step(self, batch_idx: int) -> None:
        socket_now, cpu_now = socket_counters(), cpu_clocks()
        main_thread, process, wall = (now - mark for now, mark in zip(cpu_now, self._cpu_mark, strict=True))
        self.steps.append(
            {
                "step": batch_idx,
                "collectives": self._counter.records[self._record_mark :],
                "socket_bytes_sent": socket_now[0] - self._socket_mark[0],
                "socket_writes": socket_now[1] - self._socket_mark[1],
                # [Note: CPU time per rank]
                "main_thread_cpu_seconds": main_thread,
                "other_threads_cpu_seconds": process - main_thread,
                "wall_seconds": wall,
            }
        )
        self._socket_mark, self._record_mark, self._cpu_mark = socket_now, len(self._counter.records), cpu_now
        if batch_idx == self._last:
            self.resident_bytes_after_probed_steps = resident_bytes()
            self._counter.__exit__(None, None, None)
            self.unknown_ops = self._counter.unknown
            self._counter = None

    def _read_strategy(self, strategy: Any) -> None:
        """The second counts: DDP's bucket sizes from its reducer, Gemini's chunks from its engine."""
        from torch.nn.parallel import DistributedDataParallel

        wrapped = strategy.model
        if isinstance(wrapped, DistributedDataParallel):
            logging_data = wrapped._get_ddp_logging_data()
            sizes = str(logging_data.get("rebuilt_bucket_sizes") or logging_data.get("bucket_sizes", ""))
            self.ddp_bucket_bytes = [int(size) for size in sizes.replace(",", " ").split()]
        engine = getattr(strategy, "engine", None)
        if hasattr(engine, "memory_report") and hasattr(engine.memory_report(), "num_chunks"):
            report = engine.memory_report()
            self.gemini_chunks = {"num_chunks": report.num_chunks, "chunk_numel": report.chunk_numel}


def _make_probe(probed_steps: list[int]) -> Any:
    """A Lightning callback counting the probed steps (built here so the orchestrator never imports Lightning)."""
    from lightning.pytorch import Callback, LightningModule, Trainer

    class CommunicationProbe(_CommunicationRecorder, Callback):
        """Counts collectives and socket bytes of whole training steps.

        A probed step k runs from ``on_train_batch_end`` of step k − 1 to ``on_train_batch_end`` of step k: Lightning's
        loop between the two (it broadcasts a SIGTERM flag before every batch), then forward, backward, the strategy's
        work after backward and the optimizer step. ``phase`` follows Lightning's hooks.
        """

        def on_train_start(self, trainer: Trainer, module: LightningModule) -> None:
            self.peak_resident_bytes_at_train_start = peak_resident_bytes()

        def on_train_batch_start(self, trainer: Trainer, module: LightningModule, batch: Any, batch_idx: int) -> None:
            self._phase("forward")

        def on_before_backward(self, trainer: Trainer, module: LightningModule, loss: Any) -> None:
            self._phase("backward")

        def on_after_backward(self, trainer: Trainer, module: LightningModule) -> None:
            self._phase("after backward")

        def on_before_optimizer_step(self, trainer: Trainer, module: LightningModule, optimizer: Any) -> None:
            self._phase("optimizer step")

        def on_train_batch_end(
            self, trainer: Trainer, module: LightningModule, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            self._step_ended(batch_idx)

        def on_train_end(self, trainer: Trainer, module: LightningModule) -> None:
            self._read_strategy(trainer.strategy)

    return CommunicationProbe(probed_steps)


def rank_main(spec_path: Path) -> None:
    """This rank's part of a launch (training or the gloo primitives); writes ``rank<RANK>.json``."""
    spec = json.loads(spec_path.read_text())
    rank = int(os.environ["RANK"])
    result = primitives_main(spec, rank) if spec["kind"] == "primitives" else training_main(spec, rank)
    result_path = Path(spec["directory"]) / f"rank{rank}.json"
    temporary_path = result_path.with_suffix(".json.partial")
    temporary_path.write_text(json.dumps(result))
    temporary_path.rename(result_path)


def training_main(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    """Train one configuration on this rank with Lightning, probing the chosen steps."""
    import torch
    from torch.utils.data import DataLoader

    from benchmarks.harness.workload import BenchmarkModule, build_strategy, train_on_cpu
    from lightning_colossal.demo.data import RandomTokenDataset
    from lightning_colossal.demo.model import GPTConfig

    torch.set_num_threads(1)
    model_config = GPTConfig(**spec["model_config"])
    torch.manual_seed(spec["seed"])
    dataset = RandomTokenDataset(
        vocab_size=model_config.vocab_size,
        block_size=spec["sequence_length"],
        num_samples=spec["batch_size_per_rank"] * spec["world_size"] * spec["steps"],
        seed=spec["seed"],
    )
    loader = DataLoader(dataset, batch_size=spec["batch_size_per_rank"], shuffle=False, drop_last=True)
    probe = _make_probe(spec["probed_steps"])
    resident_before_model = resident_bytes()
    train_on_cpu(
        build_strategy(spec["strategy"], spec["init_args"]),
        spec["world_size"],
        spec["steps"],
        BenchmarkModule(model_config, spec["learning_rate"]),
        loader,
        [probe],
    )
    return {
        "rank": rank,
        # [Note: training memory per rank]
        "resident_bytes_before_model": resident_before_model,
        "peak_resident_bytes": peak_resident_bytes(),
        "peak_resident_bytes_at_train_start": probe.peak_resident_bytes_at_train_start,
        "resident_bytes_after_probed_steps": probe.resident_bytes_after_probed_steps,
        "steps": probe.steps,
        "unknown_ops": probe.unknown_ops,
        "ddp_bucket_bytes": probe.ddp_bucket_bytes,
        "gemini_chunks": probe.gemini_chunks,
    }


if __name__ == "__main__":
    raise SystemExit(main())
