"""The one precision plugin every lightning_colossal strategy uses.

``ColossalPrecision`` handles ``32-true``, ``bf16-mixed`` (autocast), ``bf16-true`` (bf16 weights and compute)
and ``16-mixed`` (fp16 autocast with the dynamic loss scaler below). Lightning hands custom strategies *generic*
plugins (``Precision``, ``MixedPrecision``, ``HalfPrecision``); ``to_colossal_precision`` translates those so that
``Trainer(precision=...)`` always reaches us and is never silently ignored.

[Note: overflow is global]
With sharded gradients each rank sees only part of the gradient, so an inf/nan may exist on one rank only. The
overflow flag is therefore all-reduced (MAX) over the strategy's process group before deciding to skip a step,
so every rank skips the same step and the replicas never diverge. It costs one scalar collective per step.

[Note: non-finite values without a loss scaler]
Under ``32-true``, ``bf16-mixed`` and ``bf16-true`` nothing skips a step whose loss or gradients are inf/nan, and one
such step turns every weight into nan. So after backward each rank checks its loss (flagged in ``pre_backward``, on
the device, without a host sync per micro-batch) and its gradient shards (read only: each tensor's L1 norm, which is
inf/nan exactly when the tensor holds one, or when its absolute values sum past the float32 range), and the ranks vote
with one all-reduce of a ``2 * world_size`` flag vector: like [Note: overflow is global] every
rank then takes the same decision, and the vector also says *which* ranks saw a bad loss or bad gradients, so the
message names where the fault started (a nan loss on one rank spreads to every rank's gradients through the
reduction). ``on_nonfinite`` chooses: ``"raise"`` (default) raises ``FloatingPointError`` on every rank before the
step, so the weights and the last checkpoint stay finite; ``"skip"`` skips the step on every rank and warns, like the
fp16 scaler; ``"warn"`` warns and steps anyway. ``"raise"`` is the default because without a scaler a non-finite
value is not a routine event: it means divergence or bad data, and a run that skips every later step would burn its
budget without training. ``16-mixed`` keeps the scaler's behaviour (skip and back off), which already votes.

The flags stay on the device until the vote's one read: on a GPU the check costs one wait per step (the read the
decision needs before the step), not one per flag, copy and collective (a loss read, a flag copied back, the vote
moved to the device and back: four before), and no pass that writes every gradient.

[Note: clipping belongs to the engine]
Lightning clips through the precision plugin and only passes the optimizer. A sharded engine must compute the
norm over all shards, so the strategy installs a ``GradientClipper`` on the plugin; the default clips the local
gradients, which is exact when every rank holds the full, already-reduced gradients (DDP).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Protocol

import torch
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.plugins.precision.amp import MixedPrecision
from lightning.pytorch.plugins.precision.double import DoublePrecision
from lightning.pytorch.plugins.precision.half import HalfPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_colossal.config import (
    LossScalerConfig,
    NonFiniteAction,
    PrecisionName,
    validate_nonfinite_action,
    validate_precision,
)
from lightning_colossal.distributed import collectives
from lightning_colossal.distributed import device as devices
from lightning_colossal.distributed.in_flight import Activity
from lightning_colossal.engine_parts import sharded_state


class DynamicLossScaler:
    """Dynamic loss scale for fp16 training, with hysteresis (ColossalAI semantics, see ``LossScalerConfig``)."""

    def __init__(self, config: LossScalerConfig | None = None) -> None:
        self.config = config or LossScalerConfig()
        self.scale = float(self.config.initial_scale)
        self.clean_steps = 0
        self.overflows_since_growth = 0
        self.skipped_steps = 0

    def update(self, found_overflow: bool) -> None:
        """Advance the scale after a step; ``found_overflow`` must already agree on every rank."""
        config = self.config
        if found_overflow:
            self.skipped_steps += 1
            self.clean_steps = 0
            self.overflows_since_growth += 1
            if self.overflows_since_growth >= config.hysteresis:
                self.scale = max(self.scale * config.backoff_factor, config.min_scale)
            return
        self.clean_steps += 1
        if self.clean_steps >= config.growth_interval:
            self.scale = min(self.scale * config.growth_factor, config.max_scale)
            self.clean_steps = 0
            self.overflows_since_growth = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "overflows_since_growth": self.overflows_since_growth,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.overflows_since_growth = int(state["overflows_since_growth"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


class GradientClipper(Protocol):
    """Clips the gradients an optimizer will step on (see [Note: clipping belongs to the engine])."""

    def clip_by_norm(self, optimizer: Optimizer, max_norm: float) -> Tensor: ...

    def clip_by_value(self, optimizer: Optimizer, clip_value: float) -> None: ...

    def gradient_norm(self, optimizer: Optimizer, norm_type: float) -> Tensor: ...


def optimizer_gradients(optimizer: Optimizer) -> list[Tensor]:
    """This rank's gradient tensors of every parameter of ``optimizer`` that has one.

    Sharded (DTensor) gradients are returned as their local shards: the fused unscale kernel works on plain
    tensors, and in-place changes to the shard are changes to the DTensor.
    """
    return [gradient.to_local() if isinstance(gradient, DTensor) else gradient for gradient in _gradients(optimizer)]


class LocalGradientClipper:
    """Clips the gradients held by this rank; exact when every rank holds the full reduced gradients (DDP)."""

    def clip_by_norm(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        parameters = [param for group in optimizer.param_groups for param in group["params"]]
        gradients = _gradients(optimizer)
        if not any(isinstance(gradient, DTensor) for gradient in gradients):
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        # FSDP: torch's clip_grad_norm_ would reduce the DTensor norm on the mesh's device, which fails for shards
        # offloaded to the host on an NCCL mesh. The sharded engines' clipping takes the shards where they are and
        # sums one scalar on the group's device.
        local = optimizer_gradients(optimizer)
        return sharded_state.scale_to_global_norm(local, _counted_pieces(gradients), max_norm, None, local[0].device)

    def clip_by_value(self, optimizer: Optimizer, clip_value: float) -> None:
        parameters = [param for group in optimizer.param_groups for param in group["params"]]
        if not any(isinstance(gradient, DTensor) for gradient in _gradients(optimizer)):
            torch.nn.utils.clip_grad_value_(parameters, clip_value)
            return
        # FSDP: clamp each rank's shard where it lives. torch 2.11's clip_grad_value_ fails on a rank whose shards
        # are all empty (its fused clamp refuses an empty list).
        for local in optimizer_gradients(optimizer):
            if local.numel():
                local.clamp_(-clip_value, clip_value)

    def gradient_norm(self, optimizer: Optimizer, norm_type: float) -> Tensor:
        gradients = _gradients(optimizer)
        if not any(isinstance(gradient, DTensor) for gradient in gradients):
            # Every rank holds the whole reduced gradient (DDP): nothing to sum across ranks.
            whole = [gradient for gradient in gradients if gradient.numel()]
            return torch.nn.utils.get_total_norm(whole, norm_type) if whole else torch.zeros(())
        device = optimizer_gradients(optimizer)[0].device
        return sharded_state.global_norm(_counted_pieces(gradients), None, device, norm_type)


def _gradients(optimizer: Optimizer) -> list[Tensor]:
    return [param.grad for group in optimizer.param_groups for param in group["params"] if param.grad is not None]


def _counted_pieces(gradients: list[Tensor]) -> list[Tensor]:
    """FSDP: DTensor shards (a rank's may be empty, which torch's max-norm refuses). Each element is counted on one
    rank: its shard's owner, at coordinate 0 of every mesh dimension that replicates it."""
    return [piece for gradient in gradients if (piece := counted_piece(gradient)) is not None]


def counted_piece(gradient: Tensor) -> Tensor | None:
    """The part of ``gradient`` this rank counts in a norm summed over all ranks (``None``: none of it)."""
    if not isinstance(gradient, DTensor):
        return gradient if collectives.rank() == 0 and gradient.numel() else None  # whole on every rank
    coordinate = gradient.device_mesh.get_coordinate() or []
    for dimension, placement in enumerate(gradient.placements):
        if placement.is_replicate() and coordinate[dimension] != 0:
            return None
    local = gradient.to_local()
    return local if local.numel() else None


def plain_step(optimizer: Any, **kwargs: Any) -> Any:
    return optimizer.step(**kwargs)


class ColossalPrecision(Precision):
    """Precision plugin shared by all lightning_colossal strategies.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"`` or ``"16-mixed"``.
        loss_scaler: dynamic loss scaling settings, used only by ``"16-mixed"``.
        device_type: device type for autocast; the strategy sets it from its root device during setup.
        on_nonfinite: what a non-finite loss or gradient on any rank does without a loss scaler: ``"raise"``
            (stop every rank before the step), ``"skip"`` (skip the step on every rank) or ``"warn"`` (step anyway).
            See [Note: non-finite values without a loss scaler]; ``"16-mixed"`` always skips through its scaler.
    """

    def __init__(
        self,
        precision: PrecisionName = "32-true",
        loss_scaler: LossScalerConfig | None = None,
        device_type: str = "cpu",
        on_nonfinite: NonFiniteAction = "raise",
    ) -> None:
        self.precision = validate_precision(precision)  # type: ignore[assignment]
        self.device_type = device_type
        self.loss_scaler: DynamicLossScaler | None = None
        if self.precision == "16-mixed":
            self.loss_scaler = DynamicLossScaler(loss_scaler)
        self.gradient_clipper: GradientClipper = LocalGradientClipper()
        #: Runs ``optimizer.step(**kwargs)``; an engine that keeps optimizer state on disk replaces it (strategies set
        #: it with the gradient clipper).
        self.optimizer_stepper: Callable[..., Any] = plain_step
        self.process_group: ProcessGroup | None = None
        # Filled by every optimizer_step: whether the last step was skipped because of an overflow.
        self.last_step_skipped = False
        self.on_nonfinite: NonFiniteAction = validate_nonfinite_action(on_nonfinite)
        #: Steps skipped because of a non-finite loss or gradient (``on_nonfinite="skip"``; not fp16 overflows).
        self.nonfinite_skipped_steps = 0
        # Set in pre_backward when a loss since the last step was inf/nan; a device tensor, read at the vote.
        self._nonfinite_loss: Tensor | None = None

    # ------------------------------------------------------------------------------------------ dtypes and contexts
    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matrix multiplications run in."""
        return {"32-true": torch.float32, "16-mixed": torch.float16}.get(self.precision, torch.bfloat16)

    @property
    def parameter_dtype(self) -> torch.dtype:
        """The dtype the model's parameters are stored in."""
        return torch.bfloat16 if self.precision == "bf16-true" else torch.float32

    @property
    def is_mixed(self) -> bool:
        return self.precision in ("bf16-mixed", "16-mixed")

    def _default_dtype_context(self) -> Any:
        if self.precision != "bf16-true":
            return nullcontext()
        return _default_dtype(torch.bfloat16)

    def tensor_init_context(self) -> Any:
        return self._default_dtype_context()

    def module_init_context(self) -> Any:
        return self._default_dtype_context()

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.is_mixed:
            # cache_enabled=False: the autocast weight cache would keep stale casts alive across optimizer steps.
            with torch.autocast(self.device_type, dtype=self.compute_dtype, cache_enabled=False):
                yield
        else:
            with self._default_dtype_context():
                yield

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.precision == "bf16-true":
            return module.to(dtype=torch.bfloat16)
        return module

    def convert_input(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data
        return apply_to_collection(data, Tensor, _cast_floating, torch.bfloat16)

    def convert_output(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data
        return apply_to_collection(data, Tensor, _cast_floating, torch.get_default_dtype())

    # ------------------------------------------------------------------------------------------ loss scaling
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        return super().pre_backward(self.scale_loss(tensor), module)

    def scale_loss(self, tensor: Tensor) -> Tensor:
        """The loss to back-propagate: multiplied by the loss scale under ``16-mixed``; otherwise unchanged, its
        finiteness noted (on the device, read at the step's vote) for [Note: non-finite values without a loss
        scaler]."""
        if self.loss_scaler is not None:
            return tensor * self.loss_scaler.scale
        bad = torch.isfinite(tensor.detach()).all().logical_not()
        self._nonfinite_loss = bad if self._nonfinite_loss is None else self._nonfinite_loss.logical_or(bad)
        return tensor

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizable,
        model: Any,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        self.last_step_skipped = False
        if self.loss_scaler is None:
            if isinstance(optimizer, torch.optim.LBFGS):
                # LBFGS re-evaluates the closure inside step(); it cannot be run once up front and checked.
                return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
            return self._step_unless_nonfinite(optimizer, model, closure, **kwargs)
        closure_result = closure()
        automatic = getattr(model, "automatic_optimization", True)
        skipped_backward = closure_result is None and automatic
        if skipped_backward:
            # training_step returned None: no backward ran, nothing to unscale or step.
            self._after_closure(model, optimizer)
            return closure_result
        found_overflow = self.unscale_and_check(optimizer)  # type: ignore[arg-type]
        # Callbacks and clipping see unscaled gradients, as with torch's GradScaler.
        self._after_closure(model, optimizer)
        self.loss_scaler.update(found_overflow)
        if found_overflow:
            self.last_step_skipped = True
            return closure_result
        return self.optimizer_stepper(optimizer, **kwargs)

    def _step_unless_nonfinite(
        self, optimizer: Optimizable, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Run the closure, vote on non-finite values, then step, skip or raise (see [Note: non-finite values without
        a loss scaler])."""
        closure_result = closure()
        if closure_result is None and getattr(model, "automatic_optimization", True):
            # training_step returned None: no backward ran, nothing to check or step.
            self._nonfinite_loss = None
            self._after_closure(model, optimizer)
            return closure_result
        loss_ranks, gradient_ranks = self.nonfinite_ranks(optimizer)  # type: ignore[arg-type]
        if not loss_ranks and not gradient_ranks:
            self._after_closure(model, optimizer)
            return self.optimizer_stepper(optimizer, **kwargs)
        step = getattr(model, "global_step", "?")
        found = (
            f"Step {step} (global_step): non-finite loss on rank(s) {loss_ranks or 'none'}, non-finite gradients on"
            f" rank(s) {gradient_ranks or 'none'} (precision {self.precision!r})."
        )
        if self.on_nonfinite == "raise":
            raise FloatingPointError(
                f"{found} No rank took this step, so the weights and the last checkpoint are still finite. Look at the"
                " batch the first rank listed read at this step, lower the learning rate or clip gradients"
                " (`Trainer(gradient_clip_val=...)`); or pass `on_nonfinite='skip'` to the strategy or to"
                " `ColossalPrecision` to skip such steps on every rank and go on."
            )
        self._after_closure(model, optimizer)
        if self.on_nonfinite == "skip":
            self.nonfinite_skipped_steps += 1
            self.last_step_skipped = True
            rank_zero_warn(f"{found} Skipped this optimizer step on every rank (on_nonfinite='skip').")
            return closure_result
        rank_zero_warn(f"{found} Stepping anyway (on_nonfinite='warn'): the weights may become non-finite.")
        return self.optimizer_stepper(optimizer, **kwargs)

    def nonfinite_ranks(self, optimizer: Optimizer) -> tuple[list[int], list[int]]:
        """The ranks whose loss (since the last step) and whose gradient shards hold an inf/nan, agreed by all ranks.

        One all-reduce (MAX) of a ``2 * world_size`` vector of flags over the plugin's process group, built where the
        gradients are and read once ([Note: non-finite values without a loss scaler]).
        """
        gradients = optimizer_gradients(optimizer)
        world_size, rank = collectives.world_size(self.process_group), collectives.rank(self.process_group)
        gradient_flag = _nonfinite_flag(gradients)
        loss_flag = self._nonfinite_loss
        self._nonfinite_loss = None
        here = torch.stack(
            [
                torch.zeros((), device=gradient_flag.device)
                if loss_flag is None
                else devices.to_device(loss_flag.float(), gradient_flag.device),
                gradient_flag,
            ]
        )
        if world_size == 1:
            seen = here.tolist()
        else:
            flags = torch.zeros(2, world_size, device=here.device)
            flags[:, rank] = here
            with Activity("voting on non-finite losses and gradients"):
                collectives.all_reduce(flags, op="max", group=self.process_group)
            seen = flags.reshape(-1).tolist()
        return (
            [index for index in range(world_size) if seen[index] > 0],
            [index for index in range(world_size) if seen[world_size + index] > 0],
        )

    def unscale_and_check(self, optimizer: Optimizer) -> bool:
        """Divide every gradient by the loss scale and report an inf/nan on any rank (see [Note: overflow is global])."""
        assert self.loss_scaler is not None
        found_overflow = _check_and_unscale(optimizer_gradients(optimizer), 1.0 / self.loss_scaler.scale)
        with Activity("voting on a gradient overflow (loss scaler)"):
            return collectives.any_rank_true(found_overflow, group=self.process_group)

    # ------------------------------------------------------------------------------------------ clipping
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self.gradient_clipper.clip_by_value(optimizer, float(clip_val))
        elif gradient_clip_algorithm == GradClipAlgorithmType.NORM:
            self.gradient_clipper.clip_by_norm(optimizer, float(clip_val))
        else:
            raise ValueError(f"gradient_clip_algorithm={gradient_clip_algorithm!r}: use 'norm' or 'value'.")

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        if self.loss_scaler is None:
            return {}
        return {"loss_scaler": self.loss_scaler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.loss_scaler is not None and "loss_scaler" in state_dict:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])


def to_colossal_precision(plugin: Precision | None, loss_scaler: LossScalerConfig | None = None) -> ColossalPrecision:
    """Translate whatever precision plugin Lightning handed over into a ``ColossalPrecision``.

    Raises:
        ValueError: the plugin asks for a precision lightning_colossal does not train in.
        TypeError: the plugin is a specialised one (quantisation, transformer-engine, another strategy's) that
            cannot be translated without losing what it does.
    """
    if plugin is None:
        return ColossalPrecision("32-true", loss_scaler)
    if isinstance(plugin, ColossalPrecision):
        return plugin
    if isinstance(plugin, MixedPrecision):
        refuse_a_custom_grad_scaler(plugin.precision, plugin.scaler, "Trainer")
        return ColossalPrecision(plugin.precision, loss_scaler, device_type=str(plugin.device))  # type: ignore[arg-type]
    if isinstance(plugin, HalfPrecision):
        return ColossalPrecision(validate_precision(plugin.precision), loss_scaler)
    if isinstance(plugin, DoublePrecision):
        validate_precision("64-true")
    if type(plugin) is Precision:
        return ColossalPrecision(validate_precision(plugin.precision), loss_scaler)
    raise TypeError(
        f"The precision plugin {type(plugin).__name__} cannot be used with lightning_colossal strategies. Pass"
        " `Trainer(precision=...)` with one of '32-true', 'bf16-mixed', 'bf16-true', '16-mixed', or a"
        " `lightning_colossal.ColossalPrecision` in `Trainer(plugins=[...])`."
    )


def refuse_a_custom_grad_scaler(precision: str, scaler: Any, front_door: str) -> None:
    """Refuse a user's own ``GradScaler`` handed over in a ``MixedPrecision`` plugin (of ``front_door``, "Trainer" or
    "Fabric"): the plugins here scale with ``DynamicLossScaler``, and its settings are where to put the user's."""
    if precision == "16-mixed" and scaler is not None and not is_default_grad_scaler(scaler):
        raise TypeError(
            "A custom torch GradScaler was passed through MixedPrecision; lightning_colossal uses its own loss"
            " scaler. Pass its settings as `ColossalPrecision('16-mixed', loss_scaler=LossScalerConfig(...))` in"
            f" `{front_door}(plugins=[...])` or as the strategy's `loss_scaler=` argument."
        )


def is_default_grad_scaler(scaler: Any) -> bool:
    # Lightning builds a default GradScaler for "16-mixed"; that one carries no user intent and is safe to replace.
    defaults = {"_init_scale": 2.0**16, "_growth_factor": 2.0, "_backoff_factor": 0.5, "_growth_interval": 2000}
    return isinstance(scaler, torch.amp.GradScaler) and all(
        getattr(scaler, name, value) == value for name, value in defaults.items()
    )


def _cast_floating(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    return tensor.to(dtype) if torch.is_floating_point(tensor) else tensor


def _by_device_and_dtype(
    gradients: Sequence[Tensor],
) -> tuple[torch.device, dict[tuple[torch.device, torch.dtype], list[Tensor]]]:
    """``gradients`` grouped for the fused kernels (one device and dtype per call), and the device their flags are
    combined on: the first accelerator among them, the host otherwise."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for gradient in gradients:
        groups.setdefault((gradient.device, gradient.dtype), []).append(gradient)
    accelerators = [device for device, _ in groups if devices.is_accelerator(device)]
    return (accelerators[0] if accelerators else torch.device("cpu")), groups


def _nonfinite_flag(gradients: Sequence[Tensor]) -> Tensor:
    """A 0-d float tensor, 1.0 if any of ``gradients`` holds an inf/nan (read only: per-tensor L1 norms in float32,
    [Note: non-finite values without a loss scaler]); on the combining device, not read here."""
    device, groups = _by_device_and_dtype(gradients)
    found = torch.zeros((), device=device)
    for (group_device, _), group in groups.items():
        norms = torch._foreach_norm(group, 1, dtype=torch.float32)
        bad = torch.stack(norms).isfinite().logical_not().any().float()
        found = torch.maximum(found, bad if group_device == device else devices.to_device(bad, device))
    return found


def _check_and_unscale(gradients: Sequence[Tensor], inverse_scale: float) -> Tensor:
    """Multiply ``gradients`` by ``inverse_scale`` in place; a 0-d float tensor, 1.0 if any held an inf/nan, on the
    combining device and not read here.

    The fused kernel takes one device and dtype per call, with its flag and scale on that device: gradients spread
    over a GPU and the host (Gemini's mixed placement, offloaded masters) get a flag per device, combined on one.
    """
    device, groups = _by_device_and_dtype(gradients)
    found = torch.zeros((), device=device)
    for (group_device, _), group in groups.items():
        found_here = torch.zeros(1, device=group_device)
        torch._amp_foreach_non_finite_check_and_unscale_(
            group, found_here, torch.full((1,), inverse_scale, device=group_device)
        )
        flag = found_here[0] if group_device == device else devices.to_device(found_here[0], device)
        found = torch.maximum(found, flag)
    return found


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
