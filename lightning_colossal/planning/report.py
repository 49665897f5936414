"""A plan as a table for people and as JSON for programs."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from lightning_colossal.planning.model_state import Placed
from lightning_colossal.planning.planner import Evaluation, Plan
from lightning_colossal.planning.units import format_bytes

__all__ = ["plan_to_json", "render_plan"]

_COLUMNS = (
    "setting",
    "parameters",
    "gradients",
    "optimizer",
    "working",
    "activations",
    "{device}",
    "host/node",
    "fits",
)
_WIDTHS = (31, 21, 21, 21, 10, 11, 10, 10, 8)


# A part under 1% of its cell (Adam's 4-byte ``step`` scalars live on the CPU) is folded into the other part in the
# table; the JSON keeps every byte where it lives.
_NEGLIGIBLE = 0.01


def _cell(placed: Placed) -> str:
    """Bytes of a category on the device, ``H`` marking bytes in host memory."""
    if placed.host <= _NEGLIGIBLE * placed.total:
        return format_bytes(placed.total)
    if placed.device <= _NEGLIGIBLE * placed.total:
        return format_bytes(placed.total) + " H"
    return f"{format_bytes(placed.device)}+{format_bytes(placed.host)} H"


def _fits(evaluation: Evaluation, device_word: str) -> str:
    if evaluation.fits:
        return "yes"
    if not evaluation.fits_device and not evaluation.fits_host:
        return "no: both"
    return f"no: {device_word}" if not evaluation.fits_device else "no: host"


def _row(values: tuple[str, ...]) -> str:
    return "  ".join(value.ljust(width) for value, width in zip(values, _WIDTHS, strict=True)).rstrip()


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
    return [
        f"Model     {plan.model.description}: {plan.model.numel:,} parameters in {len(plan.model.parameters)} tensors",
        f"Machines  {machines}",
        f"Training  {training.precision}, {training.optimizer.name}, micro-batch {workload.micro_batch_size} x"
        f" {workload.sequence_length} tokens, {checkpointing}",
        "",
        f"Per {word} (rank 0, the fullest). Model state is exact; working memory and activations are estimates."
        ' "H": in host memory.',
    ]


def render_plan(plan: Plan) -> str:
    """The plan as text: header, one row per setting, the recommendation and notes."""
    word = plan.hardware.device_word
    lines = _header_lines(plan)
    lines.append(_row(tuple(column.format(device=f"{word} total") for column in _COLUMNS)))
    for evaluation in plan.evaluations:
        state = evaluation.model_state
        device_total = format_bytes(evaluation.device_bytes) if plan.hardware.device_type == "cuda" else "-"
        lines.append(
            _row(
                (
                    evaluation.setting.label,
                    _cell(state.parameters),
                    _cell(state.gradients),
                    _cell(state.optimizer_state),
                    _cell(evaluation.working.placed),
                    format_bytes(evaluation.activations.total),
                    device_total,
                    format_bytes(evaluation.host_bytes),
                    _fits(evaluation, word),
                )
            )
        )
    recommendation = plan.recommendation
    lines += ["", f"Recommendation: {recommendation.reason}"]
    if recommendation.how is not None:
        lines.append(f"  use: {recommendation.how}")
    notes = list(plan.notes) + sorted({note for evaluation in plan.evaluations for note in evaluation.notes})
    lines += ["", "Notes:"] + [f"  - {note}" for note in notes]
    return "\n".join(lines)


def _placed(placed: Placed) -> dict[str, int]:
    return {"device": placed.device, "host": placed.host}


def _evaluation_to_json(evaluation: Evaluation) -> dict[str, Any]:
    state = evaluation.model_state
    return {
        "setting": evaluation.setting.label,
        "family": evaluation.setting.family,
        "how": evaluation.how,
        "tp_size": evaluation.setting.tp_size,
        "model_state": {
            "parameters": _placed(state.parameters),
            "gradients": _placed(state.gradients),
            "optimizer_state": _placed(state.optimizer_state),
        },
        "working": {**_placed(evaluation.working.placed), "what": evaluation.working.what},
        "activations": {**asdict(evaluation.activations), "total": evaluation.activations.total},
        "device_bytes": evaluation.device_bytes,
        "host_bytes_per_node": evaluation.host_bytes,
        "fits_device": evaluation.fits_device,
        "fits_host": evaluation.fits_host,
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
