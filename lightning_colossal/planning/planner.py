"""Weigh every strategy and setting for one model on one machine, and recommend one with the reason.

Per setting and per rank (the fullest rank, rank 0: ``torch.chunk`` gives it the most rows): exact model state
(``model_state.py``), estimated working memory (``working.py``) and activations (``activations.py``). A setting fits
when, on every device, model state on the device + working memory + activations + the reserve fit the device memory,
the host bytes of all ranks of a node fit the node's host memory, and (disk settings) their disk bytes fit the free
space of the node's disk. On CPU ranks device and host are one memory.

Disk settings (``disk_tier.py``) are weighed only when the hardware has a disk, and recommended only when no setting
without disk fits: their optimizer steps read and write the state on disk every step. Each is shown at the least
share of its optimizer state on disk that fits the host, and with the fp32 masters of that share on disk too
(``masters_on_disk``) only when no share of the state alone fits it. Gemini's automatic placement with a host budget
(``host_budget.py``) is shown with the chunks its engine would send to disk under the budget the planner names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_colossal.planning.activations import (
    ActivationEstimate,
    Workload,
    activation_estimate,
    compute_bytes,
    ring_exchange_bytes,
)
from lightning_colossal.planning.chunks import chunk_layout
from lightning_colossal.planning.disk_tier import DISK_FRACTIONS, Disk, io_seconds
from lightning_colossal.planning.experts import all_to_all_bytes_per_step, expert_parallel_state, moe_layers
from lightning_colossal.planning.host_budget import (
    budget_from,
    budget_note,
    disk_chunks_for_budget,
    outside_budget_bytes,
)
from lightning_colossal.planning.model_shape import ModelShape
from lightning_colossal.planning.model_state import DeviceType, ModelState, Training, model_state
from lightning_colossal.planning.settings import (
    DISK_BASES,
    Setting,
    disk_setting,
    host_budget_setting,
    hybrid_settings,
    offload_settings,
    standard_settings,
)
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
    "disk_evaluations",
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
        disk: each node's local disk for the disk tier (``None``: no disk settings are weighed).
    """

    devices_per_node: int
    nodes: int
    device_memory: int
    host_memory: int
    device_type: DeviceType = "cuda"
    device_reserve: int = 2 * 2**30
    disk: Disk | None = None

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
    host_bytes_per_rank: int  # one rank's host bytes (on CPU ranks: all of its bytes)
    host_bytes: int  # per node: every local rank's host bytes
    fits_device: bool
    fits_host: bool
    disk_bytes_per_rank: int = 0  # the disk tier's bytes (optimizer state between steps)
    disk_bytes: int = 0  # per node: every local rank's disk bytes, on the node's one disk
    fits_disk: bool = True
    disk_io_seconds: float | None = None  # lower bound of one optimizer step's disk I/O on a node (disk settings)
    checkpoint_extra_bytes: int = 0  # per node: host bytes a checkpoint save or load adds to a disk setting's
    notes: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host and self.fits_disk


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
    state = (
        expert_parallel_state(model, setting, training, data_parallel)
        if setting.ep_size > 1
        else model_state(shapes, setting, training, data_parallel, rank=0)
    )
    working = working_memory(model, setting, training, data_parallel, workload.activation_checkpointing)
    activations = activation_estimate(
        model, training, workload, setting.tp_size, casts_weights=setting.family != "fsdp", sp_size=setting.sp_size
    )
    on_device = state.placed.device + working.placed.device + activations.total + hardware.device_reserve
    host_per_rank = state.placed.host + working.placed.host
    if hardware.device_type == "cpu":  # one memory: every byte of every local rank comes out of the host's
        host_per_rank += on_device - hardware.device_reserve
        on_device = 0
    on_host = host_per_rank * hardware.devices_per_node
    disk_per_rank = state.placed.disk + working.placed.disk
    on_disk = disk_per_rank * hardware.devices_per_node
    if on_disk and hardware.disk is None:
        raise ValueError(f"{setting.label} keeps state on disk: describe the disk (Hardware.disk) to weigh it.")
    disk = hardware.disk
    records = working.disk_records
    how, notes = _how(setting, workload)
    if setting.sp_size > 1:
        notes += _ring_notes(model, setting, training, workload)
    if setting.ep_size > 1:
        notes += _expert_notes(model, setting, training, workload)
    return Evaluation(
        setting=setting,
        how=how,
        model_state=state,
        working=working,
        activations=activations,
        device_bytes=on_device,
        host_bytes_per_rank=host_per_rank,
        host_bytes=on_host,
        fits_device=on_device <= hardware.device_memory,
        fits_host=on_host <= hardware.host_memory,
        disk_bytes_per_rank=disk_per_rank,
        disk_bytes=on_disk,
        fits_disk=disk is None or disk.space is None or on_disk <= disk.space,
        # Each optimizer step reads every byte on disk once and writes it back once; a node's ranks share its disk.
        disk_io_seconds=io_seconds(disk, on_disk, on_disk) if disk is not None and setting.uses_disk else None,
        checkpoint_extra_bytes=records.checkpoint_bytes * hardware.devices_per_node,
        notes=notes,
    )


def _expert_notes(model: ModelShape, setting: Setting, training: Training, workload: Workload) -> tuple[str, ...]:
    """What an expert-parallel setting sends per micro-batch ([Note: expert-parallel all-to-all bytes])."""
    shape = model.architecture
    traffic = all_to_all_bytes_per_step(
        tokens=workload.tokens,
        top_k=shape.experts_per_token or 1,
        hidden=shape.hidden,
        element_bytes=compute_bytes(training),
        ep_size=setting.ep_size,
        moe_layers=moe_layers(model),
        activation_checkpointing=workload.activation_checkpointing,
    )
    return (
        f"{setting.label}: each rank sends {format_bytes(traffic.total)} per micro-batch in the experts' all-to-alls"
        f" (and receives as much), with balanced routing; {shape.experts} experts, {shape.experts_per_token} per token",
    )


def _ring_notes(model: ModelShape, setting: Setting, training: Training, workload: Workload) -> tuple[str, ...]:
    """What a ring-attention setting sends, and the sequence lengths it takes."""
    sent = ring_exchange_bytes(model, training, workload, setting.tp_size, setting.sp_size)
    notes = (
        f"{setting.label}: each rank sends {format_bytes(sent)} per layer per micro-batch around the ring (key/value"
        " blocks forward and backward, their fp32 gradients back to their owners), overlapped with attention",
    )
    chunks = 2 * setting.sp_size
    if workload.sequence_length % chunks:
        notes += (f"{setting.label} needs a sequence length divisible by 2 * sp_size = {chunks} (zigzag chunks)",)
    return notes


def _need(evaluation: Evaluation, hardware: Hardware) -> str:
    needs = []
    if not evaluation.fits_device:
        needs.append(f"{format_bytes(evaluation.device_bytes)} per {hardware.device_word}")
    if not evaluation.fits_host:
        needs.append(f"{format_bytes(evaluation.host_bytes)} of host memory per node")
    if not evaluation.fits_disk:
        needs.append(f"{format_bytes(evaluation.disk_bytes)} of disk per node")
    return " and ".join(needs)


def disk_io_text(evaluation: Evaluation, hardware: Hardware) -> str:
    """What a disk setting's optimizer step moves through a node's disk, and the least time that takes."""
    assert evaluation.disk_io_seconds is not None and hardware.disk is not None
    disk = hardware.disk
    return (
        f"each optimizer step reads {format_bytes(evaluation.disk_bytes)} from each node's disk and writes it back,"
        f" at least {evaluation.disk_io_seconds:.2f} s of disk I/O per step at {disk.read_bytes_per_second / 1e9:.2f}"
        f" GB/s read and {disk.write_bytes_per_second / 1e9:.2f} GB/s write"
    )


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
    """The first setting with comfortable headroom, else the first that fits at all; and why earlier ones lost.
    Settings without disk come first: a disk setting is chosen only when none of them fits, even tightly."""
    without_disk = [evaluation for evaluation in evaluations if not evaluation.setting.uses_disk]
    with_disk = [evaluation for evaluation in evaluations if evaluation.setting.uses_disk]
    lost: list[str] = []
    for group in (without_disk, with_disk):
        for minimum in (COMFORTABLE_HEADROOM, 0.0):
            skipped = []
            for evaluation in group:
                room, capacity = _headroom(evaluation, hardware)
                if evaluation.fits and room >= minimum * capacity:
                    return evaluation, lost + skipped
                if evaluation.fits:
                    share = f"{COMFORTABLE_HEADROOM:.0%}"
                    skipped.append(
                        f"{evaluation.setting.label} fits with only {_headroom_text(evaluation, hardware)} (<{share})"
                    )
                else:
                    skipped.append(f"{evaluation.setting.label} does not fit (needs {_need(evaluation, hardware)})")
        lost = skipped  # nothing in this group fits: every one of them lost
    return None, []


def recommend(evaluations: list[Evaluation], hardware: Hardware) -> Recommendation:
    """The first setting (in preference order) that fits with comfortable headroom (else the first that fits at
    all, called tight), with its headroom and why the ones before it lost."""
    chosen, skipped = _choose(evaluations, hardware)
    if chosen is None:
        smallest = min(evaluations, key=lambda evaluation: (evaluation.device_bytes, evaluation.host_bytes))
        disk_hint = ""
        if hardware.disk is None and any(e.fits_device and not e.fits_host for e in evaluations):
            disk_hint = ", or give the planner a local disk for the disk tier (--offload-dir PATH)"
        return Recommendation(
            None,
            None,
            f"nothing fits: the smallest is {smallest.setting.label}, which needs {_need(smallest, hardware)}. Add"
            " devices or nodes, lower --micro-batch-size or --sequence-length, or pass --activation-checkpointing"
            f"{disk_hint}.",
        )
    room, capacity = _headroom(chosen, hardware)
    tight = " (tight: the estimates may be off by more)" if room < COMFORTABLE_HEADROOM * capacity else ""
    reason = f"{chosen.setting.label}: fits with {_headroom_text(chosen, hardware)}{tight}; {chosen.setting.why_prefer}"
    if chosen.setting.uses_disk:
        reason += f"; {disk_io_text(chosen, hardware)}; chosen because no setting without disk fits"
        if chosen.setting.masters_on_disk:
            reason += ", and its masters on disk too because the optimizer state alone on disk does not fit the host"
    if skipped:
        more = f"; {len(skipped) - MAX_REASONS} more lose too" if len(skipped) > MAX_REASONS else ""
        reason += "; " + "; ".join(skipped[:MAX_REASONS]) + more
    return Recommendation(chosen.setting.label, chosen.how, reason)


def candidate_settings(model: ModelShape, hardware: Hardware) -> list[Setting]:
    """Every setting without disk worth weighing, in preference order (offload is pointless when ranks compute on the
    CPU). The disk settings depend on the evaluations: ``disk_evaluations``."""
    settings = standard_settings() + hybrid_settings(model, hardware.devices_per_node)
    if hardware.device_type == "cuda":
        settings += offload_settings()
    return settings


def _first_fitting(evaluations: list[Evaluation], hardware: Hardware) -> Evaluation | None:
    """Of one setting's disk shares (least I/O first), the first that leaves comfortable host headroom, else the
    first that fits at all."""
    for minimum in (COMFORTABLE_HEADROOM, 0.0):
        for evaluation in evaluations:
            if evaluation.fits and hardware.host_memory - evaluation.host_bytes >= minimum * hardware.host_memory:
                return evaluation
    return None


def _moves_masters(evaluation: Evaluation) -> bool:
    """Whether a ``masters_on_disk`` setting puts any master on disk: a Gemini chunk whose fp32 shard is its own
    master has none apart to move, and such a setting is the same as without it."""
    return evaluation.model_state.parameters.disk > 0


def _least_disk(
    base: str, model: ModelShape, hardware: Hardware, training: Training, workload: Workload
) -> Evaluation | None:
    """``base``'s disk row: the least share of its optimizer state on disk that fits (``_first_fitting``); when the
    host is all that no share fits, the least share with the masters on disk too (more I/O per step for the same
    share, so only as a further step); when nothing fits, the largest share of whichever was tried last, shown as not
    fitting. An optimizer without state shaped like the parameters (plain SGD) has only the masters to move: its row
    is the least share with the masters on disk, or none where no master is separate from the working weights."""
    assert hardware.disk is not None
    offload_dir = hardware.disk.path

    def shares(masters_on_disk: bool) -> list[Evaluation]:
        return [
            evaluate(model, disk_setting(base, fraction, offload_dir, masters_on_disk), hardware, training, workload)
            for fraction in DISK_FRACTIONS
        ]

    stateless = training.optimizer.moments == 0
    state_only: list[Evaluation] = []
    if not stateless:
        state_only = shares(masters_on_disk=False)
        chosen = _first_fitting(state_only, hardware)
        if chosen is not None:
            return chosen
        # The masters only help where host memory is all that is short: they add to the disk, leave the device alone.
        if not any(evaluation.fits_device and evaluation.fits_disk for evaluation in state_only):
            return state_only[-1]
    with_masters = [evaluation for evaluation in shares(masters_on_disk=True) if _moves_masters(evaluation)]
    if not with_masters:
        return state_only[-1] if state_only else None
    return _first_fitting(with_masters, hardware) or with_masters[-1]


def _host_budget_row(model: ModelShape, hardware: Hardware, training: Training, workload: Workload) -> Evaluation:
    """Gemini's automatic placement with ``host_memory_budget`` (``host_budget.py``), with the chunks its engine
    sends to disk under the largest budget that leaves the node 10% of its host memory (as the static rows' shares
    leave it), else under the rank's whole share; where the engine would refuse even that, every chunk's state on disk
    and the row not fitting the host, with a note saying so."""
    assert hardware.disk is not None
    offload_dir, ranks = hardware.disk.path, hardware.devices_per_node
    # Nothing on disk (the budget does not change the bytes): what the planner counts that the budget does not.
    in_memory = evaluate(model, host_budget_setting(1, offload_dir), hardware, training, workload)
    outside = outside_budget_bytes(in_memory.host_bytes_per_rank, in_memory.model_state, training, len(model.shapes))
    chunks = len(chunk_layout(model.shapes, training.parameter_bytes, in_memory.setting, hardware.world_size, 0))
    for share in (1 - COMFORTABLE_HEADROOM, 1.0):
        budget = budget_from(int(share * hardware.host_memory) // ranks - outside)
        setting = host_budget_setting(budget, offload_dir)
        on_disk = disk_chunks_for_budget(model.shapes, training, setting, hardware.world_size, 0)
        if on_disk is not None:
            setting = host_budget_setting(budget, offload_dir, on_disk)
            row = evaluate(model, setting, hardware, training, workload)
            return replace(
                row, notes=row.notes + (budget_note(setting, share, outside, training, chunks, refused=False),)
            )
    setting = host_budget_setting(budget, offload_dir, frozenset(range(chunks)))
    row = evaluate(model, setting, hardware, training, workload)
    note = budget_note(setting, share, outside, training, chunks, refused=True)
    return replace(row, fits_host=False, notes=row.notes + (note,))


def disk_evaluations(model: ModelShape, hardware: Hardware, training: Training, workload: Workload) -> list[Evaluation]:
    """Each offload setting with a disk tier (``DISK_BASES``) at the least disk share of ``DISK_FRACTIONS`` that fits
    the host (less on disk is less I/O per step), with the masters of that share on disk too only where no share of
    the optimizer state alone fits the host (``_least_disk``), and Gemini's automatic placement with a host budget
    (``_host_budget_row``); none when the hardware has no disk. An optimizer without state shaped like the parameters
    (plain SGD) gets only rows that move masters. Also on CPU ranks, where the disk saves RAM."""
    if hardware.disk is None:
        return []
    static_rows = (_least_disk(base, model, hardware, training, workload) for base in DISK_BASES)
    rows = [row for row in static_rows if row is not None]
    if training.optimizer.moments == 0:
        return rows  # the host-budget row moves optimizer state only, and there is none shaped like the parameters
    automatic = _host_budget_row(model, hardware, training, workload)
    # Automatic placement keeps chunks on the device as its compute budget allows, where the fully offloaded static
    # placement gathers every chunk from host memory: it goes ahead of that row when it also moves no more bytes
    # through the disk per step, and after it otherwise. (On a GPU its fp32 masters are copies apart from the shards,
    # which move to the device, so it can need more of the state on disk than the static row's share.)
    static = next(index for index, row in enumerate(rows) if row.setting.label.startswith(DISK_BASES[-1] + " + "))
    rows.insert(static if automatic.disk_bytes <= rows[static].disk_bytes else static + 1, automatic)
    return rows


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
    notes += _disk_notes(hardware, training)
    return tuple(notes)


def _disk_notes(hardware: Hardware, training: Training) -> list[str]:
    disk = hardware.disk
    if disk is None:
        return []
    shares = "/".join(f"{fraction:.0%}" for fraction in DISK_FRACTIONS)
    if training.optimizer.moments == 0:
        notes = [
            f"{training.optimizer.name} keeps no optimizer state shaped like the parameters: its only disk settings"
            " are '+ masters' rows (masters_on_disk=True), which keep the fp32 masters of the least share of"
            f" {shares} that fits the host on disk, offered where the masters are separate from the working weights"
            " (bf16-true parameters, or shards on a GPU): every optimizer step reads them and writes them back"
        ]
    else:
        notes = [
            f"disk settings keep that share of the optimizer state ({training.optimizer.name}'s moments) on each node's"
            f" disk; fp32 masters (unless marked '+ masters') and gradient shards stay in host memory. Each is shown at"
            f" the least share of {shares} that fits the host, and recommended only when nothing without disk fits: every"
            " optimizer step reads the state from disk and writes it back (the min disk I/O column: a lower bound of that"
            " step's I/O)",
            "a disk setting marked '+ masters' (masters_on_disk=True) also keeps the fp32 masters of that share on disk,"
            " in the same records: shown only when no share of the optimizer state alone fits the host, as it adds 4"
            " bytes an element to every step's reads and writes; a Gemini chunk whose fp32 shard is its own master has no"
            " separate master to move",
        ]
    if disk.offload_dir is None:
        notes.append(
            f"disk described by its bandwidths only: replace {disk.path!r} in `use:` by a local disk's directory"
        )
    if disk.space is None:
        notes.append("disk space not checked: pass --disk-space (the free space under --offload-dir per node)")
    if disk.measured and disk.direct_io is False:
        notes.append(
            f"the bandwidth under {disk.path} was measured through the page cache (no direct I/O on that filesystem):"
            " it is optimistic, and the I/O times with it"
        )
    return notes


def checkpoint_host_bytes(evaluation: Evaluation) -> int:
    """Host bytes per node while a checkpoint of a disk setting is saved or loaded: the state on disk goes through
    host memory one entry at a time (``engine_parts/stand_ins.py`` [Note: deferred tensors]), two records per rank."""
    return evaluation.host_bytes + evaluation.checkpoint_extra_bytes


def background_checkpoint_host_bytes(evaluation: Evaluation) -> int:
    """Host bytes per node while a background save (``async_checkpoint=True``) of a disk setting is staged: its copy
    holds every tensor of the save, the state on disk included, while training goes on."""
    return evaluation.host_bytes + evaluation.disk_bytes


def _verdict(peak: int, hardware: Hardware, what: str) -> str:
    if peak > hardware.host_memory:
        return f"more than the node's {format_bytes(hardware.host_memory)}: {what} would run out of host memory"
    return f"within the node's {format_bytes(hardware.host_memory)}"


def _checkpoint_save_note(evaluations: list[Evaluation], hardware: Hardware, chosen: str | None) -> list[str]:
    """For a recommended disk setting: the host memory a checkpoint save or load needs, and whether the node has it."""
    evaluation = next((e for e in evaluations if e.setting.label == chosen and e.setting.uses_disk), None)
    if evaluation is None:
        return []
    peak = checkpoint_host_bytes(evaluation)
    background = background_checkpoint_host_bytes(evaluation)
    return [
        f"checkpoints of {evaluation.setting.label}: saving or loading one streams the state on disk through host"
        f" memory one record at a time, about {format_bytes(peak)} per node (host/node + 2 records per rank),"
        f" {_verdict(peak, hardware, 'saving or loading a checkpoint')}; a background save (async_checkpoint=True)"
        f" stages all of it, about {format_bytes(background)} per node (host/node + the disk bytes),"
        f" {_verdict(background, hardware, 'a background save')}"
    ]


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
            needs = (
                f"{format_bytes(evaluation.host_bytes)} of host memory per node"
                if hardware.device_type == "cpu"  # one memory: the device total is 0
                else f"{format_bytes(evaluation.device_bytes)} per {hardware.device_word}"
            )
            return [f"with --activation-checkpointing {setting.label} would fit ({needs}): {evaluation.how}{knob}"]
    return []


def make_plan(model: ModelShape, hardware: Hardware, training: Training, workload: Workload) -> Plan:
    """Evaluate every candidate setting and recommend one."""
    if hardware.device_type == "cpu":
        hardware = replace(hardware, device_reserve=0)
    evaluations = [
        evaluate(model, setting, hardware, training, workload) for setting in candidate_settings(model, hardware)
    ]
    evaluations += disk_evaluations(model, hardware, training, workload)
    recommendation = recommend(evaluations, hardware)
    hint = _checkpointing_hint(model, hardware, training, workload, recommendation.label)
    hint += _checkpoint_save_note(evaluations, hardware, recommendation.label)
    return Plan(
        model=model,
        hardware=hardware,
        training=training,
        workload=workload,
        evaluations=tuple(evaluations),
        recommendation=recommendation,
        notes=_plan_notes(model, hardware, training, workload) + tuple(hint),
    )
