"""``colossal_hybrid``: tensor, pipeline, sequence and data parallelism (ZeRO on the data axis) in one strategy.

The engine (``lightning_colossal.parallel``) parallelises the model a policy knows; this adapter wires it into
Lightning: groups from the strategy's device mesh, the sampler over the data-parallel axis only, ``loss_parallel``
around every step under tensor parallelism, the sequence split under Ulysses, and with ``pp_size > 1`` the
pipeline schedule in place of ``training_step`` (see ``docs/hybrid.md``, "LightningModules for pipelines").
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_colossal.config import (
    DEFAULT_COLLECTIVE_TIMEOUT,
    DEFAULT_HEARTBEAT_TIMEOUT,
    HybridConfig,
    LossScalerConfig,
    NonFiniteAction,
    PipelineSchedule,
    SequenceParallelMode,
    StartMethod,
)
from lightning_colossal.distributed import ParallelDims, collectives
from lightning_colossal.parallel import HybridEngine, ModelPolicy, build_groups, find_policy
from lightning_colossal.parallel.pipeline import broadcast_from_last_stage, microbatch_count
from lightning_colossal.strategies.base import ColossalStrategy, _unwrap_optimizer


class HybridParallelStrategy(ColossalStrategy):
    """Hybrid 3D parallelism; registered as ``colossal_hybrid`` (and ``colossal_hybrid_notebook``).

    Args:
        policy: which parts of the model to split: ``None`` picks a built-in policy (demo GPT, Hugging Face models
            with a ``base_model_tp_plan``, GPT-2, BERT; or keeps DTensor tensor parallelism ``configure_model``
            applied), a ``dict`` is a user plan (module pattern -> ``"colwise"`` or ``"rowwise"``), or a
            ``ModelPolicy`` instance.
    """

    strategy_name = "colossal_hybrid"
    argument_doc_sources = (HybridConfig,)
    materialises_meta_models = True  # the engine splits a meta model first (engine.py [Note: meta-device models])

    def __init__(
        self,
        tp_size: int = 1,
        pp_size: int = 1,
        sp_size: int = 1,
        zero_stage: int = 0,
        sequence_parallel: SequenceParallelMode | None = None,
        pp_schedule: PipelineSchedule = "1f1b",
        num_microbatches: int | None = None,
        microbatch_size: int | None = None,
        num_model_chunks: int = 1,
        layers_per_stage: list[int] | None = None,
        activation_checkpointing: bool = False,
        bucket_size_mb: float = 25.0,
        init_window_bytes: int = 2**30,
        policy: ModelPolicy | dict[str, str] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = DEFAULT_COLLECTIVE_TIMEOUT,
        start_method: StartMethod = "popen",
        loss_scaler: LossScalerConfig | None = None,
        heartbeat_timeout: timedelta | None = DEFAULT_HEARTBEAT_TIMEOUT,
        on_nonfinite: NonFiniteAction | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            loss_scaler=loss_scaler,
            heartbeat_timeout=heartbeat_timeout,
            on_nonfinite=on_nonfinite,
        )
        self.hybrid_config = HybridConfig(
            tp_size=tp_size,
            pp_size=pp_size,
            sp_size=sp_size,
            zero_stage=zero_stage,
            sequence_parallel=sequence_parallel,
            pp_schedule=pp_schedule,
            num_microbatches=num_microbatches,
            microbatch_size=microbatch_size,
            num_model_chunks=num_model_chunks,
            layers_per_stage=tuple(layers_per_stage) if layers_per_stage is not None else None,
            activation_checkpointing=activation_checkpointing,
            bucket_size_mb=bucket_size_mb,
            init_window_bytes=init_window_bytes,
        )
        self.policy = policy
        self.engine: HybridEngine | None = None
        self._stashed_gradients: list[tuple[torch.nn.Parameter, Tensor]] = []

    def _build_parallel_dims(self) -> ParallelDims:
        config = self.hybrid_config
        return ParallelDims(world_size=self.world_size, tp=config.tp_size, pp=config.pp_size, sp=config.sp_size)

    @property
    def pipelined(self) -> bool:
        return self.hybrid_config.pp_size > 1

    # ---------------------------------------------------------------------------------------------- set-up
    def setup(self, trainer: pl.Trainer) -> None:
        fitting = self._prepare_module(trainer)
        assert self.model is not None and self.lightning_module is not None
        if self.engine is None:
            config = self.hybrid_config
            model_parallel = config.model_parallel_size > 1
            _refuse_module_split_by_an_earlier_run(self.lightning_module)
            model, policy = find_policy(self.lightning_module, self.policy, model_parallel=model_parallel)
            if self.pipelined and not callable(getattr(self.lightning_module, "pipeline_loss", None)):
                raise TypeError(
                    f"pp_size={config.pp_size}: the strategy runs the pipeline schedule in place of"
                    " `training_step`, so the LightningModule must define `pipeline_loss(self, outputs, targets)`"
                    " returning the mean loss of one micro-batch (see docs/hybrid.md)."
                )
            self.engine = HybridEngine(
                self.lightning_module,
                model,
                policy,
                self.hybrid_config,
                build_groups(self.device_mesh, self._timeout),
                self.root_device,
                self._timeout,
            )
            if model_parallel:
                self.lightning_module.__dict__[_SPLIT_MARKER] = True
        if fitting:
            optimizer = self._setup_single_optimizer(
                trainer,
                manual_reason="the strategy owns when gradients are reduced and, with pipelines, runs backward itself",
                manual_alternatives="`colossal_ddp`",
            )
            self.engine.attach_optimizer(optimizer)
        self.setup_precision_plugin()
        self.precision_plugin.gradient_clipper = self.engine
        _log_plain_values(self.lightning_module)

    def teardown(self) -> None:
        if self.lightning_module is not None:
            _stop_logging_plain_values(self.lightning_module)
        super().teardown()

    # ---------------------------------------------------------------------------------------------- steps
    def _step_context(self) -> Any:
        # Vocabulary-sharded logits: cross-entropy without gathering them (VocabParallelHead).
        assert self.engine is not None
        return self.engine.loss_context()

    def _split_sequence(self, batch: Any) -> Any:
        """Ulysses: each sequence-parallel rank takes its slice of every ``[batch, sequence, ...]`` tensor."""
        sp_size = self.hybrid_config.sp_size
        if sp_size == 1:
            return batch
        rank = self.device_mesh["sp"].get_local_rank()

        def split(tensor: Tensor) -> Tensor:
            if tensor.dim() < 2:
                return tensor
            if tensor.shape[1] % sp_size != 0:
                raise ValueError(
                    f"Sequence parallelism splits dim 1 of every batch tensor over sp_size={sp_size} ranks, but a batch"
                    f" tensor has shape {tuple(tensor.shape)}: use a sequence length divisible by {sp_size}."
                )
            return tensor.chunk(sp_size, dim=1)[rank]

        return apply_to_collection(batch, Tensor, split)

    def _with_split_batch(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (self._split_sequence(args[0]), *args[1:]) if args else args

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        args = self._with_split_batch(args)
        if self.pipelined:
            return self._pipeline_training_step(args[0], args[1] if len(args) > 1 else kwargs.get("batch_idx", 0))
        with self._step_context():
            return _plain(super().training_step(*args, **kwargs))

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        args = self._with_split_batch(args)
        if self.pipelined:
            return self._pipeline_evaluation_step(args[0])
        with self._step_context():
            return _plain(super().validation_step(*args, **kwargs))

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        args = self._with_split_batch(args)
        if self.pipelined:
            return self._pipeline_evaluation_step(args[0])
        with self._step_context():
            return _plain(super().test_step(*args, **kwargs))

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        args = self._with_split_batch(args)
        if self.pipelined:
            return self._pipeline_prediction_step(args[0])
        with self._step_context():
            return _plain(super().predict_step(*args, **kwargs))

    def _pipeline_inputs(self, batch: Any, targets_required: bool = True) -> tuple[Tensor, Any]:
        if isinstance(batch, (tuple, list)) and (len(batch) == 2 or (batch and not targets_required)):
            return batch[0], batch[1] if len(batch) > 1 else None
        if isinstance(batch, Mapping) and "input_ids" in batch and ("labels" in batch or not targets_required):
            mask = batch.get("attention_mask")
            # Stages receive token ids only. Right padding is harmless under causal attention (no real token attends
            # to a later pad; give pads the label -100); padding before real tokens would be attended silently.
            if isinstance(mask, Tensor) and mask.dim() == 2 and bool((mask[:, 1:] > mask[:, :-1]).any()):
                raise ValueError(
                    "With pp_size > 1 the pipeline stages get no attention_mask, but this batch has padding before real"
                    " tokens (left padding): pad on the right (tokenizer.padding_side = 'right', labels -100 on the"
                    " pads) or pack sequences without padding."
                )
            return batch["input_ids"], batch.get("labels")
        raise TypeError(
            "With pp_size > 1 a batch must be an (inputs, targets) pair or a dict with 'input_ids' and 'labels': the"
            " first stage reads the inputs and the last stage passes the targets to `pipeline_loss`."
        )

    def _pipeline_split(self, batch: Any, targets_required: bool = True) -> tuple[Tensor, Any, int]:
        """(inputs, targets, micro-batch count) of a pipeline batch; a bare tensor is inputs only."""
        if isinstance(batch, Tensor) and not targets_required:
            inputs, targets = batch, None
        else:
            inputs, targets = self._pipeline_inputs(batch, targets_required)
        config = self.hybrid_config
        return inputs, targets, microbatch_count(inputs.shape[0], config.num_microbatches, config.microbatch_size)

    def _pipeline_training_step(self, batch: Any, batch_index: int) -> Tensor:
        assert self.engine is not None and self.lightning_module is not None
        inputs, targets, num_microbatches = self._pipeline_split(batch)
        trainer = self.lightning_module.trainer
        if batch_index % trainer.accumulate_grad_batches == 0:
            # First batch of an accumulation window: Lightning zeroes gradients only after `training_step`, too late
            # for a schedule that already ran backward, so the previous step's gradients are dropped here.
            for parameter in self.lightning_module.parameters():
                parameter.grad = None
        # Lightning divides the loss by accumulate_grad_batches before its backward; the schedule's backward runs
        # here, so the division (and fp16 loss scaling) goes into each micro-batch loss instead.
        multiplier = 1.0 / trainer.accumulate_grad_batches
        scaler = self.precision_plugin.loss_scaler
        if scaler is not None:
            multiplier *= scaler.scale
        with self.precision_plugin.train_step_context():
            loss = self.engine.pipeline_step(
                inputs, targets, num_microbatches, self.lightning_module.pipeline_loss, multiplier
            )
        runner = self.engine.runner
        assert runner is not None and self.engine.groups.pp_group is not None
        # The batch's mean loss, as `training_step` returns it under pp_size=1 (Lightning divides it by
        # accumulate_grad_batches for its closure result, here as there).
        mean = broadcast_from_last_stage(loss, runner.holds_last, self.engine.groups.pp_group, self.root_device)
        # Lightning zeroes gradients between `training_step` and `backward`; the schedule's backward already ran, so its
        # gradients are set aside here and put back when Lightning calls `backward` (see there).
        self._stashed_gradients = [
            (parameter, parameter.grad)
            for parameter in self.lightning_module.parameters()
            if parameter.grad is not None
        ]
        for parameter, _ in self._stashed_gradients:
            parameter.grad = None
        return mean

    def _pipeline_evaluation_step(self, batch: Any) -> Tensor:
        assert self.engine is not None and self.lightning_module is not None
        runner = self.engine.runner
        assert runner is not None and self.engine.groups.pp_group is not None
        inputs, targets, num_microbatches = self._pipeline_split(batch)
        with self.precision_plugin.val_step_context():
            loss = self.engine.pipeline_evaluate(
                inputs if runner.holds_first else None, targets, num_microbatches, self.lightning_module.pipeline_loss
            )
        return broadcast_from_last_stage(loss, runner.holds_last, self.engine.groups.pp_group, self.root_device)

    def _pipeline_prediction_step(self, batch: Any) -> Any:
        """Forward-only schedule; the last stage's outputs (or ``pipeline_predict`` of them) reach every rank."""
        assert self.engine is not None and self.lightning_module is not None
        runner = self.engine.runner
        assert runner is not None and self.engine.groups.pp_group is not None
        inputs, _, num_microbatches = self._pipeline_split(batch, targets_required=False)
        with self.precision_plugin.predict_step_context():
            outputs = self.engine.pipeline_predict(inputs if runner.holds_first else None, num_microbatches)
        prediction = None
        if runner.holds_last:
            assert outputs is not None
            hook = getattr(self.lightning_module, "pipeline_predict", None)
            prediction = hook(outputs, batch) if callable(hook) else outputs
        last_holder = self.engine.stage_holders[-1]
        return collectives.broadcast_object(prediction, source_rank=last_holder, group=self.engine.groups.pp_group)

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self.pipelined:
            for parameter, gradient in self._stashed_gradients:
                parameter.grad = gradient
            self._stashed_gradients = []
        else:
            # loss_parallel's cross-entropy has a DTensor backward that must run inside the same context.
            with self._step_context():
                closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self.engine is not None:
            self.engine.after_backward()
        return closure_loss

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        if self.engine is None:
            yield
            return
        with self.engine.no_sync():
            yield

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.engine is not None:
            self.engine.after_step(stepped=not self.precision_plugin.last_step_skipped)
        return output

    # ---------------------------------------------------------------------------------------------- checkpoints
    def model_state_for_checkpoint(self) -> dict[str, Any]:
        assert self.engine is not None
        state = self.engine.model_state()
        zero = self.engine.zero
        if zero is not None and not zero.masters_alias_parameters:
            # fp32 masters rather than their low-precision working copies.
            state.update(zero.masters_by_name())
        return state

    def whole_model_keys(self, model_state: dict[str, Any]) -> set[str]:
        assert self.engine is not None
        return set(self.engine.whole_model_keys)

    def _on_model_state_loaded(self) -> None:
        assert self.engine is not None
        self.engine.restore_gathered()
        zero = self.engine.zero
        if zero is None:
            return
        if zero.masters_alias_parameters:
            zero.parameters_to_masters()
        else:
            zero.masters_to_parameters()

    def _load_full_model_state(self, state_dict: Mapping[str, Tensor], strict: bool) -> None:
        assert self.engine is not None
        self.engine.load_full_weights(state_dict, strict)

    def full_model_state_dict(self) -> dict[str, Tensor]:
        """The whole model's weights as plain CPU tensors under the LightningModule's names, on every rank: the
        tensor-parallel shards gathered and every pipeline stage's weights merged (a collective over all ranks)."""
        assert self.engine is not None, "the model is parallelised in `setup`; call this after `trainer.fit` & co."
        return self.engine.full_weights()

    def optimizer_names_and_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.engine is not None and self.lightning_module is not None
        engine = self.engine
        if engine.zero is not None:
            state = engine.zero.optimizer_state_by_name()
        else:
            state = get_optimizer_state_dict(self.lightning_module, _unwrap_optimizer(optimizer))
            # The per-parameter dicts are the optimizer's own (``Optimizer.state_dict`` does not copy them), so the
            # descriptions go into new dicts: writing them back would leave DTensors in the live state, and the next
            # step (or a second description of a tied weight) would fail on them. The tensors inside still alias
            # the live state, which loading relies on.
            state["state"] = {
                name: {
                    state_key: engine.whole_tensor_of(value, id(self.lightning_module.get_parameter(name)))
                    if isinstance(value, Tensor) and value.dim() > 0
                    else value
                    for state_key, value in entries.items()
                }
                for name, entries in state["state"].items()
            }
        canonical = engine.rename_optimizer_state(state, to_canonical=True)
        return {"state": canonical["state"], "param_groups": engine.whole_model_param_groups(canonical["param_groups"])}

    def _load_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        assert self.engine is not None and self.lightning_module is not None
        engine = self.engine
        state = engine.rename_optimizer_state(state, to_canonical=False)
        # Groups list the whole model (whole_model_param_groups); this rank loads the parameters it holds.
        own = dict(self.lightning_module.named_parameters())
        state = {
            "state": {name: entries for name, entries in state["state"].items() if name in own},
            "param_groups": [
                {**group, "params": [name for name in group["params"] if name in own]}
                for group in state["param_groups"]
            ],
        }
        state = engine.full_optimizer_state_to_local(state)
        if engine.zero is not None:
            engine.zero.load_optimizer_state_by_name(state)
            return
        # Plain parameters take plain state; DTensor parameters (the user's own tensor parallelism) keep DTensor state.
        local = {
            name: {
                key: value.to_local()
                if isinstance(value, DTensor) and not isinstance(own.get(name), DTensor)
                else value
                for key, value in entries.items()
            }
            for name, entries in state["state"].items()
        }
        set_optimizer_state_dict(
            self.lightning_module, _unwrap_optimizer(optimizer), {"state": local, "param_groups": state["param_groups"]}
        )

    @classmethod
    def registry_entries(cls) -> Iterable[tuple[str, dict[str, Any]]]:
        return [(cls.strategy_name, {})]


# Set on a LightningModule whose model this strategy split into tensor-parallel pieces or pipeline stages.
_SPLIT_MARKER = "_lightning_colossal_split_by_hybrid"


def _refuse_module_split_by_an_earlier_run(module: pl.LightningModule) -> None:
    """A module keeps its pieces after a run (see docs/hybrid.md); a new strategy would split the pieces again and
    train a different model, silently. The same Trainer may fit again: its strategy keeps its engine."""
    if module.__dict__.get(_SPLIT_MARKER):
        raise RuntimeError(
            f"This {type(module).__name__} was split into tensor-parallel pieces or pipeline stages by an earlier"
            " colossal_hybrid run and holds only this rank's pieces, so a new Trainer cannot split it again. Fit again"
            " with the same Trainer (e.g. a larger max_epochs), or start from a whole model:"
            " `Module.load_from_checkpoint(trainer.checkpoint_callback.last_model_path)`, or build the module anew"
            " and load `trainer.strategy.full_model_state_dict()` (gathered before the first Trainer is dropped)."
        )


def _plain(output: Any) -> Any:
    """Step outputs with every ``DTensor`` as the plain tensor of its whole value.

    A loss computed under ``loss_parallel`` is a replicated DTensor (its own value, differentiably), and the
    vocabulary-sharded logits a ``predict_step`` returns are gathered here: Lightning, callbacks and the predictions
    ``trainer.predict`` returns get what the same module gives without tensor parallelism.
    """
    return apply_to_collection(output, DTensor, lambda tensor: tensor.full_tensor())


def _log_plain_values(module: pl.LightningModule) -> None:
    """Make ``module.log`` (and ``log_dict``, which calls it) store plain tensors rather than DTensors.

    A loss the user logs inside a step under tensor parallelism is a DTensor (``loss_parallel``); Lightning would
    keep it as such in ``callback_metrics``, ``logged_metrics`` and the progress bar, where a DTensor is of no use
    outside the ranks' process group (loggers, a notebook's parent process). Lightning has no hook between ``self.log`` and its metric store, so the
    bound method is shadowed on this instance for the strategy's lifetime (undone in ``teardown``).
    """
    if getattr(module.__dict__.get("log"), "logs_plain_values", False):
        return
    log = module.log

    def log_plain_values(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        log(name, _plain(value), *args, **kwargs)

    log_plain_values.logs_plain_values = True  # type: ignore[attr-defined]
    module.log = log_plain_values  # type: ignore[method-assign]


def _stop_logging_plain_values(module: pl.LightningModule) -> None:
    if getattr(module.__dict__.get("log"), "logs_plain_values", False):
        del module.__dict__["log"]
