"""Capacity under a memory budget: the deepest GPT each strategy trains with its device model state kept under B.

Example (the setting of ``benchmarks/RESULTS.md``, "Capacity under a memory budget")::

    python -m benchmarks.capacity --budget-mib 64 --output benchmarks/out/capacity.json

On CPU ranks the compute device and the host are the same RAM, so the budget B is enforced by the engines' own byte
accounting: the model-state bytes an engine holds *on the compute device* (DDP and ZeRO: parameters, gradients,
optimizer state and buckets not offloaded; Gemini: every chunk byte its report places on the compute device) must
stay within B at every sample of every step (``benchmarks.capacity.ranks``; for Gemini, a bound from above built
with the engine's exact running peak of its working set). Gemini's automatic placement gets
``compute_memory_budget=B`` and keeps to it itself (it budgets the activations it traced too); the others are
measured. A model "fits B" when ``--steps`` steps train on every rank with finite losses and no sample exceeds B.

Per strategy, the GPT grows in depth at a fixed width. The planner's formulas (``lightning_colossal.planning``) give
the depth predicted to fit; real 2-rank runs then confirm the largest depth that fits and the first that does not,
walking out from the prediction by doubling steps and bisecting (``search_largest``). Fitting is taken to be monotone
in depth. See ``benchmarks/README.md``.

The disk rows (``colossal_gemini_auto_disk``, ``colossal_gemini_offload_all_disk``) keep optimizer state on disk
under ``--offload-dir`` and must also keep their host model state within ``--host-budget-mib`` (H) per rank; they train
their own workload (``row_arguments``). Example (``benchmarks/RESULTS.md``, "The disk tier")::

    python -m benchmarks.capacity --budget-mib 64 --strategies colossal_ddp,colossal_gemini_auto_disk
        --host-budget-mib 2048 --max-layers 200 --peak-rule events --run-timeout 900   (one line)
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.harness.launch import REPOSITORY_ROOT, RunFailed, launch_ranks
from benchmarks.harness.machine import cpu_description, git_revision, software_versions

__all__ = ["CapacityStrategy", "STRATEGIES", "classify", "largest_predicted", "main", "ratio_to", "search_largest"]

MIB = 2**20


@dataclass(frozen=True)
class CapacityStrategy:
    """One row: a registered strategy, its constructor arguments and how B is kept.

    Args:
        label: the row's name.
        strategy: the registered name the ranks build.
        init_args: JSON constructor arguments; ``"placement": "budget"`` becomes ``AutoPlacement(
            compute_memory_budget=B)``, any other placement dict is passed to the rank as is.
        planner_setting: the planner setting (``standard_settings``/``offload_settings`` label) whose formulas
            predict the device bytes.
        enforcement: how B is held, for the report.
        disk: the row keeps optimizer state on disk (``offload_dir``) and is held to a host budget H as well; it trains
            the disk workload (``--disk-embed-dim``, ``--disk-heads``, chunks of the largest parameter, activation
            checkpointing, the GPT built on the meta device; see ``row_arguments``).
        precision: the Trainer's precision (``bf16-true``: bf16 working shards, so fp32 masters are separate copies
            that ``masters_on_disk`` can move to disk).
    """

    label: str
    strategy: str
    init_args: dict[str, Any]
    planner_setting: str
    enforcement: str
    disk: bool = False
    precision: str = "32-true"


# Buckets are sized for the budget: ZeRO's default 25 MiB bucket would alone take most of a 64 MiB budget, and DDP's
# reducer keeps a second copy of every gradient unless the gradients are views of its buckets. Each peer gets the
# setting that uses the least device memory, so the comparison is with their best, not their defaults.
STRATEGIES: dict[str, CapacityStrategy] = {
    strategy.label: strategy
    for strategy in (
        CapacityStrategy(
            "colossal_ddp",
            "colossal_ddp",
            {"gradient_as_bucket_view": True},
            "colossal_ddp",
            "measured: parameters + gradients (DDP's buckets) + optimizer state, tensor walk",
        ),
        CapacityStrategy(
            "colossal_zero2",
            "colossal_zero2",
            {"bucket_size_mb": 1.0},
            "colossal_zero2",
            "measured: ZeroEngine.memory_report, everything on the device, pooled buckets included",
        ),
        CapacityStrategy(
            "colossal_zero2_offload",
            "colossal_zero2_offload",
            {"bucket_size_mb": 1.0},
            "colossal_zero2_offload",
            "measured: ZeroEngine.memory_report, parameters + gradient accumulator + buckets on the device",
        ),
        CapacityStrategy(
            "colossal_gemini_offload",
            "colossal_gemini_offload",
            {},
            "colossal_gemini_offload",
            "measured: Gemini chunk bytes on the compute device (static placement, optimizer offloaded)",
        ),
        CapacityStrategy(
            "colossal_gemini_auto",
            "colossal_gemini_auto",
            {"placement": "budget"},
            "colossal_gemini_offload",
            "enforced by the engine (AutoPlacement(compute_memory_budget=B)) and measured as for Gemini",
        ),
        CapacityStrategy(
            "colossal_gemini_offload_all",
            "colossal_gemini",
            {
                "placement": {
                    "kind": "static",
                    "shard_param_frac": 1.0,
                    "offload_optim_frac": 1.0,
                    "offload_param_frac": 1.0,
                }
            },
            "colossal_gemini (all offloaded)",
            "measured: Gemini chunk bytes on the compute device (static placement, parameter shards offloaded too)",
        ),
        CapacityStrategy(
            "colossal_gemini_auto_disk",
            "colossal_gemini",
            {"placement": "budget+host"},
            "colossal_gemini_offload",
            "B and H enforced by the engine (AutoPlacement(compute_memory_budget=B, host_memory_budget=H), the"
            " optimizer state of the chunks beyond H on disk under offload_dir) and measured as for Gemini; host model"
            " state (chunk bytes off the compute device) measured against H",
            disk=True,
        ),
        CapacityStrategy(
            "colossal_gemini_auto_disk_masters",
            "colossal_gemini",
            {"placement": "budget+host", "masters_on_disk": True},
            "colossal_gemini_offload",
            "as colossal_gemini_auto_disk, with bf16 weights (precision='bf16-true') and the fp32 masters of the"
            " chunks beyond H on disk too (masters_on_disk=True)",
            disk=True,
            precision="bf16-true",
        ),
        CapacityStrategy(
            "colossal_gemini_offload_all_disk",
            "colossal_gemini",
            {
                "placement": {
                    "kind": "static",
                    "shard_param_frac": 1.0,
                    "offload_optim_frac": 1.0,
                    "offload_param_frac": 1.0,
                    "disk_fraction": 1.0,
                }
            },
            "colossal_gemini (all offloaded)",
            "measured: Gemini chunk bytes on the compute device (static placement, everything offloaded, all optimizer"
            " state on disk); host model state measured against H (not enforced by the engine)",
            disk=True,
        ),
    )
}
DEFAULT_STRATEGIES = (
    "colossal_ddp,colossal_zero2,colossal_zero2_offload,colossal_gemini_auto,colossal_gemini_offload,"
    "colossal_gemini_offload_all"
)


# ---------------------------------------------------------------------------------------------------------------
# Prediction (planner formulas) and search (pure logic, unit-tested without training)
# ---------------------------------------------------------------------------------------------------------------


def row_arguments(strategy: CapacityStrategy, arguments: argparse.Namespace) -> argparse.Namespace:
    """The workload a row trains: the command line's, or for a disk row the disk workload. A model of hundreds of
    millions of parameters under B = 64 MiB needs it: wide layers (parameters grow with width squared, activations
    with width), chunks just large enough for the largest parameter (the MLP's 4·d² weight; 4·d² + 8·d packs a block
    into 3 full chunks: the working set of gathered chunks counts against B), each block recomputing its activations in backward (automatic placement
    budgets traced activations inside B), and the GPT built on the meta device so that no rank holds it whole."""
    if not strategy.disk:
        return argparse.Namespace(**{**vars(arguments), "activation_checkpointing": False, "meta_init": False})
    embed_dim = arguments.disk_embed_dim
    return argparse.Namespace(
        **{
            **vars(arguments),
            "embed_dim": embed_dim,
            "heads": arguments.disk_heads,
            "chunk_numel": arguments.disk_chunk_numel or 4 * embed_dim * embed_dim + 8 * embed_dim,
            "activation_checkpointing": arguments.disk_activation_checkpointing,
            "meta_init": True,
        }
    )


def model_config(arguments: argparse.Namespace, layers: int) -> dict[str, Any]:
    """The demo GPT at ``layers`` blocks; the planner's demo defaults (tied head, bias, MLP ratio 4) are kept."""
    return {
        "vocab_size": arguments.vocab,
        "block_size": arguments.sequence_length,
        "num_layers": layers,
        "num_heads": arguments.heads,
        "embed_dim": arguments.embed_dim,
    }


def _planner_model(arguments: argparse.Namespace, layers: int) -> Any:
    """The planner's shape of the demo GPT at ``layers`` blocks (``model_config``'s settings)."""
    from lightning_colossal.planning.sources import DemoOverrides, demo_model

    config = model_config(arguments, layers)
    return demo_model(
        DemoOverrides(
            layers=layers,
            hidden=config["embed_dim"],
            heads=config["num_heads"],
            vocab=config["vocab_size"],
            block_size=config["block_size"],
        )
    )


def predicted_device_bytes(strategy: CapacityStrategy, arguments: argparse.Namespace, layers: int) -> int:
    """Device bytes the planner's formulas give rank 0 (the fullest) at ``layers`` blocks: only a bracket for the
    runs, which decide. Gemini adds a working set of two gathered chunks and one fp32 full gradient of the chunk size
    the runs use; automatic placement adds the activations it will budget for and keeps 10% headroom
    (``steady_compute_cap_ratio``), so its figure is what B must be, not its model state."""
    from lightning_colossal.planning import OPTIMIZERS, Training, Workload, activation_estimate, model_state
    from lightning_colossal.planning.settings import offload_settings, standard_settings

    model = _planner_model(arguments, layers)
    training = Training("32-true", OPTIMIZERS["adamw"], device_type="cpu")
    settings = {setting.label: setting for setting in [*standard_settings(), *offload_settings()]}
    device = model_state(
        model.shapes, settings[strategy.planner_setting], training, arguments.world_size, 0
    ).placed.device
    if strategy.strategy.startswith("colossal_zero"):
        largest = max(math.prod(shape) for shape in model.shapes)
        # Up to 3 pooled buckets, each staged as world_size slots (zero/stages.py [Note: bounded staging]).
        device += 3 * arguments.world_size * (int(strategy.init_args["bucket_size_mb"] * MIB) + 4 * largest)
    if strategy.strategy.startswith("colossal_gemini"):
        device += 3 * 4 * arguments.chunk_numel
    if strategy.init_args.get("placement") == "budget+host":
        workload = Workload(
            micro_batch_size=arguments.batch_size_per_rank,
            sequence_length=arguments.sequence_length,
            activation_checkpointing=arguments.activation_checkpointing,
        )
        activations = activation_estimate(model, training, workload).total
        device = math.ceil((3 * 4 * arguments.chunk_numel + activations) / 0.9)
    if strategy.label == "colossal_gemini_auto":
        workload = Workload(micro_batch_size=arguments.batch_size_per_rank, sequence_length=arguments.sequence_length)
        activations = activation_estimate(model, training, workload).total
        # On CPU the engine's tracer counts the gathered weights a module saves for backward as activations too (it
        # takes the parameters' pointers while they are empty placeholders), so every weight is charged once more.
        traced_weights = 4 * model.numel
        device = math.ceil((3 * 4 * arguments.chunk_numel + activations + traced_weights) / 0.9)
    return device


def predicted_host_bytes(strategy: CapacityStrategy, arguments: argparse.Namespace, layers: int) -> int:
    """Host bytes of a disk row's rank at ``layers`` blocks with all optimizer state on disk, as automatic placement
    counts them against H: every fp32 shard and its fp32 gradient shard (8 bytes per element of a rank's share of the
    chunks), and the disk tier's three staging buffers of one chunk's Adam state (8 bytes per element of a shard,
    4 KiB-aligned). With ``masters_on_disk`` and bf16 weights: a bf16 shard and the fp32 gradient shard (6 bytes),
    and staging buffers that hold the masters too (12 bytes). 0 for other rows."""
    if not strategy.disk:
        return 0
    model = _planner_model(arguments, layers)
    from lightning_colossal.disk.optimizer_state import staging_bytes_for

    chunks = math.ceil(model.numel / arguments.chunk_numel)
    shard = math.ceil(arguments.chunk_numel / arguments.world_size)
    if strategy.init_args.get("masters_on_disk") and strategy.precision == "bf16-true":
        return chunks * shard * 6 + staging_bytes_for([shard * 12] * chunks)
    return chunks * shard * 8 + staging_bytes_for([shard * 8] * chunks)


def largest_predicted(predict: Callable[[int], int], budget: int, max_layers: int) -> int:
    """The most layers in ``[1, max_layers]`` whose prediction is within ``budget`` (1 when none is: the runs will
    say whether even one layer fits). Predictions grow with depth, so the scan stops at the first miss."""
    best = 1
    for layers in range(1, max_layers + 1):
        if predict(layers) > budget:
            break
        best = layers
    return best


def search_largest(fits: Callable[[int], bool], guess: int, max_layers: int) -> tuple[int | None, int | None]:
    """(largest depth that fits, smallest depth that does not) in ``[1, max_layers]``, by real runs.

    Starts at ``guess``, walks up (if it fits) or down (if not) by doubling steps until the outcome changes, then
    bisects the bracket; ``fits`` is taken to be monotone (deeper never fits when shallower does not). ``None`` for
    the first: not even one layer fits; for the second: ``max_layers`` still fits (the search cap, not B, bounds it).
    """
    guess = min(max(guess, 1), max_layers)
    fitting: int | None = None
    failing: int | None = None
    step = 1
    probe = guess
    if fits(probe):
        fitting = probe
        while failing is None and fitting < max_layers:
            probe = min(fitting + step, max_layers)
            if fits(probe):
                fitting = probe
                step *= 2
            else:
                failing = probe
    else:
        failing = probe
        while fitting is None and failing > 1:
            probe = max(failing - step, 1)
            if fits(probe):
                fitting = probe
            else:
                failing = probe
                step *= 2
    while fitting is not None and failing is not None and failing - fitting > 1:
        middle = (fitting + failing) // 2
        if fits(middle):
            fitting = middle
        else:
            failing = middle
    return fitting, failing


def classify(
    ranks: list[dict[str, Any]], world_size: int, steps: int, budget: int, host_budget: int | None = None
) -> tuple[bool, str]:
    """Whether a run fits B, and why not: every rank reported, trained ``steps`` steps with finite losses, and no
    sample of its device model-state bytes exceeded ``budget`` (nor, with ``host_budget``, of its host model-state
    bytes)."""
    if len(ranks) < world_size:
        return False, f"only {len(ranks)} of {world_size} ranks reported (killed, or out of host memory)"
    errors = [rank["error"] for rank in ranks if rank.get("error")]
    if errors:
        return False, errors[0].splitlines()[0][:300]
    if any(rank["steps_done"] < steps for rank in ranks):
        return False, f"trained {min(rank['steps_done'] for rank in ranks)} of {steps} steps"
    if not all(rank["finite"] for rank in ranks):
        return False, "a loss was not finite"
    peak = max(rank["peak_device_bytes"] for rank in ranks)
    if peak > budget:
        return False, f"device model state peaked at {peak / MIB:.2f} MiB > B"
    if host_budget is not None:
        host_peak = max(rank.get("peak_host_bytes", 0) for rank in ranks)
        if host_peak > host_budget:
            return False, f"host model state peaked at {host_peak / MIB:.2f} MiB > H"
    return True, "fits"


def ratio_to(results: dict[str, dict[str, Any]], label: str, reference: str) -> float | None:
    """Largest fitting parameter count of ``label`` over ``reference``'s (``None`` if either has none)."""
    mine = results.get(label, {}).get("largest")
    theirs = results.get(reference, {}).get("largest")
    if not mine or not theirs:
        return None
    return mine["parameters"] / theirs["parameters"]


# ---------------------------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------------------------


def rank_arguments(strategy: CapacityStrategy, arguments: argparse.Namespace) -> dict[str, Any]:
    """Constructor arguments as the ranks get them: the budget placed in, Gemini's chunk size fixed."""
    init_args = dict(strategy.init_args)
    if init_args.get("placement") == "budget":
        init_args["placement"] = {"kind": "auto", "compute_memory_budget": arguments.budget_mib * MIB}
    if init_args.get("placement") == "budget+host":
        init_args["placement"] = {
            "kind": "auto",
            "compute_memory_budget": int(arguments.budget_mib * MIB),
            "host_memory_budget": int(arguments.host_budget_mib * MIB),
        }
    if strategy.disk:
        init_args["offload_dir"] = str(arguments.offload_dir)
        # The GPT is built on the meta device; Gemini materialises it window by window, and its default window
        # (1 GiB of parameters at once) would dominate a rank's RSS, which these rows report next to H.
        init_args["init_window_bytes"] = 64 * MIB
    if strategy.strategy.startswith("colossal_gemini"):
        # The searched chunk size grows with the model (up to 17M elements, 64 MiB gathered): a budget of tens of MiB
        # needs chunks sized for it, as a user with that budget would set them.
        init_args["chunk_numel"] = arguments.chunk_numel
    return init_args


def run_probe(strategy: CapacityStrategy, arguments: argparse.Namespace, layers: int, scratch: Path) -> dict[str, Any]:
    """Train ``layers`` blocks under ``strategy`` on ``world_size`` ranks (``arguments``: the row's, from
    ``row_arguments``) and say whether it fits B (and H for a disk row)."""
    directory = scratch / f"{strategy.label}_{layers}"
    directory.mkdir(parents=True)
    spec = {
        "strategy": strategy.strategy,
        "init_args": rank_arguments(strategy, arguments),
        "model_config": model_config(arguments, layers),
        "world_size": arguments.world_size,
        "batch_size_per_rank": arguments.batch_size_per_rank,
        "sequence_length": arguments.sequence_length,
        "steps": arguments.steps,
        "learning_rate": 3e-4,
        "seed": 0,
        "activation_checkpointing": arguments.activation_checkpointing,
        "meta_init": arguments.meta_init,
        "peak_rule": arguments.peak_rule,
        "precision": strategy.precision,
    }
    spec_path = directory / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    start = time.perf_counter()
    failure = None
    try:
        launch_ranks(
            "benchmarks.capacity.ranks",
            ["--spec", str(spec_path)],
            arguments.world_size,
            directory,
            arguments.run_timeout,
        )
    except RunFailed as error:
        failure = str(error)
    ranks = [json.loads(path.read_text()) for path in sorted(directory.glob("rank*.json"))]
    host_budget = arguments.host_budget_mib * MIB if strategy.disk else None
    fits, reason = classify(ranks, arguments.world_size, arguments.steps, arguments.budget_mib * MIB, host_budget)
    if failure is not None and fits:
        fits, reason = False, failure.splitlines()[0]
    outcome = {
        "layers": layers,
        "parameters": ranks[0]["parameter_count"] if ranks else None,
        "fits": fits,
        "reason": reason,
        "peak_device_bytes": max((rank["peak_device_bytes"] for rank in ranks), default=None),
        "wall_seconds": round(time.perf_counter() - start, 1),
        "ranks": ranks,
    }
    if failure is not None:
        outcome["log_tail"] = failure[-3000:]
    print(f"  {strategy.label} {layers} layers: {reason} ({outcome['wall_seconds']} s)", flush=True)
    return outcome


def measure_strategy(strategy: CapacityStrategy, arguments: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Predict, then search by real runs; every run's outcome is kept."""
    arguments = row_arguments(strategy, arguments)
    budget = arguments.budget_mib * MIB

    def predicted(layers: int) -> int:
        # A depth whose host bytes exceed H does not fit, whatever its device bytes.
        if strategy.disk and predicted_host_bytes(strategy, arguments, layers) > arguments.host_budget_mib * MIB:
            return budget + 1
        return predicted_device_bytes(strategy, arguments, layers)

    guess = largest_predicted(predicted, budget, arguments.max_layers)
    outcomes: dict[int, dict[str, Any]] = {}

    def fits(layers: int) -> bool:
        if layers not in outcomes:
            outcomes[layers] = run_probe(strategy, arguments, layers, scratch)
        return bool(outcomes[layers]["fits"])

    print(f"{strategy.label}: planner predicts {guess} layers", flush=True)
    largest, first_failing = search_largest(fits, guess, arguments.max_layers)
    return {
        "strategy": strategy.strategy,
        "init_args": rank_arguments(strategy, arguments),
        "enforcement": strategy.enforcement,
        "predicted_layers": guess,
        "predicted_device_bytes": predicted_device_bytes(strategy, arguments, guess),
        "predicted_host_bytes": predicted_host_bytes(strategy, arguments, guess),
        "workload": {
            key: getattr(arguments, key)
            for key in ("embed_dim", "heads", "chunk_numel", "activation_checkpointing", "meta_init")
        }
        | {"precision": strategy.precision},
        "host_budget_bytes": arguments.host_budget_mib * MIB if strategy.disk else None,
        "largest": None if largest is None else _summary(outcomes[largest]),
        "first_failing": None if first_failing is None else _summary(outcomes[first_failing]),
        "runs": [outcomes[layers] for layers in sorted(outcomes)],
    }


def _summary(outcome: dict[str, Any]) -> dict[str, Any]:
    """The figures of one run the table shows."""
    ranks = outcome["ranks"]
    summary = {key: outcome[key] for key in ("layers", "parameters", "fits", "reason", "peak_device_bytes")}
    if ranks:
        summary["last_loss"] = ranks[0]["losses"][-1] if ranks[0]["losses"] else None
        summary["step_seconds"] = max((max(rank["step_seconds"], default=0.0) for rank in ranks), default=None)
        summary["peak_source"] = ranks[0].get("peak_source")
        for key in (
            "peak_working_set_bytes",
            "evictions",
            "traced_activation_peak_bytes",
            "sampled_peak_device_bytes",
            "peak_host_bytes",
            "disk_bytes",
            "disk_staging_bytes",
        ):
            if key in ranks[0]:
                summary[key] = max(rank[key] for rank in ranks)
        summary["peak_rss_bytes_per_rank"] = [rank.get("peak_rss_bytes") for rank in ranks]
        summary["step_seconds_per_rank"] = [rank["step_seconds"] for rank in ranks]
        summary["peak_breakdown_rank0"] = ranks[0]["peak_breakdown"]
    return summary


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def _size(summary: dict[str, Any] | None) -> str:
    if summary is None:
        return "none"
    return f"{summary['parameters'] / 1e6:.2f}M ({summary['layers']} layers)"


def _peak(summary: dict[str, Any] | None) -> str:
    if summary is None or summary.get("peak_device_bytes") is None:
        return "–"
    return f"{summary['peak_device_bytes'] / MIB:.2f}"


def table_rows(results: dict[str, dict[str, Any]], budget_mib: float, max_layers: int) -> list[str]:
    """The markdown table: one row per strategy."""
    lines = [
        f"| strategy | largest fitting: parameters (layers) | its peak device model state MiB (B = {budget_mib:g}) |"
        " slowest step s | first failing: parameters (layers) | its peak MiB | why it fails | ratio vs colossal_ddp |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, result in results.items():
        largest, failing = result["largest"], result["first_failing"]
        ratio = ratio_to(results, label, "colossal_ddp")
        why = failing["reason"] if failing else f"not reached: {max_layers} layers (the search cap) still fit"
        why = why if len(why) <= 160 else why[:157] + "..."  # the whole message is in the JSON
        step = f"{largest['step_seconds']:.2f}" if largest and largest.get("step_seconds") is not None else "–"
        lines.append(
            f"| {label} | {_size(largest)} | {_peak(largest)} | {step} | "
            f"{_size(failing) if failing else '–'} | {_peak(failing)} | {why.replace('|', '/')} | "
            f"{'–' if ratio is None else f'{ratio:.2f}x'} |"
        )
    return lines


def markdown(results: dict[str, dict[str, Any]], arguments: argparse.Namespace, context: dict[str, Any]) -> str:
    """A block for RESULTS.md: header lines, the table, how B was held per strategy."""
    lines = [
        f"- Machine: {context['cpu']}",
        f"- Date: {context['date']}",
        f"- Command: `{context['command']}`",
        f"- Model: demo GPT, d{arguments.embed_dim}, {arguments.heads} heads, vocabulary {arguments.vocab}, tied head,"
        f" depth searched in 1–{arguments.max_layers} layers",
        f"- Workload: {arguments.world_size} CPU ranks (gloo, OMP_NUM_THREADS=1), {arguments.batch_size_per_rank}"
        f" sequences x {arguments.sequence_length} tokens per rank, AdamW, {arguments.steps} steps per run, fp32"
        " unless a row says otherwise",
        f"- Software: {context['software']}, git {context['git']}",
        f"- Wall time: {context['wall_seconds']:.0f} s, {context['runs']} runs",
        "",
        *table_rows(results, arguments.budget_mib, arguments.max_layers),
        "",
    ]
    for label, result in results.items():
        lines.append(f"- {label}: {result['enforcement']}; planner predicted {result['predicted_layers']} layers.")
        if result.get("host_budget_bytes") is not None:
            lines.append(f"  {disk_note(result)}")
    return "\n".join(lines)


def disk_note(result: dict[str, Any]) -> str:
    """What a disk row trained and held: its workload, H, and at its largest fitting depth the host and disk bytes,
    peak RSS and step times per rank."""
    workload = result["workload"]
    note = (
        f"Workload: d{workload['embed_dim']}, {workload['heads']} heads, chunks of {workload['chunk_numel']:,}"
        f" elements, activation checkpointing {'on' if workload['activation_checkpointing'] else 'off'}, built on the"
        f" meta device; precision {workload.get('precision', '32-true')}; H = {result['host_budget_bytes'] / MIB:g} MiB"
        " per rank."
    )
    largest = result["largest"]
    if largest is None or "peak_host_bytes" not in largest:
        return note
    rss = " / ".join(f"{value / MIB:.0f}" for value in largest["peak_rss_bytes_per_rank"] if value)
    steps = " / ".join(
        ", ".join(f"{seconds:.1f}" for seconds in per_rank) for per_rank in largest["step_seconds_per_rank"]
    )
    return (
        f"{note} At {largest['layers']} layers: host model state peaked at {largest['peak_host_bytes'] / MIB:.1f} MiB"
        f" (+ {largest.get('disk_staging_bytes', 0) / MIB:.1f} MiB of the disk tier's staging buffers: the engine"
        " keeps the two together within H), optimizer state on disk"
        f" {largest.get('disk_bytes', 0) / MIB:.1f} MiB per rank, peak RSS {rss} MiB per rank, step times {steps} s"
        " per rank."
    )


# ---------------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------------


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=float, default=64.0, help="B: device model-state MiB per rank")
    parser.add_argument("--strategies", default=DEFAULT_STRATEGIES, help=f"rows, of {', '.join(STRATEGIES)}")
    parser.add_argument("--embed-dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch-size-per-rank", type=int, default=2)
    parser.add_argument("--sequence-length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="training steps per run")
    parser.add_argument("--max-layers", type=int, default=64, help="search cap (host RAM and time bound it)")
    parser.add_argument("--chunk-numel", type=int, default=2**19, help="Gemini chunk elements (fixed, not searched)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--host-budget-mib", type=float, default=2048.0, help="H: host model-state MiB per rank (disk rows)"
    )
    parser.add_argument(
        "--offload-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "lightning_colossal_capacity_disk",
        help="disk rows: where the disk tier's per-run directories go (removed after each run)",
    )
    parser.add_argument(
        "--peak-rule",
        choices=["bound", "events"],
        default="bound",
        help="Gemini's peak for the verdict: resident maximum + working-set maximum (bound, the default), or the"
        " maximum sampled at every hook and every growth of the working set (events); both are in the JSON",
    )
    parser.add_argument("--disk-embed-dim", type=int, default=512, help="disk rows: the GPT's width")
    parser.add_argument("--disk-heads", type=int, default=8, help="disk rows: attention heads")
    parser.add_argument(
        "--disk-chunk-numel",
        type=int,
        default=None,
        help="disk rows: chunk elements (default 4·d² + 8·d: the largest weight, a block in 3 full chunks)",
    )
    parser.add_argument(
        "--no-disk-activation-checkpointing",
        dest="disk_activation_checkpointing",
        action="store_false",
        help="disk rows: keep every block's activations for backward",
    )
    parser.add_argument("--run-timeout", type=float, default=300.0, help="seconds before a run is killed")
    parser.add_argument("--output", type=Path, default=REPOSITORY_ROOT / "benchmarks" / "out" / "capacity.json")
    arguments = parser.parse_args(argv)
    unknown = [name for name in arguments.strategies.split(",") if name not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {list(STRATEGIES)}")
    if arguments.budget_mib <= 0 or arguments.max_layers < 1 or arguments.steps < 1 or arguments.host_budget_mib <= 0:
        parser.error("--budget-mib, --host-budget-mib, --max-layers and --steps must be positive")
    return arguments


def main(argv: list[str] | None = None) -> int:
    import shlex
    import sys

    arguments = parse_arguments(argv)
    start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    created = not arguments.offload_dir.exists()
    try:
        with tempfile.TemporaryDirectory(prefix="capacity_") as scratch:
            for label in arguments.strategies.split(","):
                results[label] = measure_strategy(STRATEGIES[label], arguments, Path(scratch))
    finally:
        if created:  # the disk rows' offload_dir, when this run made it (the tier removed its own directories)
            shutil.rmtree(arguments.offload_dir, ignore_errors=True)
    context = {
        "cpu": cpu_description(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["python", "-m", "benchmarks.capacity", *(sys.argv[1:] if argv is None else argv)]),
        "software": ", ".join(f"{name} {version}" for name, version in software_versions().items()),
        "git": git_revision(REPOSITORY_ROOT),
        "wall_seconds": time.perf_counter() - start,
        "runs": sum(len(result["runs"]) for result in results.values()),
    }
    ratios = {label: ratio_to(results, label, "colossal_ddp") for label in results}
    arguments.output.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(arguments).items()},
        "context": context,
        "budget_bytes": arguments.budget_mib * MIB,
        "ratios_vs_colossal_ddp": ratios,
        "results": results,
    }
    arguments.output.write_text(json.dumps(payload, indent=2))
    print(markdown(results, arguments, context))
    print(f"\nJSON: {arguments.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
