"""What a training step would make a real GPU's host wait for, counted on fake GPUs (``cluster.DeviceWork``).

On CPU a copy is free and a scalar read costs nothing, so no CPU step time shows these costs; on a GPU each one
drains the device's queue. The tests drive ZeRO and Gemini through a backward (the gradient hooks) and an optimizer
step as one rank of 8 fake GPUs, on a GPT of 2 and of 4 blocks, and check that the waits do not grow with the
number of parameters: a wait per parameter (a flag written into a device tensor per gradient, once 2 x 49 of them
on these models) is a wait per parameter tensor per step on a GPU. Gemini also runs one forward first, whose hooks
gather the chunks in rounds that every rank enters together (hooks.py [Note: gathering in rounds]).

``python -m tests.fake_cluster.test_device_waits`` prints the counts per step for each mode.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_colossal.config import GeminiConfig, StaticPlacement, ZeroConfig
from lightning_colossal.demo.model import GPT, GPTConfig
from lightning_colossal.gemini import GeminiEngine
from lightning_colossal.zero import ZeroEngine
from tests.fake_cluster.cluster import DeviceWork, fake_cluster, materialise, run_backward_hooks

WORLD_SIZE = 8
SEQUENCE = 16  # tokens per sequence, the GPT's block size


def _gpt(blocks: int) -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=SEQUENCE, num_layers=blocks, num_heads=2, embed_dim=32)).to("meta")


@dataclass(frozen=True)
class StepWork:
    parameters: int
    backward: DeviceWork
    step: DeviceWork
    forward: DeviceWork | None = None  # Gemini's: its hooks gather the chunks in rounds (ZeRO's forward has no hooks)
    gather_rounds: int = 0  # the forward's rounds, each one vote over which chunks to gather (at 8 ranks)
    chunks: int = 0  # Gemini's
    buckets: int = 0  # ZeRO's buckets that hold rows of this rank


def _sgd(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)


def zero_step(
    blocks: int,
    stage: int,
    cpu_offload: bool,
    make_optimizer: Callable[[Any], Any] = _sgd,
    world_size: int = WORLD_SIZE,
    bucket_size_mb: float = 0.0001,  # 100 bytes: most parameters get a bucket of their own
) -> StepWork:
    model_on_meta = _gpt(blocks)
    with fake_cluster(world_size, rank=world_size - 1) as cluster:
        mesh = DeviceMesh("cuda", list(range(world_size)))
        model = materialise(model_on_meta, "cuda")
        optimizer = make_optimizer(model.parameters())
        config = ZeroConfig(stage=stage, cpu_offload=cpu_offload, bucket_size_mb=bucket_size_mb)
        engine = ZeroEngine(model, optimizer, config, mesh, cluster.device)
        start = cluster.device_work()
        run_backward_hooks(model)
        after_backward = cluster.device_work()
        engine.step_optimizer(optimizer)
        engine.after_step(stepped=True)
        end = cluster.device_work()
        buckets = sum(any(member.spec.local_numel for member in bucket.members) for bucket in engine.reducer.buckets)
        return StepWork(
            len(list(model.parameters())), after_backward.since(start), end.since(after_backward), buckets=buckets
        )


def gemini_step(
    blocks: int,
    placement: StaticPlacement,
    make_optimizer: Callable[[Any], Any] = _sgd,
    world_size: int = WORLD_SIZE,
) -> StepWork:
    model_on_meta = _gpt(blocks)
    with fake_cluster(world_size, rank=world_size - 1) as cluster:
        mesh = DeviceMesh("cuda", list(range(world_size)))
        model = materialise(model_on_meta, "cuda")
        optimizer = make_optimizer(model.parameters())
        engine = GeminiEngine(
            model, optimizer, GeminiConfig(placement=placement, chunk_numel=8192), mesh, cluster.device
        )
        manager = engine.manager
        tokens = torch.zeros((2, SEQUENCE), dtype=torch.long, device="cuda")
        votes_before = _votes(cluster, engine.vote_group)
        before_forward = cluster.device_work()
        # Without autograd: on fake CUDA tensors it aborts in C++ (a CUDA device guard this build has not got). The
        # hooks gather the same chunks in the same rounds either way; they only leave out the hooks waiting for backward.
        with torch.no_grad():
            model(tokens)
        forward = cluster.device_work().since(before_forward)
        rounds = _votes(cluster, engine.vote_group) - votes_before
        for chunk in manager.chunks:  # what the backward hooks would gather (they do not run here)
            manager.gather(chunk)
        start = cluster.device_work()
        run_backward_hooks(model)
        after_backward = cluster.device_work()
        engine.step_optimizer(optimizer)  # as the strategy steps it
        engine.after_step(stepped=True)
        end = cluster.device_work()
        return StepWork(
            len(list(model.parameters())),
            after_backward.since(start),
            end.since(after_backward),
            forward,
            rounds,
            len(manager.chunks),
        )


def _votes(cluster: Any, vote_group: Any) -> int:
    """The all-reduces on the host group of votes so far (0 at one rank, where there is none)."""
    if vote_group is None:
        return 0
    return sum(1 for call in cluster.recorder.calls if call.name == "all_reduce" and call.group_id == id(vote_group))


MODES = {
    "zero1": lambda blocks: zero_step(blocks, 1, False),
    "zero2": lambda blocks: zero_step(blocks, 2, False),
    "zero2_offload": lambda blocks: zero_step(blocks, 2, True),
    "gemini": lambda blocks: gemini_step(blocks, StaticPlacement()),
    "gemini_offload": lambda blocks: gemini_step(
        blocks, StaticPlacement(offload_optim_frac=1.0, offload_param_frac=1.0)
    ),
    # One GPU, where nothing is sharded and every wait is the engine's own overhead (the GPU run's 1.27-1.28x).
    "zero2_one_rank": lambda blocks: zero_step(blocks, 2, False, world_size=1),
    "zero2_offload_one_rank": lambda blocks: zero_step(blocks, 2, True, world_size=1),
    "gemini_one_rank": lambda blocks: gemini_step(blocks, StaticPlacement(), world_size=1),
    "gemini_offload_one_rank": lambda blocks: gemini_step(
        blocks, StaticPlacement(offload_optim_frac=1.0, offload_param_frac=1.0), world_size=1
    ),
}


@functools.cache
def counted(mode: str, blocks: int) -> StepWork:
    """``MODES[mode](blocks)``, run once per session: the counts are deterministic, and several tests read them."""
    return MODES[mode](blocks)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_backward_writes_no_number_into_device_memory(mode):
    """Which parameters got a gradient is recorded on the host, and Gemini's gather rounds build their vote there:
    written into a device tensor, each number was a blocking copy (per parameter, and per round)."""
    small, large = counted(mode, 2), counted(mode, 4)
    assert large.parameters > small.parameters
    assert (small.backward.scalar_writes, large.backward.scalar_writes) == (0, 0), (small.backward, large.backward)


#: Known to grow with the model, each left for issue 44's next steps (none now: Gemini's offloaded chunks drain their
#: reduced gradients with one wait, gemini/manager.py [Note: reduced gradients drained to the host once]).
GROWING: dict[str, str] = {}
#: Waits beyond the vote: the one wait for every offloaded chunk's reduced gradient on its way to the host.
DRAIN_WAITS = {"gemini_offload": 1, "gemini_offload_one_rank": 1}


@pytest.mark.parametrize(
    "mode",
    [pytest.param(mode, marks=pytest.mark.xfail(strict=True, reason=GROWING[mode])) if mode in GROWING else mode
     for mode in MODES],
)  # fmt: skip
def test_the_waits_of_a_backward_do_not_grow_with_the_number_of_parameters(mode):
    small, large = counted(mode, 2), counted(mode, 4)
    assert large.backward.waits == small.backward.waits, (small.backward, large.backward)
    # The vote over which parameters got a gradient (host flags to the device and back), and Gemini's closing round.
    assert large.backward.waits <= 4 + DRAIN_WAITS.get(mode, 0), large.backward


#: A backward's waits at 8 ranks, all of them: offloaded gradients come to the host with one wait for all of them.
BACKWARD_WAITS = {"zero1": 0, "zero2": 0, "zero2_offload": 1, "gemini": 0, "gemini_offload": 1}


@pytest.mark.parametrize("mode", list(BACKWARD_WAITS))
def test_votes_on_the_host_leave_a_backward_no_wait_but_offloads_one(mode):
    """The engines' votes (which parameters got a gradient on any rank; Gemini's gather rounds) go over a host group
    beside the devices' groups (collectives.py [Note: votes on the host]), so at 8 ranks a backward waits for nothing
    but, offloaded, the gradients' copies to the host. Each vote cost 2 waits (the flags to the device and back):
    ZeRO 2, Gemini 4."""
    work = counted(mode, 4)
    assert work.backward.waits == BACKWARD_WAITS[mode], work.backward


@pytest.mark.parametrize("mode", ["zero2_one_rank", "zero2_offload_one_rank", "gemini_one_rank"])
def test_one_rank_backward_launches_one_kernel_per_gradient(mode):
    """At one rank nothing is exchanged, so a backward's device work is each gradient added where the step reads it:
    one kernel per parameter, as torch DDP's copy into its bucket (stages.py [Note: ZeRO-2 on one rank]; Gemini adds
    into the chunk's gradient, then folds a chunk with one foreach call). It was three per parameter for ZeRO-2
    (a memset per bucket, a staging copy and an add) and two for Gemini."""
    # Offloaded, the reduced rows also go to the host gradients: one copy of the whole accumulator (engine.py), not
    # one per parameter as before.
    per_parameter = 1
    for blocks in (2, 4):
        work = counted(mode, blocks)
        # Gemini's foreach fold per chunk, and end-of-backward work, a few per step whatever the model.
        folds = work.chunks + 8
        assert work.backward.kernels <= per_parameter * work.parameters + folds, (blocks, work.backward)


#: Offloaded ZeRO runs whose step copies the masters to the device: one copy per step, or per bucket.
MASTER_COPIES = {
    "zero2_offload_one_rank": lambda blocks: counted("zero2_offload_one_rank", blocks),
    "zero2_offload": lambda blocks: counted("zero2_offload", blocks),
    # Stage 1's 100-byte buckets hold a parameter each (full gradients): 10 KiB ones, a few parameters each.
    "zero1_offload_10k_buckets": lambda blocks: zero_step(blocks, 1, True, bucket_size_mb=0.01),
}


@pytest.mark.parametrize("mode", list(MASTER_COPIES))
def test_offloaded_masters_reach_the_device_in_one_pinned_copy_per_step_or_bucket(mode):
    """After the host step the offloaded masters go to the device in one copy of their span of the pinned flat
    buffer, then one foreach copy on the device writes them into the parameters' rows (engine.py [Note: masters to
    the device in one copy]). One copy per parameter before: 53 (29) per step. At one rank stage 2 publishes them
    all at once after the step; at 8 ranks the exchange overlaps the step and each bucket's rows go over as it
    stepped, one copy per bucket (stage 2's 100-byte buckets hold 1 to 4 parameters' rows here: 19 (11) buckets)."""
    for blocks in (2, 4):
        work = MASTER_COPIES[mode](blocks)
        copies = work.step.host_to_device_copies + work.step.pinned_host_to_device_copies
        expected = 1 if mode.endswith("one_rank") else work.buckets
        assert copies == expected < work.parameters, (blocks, work.buckets, work.step)
        # From the pinned master buffer (devices.host_buffer beside the GPU), asynchronously: no wait.
        assert work.step.waits == 0, (blocks, work.step)


#: Gemini's forward at 8 ranks: no wait. Each round's vote goes over the host group (collectives.py [Note: votes on
#: the host]); the gathers run on the device's group; an offloaded chunk's shard comes to the device asynchronously
#: from pinned memory, one copy per chunk.
FORWARD_PINNED_COPIES_PER_CHUNK = {"gemini": 0, "gemini_offload": 1}


@pytest.mark.parametrize("mode", list(FORWARD_PINNED_COPIES_PER_CHUNK))
def test_a_gemini_forward_waits_for_nothing_in_its_gather_rounds(mode):
    for blocks in (2, 4):
        work = counted(mode, blocks)
        assert work.forward is not None
        # A round per chunk as the blocks reach it (each asks for the next one), and the round that ends the forward.
        assert work.gather_rounds == work.chunks + 1, (blocks, work.gather_rounds, work.chunks)
        assert work.forward.waits == 0, (blocks, work.forward)
        pinned = FORWARD_PINNED_COPIES_PER_CHUNK[mode] * work.chunks
        assert work.forward.pinned_host_to_device_copies == pinned, (blocks, work.forward)


if __name__ == "__main__":
    for name, run in MODES.items():
        for blocks in (2, 4):
            work = run(blocks)
            print(f"{name:16s} {work.parameters:3d} parameters  backward {work.backward}  step {work.step}")
            if work.forward is not None:
                print(f"{'':16s} forward, {work.gather_rounds} gather rounds: {work.forward}")


def vote_work(world_size: int, precision: str, offloaded: bool) -> DeviceWork:
    """The precision plugin's per-step check over a GPT's gradients (on the host when ``offloaded``), after a loss."""
    from lightning_colossal.precision import ColossalPrecision

    model_on_meta = _gpt(4)
    with fake_cluster(world_size, rank=world_size - 1) as cluster:
        model = materialise(model_on_meta, "cpu" if offloaded else "cuda")
        for parameter in model.parameters():
            parameter.grad = torch.empty(parameter.shape, device=parameter.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        plugin = ColossalPrecision(precision)  # type: ignore[arg-type]
        start = cluster.device_work()
        if plugin.loss_scaler is None:
            plugin._nonfinite_loss = (
                torch.isfinite(torch.empty((), device="cuda")).all().logical_not()
            )  # pre_backward's
            assert plugin.nonfinite_ranks(optimizer) == ([], [])
        else:
            assert plugin.unscale_and_check(optimizer) is False
        return cluster.device_work().since(start)


@pytest.mark.parametrize("world_size", [1, 8])
@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_the_nonfinite_check_waits_once_per_step_and_writes_no_gradient(world_size, precision):
    """One read for the decision the step needs (step, skip or raise); the flags are made and voted on the device."""
    work = vote_work(world_size, precision, offloaded=False)
    assert work.waits == 1, work


def test_offloaded_gradients_add_one_copy_to_the_check():
    work = vote_work(8, "32-true", offloaded=True)
    assert work.waits <= 2, work  # the host's flag to the device, and the read


@pytest.mark.parametrize("mode", ["zero2_offload", "gemini_offload"])
def test_offloaded_masters_step_with_the_fused_host_kernel(mode, monkeypatch):
    """[Note: the host step runs torch's fused kernel]: AdamW left to torch steps offloaded masters with the fused CPU
    kernel (torch alone would run its per-tensor loop on them). (Masters on fake GPUs cannot step here: torch's
    foreach AdamW reads its step count, which this tier answers with 0.)"""
    calls: list[set[str]] = []
    optimizers: list[torch.optim.Optimizer] = []
    fused = torch._fused_adamw_

    def spy(params, *args, **kwargs):
        calls.append({parameter.device.type for parameter in params})
        return fused(params, *args, **kwargs)

    def adamw(parameters: Any) -> torch.optim.Optimizer:
        optimizers.append(torch.optim.AdamW(parameters, lr=1e-3))
        return optimizers[-1]

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    if mode == "zero2_offload":
        zero_step(2, 2, True, adamw)
    else:
        gemini_step(2, StaticPlacement(offload_optim_frac=1.0, offload_param_frac=1.0), adamw)
    assert all(group["fused"] is None for group in optimizers[0].param_groups), "the user's setting is back"
    assert calls and all(devices == {"cpu"} for devices in calls), calls


def test_gemini_offloaded_chunks_live_in_host_buffers_pinned_beside_the_gpu(monkeypatch):
    """Masters, shards and gradient shards of offloaded chunks come from ``device.host_buffer`` beside the GPU (pinned
    on a real one: copies from pageable memory each wait for the GPU's queue). This tier cannot pin, so the request
    is what is checked."""
    from lightning_colossal.distributed import device as devices

    requested: list[tuple[int, torch.dtype, str]] = []
    host_buffer = devices.host_buffer

    def spy(numel: int, dtype: torch.dtype, beside: torch.device, zeroed: bool = False) -> torch.Tensor:
        requested.append((numel, dtype, beside.type))
        return host_buffer(numel, dtype, beside, zeroed)

    monkeypatch.setattr(devices, "host_buffer", spy)
    work = gemini_step(2, StaticPlacement(offload_optim_frac=1.0, offload_param_frac=1.0))
    assert work.parameters > 0
    kinds = {(dtype, beside) for _, dtype, beside in requested}
    assert kinds == {(torch.float32, "cuda")}, kinds
    # Shards and masters of every chunk (fp32 shards are their own masters), then a gradient shard per chunk.
    assert len(requested) >= 2, requested
