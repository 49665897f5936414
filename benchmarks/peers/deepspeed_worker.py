"""The body of one DeepSpeed rank: the benchmark GPT trained by DeepSpeed's own engine, measured as a Lightning run.

``benchmarks.peers.worker`` hands ``deepspeed_zero1``, ``deepspeed_zero2`` and ``deepspeed_zero3`` runs to
``run_deepspeed``. Lightning's ``DeepSpeedStrategy`` cannot train them here: its ``setup_environment`` raises
"The DeepSpeed strategy is only supported on CUDA GPUs but `CPUAccelerator` is used." So this module calls
``deepspeed.initialize`` itself, on DeepSpeed's CPU accelerator over gloo, with what every Lightning run of the
harness gets: the GPT built right after ``torch.manual_seed(seed)``, the same batches split over the ranks as
Lightning's ``DistributedSampler`` splits them, fp32, and torch's ``AdamW(lr)`` handed to DeepSpeed as
its client optimizer (DeepSpeed wraps it in its ZeRO optimizer, which steps it on this rank's fp32 partition). The
``zero_optimization`` settings are those Lightning's ``DeepSpeedStrategy`` writes by default, so the figures are
what that strategy would train on a GPU, less its CUDA-only checks.

A step is timed as Lightning's are (forward, backward, gradient communication, optimizer step; the batch already
fetched), and the bytes are counted from real tensors: parameters are the model's storage plus DeepSpeed's own
parameter partitions and fp32 masters where they are separate tensors; gradients are those present when the wrapped
AdamW steps on the last step; optimizer state is AdamW's ``state``. Every other tensor DeepSpeed's ZeRO optimizer
holds at that moment (gradient buckets, flat buffers) is counted apart, by attribute, for the notes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.harness.measure import covered_bytes, gradient_bytes, optimizer_state_bytes
from benchmarks.peers.configuration import DEEPSPEED_STAGES, RunSpec
from benchmarks.peers.worker import BenchmarkProbe, rank_result
from lightning_colossal.demo.data import RandomTokenDataset
from lightning_colossal.demo.model import GPT, GPTConfig

__all__ = ["deepspeed_config", "run_deepspeed"]

# Lightning's DeepSpeedStrategy defaults (lightning/pytorch/strategies/deepspeed.py), so these runs train what that
# strategy would configure. sub_group_size only matters to stage 3: one optimizer sub-group for this model.
_LIGHTNING_ZERO_DEFAULTS: dict[str, Any] = {
    "contiguous_gradients": True,
    "overlap_comm": True,
    "allgather_partitions": True,
    "reduce_scatter": True,
    "allgather_bucket_size": 200_000_000,
    "reduce_bucket_size": 200_000_000,
    "sub_group_size": 1_000_000_000_000,
}


def deepspeed_config(spec: RunSpec) -> dict[str, Any]:
    """The DeepSpeed config of a run: its ZeRO stage, Lightning's defaults with ``spec.init_args`` over them, fp32
    (no fp16/bf16 section), no gradient clipping or accumulation, no logging between steps."""
    return {
        "train_micro_batch_size_per_gpu": spec.batch_size_per_rank,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": DEEPSPEED_STAGES[spec.strategy], **_LIGHTNING_ZERO_DEFAULTS, **spec.init_args},
        # Torch's AdamW is not on DeepSpeed's list of optimizers tested with ZeRO; Lightning allows it by default too.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _batches(spec: RunSpec, model_config: GPTConfig, rank: int) -> DataLoader:
    dataset = RandomTokenDataset(
        vocab_size=model_config.vocab_size,
        block_size=spec.sequence_length,
        num_samples=spec.batch_size_per_rank * spec.world_size * spec.total_steps,
        seed=spec.seed,
    )
    # What Lightning puts in the harness's loader: for training it always injects a shuffling DistributedSampler,
    # seeded with PL_GLOBAL_SEED or 0 (lightning/pytorch/trainer/connectors/data_connector.py), and the harness
    # trains one epoch, so every configuration reads the same permutation split over the ranks.
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=spec.world_size, rank=rank, shuffle=True, seed=int(os.environ.get("PL_GLOBAL_SEED", 0))
    )
    return DataLoader(dataset, batch_size=spec.batch_size_per_rank, sampler=sampler, drop_last=True)


def _tensors_under(value: Any, depth: int, seen: set[int]) -> Iterator[torch.Tensor]:
    """Tensors inside ``value``: itself, its lists, tuples and dicts, and the attributes of DeepSpeed's own objects
    (gradient buckets), ``depth`` levels down; each object visited once."""
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta":  # DeepSpeed keeps meta placeholders, which hold no bytes
            yield value
        yield from _tensors_under(getattr(value, "ds_tensor", None), depth, seen)  # a stage-3 partition
    elif depth > 0 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_under(item, depth - 1, seen)
    elif depth > 0 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors_under(item, depth - 1, seen)
    elif depth > 0 and type(value).__module__.startswith("deepspeed") and hasattr(value, "__dict__"):
        for item in vars(value).values():
            yield from _tensors_under(item, depth - 1, seen)


def _engine_tensors_by_attribute(zero_optimizer: Any) -> dict[str, list[torch.Tensor]]:
    """The tensors DeepSpeed's ZeRO optimizer holds, by the attribute that holds them. The wrapped torch optimizer
    is not walked (its state is counted as optimizer state); neither is the model."""
    seen: set[int] = {id(zero_optimizer.optimizer)}
    return {
        name: tensors
        for name, value in vars(zero_optimizer).items()
        if (tensors := list(_tensors_under(value, depth=4, seen=seen)))
    }


class DeepSpeedBytes:
    """Model-state bytes of a DeepSpeed rank, counted when the wrapped AdamW steps on the last step (when the
    gradients it steps with are present) and, for parameters and optimizer state, again at the end."""

    def __init__(self, engine: Any, total_steps: int) -> None:
        self.engine = engine
        self.zero_optimizer = engine.optimizer
        self.total_steps = total_steps
        self.step = 0
        self.bytes: dict[str, Any] = {}
        self._handle = self.zero_optimizer.optimizer.register_step_pre_hook(self._before_adamw_step)

    def _stepped(self) -> list[torch.Tensor]:
        inner = self.zero_optimizer.optimizer
        return [parameter for group in inner.param_groups for parameter in group["params"]]

    def _parameters(self) -> list[torch.Tensor]:
        """The model's parameter storage, DeepSpeed's stage-3 partitions of it, and the fp32 masters AdamW steps."""
        model_parameters = list(self.engine.module.parameters())
        partitions = [parameter.ds_tensor for parameter in model_parameters if hasattr(parameter, "ds_tensor")]
        return [*model_parameters, *partitions, *self._stepped()]

    def _before_adamw_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.step != self.total_steps - 1:
            return
        stepped = self._stepped()
        gradients = [tensor.grad for tensor in [*self.engine.module.parameters(), *stepped] if tensor.grad is not None]
        self.bytes["gradients"] = gradient_bytes([*self.engine.module.parameters(), *stepped])
        self.bytes["adamw_steps_in_last_step"] = self.bytes.get("adamw_steps_in_last_step", 0) + 1
        state = [value for values in optimizer.state.values() for value in values.values() if torch.is_tensor(value)]
        counted = [*self._parameters(), *gradients, *state]
        by_attribute = _engine_tensors_by_attribute(self.zero_optimizer)
        engine_tensors = [tensor for tensors in by_attribute.values() for tensor in tensors]
        # Beyond parameters, masters, gradients and optimizer state: the union of everything less the union of those.
        self.bytes["engine_other_bytes"] = covered_bytes([*counted, *engine_tensors]) - covered_bytes(counted)
        # Per attribute, the same difference: names what the extra bytes are.
        model_state_bytes = covered_bytes(counted)
        self.bytes["engine_bytes_by_attribute"] = {
            name: size
            for name, tensors in by_attribute.items()
            if (size := covered_bytes([*counted, *tensors]) - model_state_bytes)
        }

    def finish(self) -> dict[str, Any]:
        """Parameter and optimizer-state bytes after the last step, beside the gradients counted during it."""
        self._handle.remove()
        state_total, state_by_key = optimizer_state_bytes([self.zero_optimizer.optimizer])
        model_parameters = list(self.engine.module.parameters())
        self.bytes["parameters"] = covered_bytes(self._parameters())
        self.bytes["parameter_split"] = {
            "model_storage": covered_bytes(model_parameters),
            "separate_partitions_and_masters": covered_bytes(self._parameters()) - covered_bytes(model_parameters),
        }
        self.bytes["optimizer_state"] = state_total
        self.bytes["optimizer_state_by_key"] = state_by_key
        self.bytes["parameter_tensors"] = len(model_parameters)
        return self.bytes


def _train(engine: Any, loader: DataLoader, probe: BenchmarkProbe, counter: DeepSpeedBytes) -> None:
    """Lightning's loop body, as the probe times it: the batch is fetched before the step's clock starts."""
    for step, (input_ids, targets) in enumerate(loader):
        counter.step = step
        if step == probe.warmup_steps:
            probe.open_window()
        start = time.perf_counter()
        logits = engine(input_ids)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        engine.backward(loss)
        engine.step()  # reduces the gradients, steps AdamW on this rank's partition, gathers, zeroes the gradients
        elapsed = time.perf_counter() - start
        (probe.step_times if step >= probe.warmup_steps else probe.warmup_step_times).append(elapsed)
        probe.losses.append(float(loss.detach()))
        if step == probe.total_steps - 1:
            probe.close_window()


def run_deepspeed(spec: RunSpec, rank: int) -> dict[str, Any]:
    """Train one run of a ``deepspeed_zero*`` configuration on this rank and return its measurements."""
    # DeepSpeed picks its accelerator once, at its first use; the harness's ranks are CPU ranks.
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # joins through RANK, WORLD_SIZE, MASTER_*
    model_config = GPTConfig(**spec.model_config)
    torch.manual_seed(spec.seed)  # the same initial weights as every Lightning configuration
    model = GPT(model_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(spec))
    probe = BenchmarkProbe(spec.warmup_steps, spec.total_steps)
    counter = DeepSpeedBytes(engine, spec.total_steps)
    _train(engine, _batches(spec, model_config, rank), probe, counter)
    if len(probe.step_times) != spec.measured_steps:
        raise RuntimeError(f"Measured {len(probe.step_times)} steps, expected {spec.measured_steps}.")
    probe.bytes = counter.finish()
    result = rank_result(probe, rank, model_config, spec.world_size, type(engine.optimizer).__qualname__)
    torch.distributed.barrier()  # no rank leaves while another still needs it in a collective
    torch.distributed.destroy_process_group()
    return result
