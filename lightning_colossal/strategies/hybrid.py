"""``colossal_hybrid``: tensor, pipeline, sequence and data parallelism (ZeRO on the data axis) in one strategy.

The engine (``lightning_colossal.parallel``) parallelises the model a policy knows; this adapter wires it into
Lightning: groups from the strategy's device mesh, the sampler over the data-parallel axis only, ``loss_parallel``
around every step under tensor parallelism, the sequence split under Ulysses and ring, and with ``pp_size > 1`` the
pipeline schedule in place of ``training_step`` (see ``docs/hybrid.md``, "LightningModules for pipelines").
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_colossal.config import (
    Communication,
    HybridConfig,
    PipelineConfig,
    PipelineSchedule,
    SequenceParallelMode,
    ZeroConfig,
)
from lightning_colossal.distributed import ParallelDims
from lightning_colossal.engine_parts.running_statistics import modules_with_running_statistics
from lightning_colossal.parallel import (
    GradientStash,
    HybridEngine,
    ModelPolicy,
    PipelineStep,
    build_groups,
    find_policy,
    split_sequence,
)
from lightning_colossal.strategies.engine_strategy import EngineStrategy
from lightning_colossal.strategies.hybrid_module import (
    log_plain_values,
    mark_split,
    plain,
    refuse_module_split_by_an_earlier_run,
    require_pipeline_loss,
    stop_logging_plain_values,
)


class HybridParallelStrategy(EngineStrategy[HybridEngine]):
    """Hybrid 3D parallelism; registered as ``colossal_hybrid`` (and ``colossal_hybrid_notebook``).

    Args:
        policy: which parts of the model to split: ``None`` picks a built-in policy (demo GPT, Hugging Face models
            with a ``base_model_tp_plan``, GPT-2, BERT; or keeps DTensor tensor parallelism ``configure_model``
            applied), a ``dict`` is a user plan (module pattern -> ``"colwise"`` or ``"rowwise"``), or a
            ``ModelPolicy`` instance.
    """

    strategy_name = "colossal_hybrid"
    # The flat arguments are described where they land: a part of HybridConfig, or from_flat_arguments for those
    # that are no part's field (pp_size, sp_size, zero_stage, sequence_parallel).
    argument_doc_sources = (HybridConfig, HybridConfig.from_flat_arguments, PipelineConfig, ZeroConfig)
    # The engine splits a meta model first (parallel/initial_weights.py [Note: meta-device models]).
    materialises_meta_models = True
    manual_optimization_refusal = (
        "the strategy owns when gradients are reduced and, with pipelines, runs backward itself"
    )
    # With tp_size = pp_size = 1 colossal_hybrid is ZeRO over the data-parallel ranks, which the ZeRO strategies run.
    manual_optimization_alternatives = (
        "`colossal_zero1` / `colossal_zero2` (ZeRO over the data-parallel ranks, as colossal_hybrid with tp_size ="
        " pp_size = 1) or `colossal_ddp`"
    )

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
        communication: Communication = "auto",
        zero: ZeroConfig | None = None,
        ep_size: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # Each group of flat arguments becomes one part of the config: ``pipeline`` (``None`` when pp_size=1),
        # ``sequence_parallelism`` and ``data_parallel`` (a ``ZeroConfig`` when zero_stage > 0). ZeRO settings after
        # zero_stage and bucket_size_mb are passed by name and reach ``ZeroConfig`` unchanged.
        self.hybrid_config = HybridConfig.from_flat_arguments(
            tp_size=tp_size,
            pp_size=pp_size,
            sp_size=sp_size,
            zero_stage=zero_stage,
            sequence_parallel=sequence_parallel,
            pp_schedule=pp_schedule,
            num_microbatches=num_microbatches,
            microbatch_size=microbatch_size,
            num_model_chunks=num_model_chunks,
            layers_per_stage=layers_per_stage,
            activation_checkpointing=activation_checkpointing,
            bucket_size_mb=bucket_size_mb,
            init_window_bytes=init_window_bytes,
            communication=communication,
            zero=zero,
            ep_size=ep_size,
        )
        self.policy = policy
        self.engine = None  # the HybridEngine, made at the first `setup` (EngineStrategy.engine)
        self._stashed_gradients = GradientStash()

    def _build_parallel_dims(self) -> ParallelDims:
        config = self.hybrid_config
        return ParallelDims(world_size=self.world_size, tp=config.tp_size, pp=config.pp_size, sp=config.sp_size)

    @property
    def pipelined(self) -> bool:
        return self.hybrid_config.pp_size > 1

    def parameter_pieces(self) -> str | None:
        config = self.hybrid_config
        if config.ep_size > 1:
            return f"only its experts of each mixture-of-experts layer (ep_size={config.ep_size})"
        if config.tp_size == 1 and config.pp_size == 1:
            return None  # data (and sequence) parallelism only: every rank holds every parameter whole
        return (
            f"only its pieces of the model (tp_size={config.tp_size}: tensor-parallel shards; pp_size={config.pp_size}:"
            " the layers of its pipeline stage)"
        )

    # ---------------------------------------------------------------------------------------------- set-up
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        assert self.lightning_module is not None
        log_plain_values(self.lightning_module)
        # The pipeline cut pruned the layers of other ranks' stages after `_prepare_module` listed the norm layers of
        # the whole model: follow only those this rank still holds (the others it neither runs nor, from the meta
        # device, materialised).
        self._running_statistics = modules_with_running_statistics(self.model)

    def _setup_engines(self, trainer: pl.Trainer, fitting: bool) -> list[HybridEngine]:
        assert self.lightning_module is not None
        # Built once per strategy: a second run of the same Trainer keeps it, the module already holds its pieces.
        engine = self.engine if self.engine is not None else self._parallelise_module(self.lightning_module)
        if fitting:
            optimizer = self._setup_single_optimizer(
                trainer, self.manual_optimization_refusal, self.manual_optimization_alternatives
            )
            self._record_held_frozen([optimizer])
            engine.attach_optimizer(optimizer)  # replaces (and unhooks) an earlier fit's data parallelism
        return [engine]

    def _parallelise_module(self, module: pl.LightningModule) -> HybridEngine:
        """Split ``module``'s model in place (once per strategy: the module then holds only this rank's pieces)."""
        config = self.hybrid_config
        model_parallel = config.model_parallel_size > 1
        refuse_module_split_by_an_earlier_run(module)
        model, policy = find_policy(module, self.policy, model_parallel=model_parallel)
        if self.pipelined:
            require_pipeline_loss(module, config.pp_size)
        groups = build_groups(self.device_mesh, self._timeout)
        engine = HybridEngine(module, model, policy, config, groups, self.root_device, self._timeout)
        if model_parallel:
            mark_split(module)
        return engine

    def _set_up_engine(self) -> HybridEngine:
        assert self.engine is not None, "the model is parallelised in `setup`; call this after `trainer.fit` & co."
        return self.engine

    @contextmanager
    def whole_parameters(self) -> Generator[None, None, None]:
        config = self.hybrid_config
        if config.model_parallel_size > 1:
            # Pipeline stages hold only their layers; tensor-parallel pieces are plain tensors of this rank
            # (parallel/tensor_parallel.py [Note: plain local shards instead of DTensor parameters]), some fused
            # (query/key/value), so no whole view exists to hand out here.
            raise ValueError(
                f"whole_parameters() under colossal_hybrid with tp_size={config.tp_size}, pp_size={config.pp_size}:"
                " a rank holds only its tensor-parallel pieces and the layers of its pipeline stage, so the model's"
                " parameters cannot be read whole in training_step. Compute a term over parameters inside the modules"
                " that own them (their forward sees this rank's pieces), or train with colossal_fsdp or colossal_gemini,"
                " whose whole_parameters() gathers them."
            )
        yield  # data and sequence parallelism only: every parameter is whole on every rank

    def _release_engine(self, engine: HybridEngine) -> None:
        # The module keeps its split form and the engine for a next run; ZeRO's gradient hooks go now.
        engine.stop_reducing()

    def teardown(self) -> None:
        if self.lightning_module is not None:
            stop_logging_plain_values(self.lightning_module)
        super().teardown()

    # ---------------------------------------------------------------------------------------------- steps
    def _with_split_batch(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Ulysses and ring: each sequence-parallel rank takes its share of every ``[batch, sequence, ...]`` tensor (a
        slice under Ulysses, two zigzag chunks under ring: [Note: sequence layouts] in parallel/sequence_layout.py)."""
        mode = self.hybrid_config.sequence_parallelism
        if not args or mode is None or mode.sp_size == 1:
            return args
        rank = self.device_mesh["sp"].get_local_rank()
        return (split_sequence(args[0], mode.sp_size, rank, mode.layout), *args[1:])

    def _pipeline(self) -> PipelineStep:
        assert self.engine is not None and self.engine.pipeline is not None
        return self.engine.pipeline

    def _step(
        self, step: Callable[..., Any], pipeline_step: Callable[..., Any], training: bool, *args: Any, **kwargs: Any
    ) -> Any:
        """A Lightning step: the pipeline's in its place when ``pp_size > 1``, else ``step`` inside ``loss_parallel``,
        its DTensor outputs made plain. Outside training the logits are whole and plain (``whole_logits``): an
        evaluation or prediction step may decode (``generate()``), which mixes them with plain tensors."""
        args = self._with_split_batch(args)
        if self.pipelined:
            return pipeline_step(*args, **kwargs)
        engine = self._set_up_engine()
        # Training: vocabulary-sharded logits, so cross-entropy never gathers them (VocabParallelHead).
        whole = nullcontext() if training else engine.whole_logits()
        with engine.loss_context(), whole:
            return plain(step(*args, **kwargs))

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_anomaly_detection_on_dtensors()
        return self._step(super().training_step, self._pipeline_training_step, True, *args, **kwargs)

    def _refuse_anomaly_detection_on_dtensors(self) -> None:
        """``Trainer(detect_anomaly=True)`` (on from the loop's start, so first seen here) fails inside backward under
        tensor parallelism: anomaly mode checks each gradient with ``aten._is_any_true``, an operator DTensor has no
        sharding rule for. Refuse before the first forward, naming what works instead."""
        if not torch.is_anomaly_enabled() or self.lightning_module is None:
            return
        tensor_parallel = self.hybrid_config.tp_size > 1  # the policy's layers compute on DTensors inside forward
        if tensor_parallel or any(isinstance(parameter, DTensor) for parameter in self.lightning_module.parameters()):
            raise RuntimeError(
                "Trainer(detect_anomaly=True) cannot run under tensor parallelism (DTensors): torch's anomaly"
                " mode checks every gradient with an operator DTensor has no rule for (aten._is_any_true) and fails"
                " inside backward. Debug with detect_anomaly=True at tp_size=1 (data or pipeline parallelism), or keep"
                " tensor parallelism and find the first non-finite step with ColossalPrecision(on_nonfinite='raise'),"
                " the default, which names the step and the ranks."
            )

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step(super().validation_step, self._pipeline_evaluation_step, False, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step(super().test_step, self._pipeline_evaluation_step, False, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step(super().predict_step, self._pipeline_prediction_step, False, *args, **kwargs)

    def _pipeline_training_step(self, batch: Any, batch_idx: int = 0, *_: Any, **__: Any) -> Tensor:
        module = self.lightning_module
        assert module is not None
        trainer = module.trainer
        if batch_idx % trainer.accumulate_grad_batches == 0:
            # First batch of an accumulation window: Lightning zeroes gradients only after `training_step`, too late
            # for a schedule that already ran backward, so the previous step's gradients are dropped here.
            for parameter in module.parameters():
                parameter.grad = None
        # The schedule takes the place of the base's `training_step`, and so of its copy of the first replica's
        # running statistics (engine_parts/running_statistics.py [Note: running statistics follow the first replica]).
        self._follow_first_replica_statistics()
        # Lightning divides the loss by accumulate_grad_batches before its backward; the schedule's backward runs
        # here, so the division (and fp16 loss scaling) goes into each micro-batch loss instead.
        multiplier = 1.0 / trainer.accumulate_grad_batches
        scaler = self.precision_plugin.loss_scaler
        if scaler is not None:
            multiplier *= scaler.scale
        with self.precision_plugin.train_step_context():
            # The batch's mean loss on every rank, as `training_step` returns it under pp_size=1 (Lightning divides
            # it by accumulate_grad_batches for its closure result, here as there).
            mean = self._pipeline().train_step(batch, module.pipeline_loss, multiplier)
        # Lightning zeroes gradients between `training_step` and `backward`; the schedule's backward already ran, so
        # its gradients are set aside here and put back when Lightning calls `backward` (see there).
        self._stashed_gradients.set_aside(module.parameters())
        return mean

    def _pipeline_evaluation_step(self, batch: Any, *_: Any, **__: Any) -> Tensor:
        assert self.lightning_module is not None
        self._follow_first_replica_statistics_while_fitting()  # in place of the base's `validation_step`'s copy
        with self.precision_plugin.val_step_context():
            return self._pipeline().evaluate(batch, self.lightning_module.pipeline_loss)

    def _pipeline_prediction_step(self, batch: Any, *_: Any, **__: Any) -> Any:
        """Forward-only schedule; the last stage's outputs (or ``pipeline_predict`` of them) reach every rank."""
        assert self.lightning_module is not None
        pipeline = self._pipeline()
        with self.precision_plugin.predict_step_context():
            outputs = pipeline.predict(batch)
        prediction = None
        if pipeline.holds_last:
            hook = getattr(self.lightning_module, "pipeline_predict", None)
            prediction = hook(outputs, batch) if callable(hook) else outputs
        return pipeline.share_from_last_stage(prediction)

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self.pipelined:
            self._stashed_gradients.put_back()
        else:
            # loss_parallel's cross-entropy has a DTensor backward that must run inside the same context.
            with self._set_up_engine().loss_context():
                closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self.engine is not None:
            self.engine.after_backward()
        return closure_loss

    # ---------------------------------------------------------------------------------------------- checkpoints
    def model_state_for_checkpoint(self) -> dict[str, Any]:
        return self._set_up_engine().model_state_for_checkpoint()

    def whole_model_keys(self, model_state: dict[str, Any]) -> set[str]:
        return set(self._set_up_engine().names.whole_model_keys)

    def _on_model_state_loaded(self) -> None:
        self._set_up_engine().after_model_state_loaded()

    def _load_full_model_state(self, state_dict: Mapping[str, Tensor], strict: bool) -> None:
        self._set_up_engine().load_full_weights(state_dict, strict)

    def full_model_state_dict(self) -> dict[str, Tensor]:
        """The whole model's weights as plain CPU tensors under the LightningModule's names, on every rank: the
        tensor-parallel shards gathered and every pipeline stage's weights merged (a collective over all ranks)."""
        return self._set_up_engine().full_weights()

    @classmethod
    def registry_entries(cls) -> Iterable[tuple[str, dict[str, Any]]]:
        return [(cls.strategy_name, {})]
