"""Weigh every strategy and setting for one model on one machine, and recommend one with the reason.

Per setting and per rank (the fullest rank, rank 0: ``torch.chunk`` gives it the most rows): exact model state
(``model_state.py``), estimated working memory (``working.py``) and activations (``activations.py``). A setting fits
when, on every device, model state on the device + working memory + activations + the reserve fit the device memory,
and the host bytes of all ranks of a node fit the node's host memory. On CPU ranks device and host are one memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_colossal.planning.activations import ActivationEstimate, Workload, activation_estimate
from lightning_colossal.planning.model_shape import ModelShape
from lightning_colossal.planning.model_state import DeviceType, ModelState, Training, model_state
from lightning_colossal.planning.settings import Setting, hybrid_settings, offload_settings, standard_settings
from lightning_colossal.planning.units import format_bytes
from lightning_colossal.planning.working import Working, working_memory

# The recommendation names at most this many preferred settings that lost (the table shows them all).
MAX_REASONS = 3
# Headroom a recommended setting should leave, as a share of the memory that limits it: working memory and
# activations are estimates, and allocators fragment. Only when nothing leaves this much is a tighter fit chosen.
COMFORTABLE_HEADROOM = 0.10

__all__ = [
    "Evaluation",
    "Hardware",
    "Plan",
    "Recommendation",
    "candidate_settings",
    "evaluate",
    "make_plan",
    "recommend",
]


@dataclass(frozen=True)
class Hardware:
    """The machines.

    Args:
        devices_per_node: devices (ranks) per node, as ``Trainer(devices=...)``.
        nodes: nodes, as ``Trainer(num_nodes=...)``.
        device_memory: bytes of one device.
        host_memory: bytes of host memory per node, shared by its ranks.
        device_type: ``"cuda"`` or ``"cpu"``.
        device_reserve: bytes per device that training cannot use (CUDA context, allocator fragmentation).
    """

    devices_per_node: int
    nodes: int
    device_memory: int
    host_memory: int
    device_type: DeviceType = "cuda"
    device_reserve: int = 2 * 2**30

    def __post_init__(self) -> None:
        if self.devices_per_node < 1 or self.nodes < 1:
            raise ValueError(f"--devices {self.devices_per_node} --nodes {self.nodes}: pass positive counts.")

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def device_word(self) -> str:
        return "GPU" if self.device_type == "cuda" else "rank"


@dataclass(frozen=True)
class Evaluation:
    """One setting on the hardware, for the fullest rank."""

    setting: Setting
    how: str
    model_state: ModelState
    working: Working
    activations: ActivationEstimate
    device_bytes: int  # per device: model state and working memory on it, activations, reserve
    host_bytes: int  # per node: every local rank's host bytes
    fits_device: bool
    fits_host: bool
    notes: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host


@dataclass(frozen=True)
class Recommendation:
    """The chosen setting (``None`` when nothing fits) and why."""

    label: str | None
    how: str | None
    reason: str


@dataclass(frozen=True)
class Plan:
    """Everything the report prints."""

    model: ModelShape
    hardware: Hardware
    training: Training
    workload: Workload
    evaluations: tuple[Evaluation, ...]
    recommendation: Recommendation
    notes: tuple[str, ...]


def _how(setting: Setting, workload: Workload) -> tuple[str, tuple[str, ...]]:
    """How to ask for ``setting``, with activation checkpointing where the strategy has the knob."""
    if not workload.activation_checkpointing:
        return setting.how, ()
    if setting.family == "fsdp":
        offload = ", cpu_offload=True" if setting.offload else ""
        return f"ColossalFSDPStrategy(activation_checkpointing=True{offload})", ()
    if setting.family == "hybrid":
        return setting.how[:-1] + ", activation_checkpointing=True)", ()
    return setting.how, ("no checkpointing knob: wrap the blocks with torch.utils.checkpoint in your module",)


def evaluate(
    model: ModelShape, setting: Setting, hardware: Hardware, training: Training, workload: Workload
) -> Evaluation:
    """The fullest rank's memory under ``setting``, and whether it fits."""
    data_parallel = hardware.world_size // setting.tp_size
    shapes = model.tensor_parallel_shapes(setting.tp_size) if setting.family == "hybrid" else model.shapes
    state = model_state(shapes, setting, training, data_parallel, rank=0)
    working = working_memory(model, setting, training, data_parallel)
    activations = activation_estimate(
        model, training, workload, setting.tp_size, casts_weights=setting.family != "fsdp"
    )
    on_device = state.placed.device + working.placed.device + activations.total + hardware.device_reserve
    on_host = (state.placed.host + working.placed.host) * hardware.devices_per_node
    if hardware.device_type == "cpu":  # one memory: every byte of every local rank comes out of the host's
        on_host = on_host + (on_device - hardware.device_reserve) * hardware.devices_per_node
        on_device = 0
    how, notes = _how(setting, workload)
    return Evaluation(
        setting=setting,
        how=how,
        model_state=state,
        working=working,
        activations=activations,
        device_bytes=on_device,
        host_bytes=on_host,
        fits_device=on_device <= hardware.device_memory,
        fits_host=on_host <= hardware.host_memory,
        notes=notes,
    )


def _need(evaluation: Evaluation, hardware: Hardware) -> str:
    needs = []
    if not evaluation.fits_device:
        needs.append(f"{format_bytes(evaluation.device_bytes)} per {hardware.device_word}")
    if not evaluation.fits_host:
        needs.append(f"{format_bytes(evaluation.host_bytes)} of host memory per node")
    return " and ".join(needs)


def _headroom(evaluation: Evaluation, hardware: Hardware) -> tuple[int, int]:
    """(headroom, capacity) of the memory that limits this setting: the device's, or the node's on CPU ranks."""
    if hardware.device_type == "cpu":
        return hardware.host_memory - evaluation.host_bytes, hardware.host_memory
    return hardware.device_memory - evaluation.device_bytes, hardware.device_memory


def _headroom_text(evaluation: Evaluation, hardware: Hardware) -> str:
    room, _ = _headroom(evaluation, hardware)
    where = "host headroom per node" if hardware.device_type == "cpu" else "headroom per GPU"
    return f"{format_bytes(room)} {where}"


def _choose(evaluations: list[Evaluation], hardware: Hardware) -> tuple[Evaluation | None, list[str]]:
    """The first setting with comfortable headroom, else the first that fits at all; and why earlier ones lost."""
    for minimum in (COMFORTABLE_HEADROOM, 0.0):
        skipped = []
        for evaluation in evaluations:
            room, capacity = _headroom(evaluation, hardware)
            if evaluation.fits and room >= minimum * capacity:
                return evaluation, skipped
            if evaluation.fits:
                share = f"{COMFORTABLE_HEADROOM:.0%}"
                skipped.append(
                    f"{evaluation.setting.label} fits with only {_headroom_text(evaluation, hardware)} (<{share})"
                )
            else:
                skipped.append(f"{evaluation.setting.label} does not fit (needs {_need(evaluation, hardware)})")
    return None, []


def recommend(evaluations: list[Evaluation], hardware: Hardware) -> Recommendation:
    """The first setting (in preference order) that fits with comfortable headroom (else the first that fits at
    all, called tight), with its headroom and why the ones before it lost."""
    chosen, skipped = _choose(evaluations, hardware)
    if chosen is None:
        smallest = min(evaluations, key=lambda evaluation: (evaluation.device_bytes, evaluation.host_bytes))
        return Recommendation(
            None,
            None,
            f"nothing fits: the smallest is {smallest.setting.label}, which needs {_need(smallest, hardware)}. Add"
            " devices or nodes, lower --micro-batch-size or --sequence-length, or pass --activation-checkpointing.",
        )
    room, capacity = _headroom(chosen, hardware)
    tight = " (tight: the estimates may be off by more)" if room < COMFORTABLE_HEADROOM * capacity else ""
    reason = f"{chosen.setting.label}: fits with {_headroom_text(chosen, hardware)}{tight}; {chosen.setting.why_prefer}"
    if skipped:
        more = f"; {len(skipped) - MAX_REASONS} more lose too" if len(skipped) > MAX_REASONS else ""
        reason += "; " + "; ".join(skipped[:MAX_REASONS]) + more
    return Recommendation(chosen.setting.label, chosen.how, reason)


def candidate_settings(model: ModelShape, hardware: Hardware) -> list[Setting]:
    """Every setting worth weighing, in preference order (offload is pointless when ranks compute on the CPU)."""
    settings = standard_settings() + hybrid_settings(model, hardware.devices_per_node)
    if hardware.device_type == "cuda":
        settings += offload_settings()
    return settings


def _plan_notes(model: ModelShape, hardware: Hardware, training: Training, workload: Workload) -> tuple[str, ...]:
    notes = []
    shape = model.architecture
    if shape.max_sequence is not None and workload.sequence_length > shape.max_sequence:
        notes.append(
            f"--sequence-length {workload.sequence_length} is longer than the model's {shape.max_sequence} positions"
        )
    if shape.tensor_parallel_policy is None:
        notes.append("colossal_hybrid left out: no built-in policy splits this model (docs/hybrid.md: write one)")
    whole = model.numel * training.parameter_bytes * hardware.devices_per_node
    notes.append(
        f"building the model whole in every process takes {format_bytes(whole)} of host memory per node at start;"
        " build it on the meta device (Trainer.init_module(empty_init=True)) for Gemini and FSDP"
    )
    return tuple(notes)


def _checkpointing_hint(
    model: ModelShape, hardware: Hardware, training: Training, workload: Workload, chosen: str | None
) -> list[str]:
    """When the simplest settings do not fit for activations, say which would with activation checkpointing."""
    if workload.activation_checkpointing:
        return []
    recomputing = replace(workload, activation_checkpointing=True)
    for setting in standard_settings():
        if setting.label == chosen:
            return []
        evaluation = evaluate(model, setting, hardware, training, recomputing)
        if evaluation.fits:
            knob = f" ({evaluation.notes[0]})" if evaluation.notes else ""
            return [
                f"with --activation-checkpointing {setting.label} would fit"
                f" ({format_bytes(evaluation.device_bytes)} per {hardware.device_word}): {evaluation.how}{knob}"
            ]
    return []


def make_plan(model: ModelShape, hardware: Hardware, training: Training, workload: Workload) -> Plan:
    """Evaluate every candidate setting and recommend one."""
    if hardware.device_type == "cpu":
        hardware = replace(hardware, device_reserve=0)
    evaluations = [
        evaluate(model, setting, hardware, training, workload) for setting in candidate_settings(model, hardware)
    ]
    recommendation = recommend(evaluations, hardware)
    hint = _checkpointing_hint(model, hardware, training, workload, recommendation.label)
    return Plan(
        model=model,
        hardware=hardware,
        training=training,
        workload=workload,
        evaluations=tuple(evaluations),
        recommendation=recommendation,
        notes=_plan_notes(model, hardware, training, workload) + tuple(hint),
    )
