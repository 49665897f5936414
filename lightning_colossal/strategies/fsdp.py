"""``colossal_fsdp`` / ``colossal_fsdp_offload``: torch FSDP2 as a strategy that runs on CPU and GPU.

Lightning's own ``FSDPStrategy`` refuses CPUs and cannot clip by norm; its ``ModelParallelStrategy`` makes the user
write the sharding. Here the strategy shards transformer blocks (detected, or named by ``wrap_policy``) and then
the LightningModule's parameter-holding children (``lightning_colossal.fsdp``, [Note: roots]), feeds FSDP's
mixed-precision policy from our precision plugin, and keeps the portable checkpoint format: DCP reads and writes
FSDP2's DTensor parameters and optimizer state directly, so checkpoints reshard and load into the other strategies.

[Note: what the module holds after a run]
Like Lightning's ``ddp``, the LightningModule holds ordinary full tensors (``torch.nn.Parameter``, on the CPU) after
``fit``/``validate``/``test``/``predict``: teardown gathers every shard and gives the module back unsharded (see
[Note: giving the module back] in ``lightning_colossal.fsdp.wrap``), so ``torch.save(model.state_dict())`` saves
whole weights and a second ``fit`` shards the module again. The optimizers are pointed at the plain parameters with
gathered state, so ``trainer.save_checkpoint`` after ``fit`` still works. That needs the whole model (and optimizer
state) in memory on every rank once per run; for a model too large for one rank pass ``keep_weights_sharded=True``:
the module then keeps FSDP's DTensor shards (``model.state_dict()`` holds DTensors; gather with ``.full_tensor()``
on every rank, or save with ``trainer.save_checkpoint`` and ``lightning_colossal.checkpoint.consolidate``), and a
later run with a new Trainer reuses those shards instead of sharding again.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_colossal.config import FSDPConfig
from lightning_colossal.distributed import collectives
from lightning_colossal.distributed.mesh import named_device_mesh
from lightning_colossal.engine_parts.meta_init import has_meta_tensors
from lightning_colossal.engine_parts.whole_parameters import whole_dtensor_parameters
from lightning_colossal.fsdp import (
    UnusedGradientTracker,
    detect_block_classes,
    drop_kept_buffers,
    include_unused_parameters_in_reduction,
    shard_model,
    sharded_roots,
)
from lightning_colossal.fsdp.initialise import DEFAULT_INIT_WINDOW_BYTES, initialise_shards, storage_free_template
from lightning_colossal.strategies.base import ColossalStrategy
from lightning_colossal.strategies.failures import explain_in_message
from lightning_colossal.strategies.optimizers import unwrap_optimizer
from lightning_colossal.strategies.plain_weights import give_back_plain_weights


class ColossalFSDPStrategy(ColossalStrategy):
    """Fully sharded data parallelism with torch FSDP2; registered as ``colossal_fsdp`` and ``colossal_fsdp_offload``.

    Args:
        wrap_policy: which modules to shard one by one (transformer blocks): a list of class names, or a predicate
            ``module -> bool``. ``None`` detects them: the classes a model names in ``_no_split_modules`` (Hugging
            Face models; the demo GPT declares its ``Block`` the same way).
    """

    argument_doc_sources = (FSDPConfig,)
    materialises_meta_models = True  # meta models are materialised per shard after fully_shard

    def __init__(
        self,
        wrap_policy: list[str] | Callable[[torch.nn.Module], bool] | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        activation_checkpointing: bool = False,
        replicate_size: int = 1,
        keep_weights_sharded: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.fsdp_config = FSDPConfig(
            wrap_policy=tuple(wrap_policy) if wrap_policy is not None and not callable(wrap_policy) else wrap_policy,
            reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload,
            activation_checkpointing=activation_checkpointing,
            replicate_size=replicate_size,
            keep_weights_sharded=keep_weights_sharded,
        )
        self._roots: list[FSDPModule] = []
        # Names of the module's parameters before sharding, by id: after a validate/test/predict run the optimizers
        # of an earlier fit hold those plain parameters, and teardown re-points them by name.
        self._names_before_sharding: dict[int, str] = {}
        self._run_failed = False
        # See [Note: gradients nobody produced, under FSDP2] in lightning_colossal.fsdp.gradients.
        self._gradient_tracker: UnusedGradientTracker | None = None
        self._gradient_sync_blocked = False

    @classmethod
    def registry_entries(cls) -> Iterable[tuple[str, dict[str, Any]]]:
        return [("colossal_fsdp", {"cpu_offload": False}), ("colossal_fsdp_offload", {"cpu_offload": True})]

    def _sharding_mesh(self) -> DeviceMesh:
        replicate_size = self.fsdp_config.replicate_size
        if self.world_size % replicate_size != 0:
            raise ValueError(
                f"replicate_size={replicate_size} does not divide the world size {self.world_size}: choose a"
                " divisor (e.g. the number of nodes)."
            )
        if replicate_size == 1:
            return self.device_mesh["dp"]
        # HSDP: a 2-D mesh (replicate, shard); fully_shard replicates over the first axis, shards over the second.
        shape = (replicate_size, self.world_size // replicate_size)
        return named_device_mesh(self.root_device.type, shape, ("replicate", "shard"), self._timeout)

    def _mixed_precision_policy(self) -> MixedPrecisionPolicy:
        # All-gather and compute in the plugin's compute dtype, reduce gradients in fp32 (autocast still decides
        # which ops need fp32 inside the forward).
        if self.precision_plugin.is_mixed:
            return MixedPrecisionPolicy(param_dtype=self.precision_plugin.compute_dtype, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    # ---------------------------------------------------------------------------------------------- set-up
    def parameter_pieces(self) -> str | None:
        return "only its FSDP shard of each parameter (a DTensor)"

    def setup(self, trainer: pl.Trainer) -> None:
        self._run_failed = False
        fitting = self._prepare_module(trainer)
        assert self.model is not None and self.lightning_module is not None
        if not self._roots:
            # A module an earlier run left sharded (keep_weights_sharded=True) keeps its shards.
            self._roots = sharded_roots(self.lightning_module) or self._shard(self.lightning_module)
        torch_reduces_unused = include_unused_parameters_in_reduction(self._roots)
        self._gradient_tracker = None
        if fitting:
            # After sharding: the optimizer must hold the DTensor parameters FSDP2 installed.
            self.setup_optimizers(trainer)
            self._gradient_tracker = self._track_unused_gradients(self.lightning_module, torch_reduces_unused)
        self.setup_precision_plugin()

    def _track_unused_gradients(self, module: torch.nn.Module, torch_reduces_unused: bool) -> UnusedGradientTracker:
        """lightning_colossal.fsdp.gradients [Note: gradients nobody produced, under FSDP2], voting on the host."""
        vote_group = collectives.host_group_like(None, self._timeout) if self.world_size > 1 else None
        return UnusedGradientTracker(module, torch_reduces_unused, vote_group=vote_group)

    def model_to_device(self) -> None:
        # Meta parameters (built for a model larger than one rank) are materialised after sharding, not moved.
        assert self.model is not None
        if not any(parameter.is_meta for parameter in self.model.parameters()):
            self.model.to(self.root_device)

    def _shard(self, module: pl.LightningModule) -> list[FSDPModule]:
        config = self.fsdp_config
        policy = config.wrap_policy
        if callable(policy):
            is_block = policy
        else:
            names = set(policy) if policy is not None else detect_block_classes(module)

            def is_block(candidate: torch.nn.Module) -> bool:
                return type(candidate).__name__ in names

        self._names_before_sharding = {id(parameter): name for name, parameter in module.named_parameters()}
        # [Note: FSDP meta initialisation]: the unsharded structure, storage-free, taken before sharding.
        template = storage_free_template(module) if has_meta_tensors(module) else None
        roots = shard_model(
            module,
            self._sharding_mesh(),
            is_block,
            reshard_after_forward=config.reshard_after_forward,
            mixed_precision=self._mixed_precision_policy(),
            cpu_offload=config.cpu_offload,
            activation_checkpointing=config.activation_checkpointing,
        )
        if template is not None:
            # Under CPU offload FSDP2 holds the parameter shards on the host and refuses them anywhere else.
            parameter_device = torch.device("cpu") if config.cpu_offload else None
            initialise_shards(module, template, self.root_device, DEFAULT_INIT_WINDOW_BYTES, parameter_device)
        return roots

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        for root in self._roots:
            root.set_requires_gradient_sync(False)
        self._gradient_sync_blocked = True
        try:
            yield
        finally:
            self._gradient_sync_blocked = False
            for root in self._roots:
                root.set_requires_gradient_sync(True)

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        tracker = self._gradient_tracker
        if tracker is not None:
            assert self.lightning_module is not None
            closure_loss = tracker.before_backward(closure_loss, self.lightning_module)
        output = super().backward(closure_loss, optimizer, *args, **kwargs)
        if tracker is not None and not self._gradient_sync_blocked:
            tracker.after_synchronising_backward()
        return output

    def grad_norm_limitation(self) -> str | None:
        return (
            "parameters' `.grad` are DTensor shards of this rank, so Lightning's `grad_norm(module)` fails in its"
            " `torch.tensor(...)` of the norms, which cannot read a DTensor"
        )

    @contextmanager
    def whole_parameters(self) -> Generator[None, None, None]:
        assert self.lightning_module is not None
        with whole_dtensor_parameters(self.lightning_module):
            yield

    def _annotate_failure(self, exception: BaseException) -> None:
        super()._annotate_failure(exception)
        if isinstance(exception, RuntimeError) and "mixed torch.Tensor and DTensor" in str(exception):
            explain_in_message(
                exception,
                "colossal_fsdp: outside a forward, each parameter is a DTensor shard of this rank. For a loss term"
                " over the parameters themselves (an L2 penalty, a regulariser) compute it inside `with"
                " self.trainer.strategy.whole_parameters():` in training_step, on every rank; its gradient is exact, as"
                " under Lightning's ddp.",
            )
        if isinstance(exception, RuntimeError) and "data is not allocated yet" in str(exception):
            # What torch says when Lightning's grad_norm(module) reads DTensor gradients (see grad_norm_limitation).
            explain_in_message(exception, self._grad_norm_limitation_message())

    def on_exception(self, exception: BaseException) -> None:
        # Teardown follows; after a failure other ranks may never reach its collectives, so it must not gather.
        self._run_failed = True

    def teardown(self) -> None:
        self._gradient_tracker = None  # it holds this run's sharded parameters
        drop_kept_buffers()  # the exchanges' buffers kept between gathers
        if (
            self.fsdp_config.keep_weights_sharded
            or self._run_failed
            or not self._roots
            or self.lightning_module is None
        ):
            # Skip the base teardown's .cpu() on sharded parameters (as Lightning's FSDP strategies do), but not
            # its wait for the checkpoint still being written in the background, first, while the watchdog runs.
            assert self.cluster_environment is not None and self.accelerator is not None
            error = self._finish_background_save(self._failure_being_torn_down())
            self._finish_watchdog()
            self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            self.accelerator.teardown()
            if error is not None:
                raise error
            return
        # Unshard into full plain parameters and point the optimizers at them (a collective).
        give_back_plain_weights(self.lightning_module, self.optimizers, self._names_before_sharding)
        self._roots = []
        # The module is an ordinary one again: the base teardown moves it (and the optimizers) to the CPU.
        super().teardown()

    # ---------------------------------------------------------------------------------------------- checkpoints
    def _load_full_model_state(self, state_dict: Mapping[str, Tensor], strict: bool) -> None:
        assert self.lightning_module is not None
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_model_state_dict(self.lightning_module, dict(state_dict), options=options)

    def _load_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        assert self.lightning_module is not None
        tensors = [value for entry in state["state"].values() for value in entry.values() if isinstance(value, Tensor)]
        # A plain (single-file) checkpoint brings full tensors; a sharded one DTensors already loaded in place.
        full = any(not isinstance(value, DTensor) and value.dim() > 0 for value in tensors)
        # strict=False: a parameter no gradient has reached has no state in the checkpoint (checkpointing.py).
        options = StateDictOptions(full_state_dict=full, strict=False)
        set_optimizer_state_dict(self.lightning_module, unwrap_optimizer(optimizer), state, options=options)
