"""The strategies and settings the planner weighs, in the order it prefers them when several fit."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from lightning_colossal.planning.model_shape import ModelShape
from lightning_colossal.planning.units import MIB

__all__ = [
    "DISK_BASES",
    "HOST_BUDGET_LABEL",
    "Setting",
    "disk_setting",
    "expert_parallel_sizes",
    "host_budget_setting",
    "hybrid_settings",
    "offload_settings",
    "ring_sizes",
    "setting_named",
    "standard_settings",
    "tensor_parallel_sizes",
]

Family = Literal["ddp", "zero", "gemini", "fsdp", "hybrid"]


@dataclass(frozen=True)
class Setting:
    """One strategy with one setting.

    Args:
        label: what the report calls it (the registered strategy name, with the tp size for hybrid).
        family: which engine runs it.
        how: how to ask for it in a ``Trainer``.
        zero_stage: ZeRO stage (zero family; hybrid's ``zero_stage``).
        offload: optimizer state (and for FSDP, parameters) in host memory.
        offload_parameters: Gemini's ``offload_param_frac`` (parameter shards in host memory too).
        disk_fraction: share of the offloaded optimizer state (Adam's moments) on disk between steps (the disk tier:
            ``ZeroConfig.disk_fraction``, ``StaticPlacement.disk_fraction``); needs ``offload``.
        masters_on_disk: the fp32 masters of the shards (ZeRO) or chunks (Gemini) whose optimizer state is on disk
            live in the same records (``ZeroConfig.masters_on_disk``, ``GeminiConfig.masters_on_disk``); needs
            ``disk_fraction``. A Gemini chunk whose fp32 shard is its own master has no separate master to move.
        host_memory_budget: Gemini's automatic placement with ``AutoPlacement(host_memory_budget=...)`` and an
            ``offload_dir`` (``None``: not this setting): every optimizer in host memory, every parameter shard
            starting there, and the optimizer state of the last chunks on disk until the rest fits the budget.
        disk_chunks: under ``host_memory_budget``, the chunks (of the rank the planner reports) whose optimizer state
            the engine sends to disk (``host_budget.disk_chunks_for_budget``).
        tp_size: tensor-parallel ranks (hybrid).
        sp_size: ring-attention ranks (hybrid with ``sequence_parallel="ring"``): each holds ``1 / sp_size`` of every
            sequence, so its activations shrink by that factor, for key/value blocks sent around the ring per layer.
        ep_size: expert-parallel ranks (hybrid with ``ep_size``): each keeps ``1 / ep_size`` of every experts
            module's experts, and routed tokens travel to them by all-to-all.
        why_prefer: what this setting is good at, for the recommendation.
    """

    label: str
    family: Family
    how: str
    zero_stage: int = 0
    offload: bool = False
    offload_parameters: float = 0.0
    disk_fraction: float = 0.0
    masters_on_disk: bool = False
    host_memory_budget: int | None = None
    disk_chunks: frozenset[int] = frozenset()
    tp_size: int = 1
    sp_size: int = 1
    ep_size: int = 1
    why_prefer: str = ""

    def __post_init__(self) -> None:
        if self.masters_on_disk and self.disk_fraction <= 0:
            raise ValueError(
                f"{self.label}: masters_on_disk needs disk_fraction > 0 (the masters go to disk beside their shards'"
                " optimizer state); build it with disk_setting(base, fraction, offload_dir, masters_on_disk=True)."
            )
        if self.disk_chunks and self.host_memory_budget is None:
            raise ValueError(
                f"{self.label}: disk_chunks are what a host_memory_budget sends to disk; build the setting with"
                " host_budget_setting(budget, offload_dir, disk_chunks)."
            )

    @property
    def uses_disk(self) -> bool:
        return self.disk_fraction > 0 or self.automatic

    @property
    def automatic(self) -> bool:
        """Gemini's automatic placement (the host-budget row), where the disk share follows from the budget."""
        return self.host_memory_budget is not None


def _named(name: str, family: Family, why: str, **fields: object) -> Setting:
    return Setting(label=name, family=family, how=f'Trainer(strategy="{name}")', why_prefer=why, **fields)  # type: ignore[arg-type]


def standard_settings() -> list[Setting]:
    """The registered strategies without model parallelism, most preferred first (least communication and
    host traffic first; docs/choosing-a-strategy.md, decision table)."""
    return [
        _named("colossal_ddp", "ddp", "least communication, exact local clipping"),
        _named("colossal_zero1", "zero", "one parameter exchange per step, no per-micro-batch traffic", zero_stage=1),
        _named("colossal_zero2", "zero", "gradients sharded too, parameters never gathered", zero_stage=2),
        _named("colossal_fsdp", "fsdp", "everything sharded, one block gathered at a time"),
        _named("colossal_gemini", "gemini", "everything sharded in chunks, with placement knobs"),
    ]


def offload_settings() -> list[Setting]:
    """The settings that keep optimizer state in host memory and step there (slower steps), most preferred first."""
    fully_offloaded = "GeminiStrategy(placement=StaticPlacement(shard_param_frac=1.0, offload_optim_frac=1.0, offload_param_frac=1.0))"
    return [
        _named("colossal_zero1_offload", "zero", "optimizer on the host, parameters whole", zero_stage=1, offload=True),
        _named(
            "colossal_zero2_offload", "zero", "optimizer on the host, gradients sharded", zero_stage=2, offload=True
        ),
        _named(
            "colossal_gemini_offload", "gemini", "optimizer on the host, parameter shards on the device", offload=True
        ),
        _named("colossal_fsdp_offload", "fsdp", "all model state on the host", offload=True),
        Setting(
            label="colossal_gemini (all offloaded)",
            family="gemini",
            how=fully_offloaded,
            offload=True,
            offload_parameters=1.0,
            why_prefer="all model state on the host, only gathered chunks on the device",
        ),
    ]


# The offload settings the disk tier extends (FSDP2's CPU offload has no disk tier), most preferred first.
DISK_BASES = (
    "colossal_zero1_offload",
    "colossal_zero2_offload",
    "colossal_gemini_offload",
    "colossal_gemini (all offloaded)",
)


def _disk_how(base: Setting, fraction: float, offload_dir: str, masters_on_disk: bool) -> str:
    # Both engines take the flag as a strategy argument (ZeroConfig's and GeminiConfig's masters_on_disk).
    masters = ", masters_on_disk=True" if masters_on_disk else ""
    if base.family == "zero":
        return (
            f"ZeroStrategy(stage={base.zero_stage}, cpu_offload=True, offload_dir={offload_dir!r},"
            f" disk_fraction={fraction}{masters})"
        )
    parameters = ", offload_param_frac=1.0" if base.offload_parameters else ""
    sharding = "shard_param_frac=1.0, " if base.offload_parameters else ""
    return (
        f"GeminiStrategy(placement=StaticPlacement({sharding}offload_optim_frac=1.0{parameters},"
        f" disk_fraction={fraction}), offload_dir={offload_dir!r}{masters})"
    )


def disk_setting(base_label: str, fraction: float, offload_dir: str, masters_on_disk: bool = False) -> Setting:
    """The offload setting ``base_label`` (one of ``DISK_BASES``) with ``fraction`` of its optimizer state (Adam's
    moments) on disk under ``offload_dir``; with ``masters_on_disk`` the fp32 masters of the same shards or chunks go
    there too (labelled ``+ masters``). Gradient shards stay in host memory.

    Raises:
        ValueError: a base without a disk tier, or a fraction outside (0, 1].
    """
    if base_label not in DISK_BASES:
        raise ValueError(f"{base_label!r} has no disk tier; pass one of {', '.join(DISK_BASES)}.")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"disk fraction {fraction}: pass a share in (0, 1].")
    base = setting_named(base_label)
    what = "the optimizer state and its fp32 masters" if masters_on_disk else "the optimizer state"
    return replace(
        base,
        label=f"{base_label} + disk {fraction:.0%}" + (" + masters" if masters_on_disk else ""),
        how=_disk_how(base, fraction, offload_dir, masters_on_disk),
        disk_fraction=fraction,
        masters_on_disk=masters_on_disk,
        why_prefer=f"{base.why_prefer}; {fraction:.0%} of {what} on disk",
    )


HOST_BUDGET_LABEL = "colossal_gemini_auto + host budget"


def host_budget_setting(budget: int, offload_dir: str, disk_chunks: frozenset[int] = frozenset()) -> Setting:
    """Gemini's automatic placement with ``AutoPlacement(host_memory_budget=budget)`` and the disk tier under
    ``offload_dir``: counted like the fully offloaded Gemini (every shard starts in host memory, as automatic placement
    starts them under a compute budget), with the optimizer state of ``disk_chunks`` on disk.

    Raises:
        ValueError: a budget below one byte (``AutoPlacement`` refuses it).
    """
    if budget < 1:
        raise ValueError(f"host memory budget {budget}: pass a positive number of bytes.")
    # Whole MiB read better in ``use:``, and stay a Python expression that builds the strategy.
    written = f"{budget // MIB} * 2**20" if budget % MIB == 0 else str(budget)
    return Setting(
        label=HOST_BUDGET_LABEL,
        family="gemini",
        how=f"GeminiStrategy(placement=AutoPlacement(host_memory_budget={written}), offload_dir={offload_dir!r})",
        offload=True,
        offload_parameters=1.0,
        host_memory_budget=budget,
        disk_chunks=disk_chunks,
        why_prefer="chunks on the device as automatic placement's compute budget allows, all model state counted in"
        " host memory; on disk only the optimizer state (of the last chunks) that the host budget cannot hold",
    )


def tensor_parallel_sizes(model: ModelShape, devices_per_node: int) -> list[int]:
    """tp sizes above 1 that split the heads, the kv heads (and the vocabulary for vocabulary-parallel policies)
    evenly and stay inside one node (tensor parallelism communicates every layer)."""
    architecture = model.architecture
    sizes = []
    for size in range(2, devices_per_node + 1):
        divides = devices_per_node % size == 0 and architecture.heads % size == 0
        divides = divides and architecture.kv_heads % size == 0
        if architecture.vocab_parallel:
            divides = divides and architecture.vocab % size == 0
        if divides:
            sizes.append(size)
    return sizes


def hybrid_settings(model: ModelShape, devices_per_node: int) -> list[Setting]:
    """``colossal_hybrid`` with each usable tp size, then each usable ring size, and ZeRO-1 over the data-parallel
    rest (empty when no policy splits the model)."""
    experts = [
        Setting(
            label=f"colossal_hybrid ep={size} zero1",
            family="hybrid",
            how=f"HybridParallelStrategy(ep_size={size}, zero_stage=1)",
            zero_stage=1,
            ep_size=size,
            why_prefer="splits the experts over the node's devices (ZeRO-1 on the rest)",
        )
        for size in expert_parallel_sizes(model, devices_per_node)
    ]
    if model.architecture.tensor_parallel_policy is None:
        return experts
    return (
        experts
        + [
            Setting(
                label=f"colossal_hybrid tp={size} zero1",
                family="hybrid",
                how=f"HybridParallelStrategy(tp_size={size}, zero_stage=1)",
                zero_stage=1,
                tp_size=size,
                why_prefer="splits the layers and their activations over the node's devices",
            )
            for size in tensor_parallel_sizes(model, devices_per_node)
        ]
        + [
            Setting(
                label=f"colossal_hybrid ring sp={size} zero1",
                family="hybrid",
                how=f'HybridParallelStrategy(sp_size={size}, sequence_parallel="ring", zero_stage=1)',
                zero_stage=1,
                sp_size=size,
                why_prefer="splits every sequence, and so the activations, over the ring's devices",
            )
            for size in ring_sizes(model, devices_per_node)
        ]
    )


def expert_parallel_sizes(model: ModelShape, devices_per_node: int) -> list[int]:
    """ep sizes above 1 that divide both the experts and the node's devices (the all-to-all of every MoE layer stays
    inside a node), for models with experts."""
    experts = model.architecture.experts
    if experts < 2:
        return []
    return [size for size in range(2, devices_per_node + 1) if devices_per_node % size == 0 and experts % size == 0]


def ring_sizes(model: ModelShape, devices_per_node: int) -> list[int]:
    """Ring sizes above 1 that divide the node's devices, for models whose policy installs ring attention (the demo
    GPT's; docs/hybrid.md, ring attention). The ring passes blocks between neighbours only, but keeping it inside a
    node keeps those sends off the network."""
    if model.source != "demo" or model.architecture.dropout > 0:  # the demo's ring refuses attention dropout
        return []
    return [size for size in range(2, devices_per_node + 1) if devices_per_node % size == 0]


def setting_named(label: str) -> Setting:
    """The standard or offload setting called ``label`` (a registered strategy name, e.g. ``"colossal_zero2"``).

    Raises:
        ValueError: no such setting, naming the known ones.
    """
    known = {setting.label: setting for setting in standard_settings() + offload_settings()}
    if label not in known:
        raise ValueError(f"{label!r} is not a setting the planner weighs; pass one of {', '.join(sorted(known))}.")
    return known[label]
