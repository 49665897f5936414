"""Hybrid 3D parallelism: tensor, pipeline, sequence and data parallelism (with ZeRO) on one model. No Lightning.

The engine applies the techniques in one fixed order (``HybridEngine._parallelize``) and composes the parts that
result, each owned by its own module:

- ``names.py``: the whole model's names and shapes, read before splitting ([Note: names survive parallelisation]);
- the policy (``policy.py``, ``policies.py`` and the per-model policies): tensor and sequence parallelism;
- ``initial_weights.py``: the weights every rank starts from ([Note: meta-device models]);
- ``pipeline.py``: this rank's stages and the schedule's steps, only when ``pp_size > 1`` ([Note: tied weights
  across stages]);
- the data-parallel part, ``data_parallel.py``'s averager or the ZeRO engine (both offer the same methods): the
  reduction over the dp x sp ranks (``groups.py`` [Note: the gradient-reduction axis]), attached once the optimizer
  exists;
- ``checkpoint_view.py``: weights and optimizer state as checkpoints see them ([Note: fused shards are saved whole]).

The engine itself keeps what spans the parts: the gradient sums over the tensor-parallel ranks, the hooks a training
loop calls around backward and the optimizer step, and clipping by a norm that counts every element once.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_colossal.config import HybridConfig, ZeroConfig
from lightning_colossal.distributed import collectives
from lightning_colossal.engine_parts import sharded_state
from lightning_colossal.engine_parts.meta_init import has_meta_tensors
from lightning_colossal.parallel.checkpoint_view import CheckpointView
from lightning_colossal.parallel.data_parallel import GradientAverager
from lightning_colossal.parallel.experts import ExpertGradientAverager, ExpertShards, parallelize_experts
from lightning_colossal.parallel.groups import HybridGroups, build_expert_groups
from lightning_colossal.parallel.initial_weights import initialise_from_template, replicate_from_rank_zero
from lightning_colossal.parallel.names import ParameterNames
from lightning_colossal.parallel.pipeline import PipelineStep
from lightning_colossal.parallel.policy import ModelPolicy, ParallelPlan, check_tensor_parallel_regions
from lightning_colossal.parallel.tensor_parallel import ParallelContext, VocabParallelHead, loss_context
from lightning_colossal.zero import ZeroEngine


class HybridEngine:
    """Parallelises ``model`` (a submodule of ``root``) in place and runs its gradient and step bookkeeping.

    Args:
        root: the module whose parameter names checkpoints use (the LightningModule).
        model: the model the policy knows (``root`` itself or one of its submodules).
        policy: the model's policy.
        config: hybrid settings.
        groups: process groups from ``groups.build_groups``.
        device: where the model computes.
        timeout: timeout of the extra groups created here.
    """

    def __init__(
        self,
        root: nn.Module,
        model: nn.Module,
        policy: ModelPolicy,
        config: HybridConfig,
        groups: HybridGroups,
        device: torch.device,
        timeout: timedelta,
    ) -> None:
        self.root, self.model, self.policy, self.config, self.groups = root, model, policy, config, groups
        self._vocabulary_heads: list[VocabParallelHead] | None = None  # found on first use by ``whole_logits``
        self.device = device
        self.context = ParallelContext(
            tp_group=groups.tp_group,
            tp_mesh=groups.tp_mesh,
            sp_group=groups.sp_group,
            sequence=config.sequence_parallelism,  # the typed mode, carried as it is to the policies
        )
        #: The pipeline part (``pp_size > 1`` only).
        self.pipeline: PipelineStep | None = None
        #: The data-parallel part, set by ``attach_optimizer``: an averager (``zero_stage=0``) or a ZeRO engine. It
        #: holds the optimizer, whose state it saves and loads by name.
        self.data_parallel: GradientAverager | ZeroEngine | None = None
        self._blocked = False
        #: Expert parallelism's slices (``ep_size > 1`` only) and the reduction of their gradients (``attach_optimizer``).
        self.experts: ExpertShards | None = None
        self.expert_gradients: ExpertGradientAverager | None = None
        self._parallelize(timeout)
        self.checkpoint_view = CheckpointView(root, self.plan, self.context, groups, self.names, experts=self.experts)

    # ---------------------------------------------------------------------------------------------- set-up
    def _parallelize(self, timeout: timedelta) -> None:
        """Apply the techniques in one fixed order (torchtitan's); data parallelism follows in ``attach_optimizer``."""
        root, model, config = self.root, self.model, self.config
        # 0. Every rank starts from rank 0's weights; a meta-device model keeps an unsplit, storage-free copy to run
        #    its own initialiser over once the pieces are known ([Note: meta-device models]). Names and whole shapes
        #    are read while the model is still whole ([Note: names survive parallelisation]).
        replicate_from_rank_zero(root, self.groups.reduce_group)
        template = copy.deepcopy(model) if has_meta_tensors(root) else None
        self.names = ParameterNames.of_whole_model(root)
        # 1-2. Tensor and sequence parallelism: the policy splits layers in place and installs sequence parallelism.
        self.plan: ParallelPlan = self.policy.parallelize(model, self.context)
        # 2b. Expert parallelism: this rank keeps its experts and exchanges routed tokens with its ep peers
        #     (experts.py, [Note: expert-parallel groups] in groups.py); new parameters, so before the rekeying below.
        if config.expert_parallelism is not None:
            if template is not None:
                raise ValueError(
                    f"ep_size={config.ep_size} with a model built on the meta device is not supported yet: build the"
                    " model eagerly (each rank keeps only its experts once split), or use ep_size=1."
                )
            self.groups.experts = build_expert_groups(self.groups.mesh, config.ep_size, timeout)
            self.experts = parallelize_experts(model, self.groups.experts)
            self.plan.attached.extend(self.experts.attached)
        #: DTensor parameters the user's own tensor parallelism shards (each rank holds a different piece).
        self.user_sharded: set[int] = {
            id(parameter)
            for parameter in root.parameters()
            if isinstance(parameter, DTensor) and any(placement.is_shard() for placement in parameter.placements)
        }
        self.names.rekey_after_replacement(root)
        # [Note: replicated parameters in tensor-parallel regions] (policy.py): a whole parameter left inside a
        # tensor-parallel region must be declared by the policy, or the model is refused before its first optimizer
        # step; which parameters run inside one, the first forward shows (regions.py [Note: regions by the order
        # modules run]), and ``after_backward`` settles it.
        check_tensor_parallel_regions(model, self.plan)
        if self.plan.region_trace is not None and config.pipeline is not None:
            self.plan.region_trace.refuse_without_trace(
                "Pipeline stages run the layers without the model's forward, so the order modules run is not"
                " watched, and nesting alone puts them in the region."
            )
        # One hook per parameter, however often a policy listed it: a second hook would sum the sum again.
        partial = {id(parameter): parameter for parameter in self.plan.partial_gradients}
        self._gradient_hooks = [
            parameter.register_hook(self._sum_over_tensor_parallel) for parameter in partial.values()
        ]
        # 3. Activation checkpointing: each layer recomputes its activations in backward.
        if config.activation_checkpointing:
            self.plan.attached.extend(self.policy.wrap_layers_for_recomputation(model))
        # 4. Pipeline split: this rank keeps its stages' layers, the rest is pruned.
        if config.pipeline is not None:
            self.pipeline = PipelineStep(
                root,
                model,
                self.policy,
                config.pipeline,
                self.groups,
                self.context,
                self.names,
                self.device,
                timeout,
                reduction_deferred=self._reduction_deferred,
            )
        # Only the pieces this rank kept get storage and values.
        if template is not None:
            initialise_from_template(
                root, model, template, self.plan, self.context, self.device, config.init_window_bytes
            )
        # 5. Data parallelism (averaging or ZeRO over dp x sp): ``attach_optimizer``, once the optimizer exists.

    def attach_optimizer(self, optimizer: Optimizer) -> None:
        """Data parallelism over dp x sp for the optimizer's parameters: averaging, or ZeRO-1/2. Replaces the one an
        earlier optimizer had (a second ``fit``)."""
        self.detach_optimizer()
        settings, groups = self.config.data_parallel, self.groups
        if not isinstance(settings, ZeroConfig):
            self.data_parallel = GradientAverager(
                optimizer, groups.reduce_group, settings, self.checkpoint_view, excluded=self._expert_keys()
            )
            if self.experts is not None:
                self.expert_gradients = ExpertGradientAverager(self.experts, self.data_parallel.all_parameters)
            return
        if any(isinstance(parameter, DTensor) for parameter in self.root.parameters()):
            raise ValueError(
                f"zero_stage={settings.stage} with DTensor parameters (tensor parallelism your configure_model"
                " applied) is not supported: ZeRO shards plain tensors. Use zero_stage=0, or let the strategy split the"
                " model (a built-in policy or policy={'pattern': 'colwise' | 'rowwise'}) so ZeRO can shard it."
            )
        if self.experts is not None:  # before ZeRO swaps the optimizer's other parameters for their masters
            self.expert_gradients = ExpertGradientAverager(
                self.experts, [parameter for group in optimizer.param_groups for parameter in group["params"]]
            )
        # Expert slices differ between the dp ranks: ZeRO leaves them whole, the expert averager reduces them.
        self.data_parallel = ZeroEngine(
            self.root,
            optimizer,
            settings,
            groups.reduce_mesh,
            self.device,
            describe=self.checkpoint_view.describe_master,
            kept_whole=self._expert_keys(),
        )

    def detach_optimizer(self) -> None:
        """Drop the data-parallel part of an earlier optimizer. Its ZeRO gradient hooks go first: left on the
        parameters, they would reduce every later gradient a second time, into the old engine's buffers."""
        self.stop_reducing()
        self.data_parallel = None
        self.expert_gradients = None

    def stop_reducing(self) -> None:
        """End of a run: remove the ZeRO gradient hooks, keeping its shards, which a checkpoint saved after the run
        (``trainer.save_checkpoint`` after ``fit``) still describes."""
        if self.data_parallel is not None:
            self.data_parallel.remove()

    def remove(self) -> None:
        """Remove every hook the engine installed (the model keeps its split form)."""
        for handle in self._gradient_hooks:
            handle.remove()
        self._gradient_hooks = []
        if self.plan.region_trace is not None:
            self.plan.region_trace.remove()
        self.stop_reducing()

    # ---------------------------------------------------------------------------------------------- gradients
    def _sum_over_tensor_parallel(self, gradient: Tensor) -> Tensor:
        # This rank's gradient covers only its sequence shard (split-gather) or its slice of the split heads/features
        # (a per-head norm): see ParallelPlan.partial_gradients.
        return collectives.sum_within_group(gradient.clone(), self.groups.tp_group)

    def _reduction_deferred(self) -> AbstractContextManager[Any]:
        # ZeRO reduces in backward hooks; a pipeline schedule runs backward per micro-batch, so it reduces after.
        return self.data_parallel.no_sync() if self.data_parallel is not None else nullcontext()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """A non-final micro-batch of gradient accumulation: keep gradients local."""
        self._blocked = True
        try:
            with self._reduction_deferred():
                yield
        finally:
            self._blocked = False

    def after_backward(self) -> None:
        """After the last backward of a step: tie stages, then reduce over data parallelism (ZeRO-1/2 reduced
        during backward already, except after a pipeline schedule, which ran backward inside ``no_sync``).
        The first one also settles the region check (before any optimizer step)."""
        trace, self.plan.region_trace = self.plan.region_trace, None
        if trace is not None:
            trace.settle()
        if self._blocked:
            return
        if self.pipeline is not None:
            self.pipeline.sum_tied_gradients()
        if self.expert_gradients is not None:
            self.expert_gradients.average()
        if self.data_parallel is not None:
            self.data_parallel.after_backward(reduction_deferred=self.pipeline is not None)

    def step_optimizer(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """``optimizer.step(**kwargs)``, through the data-parallel part (ZeRO's disk tier streams its state)."""
        if self.data_parallel is None:
            return optimizer.step(**kwargs)
        return self.data_parallel.step_optimizer(optimizer, **kwargs)

    def close_disk_tier(self) -> None:
        if self.data_parallel is not None:
            self.data_parallel.close_disk_tier()

    def release_checkpoint_copies(self) -> None:
        if self.data_parallel is not None:
            self.data_parallel.release_checkpoint_copies()

    def after_step(self, stepped: bool) -> None:
        if self.data_parallel is not None:
            self.data_parallel.after_step(stepped)

    def loss_context(self) -> AbstractContextManager[Any]:
        """``loss_parallel`` under tensor parallelism (vocabulary-sharded logits), for forward and backward alike."""
        return loss_context(self.context)

    @contextmanager
    def whole_logits(self) -> Iterator[None]:
        """Inside: vocabulary-parallel heads return whole plain logits (``VocabParallelHead.whole_output``)."""
        if self._vocabulary_heads is None:  # the model's layers are fixed once it is parallelised
            self._vocabulary_heads = [
                module for module in self.model.modules() if isinstance(module, VocabParallelHead)
            ]
        heads = self._vocabulary_heads
        for head in heads:
            head.whole_output = True
        try:
            yield
        finally:
            for head in heads:
                head.whole_output = False

    # ---------------------------------------------------------------------------------------------- clipping
    def _counted_here(self, parameter_key: int, replicated_over_reduce: bool) -> bool:
        """Whether this rank adds a gradient's square to the global norm (each element counted exactly once)."""
        groups = self.groups
        split = parameter_key in self.plan.placements or parameter_key in self.user_sharded
        if not split and groups.tp_rank != 0:
            return False  # identical on every tensor-parallel rank
        if replicated_over_reduce and groups.reduce_rank != 0:
            return False  # identical on every data-parallel rank
        return self.pipeline is None or self.pipeline.counts_in_norm(parameter_key)

    def _gradients_for_norm(self) -> tuple[list[Tensor], list[Tensor]]:
        """(every gradient the step uses, the ones this rank counts in the norm)."""
        reduced = self._data_parallel_part().reduced_gradients()
        counted = [
            piece.gradient
            for piece in reduced
            if piece.gradient.numel()
            and self._counted_here(id(piece.parameter), replicated_over_reduce=piece.replicated)
        ]
        if self.expert_gradients is None:
            return [piece.gradient for piece in reduced], counted
        # Expert slices differ between ep ranks and repeat over the expert-data group: its first rank counts them.
        experts = self.expert_gradients.gradients()
        if self.expert_gradients.groups.expert_data_rank == 0:
            counted += [gradient for gradient in experts if gradient.numel()]
        return [piece.gradient for piece in reduced] + experts, counted

    def clip_by_norm(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        """Clip by the L2 norm over every rank's gradients (tensor, pipeline and data parallel); returns the norm."""
        all_gradients, counted = self._gradients_for_norm()
        return sharded_state.scale_to_global_norm(all_gradients, counted, max_norm, None, self.device)

    def gradient_norm(self, optimizer: Optimizer, norm_type: float) -> Tensor:
        """The norm over every rank's gradients (tensor, pipeline and data parallel; one scalar all-reduce)."""
        return sharded_state.global_norm(self._gradients_for_norm()[1], None, self.device, norm_type)

    def clip_by_value(self, optimizer: Optimizer, clip_value: float) -> None:
        for gradient in self._gradients_for_norm()[0]:
            gradient.clamp_(-clip_value, clip_value)

    # ---------------------------------------------------------------------------------------------- checkpoints
    def model_state_for_checkpoint(self) -> dict[str, Any]:
        """This rank's weights as a checkpoint stores them (``CheckpointView.model_state``); under ZeRO with
        low-precision parameters, the fp32 masters instead of their working copies."""
        state = self.checkpoint_view.model_state()
        return state if self.data_parallel is None else self.data_parallel.with_precise_masters(state)

    def after_model_state_loaded(self) -> None:
        """A checkpoint filled ``model_state_for_checkpoint()`` in place: cut fused tensors back, re-sync ZeRO."""
        self.checkpoint_view.restore_gathered()
        if self.data_parallel is not None:
            self.data_parallel.resync_after_model_state_loaded()

    def load_full_weights(self, state_dict: Mapping[str, Tensor], strict: bool) -> None:
        """Copy whole weights (a full checkpoint, or a Hugging Face file) into this rank's shards (and masters)."""
        self.checkpoint_view.load_full_weights(state_dict, strict)
        if self.data_parallel is not None:
            self.data_parallel.parameters_to_masters()

    def full_weights(self) -> dict[str, Tensor]:
        """The whole model's weights as plain CPU tensors on every rank (``CheckpointView.full_weights``)."""
        return self.checkpoint_view.full_weights()

    def optimizer_state_by_name(self) -> dict[str, Any]:
        """The attached optimizer's state keyed by canonical names, its groups listing the whole model's parameters
        (a collective over the pipeline ranks)."""
        return self.checkpoint_view.canonical_optimizer_state(self._data_parallel_part().optimizer_state_by_name())

    def load_optimizer_state_by_name(self, loaded: dict[str, Any]) -> None:
        """Load a state ``optimizer_state_by_name`` saved (under any layout) into the attached optimizer."""
        self._data_parallel_part().load_optimizer_state_by_name(self.checkpoint_view.local_optimizer_state(loaded))

    def _expert_keys(self) -> frozenset[int]:
        """The expert parameters (``ep_size > 1``), which the expert-data group reduces instead of dp x sp."""
        return frozenset() if self.experts is None else frozenset(self.experts.slices)

    def _data_parallel_part(self) -> GradientAverager | ZeroEngine:
        assert self.data_parallel is not None, (
            "the data-parallel part exists once `attach_optimizer` took the optimizer"
        )
        return self.data_parallel
