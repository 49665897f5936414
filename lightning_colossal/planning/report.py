"""A plan as a table for people and as JSON for programs: per rank, bytes on the device, in host memory and on disk."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from lightning_colossal.planning.model_state import Placed
from lightning_colossal.planning.planner import (
    Evaluation,
    Hardware,
    Plan,
    background_checkpoint_host_bytes,
    checkpoint_host_bytes,
)
from lightning_colossal.planning.units import format_bytes

__all__ = ["plan_to_json", "render_plan"]

# Columns and their least widths (a longer cell widens its column); the disk columns only when a disk is weighed.
_COLUMNS = (
    ("setting", 31),
    ("parameters", 21),
    ("gradients", 21),
    ("optimizer", 21),
    ("working", 10),
    ("activations", 11),
    ("{device} total", 10),
    ("host/rank", 10),
)
_DISK_COLUMNS = (("disk/rank", 10), ("min disk I/O", 12))
_FITS_COLUMN = ("fits", 8)


# A part under 1% of its cell (Adam's 4-byte ``step`` scalars live on the CPU) is folded into the other parts in the
# table; the JSON keeps every byte where it lives.
_NEGLIGIBLE = 0.01


def _cell(placed: Placed) -> str:
    """Bytes of a category on the device, ``H`` marking bytes in host memory and ``D`` bytes on disk."""
    parts = ((placed.device, ""), (placed.host, " H"), (placed.disk, " D"))
    significant = [(size, mark) for size, mark in parts if size > _NEGLIGIBLE * placed.total]
    if len(significant) <= 1:
        return format_bytes(placed.total) + (significant[0][1] if significant else "")
    return "+".join(format_bytes(size) + mark for size, mark in significant)


def _fits(evaluation: Evaluation, device_word: str) -> str:
    if evaluation.fits:
        return "yes"
    short = [
        word
        for word, fits in (
            (device_word, evaluation.fits_device),
            ("host", evaluation.fits_host),
            ("disk", evaluation.fits_disk),
        )
        if not fits
    ]
    return "no: " + "+".join(short)


def _table(rows: list[tuple[str, ...]], widths: list[int]) -> list[str]:
    widths = [max(width, *(len(row[column]) for row in rows)) for column, width in enumerate(widths)]
    return ["  ".join(value.ljust(width) for value, width in zip(row, widths, strict=True)).rstrip() for row in rows]


def _nodes(count: int) -> str:
    return "1 node" if count == 1 else f"{count} nodes"


def _header_lines(plan: Plan) -> list[str]:
    hardware, training, workload = plan.hardware, plan.training, plan.workload
    word = hardware.device_word
    if hardware.device_type == "cpu":
        machines = (
            f"{hardware.devices_per_node} CPU ranks x {_nodes(hardware.nodes)} sharing"
            f" {format_bytes(hardware.host_memory)} per node"
        )
    else:
        machines = (
            f"{hardware.devices_per_node} GPUs x {_nodes(hardware.nodes)} (world {hardware.world_size}),"
            f" {format_bytes(hardware.device_memory)} per GPU ({format_bytes(hardware.device_reserve)} reserved),"
            f" {format_bytes(hardware.host_memory)} host per node"
        )
    checkpointing = "activation checkpointing" if workload.activation_checkpointing else "no activation checkpointing"
    lines = [
        f"Model     {plan.model.description}: {plan.model.numel:,} parameters in {len(plan.model.parameters)} tensors",
        f"Machines  {machines}",
    ]
    if hardware.disk is not None:
        lines.append(f"Disk      {_disk_line(hardware)}")
    per_node = f"host/node = host/rank x {hardware.devices_per_node}" if hardware.devices_per_node > 1 else ""
    marks = '"H": in host memory' + (', "D": on disk' if hardware.disk is not None else "")
    lines += [
        f"Training  {training.precision}, {training.optimizer.name}, micro-batch {workload.micro_batch_size} x"
        f" {workload.sequence_length} tokens, {checkpointing}",
        "",
        f"Per {word} (rank 0, the fullest). Model state is exact; working memory and activations are estimates."
        f" {marks}{'; ' + per_node if per_node else ''}.",
    ]
    if hardware.disk is not None:
        lines.append(
            "min disk I/O: each node's disk reads and writes every local rank's disk/rank once per optimizer step;"
            " the time that takes at the disk's bandwidth is a lower bound of that step's I/O."
        )
    return lines


def _disk_line(hardware: Hardware) -> str:
    disk = hardware.disk
    assert disk is not None
    if disk.measured:
        how = f"measured under {disk.path}" + ("" if disk.direct_io else " through the page cache (optimistic)")
    else:
        how = "as given" + (f", for {disk.path}" if disk.offload_dir is not None else "")
    space = f"{format_bytes(disk.space)} free per node" if disk.space is not None else "free space not checked"
    return (
        f"{disk.read_bytes_per_second / 1e9:.2f} GB/s read, {disk.write_bytes_per_second / 1e9:.2f} GB/s write"
        f" per node ({how}), {space}"
    )


def render_plan(plan: Plan) -> str:
    """The plan as text: header, one row per setting, the recommendation and notes."""
    word = plan.hardware.device_word
    has_disk = plan.hardware.disk is not None
    columns = _COLUMNS + (_DISK_COLUMNS if has_disk else ()) + (_FITS_COLUMN,)
    rows = [tuple(name.format(device=word) for name, _ in columns)]
    for evaluation in plan.evaluations:
        state = evaluation.model_state
        device_total = format_bytes(evaluation.device_bytes) if plan.hardware.device_type == "cuda" else "-"
        disk_cells: tuple[str, ...] = ()
        if has_disk:
            seconds = evaluation.disk_io_seconds
            disk_cells = (
                format_bytes(evaluation.disk_bytes_per_rank) if evaluation.setting.uses_disk else "-",
                f"{seconds:.2f} s" if seconds is not None else "-",
            )
        rows.append(
            (
                evaluation.setting.label,
                _cell(state.parameters),
                _cell(state.gradients),
                _cell(state.optimizer_state),
                _cell(evaluation.working.placed),
                format_bytes(evaluation.activations.total),
                device_total,
                format_bytes(evaluation.host_bytes_per_rank),
                *disk_cells,
                _fits(evaluation, word),
            )
        )
    lines = _header_lines(plan) + _table(rows, [width for _, width in columns])
    recommendation = plan.recommendation
    lines += ["", f"Recommendation: {recommendation.reason}"]
    if recommendation.how is not None:
        lines.append(f"  use: {recommendation.how}")
    notes = list(plan.notes) + sorted({note for evaluation in plan.evaluations for note in evaluation.notes})
    lines += ["", "Notes:"] + [f"  - {note}" for note in notes]
    return "\n".join(lines)


def _placed(placed: Placed) -> dict[str, int]:
    return {"device": placed.device, "host": placed.host, "disk": placed.disk}


def _disk_io(evaluation: Evaluation) -> dict[str, Any] | None:
    if evaluation.disk_io_seconds is None:
        return None
    return {
        "read_bytes_per_step_per_node": evaluation.disk_bytes,
        "written_bytes_per_step_per_node": evaluation.disk_bytes,
        "seconds_per_step_lower_bound": evaluation.disk_io_seconds,
        "checkpoint_host_bytes_per_node": checkpoint_host_bytes(evaluation),
        "background_checkpoint_host_bytes_per_node": background_checkpoint_host_bytes(evaluation),
    }


def _evaluation_to_json(evaluation: Evaluation) -> dict[str, Any]:
    state = evaluation.model_state
    return {
        "setting": evaluation.setting.label,
        "family": evaluation.setting.family,
        "how": evaluation.how,
        "tp_size": evaluation.setting.tp_size,
        "sp_size": evaluation.setting.sp_size,
        # Under a host budget the share on disk follows from the budget: the chunks are in the model state's bytes.
        "disk_fraction": None if evaluation.setting.automatic else evaluation.setting.disk_fraction,
        "host_memory_budget": evaluation.setting.host_memory_budget,
        "masters_on_disk": evaluation.setting.masters_on_disk,
        "model_state": {
            "parameters": _placed(state.parameters),
            "gradients": _placed(state.gradients),
            "optimizer_state": _placed(state.optimizer_state),
        },
        "working": {**_placed(evaluation.working.placed), "what": evaluation.working.what},
        "activations": {**asdict(evaluation.activations), "total": evaluation.activations.total},
        "device_bytes": evaluation.device_bytes,
        "host_bytes_per_rank": evaluation.host_bytes_per_rank,
        "host_bytes_per_node": evaluation.host_bytes,
        "disk_bytes_per_rank": evaluation.disk_bytes_per_rank,
        "disk_bytes_per_node": evaluation.disk_bytes,
        "disk_io": _disk_io(evaluation),
        "fits_device": evaluation.fits_device,
        "fits_host": evaluation.fits_host,
        "fits_disk": evaluation.fits_disk,
        "fits": evaluation.fits,
        "notes": list(evaluation.notes),
    }


def plan_to_json(plan: Plan) -> dict[str, Any]:
    """The plan as JSON-able data: every byte count an int, per rank 0 (the fullest rank)."""
    return {
        "model": {
            "description": plan.model.description,
            "source": plan.model.source,
            "parameters": plan.model.numel,
            "parameter_tensors": len(plan.model.parameters),
            "architecture": asdict(plan.model.architecture),
        },
        "hardware": {**asdict(plan.hardware), "world_size": plan.hardware.world_size},
        "training": {"precision": plan.training.precision, "optimizer": asdict(plan.training.optimizer)},
        "workload": asdict(plan.workload),
        "settings": [_evaluation_to_json(evaluation) for evaluation in plan.evaluations],
        "recommendation": asdict(plan.recommendation),
        "notes": list(plan.notes),
    }
