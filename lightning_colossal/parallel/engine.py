"""Hybrid 3D parallelism: tensor, pipeline, sequence and data parallelism (with ZeRO) on one model. No Lightning.

Set-up order (fixed, as torchtitan's): replicate weights from rank 0, split layers over the tensor-parallel ranks
and install sequence parallelism (the policy), recompute layers (activation checkpointing), cut the pipeline
stages, then, once the optimizer exists, attach data parallelism: a gradient averager (``zero_stage=0``) or the
ZeRO engine over the dp x sp ranks (``parallel/groups.py`` [Note: the gradient-reduction axis]).

[Note: names survive parallelisation]
Policies replace modules under their original attribute names and pipeline pruning replaces unused layers by
``nn.Identity`` (keeping indices) and drops the embedding/head attributes, so every parameter this rank still
holds has the name it had in the user's model. Checkpoints store each tensor-parallel shard as a DTensor of the
whole parameter under that name; DCP assembles and re-cuts them for any other layout.

[Note: tied weights across stages]
The embedding (first stage) and a tied LM head (last stage) are one parameter in the user's model and two copies
under pipelining. Their gradients are summed over the stages that hold them before the data-parallel reduction,
so both copies take identical steps. Optimizer state is saved under the parameter's first name (its canonical
name), which both copies share.

[Note: meta-device models]
A model built on the meta device (``Trainer.init_module(empty_init=True)``, or ``torch.device("meta")`` in
``configure_model``) is split and cut while it still has no storage, so each rank only ever materialises the
tensor-parallel pieces of the stages it runs. Their values come from the model's own initialiser, run over a
storage-free copy of the unsplit model in windows (``distributed/meta_init.py``): exactly the pieces of what that
initialiser gives the whole model from the same seed, whatever the layout.

[Note: fused shards are saved whole]
A fused parameter (GPT-2's ``c_attn``: q, k and v blocks, each split over the tensor-parallel ranks) is not one
contiguous piece of the whole tensor on any rank, and DCP only stores contiguous pieces (it rejects torch's
``_StridedShard``). Such parameters, and their ZeRO masters and optimizer state, are gathered into whole tensors
for a checkpoint. Loading fills those whole tensors in place, so the engine remembers (weakly: a saved state dict
must not stay alive) which local tensor each came from and cuts the loaded values back in ``restore_gathered``.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from lightning_colossal.config import HybridConfig, ZeroConfig
from lightning_colossal.distributed import collectives, sharded_state
from lightning_colossal.distributed.meta_init import has_meta_tensors, initialise_in_windows, materialise_in_place
from lightning_colossal.distributed.rows import ShardSpec
from lightning_colossal.distributed.sharded_state import ShardedMaster
from lightning_colossal.parallel.data_parallel import GradientAverager
from lightning_colossal.parallel.groups import HybridGroups, stage_tie_group
from lightning_colossal.parallel.pipeline import PipelineRunner, split_layers, stages_of_rank
from lightning_colossal.parallel.policy import ModelPolicy, ParallelPlan, check_tensor_parallel_regions
from lightning_colossal.parallel.tensor_parallel import (
    ParallelContext,
    TensorParallelPlacement,
    describe_shard,
    full_from_shards,
    local_view,
    piece_like,
    shard_of,
    vocab_sharded,
)
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
        self.device = device
        self.context = ParallelContext(
            tp_group=groups.tp_group,
            tp_mesh=groups.tp_mesh,
            sp_group=groups.sp_group,
            split_gather=config.sequence_parallel == "split_gather",
        )
        self._replicate_from_rank_zero()
        # [Note: meta-device models]: the unsplit structure, kept (storage-free) to run the model's own initialiser.
        template = copy.deepcopy(model) if has_meta_tensors(root) else None
        #: Every weight name of the whole model (pipeline ranks hold only some of them).
        self.whole_model_keys: list[str] = list(root.state_dict().keys())
        #: Position of each parameter (by canonical name) in the whole model's order.
        self.whole_parameter_order: dict[str, int] = {
            name: index for index, (name, _) in enumerate(root.named_parameters())
        }
        self.names_of: dict[int, list[str]] = _names_by_parameter(root)
        self.full_shapes: dict[int, torch.Size] = {
            key: _shape_of(root, names[0]) for key, names in self.names_of.items()
        }
        self.plan: ParallelPlan = policy.parallelize(model, self.context)
        #: DTensor parameters the user's own tensor parallelism shards (each rank holds a different piece).
        self.user_sharded: set[int] = {
            id(parameter)
            for parameter in root.parameters()
            if isinstance(parameter, DTensor) and any(placement.is_shard() for placement in parameter.placements)
        }
        self._rekey_after_replacement()
        # [Note: replicated parameters in tensor-parallel regions] (policy.py): a whole parameter left inside a
        # tensor-parallel region must be declared by the policy, or the model is refused here, before training.
        check_tensor_parallel_regions(model, self.plan)
        # One hook per parameter, however often a policy listed it: a second hook would sum the sum again.
        partial = {id(parameter): parameter for parameter in self.plan.partial_gradients}
        self._gradient_hooks = [
            parameter.register_hook(self._sum_over_tensor_parallel) for parameter in partial.values()
        ]
        if config.activation_checkpointing:
            policy.wrap_layers_for_recomputation(model)
        self.runner: PipelineRunner | None = None
        self.tied: list[nn.Parameter] = []
        self._tied_keys: set[int] = set()
        self.tie_group = None
        self.holds_first_stage = True
        # Whether the last stage returns this rank's vocabulary slice of the logits (a vocabulary-parallel head).
        self._stage_logits_sharded = False
        # Whole tensors handed out for fused parameters (see [Note: fused shards are saved whole]).
        self._gathered: list[tuple[weakref.ref[Tensor], Tensor, TensorParallelPlacement, ShardSpec | None]] = []
        if config.pp_size > 1:
            self._cut_pipeline(timeout)
        if template is not None:
            self._initialise_from(template)
        self.zero: ZeroEngine | None = None
        self.averager: GradientAverager | None = None
        self._blocked = False
        # The user's per-micro-batch loss and the factor (accumulation, loss scale) of the running pipeline step.
        self._loss_function: Callable[[Tensor, Any], Tensor] | None = None
        self._loss_multiplier = 1.0

    # ---------------------------------------------------------------------------------------------- set-up
    def _replicate_from_rank_zero(self) -> None:
        # Every rank must start from the same whole weights before taking its shard (as DDP broadcasts at wrap).
        with torch.no_grad():
            for tensor in [*self.root.parameters(), *self.root.buffers()]:
                if tensor.is_meta:
                    continue
                if isinstance(tensor, DTensor):
                    # Already split by the user's own tensor parallelism: the pieces differ over tp, so only the
                    # data-parallel copies of each piece are made equal.
                    if self.groups.reduce_group is not None:  # None: no data-parallel copies
                        collectives.broadcast_tensor(tensor.to_local(), source_rank=0, group=self.groups.reduce_group)
                else:
                    collectives.broadcast_tensor(tensor.data, source_rank=0)

    def _initialise_from(self, template: nn.Module) -> None:
        """Fill this rank's pieces of a meta-device model from the model's own initialiser (see [Note: meta-device
        models]): only the pieces this rank holds after splitting and pipeline cutting are ever materialised."""
        prefix = next(name for name, module in self.root.named_modules() if module is self.model)
        prefix = f"{prefix}." if prefix else ""
        live = {
            name: tensor
            for name, tensor in [
                *self.root.named_parameters(remove_duplicate=False),
                *self.root.named_buffers(remove_duplicate=False),
            ]
        }
        # Give the live tensors real (uninitialised) storage; tied names share one tensor, materialised once.
        materialised: dict[int, Tensor] = {}
        for tensor in live.values():
            if tensor.is_meta and id(tensor) not in materialised:
                materialise_in_place(tensor, self.device)
                materialised[id(tensor)] = tensor

        def held(names: list[str]) -> list[Tensor]:
            # A tied weight may survive pipeline pruning under any one of its names (the head on the last stage).
            found = {id(live[prefix + name]): live[prefix + name] for name in names if prefix + name in live}
            return [tensor for key, tensor in found.items() if key in materialised]

        def keep(names: list[str], whole: Tensor) -> None:
            for target in held(names):
                placement = self.plan.placements.get(id(target))
                piece = (
                    whole
                    if placement is None
                    else shard_of(whole, placement, self.context.tp_rank, self.context.tp_size)
                )
                target.data.copy_(piece)

        # Every rank must draw the same whole values to cut consistent pieces: start from rank 0's random state (the
        # eager path broadcasts rank 0's weights instead).
        state = torch.get_rng_state()
        collectives.broadcast_tensor(state, source_rank=0)
        torch.set_rng_state(state)
        if self.device.type == "cuda":
            cuda_state = torch.cuda.get_rng_state(self.device).to(self.device)
            collectives.broadcast_tensor(cuda_state, source_rank=0)
            torch.cuda.set_rng_state(cuda_state.cpu(), self.device)
        initialise_in_windows(
            template,
            lambda names: bool(held(names)),
            keep,
            self.device,
            self.config.init_window_bytes,
        )
        left = [name for name, tensor in live.items() if tensor.is_meta]
        if left:
            raise ValueError(
                f"{left[:5]} are on the meta device but outside the model the policy splits: build every module of the"
                " LightningModule inside that model, or on a real device."
            )

    def _rekey_after_replacement(self) -> None:
        """Policies created new parameters: re-read names, keep the whole shapes (see [Note: names survive...])."""
        old_shapes = dict(self.full_shapes)
        shapes_by_name = {names[0]: old_shapes[key] for key, names in self.names_of.items()}
        self.names_of = _names_by_parameter(self.root)
        self.full_shapes = {}
        for key, names in self.names_of.items():
            self.full_shapes[key] = shapes_by_name.get(names[0], _shape_of(self.root, names[0]))

    def _cut_pipeline(self, timeout: timedelta) -> None:
        config, groups = self.config, self.groups
        layers = self.policy.layers(self.model)
        ranges = split_layers(len(layers), config.num_stages, config.layers_per_stage)
        stage_indices = stages_of_rank(groups.pp_rank, groups.pp_size, config.num_model_chunks, config.pp_schedule)
        last = config.num_stages - 1
        modules = [
            self.policy.stage_module(self.model, list(ranges[index]), index == 0, index == last, self.context)
            for index in stage_indices
        ]
        keep = {layer for index in stage_indices for layer in ranges[index]}
        self.policy.prune(self.model, keep, first=0 in stage_indices, last=last in stage_indices)
        self._stage_logits_sharded = any(getattr(module, "vocab_parallel_output", False) for module in modules)
        self.holds_first_stage = 0 in stage_indices
        #: Pipeline rank running each stage.
        self.stage_holders = [
            stages_of_rank_holding(stage, groups.pp_size, config) for stage in range(config.num_stages)
        ]
        # The first and last stage's ranks (0 and S-1; both 0 under the V schedule) share the tied weights.
        holders = sorted({0, self.stage_holders[last]})
        self.tie_group = stage_tie_group(groups.mesh, holders, timeout) if len(holders) > 1 else None
        if self.tie_group is not None:
            # Parameters that had several names in the whole model and survived pruning on this rank.
            self.tied = [parameter for parameter in self.root.parameters() if len(self.names_of[id(parameter)]) > 1]
            self._tied_keys = {id(parameter) for parameter in self.tied}
        assert groups.pp_group is not None
        self.runner = PipelineRunner(
            modules,
            stage_indices,
            config.num_stages,
            groups.pp_group,
            self.device,
            config.pp_schedule,
            self._stage_loss,
        )

    def attach_optimizer(self, optimizer: Optimizer) -> None:
        """Data parallelism over dp x sp for the optimizer's parameters: averaging, or ZeRO-1/2."""
        config, groups = self.config, self.groups
        if config.zero_stage == 0:
            in_optimizer = [parameter for group in optimizer.param_groups for parameter in group["params"]]
            bucket_numel = max(1, int(config.bucket_size_mb * 2**20 / 4))
            self.averager = GradientAverager(in_optimizer, groups.reduce_group, bucket_numel)
            return
        if any(isinstance(parameter, DTensor) for parameter in self.root.parameters()):
            raise ValueError(
                f"zero_stage={config.zero_stage} with DTensor parameters (tensor parallelism your configure_model"
                " applied) is not supported: ZeRO shards plain tensors. Use zero_stage=0, or let the strategy split the"
                " model (a built-in policy or policy={'pattern': 'colwise' | 'rowwise'}) so ZeRO can shard it."
            )
        zero_config = ZeroConfig(stage=config.zero_stage, bucket_size_mb=config.bucket_size_mb)
        self.zero = ZeroEngine(
            self.root, optimizer, zero_config, groups.reduce_mesh, self.device, describe=self._describe_master
        )

    # ---------------------------------------------------------------------------------------------- gradients
    def _sum_over_tensor_parallel(self, gradient: Tensor) -> Tensor:
        # This rank's gradient covers only its sequence shard (split-gather) or its slice of the split heads/features
        # (a per-head norm): see ParallelPlan.partial_gradients.
        return collectives.sum_within_group(gradient.clone(), self.groups.tp_group)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """A non-final micro-batch of gradient accumulation: keep gradients local."""
        self._blocked = True
        context = self.zero.no_sync() if self.zero is not None else nullcontext()
        try:
            with context:
                yield
        finally:
            self._blocked = False

    def after_backward(self) -> None:
        """After the last backward of a step: tie stages, then average over data parallelism (ZeRO-1/2 reduced
        during backward already, except after a pipeline schedule)."""
        if self._blocked:
            return
        if self.tie_group is not None:
            for parameter in self.tied:
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
                collectives.sum_within_group(parameter.grad, self.tie_group)
        if self.averager is not None:
            self.averager.average()
        elif self.zero is not None and self.runner is not None:
            self.zero.reduce_now()

    def after_step(self, stepped: bool) -> None:
        if self.zero is not None:
            self.zero.after_step(stepped)

    # ---------------------------------------------------------------------------------------------- clipping
    def _counted_here(self, parameter_key: int, replicated_over_reduce: bool) -> bool:
        """Whether this rank adds a gradient's square to the global norm (each element counted exactly once)."""
        groups = self.groups
        split = parameter_key in self.plan.placements or parameter_key in self.user_sharded
        if not split and groups.tp_rank != 0:
            return False  # identical on every tensor-parallel rank
        if replicated_over_reduce and groups.reduce_rank != 0:
            return False  # identical on every data-parallel rank
        if parameter_key in self._tied_keys and not self.holds_first_stage:
            return False  # the first stage counts a weight tied across stages
        return True

    def _gradients_for_norm(self) -> tuple[list[Tensor], list[Tensor]]:
        """(every gradient the step uses, the ones this rank counts in the norm)."""
        if self.zero is not None:
            entries = [(entry, entry.master.grad) for entry in self.zero.sharded_masters]
            owner = {
                entry.name: member.parameter
                for entry, member in zip(self.zero.sharded_masters, self.zero.members, strict=True)
            }
            all_gradients = [gradient for _, gradient in entries if gradient is not None]
            counted = [
                gradient
                for entry, gradient in entries
                if gradient is not None
                and gradient.numel()
                and self._counted_here(id(owner[entry.name]), replicated_over_reduce=entry.spec.replicated)
            ]
            return all_gradients, counted
        assert self.averager is not None
        all_gradients = [
            local_view(parameter.grad) for parameter in self.averager.parameters if parameter.grad is not None
        ]
        counted = [
            local_view(parameter.grad)
            for parameter in self.averager.parameters
            if parameter.grad is not None and self._counted_here(id(parameter), replicated_over_reduce=True)
        ]
        return all_gradients, counted

    def clip_by_norm(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        """Clip by the L2 norm over every rank's gradients (tensor, pipeline and data parallel); returns the norm."""
        all_gradients, counted = self._gradients_for_norm()
        return sharded_state.scale_to_global_norm(all_gradients, counted, max_norm, None, self.device)

    def clip_by_value(self, optimizer: Optimizer, clip_value: float) -> None:
        for gradient in self._gradients_for_norm()[0]:
            gradient.clamp_(-clip_value, clip_value)

    # ---------------------------------------------------------------------------------------------- pipeline
    def _stage_loss(self, output: Tensor, target: Any) -> Tensor:
        """The user's loss on the last stage's output (runs inside ``_loss_context``)."""
        assert self._loss_function is not None
        if self._stage_logits_sharded and output.dim() >= 1:
            loss = self._loss_function(vocab_sharded(output, self.context), target)
            if isinstance(loss, DTensor):
                loss = loss.to_local()
        else:
            loss = self._loss_function(output, target)
        return loss * self._loss_multiplier

    def loss_context(self) -> Any:
        """``loss_parallel`` under tensor parallelism (vocabulary-sharded logits), for forward and backward alike."""
        if self.context.tp_size == 1:
            return nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def pipeline_step(
        self,
        inputs: Tensor | None,
        targets: Any,
        num_microbatches: int,
        loss_function: Callable[[Tensor, Any], Tensor],
        loss_multiplier: float,
    ) -> Tensor | None:
        """Forward and backward of every micro-batch; the mean loss on the rank holding the last stage.

        ``loss_multiplier`` scales each micro-batch loss before backward (loss scale / accumulation), not the result.
        """
        assert self.runner is not None
        self._loss_function = loss_function
        self._loss_multiplier = loss_multiplier
        context = self.zero.no_sync() if self.zero is not None else nullcontext()
        with context, self.loss_context():
            result = self.runner.train_step(inputs, targets, num_microbatches)
        return None if result.loss is None else result.loss / loss_multiplier

    def pipeline_evaluate(
        self, inputs: Tensor | None, targets: Any, num_microbatches: int, loss_function: Callable[[Tensor, Any], Tensor]
    ) -> Tensor | None:
        """Forward-only schedule; the mean loss over micro-batches on the rank holding the last stage."""
        assert self.runner is not None
        result = self.runner.evaluate(inputs, num_microbatches, self.stage_holders)
        if not self.runner.holds_last:
            return None
        self._loss_function = loss_function
        self._loss_multiplier = 1.0
        target_pieces = targets.chunk(num_microbatches) if isinstance(targets, Tensor) else [targets]
        with torch.no_grad(), self.loss_context():
            losses = [
                self._stage_loss(output, target) for output, target in zip(result.outputs, target_pieces, strict=True)
            ]
        return torch.stack(losses).mean()

    def pipeline_predict(self, inputs: Tensor | None, num_microbatches: int) -> Tensor | None:
        """Forward-only schedule; the whole batch's last-stage outputs (logits gathered over the vocabulary
        shards) on the rank holding the last stage, ``None`` elsewhere."""
        assert self.runner is not None
        result = self.runner.evaluate(inputs, num_microbatches, self.stage_holders)
        if not self.runner.holds_last:
            return None
        outputs = torch.cat(result.outputs)
        if self._stage_logits_sharded:
            outputs = collectives.gather_along(outputs.contiguous(), outputs.dim() - 1, self.context.tp_group)
        return outputs

    # ---------------------------------------------------------------------------------------------- checkpoints
    def whole_tensor_of(self, local: Tensor, key: int) -> Tensor:
        """``local`` (shaped like this rank's shard of parameter ``key``) as a piece of the whole tensor."""
        placement = self.plan.placements.get(key)
        if placement is None or self.context.tp_size == 1:
            return local
        if placement.fused_parts > 1:
            return self._gathered_whole(local, local, placement, None)
        return describe_shard(local, placement, self.groups.tp_mesh, self.full_shapes[key])

    def _gathered_whole(
        self, tensor_parallel_shard: Tensor, target: Tensor, placement: TensorParallelPlacement, spec: ShardSpec | None
    ) -> Tensor:
        """The whole tensor of a fused parameter's shard, remembered for ``restore_gathered``."""
        whole = full_from_shards(tensor_parallel_shard, placement, self.context.tp_group)
        self._gathered = [record for record in self._gathered if record[0]() is not None]
        self._gathered.append((weakref.ref(whole), target, placement, spec))
        return whole

    def restore_gathered(self) -> None:
        """After a checkpoint filled the whole tensors of fused parameters: cut them back into this rank's tensors."""
        with torch.no_grad():
            for reference, target, placement, spec in self._gathered:
                whole = reference()
                if whole is None:
                    continue
                piece = shard_of(whole, placement, self.context.tp_rank, self.context.tp_size)
                if spec is not None:
                    piece = sharded_state.owned_rows_of(piece, spec)
                target.copy_(piece)
        self._gathered = []

    def model_state(self) -> dict[str, Any]:
        """This rank's weights by the root's names, tensor-parallel shards as DTensors of the whole parameters."""
        state: dict[str, Any] = {}
        parameter_keys = {id(parameter) for parameter in self.root.parameters()}
        local_state = self.root.state_dict()
        for name, value in local_state.items():
            key = _key_of(self.root, name)
            state[name] = self.whole_tensor_of(value, key) if key in parameter_keys else value
        return state

    def full_weights(self) -> dict[str, Tensor]:
        """The whole model's weights by the root's names, as plain CPU copies, on every rank.

        Tensor-parallel shards are gathered over the tp ranks and the stages' weights merged over the pipeline ranks
        (collectives over both: every rank must call it). A weight tied across stages appears under each of its
        names, as in the unsplit model's ``state_dict``.
        """
        whole_by_key: dict[int, Tensor] = {}
        held: dict[str, Tensor] = {}
        with torch.no_grad():
            # Every tensor-parallel peer holds the same names in the same order, so the gathers pair up.
            for name, value in self.root.state_dict().items():
                key = _key_of(self.root, name)
                if key not in whole_by_key:
                    placement = self.plan.placements.get(key)
                    if isinstance(value, DTensor):
                        whole = value.full_tensor()
                    elif placement is not None:
                        whole = full_from_shards(value, placement, self.context.tp_group)
                    else:
                        whole = value
                    whole_by_key[key] = whole.detach().to("cpu", copy=True)
                # A tied weight pruned from this stage under one name is still held under the other.
                for alias in self.names_of.get(key, [name]):
                    held[alias] = whole_by_key[key]
        if self.groups.pp_group is not None and self.groups.pp_size > 1:
            for stage_weights in collectives.gather_objects(held, self.groups.pp_group):
                held.update(stage_weights)
        return {name: held[name] for name in self.whole_model_keys if name in held}

    def _describe_master(self, entry: ShardedMaster, value: Tensor) -> Tensor:
        """A ZeRO shard (rows over dp x sp) of a tensor-parallel shard as one DTensor of the whole parameter."""
        parameter = self.root.get_parameter(entry.name)
        placement = self.plan.placements.get(id(parameter))
        if placement is None or self.context.tp_size == 1:
            return sharded_state.as_global(value, entry.spec, self.groups.reduce_mesh)
        if entry.spec.replicated:
            return value
        if placement.fused_parts > 1:
            rows = sharded_state.as_global(value, entry.spec, self.groups.reduce_mesh)
            tensor_parallel_shard = rows.full_tensor() if isinstance(rows, DTensor) else rows
            return self._gathered_whole(tensor_parallel_shard, value, placement, entry.spec)
        # Mesh dims (tp, reduce): the tensor-parallel split is applied first, then the rows of that shard.
        return sharded_state.piece_of_whole(
            value, self.groups.describe_mesh, [Shard(placement.dim), Shard(0)], self.full_shapes[id(parameter)]
        )

    def load_full_weights(self, state_dict: Mapping[str, Tensor], strict: bool) -> None:
        """Copy whole weights (a full checkpoint, or a Hugging Face file) into this rank's shards."""
        own = self.root.state_dict()
        missing = [name for name in own if name not in state_dict]
        if strict and missing:
            raise RuntimeError(
                f"Missing keys {missing[:10]} when loading full weights into the hybrid model; set"
                " `self.strict_loading = False` in your LightningModule to load the matching weights only."
            )
        with torch.no_grad():
            for name, target in own.items():
                if name not in state_dict:
                    continue
                source = state_dict[name]
                placement = self.plan.placements.get(_key_of(self.root, name))
                if placement is not None:
                    source = shard_of(source, placement, self.context.tp_rank, self.context.tp_size)
                if isinstance(target, DTensor):
                    target.to_local().copy_(piece_like(source, target).to_local())
                else:
                    target.copy_(source)
        if self.zero is not None:
            self.zero.parameters_to_masters()

    def full_optimizer_state_to_local(self, state: dict[str, Any]) -> dict[str, Any]:
        """Cut whole optimizer-state tensors (from a full checkpoint) down to this rank's tensor-parallel shard."""
        for name, entries in state["state"].items():
            try:
                parameter = self.root.get_parameter(name)
            except AttributeError:
                continue
            placement = self.plan.placements.get(id(parameter))
            if isinstance(parameter, DTensor):
                for key, value in list(entries.items()):
                    if isinstance(value, Tensor) and not isinstance(value, DTensor) and value.shape == parameter.shape:
                        entries[key] = piece_like(value, parameter)
                continue
            if placement is None:
                continue
            for key, value in list(entries.items()):
                if (
                    isinstance(value, Tensor)
                    and not isinstance(value, DTensor)
                    and value.shape == self.full_shapes[id(parameter)]
                ):
                    entries[key] = shard_of(value, placement, self.context.tp_rank, self.context.tp_size).clone()
        return state

    def rename_optimizer_state(self, state: dict[str, Any], to_canonical: bool) -> dict[str, Any]:
        """Key optimizer state by canonical names (saving) or by this rank's names (loading); see [Note: tied
        weights across stages]."""
        local_to_canonical = {
            name: self.names_of.get(id(parameter), [name])[0] for name, parameter in self.root.named_parameters()
        }
        mapping = local_to_canonical if to_canonical else {value: key for key, value in local_to_canonical.items()}
        renamed = {mapping.get(name, name): entries for name, entries in state["state"].items()}
        groups = [
            {**group, "params": [mapping.get(name, name) for name in group["params"]]}
            for group in state["param_groups"]
        ]
        return {"state": renamed, "param_groups": groups}

    def whole_model_param_groups(self, param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Canonically named parameter groups of the whole model: every pipeline rank's names, merged in the whole
        model's order (a collective over the pipeline ranks). A checkpoint then lists every stage's parameters, so
        the consolidated file keeps every stage's optimizer state, and a full checkpoint maps onto any stage."""
        if self.groups.pp_group is None or self.groups.pp_size == 1:
            return param_groups
        gathered = collectives.gather_objects([group["params"] for group in param_groups], self.groups.pp_group)
        merged = []
        for index, group in enumerate(param_groups):
            names = {name for rank_groups in gathered for name in rank_groups[index]}
            merged.append({**group, "params": sorted(names, key=self.whole_parameter_order.__getitem__)})
        return merged

    def remove(self) -> None:
        for handle in self._gradient_hooks:
            handle.remove()
        self._gradient_hooks = []
        if self.zero is not None:
            self.zero.remove()


def stages_of_rank_holding(stage: int, pp_size: int, config: HybridConfig) -> int:
    """The pipeline rank that runs global stage ``stage`` (inverse of ``stages_of_rank``)."""
    for rank in range(pp_size):
        if stage in stages_of_rank(rank, pp_size, config.num_model_chunks, config.pp_schedule):
            return rank
    raise AssertionError(f"stage {stage} is on no rank")


def _names_by_parameter(root: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, parameter in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return names


def _shape_of(root: nn.Module, name: str) -> torch.Size:
    return root.get_parameter(name).shape


def _key_of(root: nn.Module, name: str) -> int:
    """``id`` of the parameter (or buffer) called ``name`` in ``root``."""
    module_name, _, attribute = name.rpartition(".")
    module = root.get_submodule(module_name) if module_name else root
    return id(getattr(module, attribute))
