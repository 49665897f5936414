"""The Fabric strategies of each mode: what Fabric's loop shape needs of the mode beyond the base
([Note: one mode, two front doors] in ``fabric/strategy.py``).

- ``FabricDDPStrategy`` (``colossal_ddp``): the module wrapped in torch DDP; parameters unfrozen after wrapping
  averaged as under the Trainer.
- ``FabricZeroStrategy`` (``colossal_zero1/2``, ``*_offload``): one ZeRO engine per optimizer, built when the
  optimizer is set up.
- ``FabricGeminiStrategy`` (``colossal_gemini``, ``_auto``, ``_offload``): the model chunked at set-up, the one
  optimizer attached when it is set up; step contexts and gather rounds around every forward; chunks counted before
  backward.
- ``FabricFSDPStrategy`` (``colossal_fsdp``, ``colossal_fsdp_offload``): the module sharded by FSDP2 at set-up;
  unused gradients tracked.
- ``FabricHybridStrategy`` (``colossal_hybrid``): tensor, sequence, expert and data parallelism; pipelines refused
  ([Note: tensor parallelism in a hand-written loop]).

Every mode points an optimizer made before set-up at the parameters the mode replaced, by name (the base).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_colossal.engine_parts.running_statistics import modules_with_running_statistics
from lightning_colossal.fabric.strategy import ColossalFabricStrategy
from lightning_colossal.fsdp import include_unused_parameters_in_reduction
from lightning_colossal.strategies._lightning_private import _optimizers_to_device
from lightning_colossal.strategies.ddp import ColossalDDPStrategy
from lightning_colossal.strategies.fsdp import ColossalFSDPStrategy
from lightning_colossal.strategies.gemini import GeminiStrategy
from lightning_colossal.strategies.hybrid import HybridParallelStrategy
from lightning_colossal.strategies.hybrid_module import plain
from lightning_colossal.strategies.optimizers import refuse_parameters_in_two_optimizers
from lightning_colossal.strategies.zero import ZeroStrategy


class FabricDDPStrategy(ColossalFabricStrategy):
    """``colossal_ddp`` for Fabric: torch DDP with this package's precision, clipping and checkpoints."""

    trainer_strategy = ColossalDDPStrategy
    mode: ColossalDDPStrategy

    def _prepare_model(self, module: Module) -> Module:
        return self.mode._wrap(module)  # DDP copies rank 0's buffers before each forward itself

    def _adopt_optimizer(self, optimizer: Optimizer) -> Optimizer:
        _optimizers_to_device([optimizer], self.root_device)
        return optimizer

    def after_backward(self, loss: Tensor) -> None:
        # ddp.py [Note: parameters that become trainable after wrapping]
        self.mode.post_backward(loss)


class _EngineFabricStrategy(ColossalFabricStrategy):
    """A mode whose engine takes over the optimizer (ZeRO, Gemini): built over the set-up module when its optimizer
    is set up; parameters unfrozen by hand join (ZeRO) or are refused (Gemini) before the next backward."""

    mode: Any  # an EngineStrategy
    _load_hooks: list[Any] = []
    _loading: dict[str, Any] | None = None

    def _adopt_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self.mode.engines and not self.mode.takes_several_optimizers:
            raise ValueError(
                f"{type(self).__name__} shards exactly one optimizer. Put all parameters into one optimizer with one"
                " param group per setting, or use colossal_zero1 / colossal_zero2, which take one engine per"
                " optimizer."
            )
        refuse_parameters_in_two_optimizers([*self.mode.optimizers, optimizer], type(self).__name__)
        engine = self.mode._build_engine(None, optimizer)
        self.mode._record_held_frozen([optimizer])
        self.mode.engines = [*self.mode.engines, engine]
        self.mode._fitted_engines = list(self.mode.engines)
        self.mode._wire_precision_plugin()
        return optimizer

    def before_backward(self, loss: Tensor) -> Tensor:
        if self.mode.engines:
            # A backbone unfrozen by hand since the last step (joined_parameters.py).
            self.mode._take_over_joined_parameters()
        return loss

    def _take_optimizer(self, optimizer: Optimizer) -> Optimizer:
        optimizer = super()._take_optimizer(optimizer)
        # What joined_parameters.py compares with before each backward (a group added later).
        self.mode._group_counts = self.mode._optimizer_group_counts()
        self._install_load_hooks()
        return optimizer

    def _install_load_hooks(self) -> None:
        """The hooks of [Note: weights loaded into a set-up model], once (into ``_load_hooks``)."""
        raise NotImplementedError

    def teardown(self) -> None:
        for handle in self._load_hooks:
            handle.remove()
        self._load_hooks = []
        super().teardown()


class FabricZeroStrategy(_EngineFabricStrategy):
    """``colossal_zero1`` / ``colossal_zero2`` (and ``*_offload``) for Fabric: one ZeRO engine per optimizer.

    [Note: weights loaded into a set-up model]
    A Fabric loop may load weights with ``model.load_state_dict(weights)`` after ``fabric.setup`` (litgpt loads its
    pretrained checkpoint that way). The engines keep another copy of the weights: ZeRO's fp32 masters (where the
    parameters are not fp32), Gemini's chunks (where the parameters are empty placeholders). Hooks on the module's
    ``load_state_dict`` keep them right: under ZeRO the masters take the loaded values (unrounded, from the weights
    given) once the module has loaded them; under Gemini every module that owns a chunked parameter hands its weights
    to the engine (below any renaming a module does in its own ``_load_from_state_dict``), the module loads the rest,
    and the chunked names are not reported missing. Without them the first step would undo the loaded weights (ZeRO)
    or the load would fail on the placeholders (Gemini).
    """

    trainer_strategy = ZeroStrategy

    def _install_load_hooks(self) -> None:
        if not self._load_hooks:
            assert self._module is not None
            self._load_hooks = [
                self._module.register_load_state_dict_pre_hook(self._before_weights_load),
                self._module.register_load_state_dict_post_hook(self._after_weights_load),
            ]

    def _before_weights_load(self, module: Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        self._loading = {name.removeprefix(prefix): value for name, value in state_dict.items()}

    def _after_weights_load(self, module: Module, incompatible_keys: Any) -> None:
        loaded, self._loading = self._loading or {}, None
        if any(engine.master_buffer is not None for engine in self.mode.engines):
            # Separate masters take the given values unrounded; where the masters are the fp32 parameters, the
            # module's own load already wrote them, and a lazily loaded file is not read a second time.
            weights = {name: _loaded(value) for name, value in loaded.items()}
            for engine in self.mode.engines:
                engine.parameters_to_masters(full_weights=weights)


class FabricGeminiStrategy(_EngineFabricStrategy):
    """``colossal_gemini`` (``_auto``, ``_offload``) for Fabric: parameters, gradients and optimizer state in chunks,
    built when the one optimizer is set up."""

    trainer_strategy = GeminiStrategy
    mode: GeminiStrategy

    def _prepare_model(self, module: Module) -> Module:
        # Chunked at set-up (a model on the meta device materialised shard by shard), the optimizer attached when it
        # is set up: litgpt makes its optimizer only after `fabric.setup(model)`, from the set-up parameters.
        self.mode.engines = [self.mode._build_engine(None, None)]
        self._install_load_hooks()
        return module

    def _adopt_optimizer(self, optimizer: Optimizer) -> Optimizer:
        engine = self.mode.engine
        assert engine is not None
        if self.mode.optimizers:
            raise ValueError(
                "FabricGeminiStrategy shards exactly one optimizer. Put all parameters into one optimizer with one"
                " param group per setting, or use colossal_zero1 / colossal_zero2, which take one engine per"
                " optimizer."
            )
        engine.attach_optimizer(optimizer)
        self.mode._record_held_frozen([optimizer])
        self.mode._fitted_engines = [engine]
        self.mode._wire_precision_plugin()
        return optimizer

    @contextmanager
    def forward_context(self, module: Module) -> Generator[None, None, None]:
        engine = self.mode.engine
        if self._load_hooks:
            self._hand_over_loaded_weights()
        with super().forward_context(module):
            if engine is None:
                yield
                return
            with engine.step_context():
                yield

    def after_forward(self) -> None:
        # Ranks may have run different modules (experts without tokens): serve the gathers others still need.
        if self.mode.engine is not None:
            self.mode.engine.finish_phase()

    def before_backward(self, loss: Tensor) -> Tensor:
        loss = super().before_backward(loss)
        if self.mode.engine is not None:
            self.mode.engine.prepare_backward(loss)
        return loss

    def _install_load_hooks(self) -> None:
        # [Note: weights loaded into a set-up model]: under Gemini on every module that owns a chunked parameter, so
        # that a key a module renames in its own `_load_from_state_dict` (litgpt's LoRA layers) is read as renamed;
        # the root's post-hook hands the weights over, once. And the whole value of a chunked parameter in
        # `state_dict()`, as FSDP2 gives it (litgpt's LoRA saver reads `model.state_dict()`).
        if self._load_hooks:
            return
        assert self._module is not None
        engine = self.mode.engine
        assert engine is not None
        chunked = {key for key, (chunk, _) in engine.chunk_of.items()}
        self._pending: dict[str, Tensor] = {}
        self._taken_keys: set[str] = set()
        owners = [
            module
            for module in self._module.modules()
            if any(id(parameter) in chunked for parameter in module.parameters(recurse=False))
        ]
        self._load_hooks = [owner.register_load_state_dict_pre_hook(self._take_own_weights) for owner in owners]
        self._load_hooks.append(self._module.register_load_state_dict_post_hook(self._after_weights_load))
        # (a function: torch marks the hook it is given with an attribute, which a bound method cannot take)
        self._load_hooks.append(
            self._module.register_state_dict_post_hook(lambda *arguments: self._whole_chunked_values(*arguments))
        )

    def _take_own_weights(self, module: Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        engine = self.mode.engine
        assert engine is not None
        for local_name, parameter in module.named_parameters(recurse=False):
            key = prefix + local_name
            if key in state_dict and id(parameter) in engine.chunk_of:
                # Taken out of load_state_dict's own copy: the module would copy into the empty placeholder.
                self._pending[engine.names_of[id(parameter)][0]] = _loaded(state_dict.pop(key))
                self._taken_keys.add(key)

    def _after_weights_load(self, module: Module, incompatible_keys: Any) -> None:
        taken, self._taken_keys = self._taken_keys, set()
        incompatible_keys.missing_keys[:] = [key for key in incompatible_keys.missing_keys if key not in taken]
        self._hand_over_loaded_weights()

    def _hand_over_loaded_weights(self) -> None:
        """The chunked parameters' rows from the weights a load took (also at the next forward, when the load was
        into a submodule and the root's post-hook did not run)."""
        pending, self._pending = self._pending, {}
        if pending:
            engine = self.mode.engine
            assert engine is not None
            engine.load_full_weights(pending)

    def _whole_chunked_values(self, module: Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        engine = self.mode.engine
        if engine is None or engine.detached:
            return
        chunked = engine.state_by_name()  # master rows (shard rows of frozen chunks), dim-0 DTensors of whole shape
        for key, value in state_dict.items():
            name = key.removeprefix(prefix)
            # Parameters themselves (keep_vars=True) stay: callers that ask for them want the objects.
            if name in chunked and not isinstance(value, torch.nn.Parameter):
                state_dict[key] = chunked[name]


class FabricFSDPStrategy(ColossalFabricStrategy):
    """``colossal_fsdp`` / ``colossal_fsdp_offload`` for Fabric: the module sharded by FSDP2 at set-up."""

    trainer_strategy = ColossalFSDPStrategy
    mode: ColossalFSDPStrategy

    def _prepare_model(self, module: Module) -> Module:
        self.mode._roots = self.mode._shard(module)
        torch_reduces_unused = include_unused_parameters_in_reduction(self.mode._roots)
        self.mode._gradient_tracker = self.mode._track_unused_gradients(module, torch_reduces_unused)
        return module

    def before_backward(self, loss: Tensor) -> Tensor:
        tracker = self.mode._gradient_tracker
        if tracker is None:
            return loss
        assert self._module is not None
        return tracker.before_backward(loss, self._module)

    def after_backward(self, loss: Tensor) -> None:
        tracker = self.mode._gradient_tracker
        if tracker is not None and not self.mode._gradient_sync_blocked:
            tracker.after_synchronising_backward()


class FabricHybridStrategy(ColossalFabricStrategy):
    """``colossal_hybrid`` for Fabric: tensor, sequence, expert and data parallelism (ZeRO on the data axis), without
    pipelines.

    [Note: tensor parallelism in a hand-written loop]
    Under the Trainer the strategy runs the whole training step, and so the loss, inside ``loss_parallel``, where a
    vocabulary-parallel head's logits stay sharded and cross-entropy never gathers them. A Fabric loop computes its
    loss in its own code, so by default the model returns whole plain logits (gathered differentiably: correct for any
    loss code, at the cost of the whole logits on every tensor-parallel rank), and DTensor outputs are made plain. To
    keep the logits sharded, compute the loss and call ``fabric.backward`` inside ``fabric.strategy.loss_parallel()``,
    which is the Trainer's context. Under sequence parallelism every rank reads its share of each sequence: pass each
    batch through ``fabric.strategy.split_batch(batch)`` (every ``[batch, sequence, ...]`` tensor, labels included, as
    the Trainer splits it). Pipelines are refused: their schedule replaces the training step, which a Fabric loop
    writes itself.
    """

    trainer_strategy = HybridParallelStrategy
    mode: HybridParallelStrategy

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.mode.pipelined:
            raise ValueError(
                f"colossal_hybrid with pp_size={self.mode.hybrid_config.pp_size} under Fabric: a pipeline schedule"
                " replaces the training step, which a Fabric loop writes itself. Use `Trainer(strategy=...)` for"
                " pipelines, or pp_size=1 here (tensor, sequence, expert and data parallelism)."
            )
        self._loss_parallel = False

    def _prepare_model(self, module: Module) -> Module:
        engine = self.mode._parallelise_module(module)
        self.mode.engines = [engine]
        # The split pruned nothing here (no pipeline), but norm layers are listed after it, as the Trainer does.
        self.mode._running_statistics = modules_with_running_statistics(module)
        return module

    def _take_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self.mode.optimizers:
            raise ValueError(
                "colossal_hybrid shards exactly one optimizer. Put all parameters into one optimizer with one param"
                " group per setting."
            )
        optimizer = super()._take_optimizer(optimizer)
        engine = self.mode.engine
        assert engine is not None
        self.mode._record_held_frozen([optimizer])
        engine.attach_optimizer(optimizer)
        self.mode._fitted_engines = [engine]
        self.mode._group_counts = self.mode._optimizer_group_counts()
        self.mode._wire_precision_plugin()
        return optimizer

    @contextmanager
    def loss_parallel(self) -> Generator[None, None, None]:
        """Inside: the model returns vocabulary-sharded logits and the loss computed from them stays sharded;
        compute the loss and call ``fabric.backward`` inside ([Note: tensor parallelism in a hand-written loop])."""
        engine = self.mode.engine
        assert engine is not None, "set up the model first"
        self._loss_parallel = True
        try:
            with engine.loss_context():
                yield
        finally:
            self._loss_parallel = False

    def split_batch(self, batch: Any) -> Any:
        """This sequence-parallel rank's share of every ``[batch, sequence, ...]`` tensor of ``batch`` (the batch
        itself without sequence parallelism)."""
        return self.mode._with_split_batch((batch,))[0]

    @contextmanager
    def forward_context(self, module: Module) -> Generator[None, None, None]:
        engine = self.mode.engine
        assert engine is not None
        with super().forward_context(module), nullcontext() if self._loss_parallel else engine.whole_logits():
            yield

    def convert_output(self, output: Any) -> Any:
        return output if self._loss_parallel else plain(output)

    def after_backward(self, loss: Tensor) -> None:
        if self.mode.engine is not None:
            self.mode.engine.after_backward()

    def before_backward(self, loss: Tensor) -> Tensor:
        if self.mode.engines:
            self.mode._take_over_joined_parameters()  # refused with the fix: hybrid lays its parameters out once
        # A loss computed under loss_parallel is a replicated DTensor: its own value, plain (differentiably), as the
        # Trainer makes a step's outputs, so the precision plugin's checks see an ordinary tensor.
        return plain(loss)


def _loaded(value: Any) -> Any:
    """``value`` read, where it is one of Lightning's lazily loaded tensors (``lightning.fabric.utilities.load``, which
    litgpt loads its checkpoints with): the engines slice the values they are given."""
    load = getattr(value, "_load_tensor", None)
    return load() if callable(load) else value


#: Every Fabric strategy class, in registration order.
FABRIC_STRATEGIES: tuple[type[ColossalFabricStrategy], ...] = (
    FabricDDPStrategy,
    FabricZeroStrategy,
    FabricGeminiStrategy,
    FabricFSDPStrategy,
    FabricHybridStrategy,
)

__all__ = [
    "FABRIC_STRATEGIES",
    "FabricDDPStrategy",
    "FabricFSDPStrategy",
    "FabricGeminiStrategy",
    "FabricHybridStrategy",
    "FabricZeroStrategy",
]
