"""``colossal_gemini`` / ``colossal_gemini_auto`` / ``colossal_gemini_offload``: the Gemini engine as a strategy.

The model is not wrapped: ``lightning_colossal.gemini.GeminiEngine`` moves the trainable parameters into chunks,
hooks the modules that own them, and takes over the parameter lists of the optimizer ``configure_optimizers``
returned. Lightning's loop stays in charge (``EngineStrategy``: the engine hears of every optimizer step, clips, and
saves the optimizer state by name); this adapter runs the steps under the engine's contexts and maps checkpoints onto
its name-keyed shards.
"""

from __future__ import annotations

import re
from collections.abc import Generator, Iterable, Mapping
from contextlib import contextmanager
from typing import Any, Literal

import lightning.pytorch as pl
from torch import Tensor
from torch.optim import Optimizer

from lightning_colossal.config import AutoPlacement, GeminiConfig, StaticPlacement
from lightning_colossal.gemini import GeminiEngine
from lightning_colossal.strategies.checkpointing import parameters_by_state_key
from lightning_colossal.strategies.engine_strategy import EngineStrategy
from lightning_colossal.strategies.failures import explain_in_message
from lightning_colossal.strategies.model_summary import count_whole_parameters_in_model_summary

# What torch says when an op meets a chunked parameter's empty 1-D placeholder ("mat2 must be a matrix, got 1-D
# tensor", "'weight' must be 2-D", "size of tensor b (0)", "4x32 and 0x..."): the parameter was read outside the
# forward of the module that owns it, where Gemini gathers it.
_PLACEHOLDER_SYMPTOM = re.compile(r"1-D|must be 2-D|\(0\)|\b0x\d|of size 0|\[0\]")
PLACEHOLDER_HINT = (
    "colossal_gemini: outside the forward of the module that owns it, a chunked parameter is an empty placeholder"
    " (Gemini gathers its chunk for that module's forward and backward only). If this step reads a weight directly,"
    " e.g. F.linear(hidden, self.head.weight) or a weight tied by hand, call the owning module instead (self.head("
    "hidden)). For a loss term over the parameters themselves (an L2 penalty), compute it inside `with"
    " self.trainer.strategy.whole_parameters():` on every rank. Or train with colossal_zero2, which keeps every"
    " parameter whole."
)


class GeminiStrategy(EngineStrategy[GeminiEngine]):
    """ZeRO-3 over the data-parallel ranks with parameters, gradients and optimizer state in chunks.

    Registered as ``colossal_gemini`` (static placement, all on the compute device), ``colossal_gemini_auto``
    (automatic placement) and ``colossal_gemini_offload`` (static, fp32 masters and optimizer state in CPU memory),
    each also ``*_notebook``.
    """

    argument_doc_sources = (GeminiConfig,)
    materialises_meta_models = True  # meta models are initialised into chunk shards (gemini/initialise.py)
    manual_optimization_refusal = (
        "the engine owns when chunks are gathered, reduced and refreshed around the optimizer step"
    )
    release_is_collective = True  # restoring whole parameters gathers every chunk

    def __init__(
        self,
        placement: StaticPlacement | AutoPlacement | None = None,
        chunk_numel: int | None = None,
        min_chunk_numel: int = 2**20,
        search_range_numel: int = 2**24,
        search_step_numel: int = 2**16,
        max_prefetch: int = 0,
        communication: Literal["auto", "all_reduce", "scatter_gather"] = "auto",
        init_window_bytes: int = 2**30,
        shard_frozen_parameters: bool = True,
        offload_dir: str | None = None,
        masters_on_disk: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.gemini_config = GeminiConfig(
            placement=placement if placement is not None else StaticPlacement(),
            chunk_numel=chunk_numel,
            min_chunk_numel=min_chunk_numel,
            search_range_numel=search_range_numel,
            search_step_numel=search_step_numel,
            max_prefetch=max_prefetch,
            communication=communication,
            init_window_bytes=init_window_bytes,
            shard_frozen_parameters=shard_frozen_parameters,
            offload_dir=offload_dir,
            masters_on_disk=masters_on_disk,
        )

    def parameter_pieces(self) -> str | None:
        return "only its shards of each chunk (a parameter is an empty placeholder outside its module's forward)"

    def grad_norm_limitation(self) -> str | None:
        return (
            "parameters' `.grad` is None (Gemini keeps each reduced gradient only as this rank's shard of its chunk), so"
            " Lightning's `grad_norm(module)` finds no gradient and logs nothing"
        )

    @classmethod
    def registry_entries(cls) -> Iterable[tuple[str, dict[str, Any]]]:
        return [
            ("colossal_gemini", {"placement": StaticPlacement()}),
            ("colossal_gemini_auto", {"placement": AutoPlacement()}),
            ("colossal_gemini_offload", {"placement": StaticPlacement(offload_optim_frac=1.0)}),
        ]

    # ---------------------------------------------------------------------------------------------- set-up
    def _build_engine(self, trainer: pl.Trainer | None, optimizer: Optimizer | None) -> GeminiEngine:
        # Built outside fitting too: chunks hold the model, so validate/test/predict run through the engine.
        assert self.lightning_module is not None
        engine = GeminiEngine(
            self.lightning_module,
            optimizer,
            self.gemini_config,
            self.device_mesh["dp"],
            self.root_device,
            timeout=self._timeout,
        )
        if trainer is not None:  # (None: built for a Fabric loop, which has no summary)
            # Chunked parameters are empty placeholders between gathers; Lightning's summary would count them as 0.
            count_whole_parameters_in_model_summary(trainer, engine.whole_numel)
        return engine

    def _release_engine(self, engine: GeminiEngine) -> None:
        # Parameters get their whole values back in their own storage (as after any Lightning run); at teardown the
        # base then moves them to the CPU. Between stages: the earlier stage's chunks go, this stage builds its own.
        engine.restore_full_parameters()

    def _annotate_failure(self, exception: BaseException) -> None:
        super()._annotate_failure(exception)
        if self.engine is not None and isinstance(exception, RuntimeError):
            if _PLACEHOLDER_SYMPTOM.search(str(exception)):
                explain_in_message(exception, PLACEHOLDER_HINT)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None:
            return super().training_step(*args, **kwargs)
        with self.engine.step_context():
            output = super().training_step(*args, **kwargs)
        # Ranks may have run different modules (experts without tokens): serve the gathers others still need.
        self.engine.finish_phase()
        return output

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().validation_step(*args, **kwargs)
        if self.engine is not None:
            self.engine.finish_phase()
        return output

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().test_step(*args, **kwargs)
        if self.engine is not None:
            self.engine.finish_phase()
        return output

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().predict_step(*args, **kwargs)
        if self.engine is not None:
            self.engine.finish_phase()
        return output

    @contextmanager
    def whole_parameters(self) -> Generator[None, None, None]:
        # Every chunk gathered (hooks.py ``gather_every_chunk``); the next forward releases what it does not need.
        if self.engine is not None:
            self.engine.gather_every_chunk()
        yield

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self.engine is not None:
            self.engine.prepare_backward(closure_loss)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    # ---------------------------------------------------------------------------------------------- checkpoints
    def model_state_for_checkpoint(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        if self.engine is None:
            return self.lightning_module.state_dict()
        # fp32 master rows of every trainable chunked parameter (never rounded weights), the shard rows of frozen ones
        # (in their own dtype, as module.state_dict() holds them), plus buffers and parameters kept whole; under the
        # module's own state_dict keys (checkpointing.py [Note: a module's own state_dict names]).
        fitted = self._checkpoint_engine()
        # An evaluation stage after fit: its chunks were made from the (possibly rounded) parameters, the fit's engine
        # still holds the fp32 masters its optimizer state belongs to (engine_strategy.py [Note: a fit's optimizer
        # outlives the evaluation after it]).
        chunked = (fitted if fitted is not None else self.engine).state_by_name()
        if fitted is not self.engine and fitted is not None:
            chunked = {**self.engine.state_by_name(), **chunked}
        state = self.lightning_module.state_dict()
        for key, name in parameters_by_state_key(self.lightning_module).items():
            if name in chunked:
                state[key] = chunked[name]
        return state

    def _on_model_state_loaded(self) -> None:
        if self.engine is not None:
            self.engine.masters_loaded()

    def _load_full_model_state(self, state_dict: Mapping[str, Tensor], strict: bool) -> None:
        assert self.lightning_module is not None
        if self.engine is None:
            self.lightning_module.load_state_dict(state_dict, strict=strict)
            return
        expected = set(self.lightning_module.state_dict())
        missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"The checkpoint does not match the model: missing {missing[:10]}, unexpected {unexpected[:10]}."
                " Fix the model or load with `strict_loading = False` on the LightningModule."
            )
        # The file is keyed as the module's state_dict (checkpointing.py [Note: a module's own state_dict names]).
        parameter_of = parameters_by_state_key(self.lightning_module)
        chunked = self.engine.chunked_names()
        self.engine.load_full_weights(
            {parameter_of[key]: value for key, value in state_dict.items() if parameter_of.get(key) in chunked}
        )
        rest = {key: value for key, value in state_dict.items() if parameter_of.get(key) not in chunked}
        self.lightning_module.load_state_dict(rest, strict=False)

    def full_model_state_dict(self) -> dict[str, Tensor]:
        if self.engine is None:
            return super().full_model_state_dict()
        return self.engine.full_state_dict()
