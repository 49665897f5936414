"""``colossal_ddp``: torch ``DistributedDataParallel`` with lightning_colossal's precision and checkpoints.

Every rank holds the full model and optimizer, so gradients after DDP's all-reduce are the global ones: clipping
by norm or value is exact locally, and checkpoints write full tensors that DCP spreads over the ranks. Gradient
accumulation communicates only on the last micro-batch: Lightning wraps the other micro-batches in
``block_backward_sync()``, which enters DDP's ``no_sync()``.

[Note: parameters that become trainable after wrapping]
torch DDP registers its gradient hooks on the parameters that require gradients when it wraps the model, and never
again. A parameter unfrozen later (``BackboneFinetuning`` / ``BaseFinetuning`` unfreezing a backbone, or a user's own
``requires_grad_(True)`` mid-run) gets a gradient on each rank that nobody averages, so the ranks' copies drift apart
without an error (as under Lightning's ``ddp``). After every backward that synchronises gradients, the strategy
averages those parameters' gradients itself: one all-reduce of their flattened gradients, plus one count per
parameter of the ranks that produced a gradient, so a parameter no rank reached keeps ``grad=None`` as in one process.
The set is found each time from ``requires_grad`` (the same on every rank), so freezing and unfreezing in any order
keeps every rank issuing the same collective. Gradient compression does not apply to them.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.overrides.distributed import prepare_for_backward
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lightning_colossal.config import DDPConfig, GradientCompression
from lightning_colossal.distributed import collectives
from lightning_colossal.distributed.compression import compressed_all_reduce_hook
from lightning_colossal.distributed.in_flight import Activity
from lightning_colossal.strategies._lightning_private import (
    _ForwardRedirection,
    _optimizers_to_device,
    _sync_module_states,
)
from lightning_colossal.strategies.base import ColossalStrategy

# Newer torch split DDP's broadcast_buffers into forward_sync_buffers and deprecated the old name (2.13 has both,
# 2.11 only broadcast_buffers).
_DDP_TAKES_FORWARD_SYNC_BUFFERS = (
    "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
)


class ColossalDDPStrategy(ColossalStrategy):
    """Data parallelism with torch DDP; registered as ``colossal_ddp`` and ``colossal_ddp_notebook``.

    Args:
        bucket_cap_mb: gradient bucket size in MiB.
        gradient_as_bucket_view: let gradients alias DDP's buckets (the default: one gradient copy less; ``False``
            only for code that calls ``detach_()`` on a gradient).
        static_graph: the set of used parameters never changes between steps.
        find_unused_parameters: search for parameters without gradient every step (needed when some are unused).
        forward_sync_buffers: broadcast buffers from rank 0 before every forward. ``None`` (the default) means
            ``True``, unless the deprecated ``broadcast_buffers`` is passed, which then alone decides.
        broadcast_buffers: deprecated (as in torch's DDP): use ``forward_sync_buffers``. Keep
            ``broadcast_buffers=False`` only for rank-local buffers that must not be synced when the model is wrapped.
        gradient_compression: ``"fp16"`` or ``"bf16"`` to all-reduce gradients in half precision.
    """

    strategy_name = "colossal_ddp"
    wrapper_syncs_buffers = True  # torch DDP copies rank 0's buffers before each forward (forward_sync_buffers)

    def __init__(
        self,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        forward_sync_buffers: bool | None = None,
        broadcast_buffers: bool | None = None,
        gradient_compression: GradientCompression | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._forward_redirection = _ManualOptimizationAwareRedirection()
        self._parameters_ddp_handles: set[int] = set()
        self._said_late_parameters = False
        if broadcast_buffers is not None:
            if forward_sync_buffers is not None:
                raise ValueError(
                    f"ColossalDDPStrategy(broadcast_buffers={broadcast_buffers},"
                    f" forward_sync_buffers={forward_sync_buffers}): pass only forward_sync_buffers (broadcast_buffers"
                    " is deprecated by torch)."
                )
            # Said once, here, where the user passed it; torch's own warning about it is silenced in `_wrap`.
            warnings.warn(
                f"ColossalDDPStrategy(broadcast_buffers={broadcast_buffers}) is deprecated, as in torch's"
                f" DistributedDataParallel: pass forward_sync_buffers={broadcast_buffers} instead. Only keep"
                " broadcast_buffers=False if buffers must also stay rank-local when the model is wrapped.",
                FutureWarning,
                stacklevel=2,
            )
        self.ddp_config = DDPConfig(
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
            forward_sync_buffers=forward_sync_buffers if forward_sync_buffers is not None else True,
            broadcast_buffers=broadcast_buffers,
            gradient_compression=gradient_compression,
        )

    # ---------------------------------------------------------------------------------------------- set-up
    def setup(self, trainer: pl.Trainer) -> None:
        fitting = self._prepare_module(trainer)
        assert self.model is not None
        if fitting:
            self.model = self._wrap(self.model)
            # Optimizers are created after wrapping so they hold the parameters DDP registered its hooks on.
            self.setup_optimizers(trainer)
        else:
            # Without the DDP wrapper nothing broadcasts rank 0's weights; do it once so every rank evaluates the same model.
            _sync_module_states(self.model)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _wrap(self, module: torch.nn.Module) -> DistributedDataParallel:
        config = self.ddp_config
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        # torch warns whenever DDP gets broadcast_buffers, even the default: pass it only when the user did (and was
        # warned once by the constructor), so that a plain colossal_ddp run stays quiet.
        buffer_sync: dict[str, bool]
        if config.broadcast_buffers is not None:
            buffer_sync = {"broadcast_buffers": config.broadcast_buffers}
        elif _DDP_TAKES_FORWARD_SYNC_BUFFERS:
            buffer_sync = {"forward_sync_buffers": config.forward_sync_buffers}
        else:
            # torch before 2.13 has broadcast_buffers only: it means forward_sync_buffers there, and False also skips
            # the buffers' broadcast at wrap time (the strategy copies the first replica's running statistics before
            # every step anyway: [Note: running statistics follow the first replica]).
            buffer_sync = {"broadcast_buffers": config.forward_sync_buffers}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
            wrapped = DistributedDataParallel(
                module,
                device_ids=device_ids,
                bucket_cap_mb=config.bucket_cap_mb,
                gradient_as_bucket_view=config.gradient_as_bucket_view,
                static_graph=config.static_graph,
                find_unused_parameters=config.find_unused_parameters,
                **buffer_sync,
            )
        # What DDP's reducer averages and what it was told to leave rank-local: every other parameter that trains
        # is averaged by the strategy ([Note: parameters that become trainable after wrapping]).
        self._parameters_ddp_handles = {
            id(parameter)
            for name, parameter in module.named_parameters()
            if parameter.requires_grad or name in wrapped.parameters_to_ignore
        }
        if config.gradient_compression is not None:
            dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[config.gradient_compression]
            # state=None: the hook all-reduces over DDP's own process group (the data-parallel ranks).
            wrapped.register_comm_hook(state=None, hook=compressed_all_reduce_hook(dtype))
        return wrapped

    def pre_backward(self, closure_loss: Tensor) -> None:
        # Manual optimization bypasses DDP's forward bookkeeping; tell the reducer which outputs backward will use.
        if isinstance(self.model, DistributedDataParallel):
            assert self.lightning_module is not None
            if not self.lightning_module.automatic_optimization:
                prepare_for_backward(self.model, closure_loss)

    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        model = self.model
        if isinstance(model, DistributedDataParallel) and model.require_backward_grad_sync:
            self._average_gradients_ddp_never_registered(model)

    def _average_gradients_ddp_never_registered(self, model: DistributedDataParallel) -> None:
        """Average the gradients of parameters unfrozen after wrapping ([Note: parameters that become trainable after
        wrapping]); nothing to do, and no collective, while none is."""
        late = [
            parameter
            for parameter in model.parameters()
            if parameter.requires_grad and id(parameter) not in self._parameters_ddp_handles
        ]
        if not late:
            return
        if not self._said_late_parameters:
            self._said_late_parameters = True
            rank_zero_info(
                f"colossal_ddp: {len(late)} parameter(s) became trainable after DDP wrapped the model (e.g."
                " BackboneFinetuning); their gradients are averaged separately after each synchronising backward."
            )
        gradients = [parameter.grad for parameter in late]
        reference = next((gradient for gradient in gradients if gradient is not None), late[0])
        counts = torch.tensor([float(gradient is not None) for gradient in gradients], device=reference.device)
        pieces = [
            (gradient if gradient is not None else torch.zeros_like(parameter)).reshape(-1).to(reference.dtype)
            for parameter, gradient in zip(late, gradients, strict=True)
        ]
        flat = torch.cat([*pieces, counts.to(reference.dtype)])
        with Activity("averaging the gradients of parameters unfrozen after DDP wrapped the model"):
            collectives.all_reduce(flat, op="sum", group=model.process_group)
        flat[: -len(late)].div_(collectives.world_size(model.process_group))
        reached = flat[-len(late) :].tolist()
        offset = 0
        for parameter, gradient, ranks_with_gradient in zip(late, gradients, reached, strict=True):
            size = parameter.numel()
            averaged = flat[offset : offset + size].view_as(parameter)
            offset += size
            if ranks_with_gradient == 0:
                continue  # no rank reached it: it keeps grad=None, as in one process
            if gradient is None:
                parameter.grad = averaged.to(parameter.dtype).clone()
            else:
                gradient.copy_(averaged)

    def on_exception(self, exception: BaseException) -> None:
        message = str(exception)
        if "Expected to have finished reduction in the prior iteration" in message:
            exception.args = (
                message
                + "\nSome parameters got no gradient in this step. Pass `ColossalDDPStrategy(find_unused_parameters=True)`"
                " (or static_graph=True if the unused set never changes).",
            )

    def teardown(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module
        super().teardown()

    # ---------------------------------------------------------------------------------------------- checkpoints
    def _load_full_model_state(self, state_dict: Mapping[str, Tensor], strict: bool) -> None:
        assert self.lightning_module is not None
        self.lightning_module.load_state_dict(state_dict, strict=strict)


class _ManualOptimizationAwareRedirection(_ForwardRedirection):
    """Run ``training_step`` through the DDP wrapper without DDP preparing a backward of its own.

    Lightning routes ``training_step`` through ``DistributedDataParallel.forward``. With manual optimization the
    step already ran ``manual_backward`` (which calls ``prepare_for_backward`` itself, see ``pre_backward``), so DDP's
    post-forward must not expect another backward; otherwise the next forward fails in the reducer.
    """

    def on_after_inner_forward(self, wrapper_module: torch.nn.Module, original_module: pl.LightningModule) -> None:
        if isinstance(wrapper_module, DistributedDataParallel) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = False

    def on_after_outer_forward(self, wrapper_module: torch.nn.Module, original_module: pl.LightningModule) -> None:
        if isinstance(wrapper_module, DistributedDataParallel) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = True
