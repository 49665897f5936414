"""The engines on a fake GPU cluster (``cluster.py``): where every tensor lives, and what reaches a process group.

This process plays one rank of 8 or 64 fake GPUs. Each test drives an engine through a training step (a backward is
stood in for by running the gradient hooks: ``run_backward_hooks``), the precision plugin's non-finite vote and
clipping, and the checkpoint view, and the recorder fails the test the moment a host tensor is handed to the
(NCCL-like) group. The rows of the CUDA audit this tier catches, each seen failing by planting the old code back:

- overflow / non-finite flags on the offloaded gradients' device (CPU) all-reduced on the GPU's group (row 1);
- the host's random state broadcast on that group (row 2);
- checkpoint pieces of offloaded state copied to the GPU instead of aliasing it (row 3);
- ZeRO's global norm of offloaded gradients reduced as a host scalar (row 5);
- FSDP's clipping of host shards (row 7: our clipper now reduces one scalar; torch's own went through DTensor).

Not reachable here, and where they are checked instead: row 4 (an unwaited device-to-host copy: fake tensors have
no values; forbidden by ``test_layering.py``'s device rule), row 6 (FSDP2's own kernels cannot run on fake tensors:
the seam test ``test_offload_materialises_a_meta_model_on_the_host`` in ``tests/distributed/test_fsdp.py``), row 8
(the fake unscale kernel does not check devices: a spy here checks what the CUDA kernel would), row 9 (one order over
Gemini's two communicators needs ranks that behave differently: ``tests/distributed/test_native_route.py``), row 10 (bits of sums:
``tests/distributed/test_native_route.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_colossal.config import GeminiConfig, StaticPlacement, ZeroConfig
from lightning_colossal.demo.model import GPT, GPTConfig
from lightning_colossal.distributed import collectives
from lightning_colossal.engine_parts.meta_init import start_from_rank_zero_random_state
from lightning_colossal.engine_parts.sharded_state import piece_of_whole
from lightning_colossal.gemini import GeminiEngine
from lightning_colossal.precision import ColossalPrecision, LocalGradientClipper
from lightning_colossal.zero import ZeroEngine
from tests.fake_cluster.cluster import WrongDevice, fake_cluster, materialise, run_backward_hooks

SMALL_GPT = GPTConfig(vocab_size=64, block_size=16, num_layers=2, num_heads=2, embed_dim=32)


def _local_device(tensor: torch.Tensor) -> str:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).device.type


def _vote_and_clip(optimizer: torch.optim.Optimizer, clipper: Any) -> None:
    """The precision plugin's per-step work: the non-finite vote, the fp16 unscale, then a norm clip."""
    assert ColossalPrecision("32-true").nonfinite_ranks(optimizer) == ([], [])
    scaled = ColossalPrecision("16-mixed")
    assert scaled.unscale_and_check(optimizer) is False
    clipper.clip_by_norm(optimizer, 1.0)


@pytest.mark.parametrize("world_size", [8, 64])
@pytest.mark.parametrize("cpu_offload", [False, True], ids=["on-gpu", "offload"])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_step_hands_every_group_gpu_tensors(stage, cpu_offload, world_size):
    model_on_meta = GPT(SMALL_GPT).to("meta")
    with fake_cluster(world_size, rank=world_size - 3) as cluster:
        mesh = DeviceMesh("cuda", list(range(world_size)))
        model = materialise(model_on_meta, "cuda")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        # Small buckets: the step goes bucket by bucket with the exchanges overlapped (zero/exchange.py), as a model
        # of many buckets does on a real cluster.
        config = ZeroConfig(stage=stage, cpu_offload=cpu_offload, bucket_size_mb=0.0001)
        engine = ZeroEngine(model, optimizer, config, mesh, cluster.device)
        run_backward_hooks(model)
        where = "cpu" if cpu_offload else "cuda"
        assert {master.device.type for master in engine.masters} == {where}
        assert {master.grad.device.type for master in engine.masters if master.grad is not None} == {where}
        _vote_and_clip(optimizer, engine)
        assert len(engine.reducer.buckets) > 2
        engine.step_optimizer(optimizer)
        assert engine._exchanged_in_step
        engine.after_step(stepped=True)
        state = engine.optimizer_state_by_name()["state"]
        for name, entries in state.items():
            for key, value in entries.items():
                if isinstance(value, DTensor):
                    # The checkpoint's piece is the live state itself, where the optimizer keeps it.
                    assert value.device_mesh.device_type == "cuda"
                    assert _local_device(value) == where, (name, key)
        names = {call.name for call in cluster.recorder.calls}
        assert ("reduce_scatter" in names) == (stage == 2), names
        assert "all_gather" in names


@pytest.mark.parametrize(
    "placement",
    [
        StaticPlacement(),
        StaticPlacement(offload_optim_frac=1.0, offload_param_frac=1.0),
        StaticPlacement(offload_optim_frac=0.5),  # some chunks' masters on the GPU, some on the host
    ],
    ids=["on-gpu", "offload", "mixed"],
)
def test_gemini_step_hands_every_group_gpu_tensors(placement):
    model_on_meta = GPT(SMALL_GPT).to("meta")
    with fake_cluster(8, rank=5) as cluster:
        mesh = DeviceMesh("cuda", list(range(8)))
        model = materialise(model_on_meta, "cuda")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        engine = GeminiEngine(
            model, optimizer, GeminiConfig(placement=placement, chunk_numel=8192), mesh, cluster.device
        )
        manager = engine.manager
        assert len(manager.chunks) > 1
        for chunk in manager.chunks:  # what the forward hooks do
            manager.gather(chunk)
        for chunk in reversed(manager.chunks):  # what the gradient hooks do once a chunk's gradients are complete
            chunk.full_gradient = manager.allocate_full_gradient(chunk)
            manager.reduce(chunk)
        manager.complete_reductions(block=True)
        manager.attach_master_gradients()
        masters = [entry.master for entry in engine.sharded_masters]
        gradient_devices = {master.grad.device.type for master in masters}
        expected = {"on-gpu": {"cuda"}, "offload": {"cpu"}, "mixed": {"cpu", "cuda"}}
        kind = (
            "mixed" if placement.offload_optim_frac == 0.5 else "offload" if placement.offload_optim_frac else "on-gpu"
        )
        assert gradient_devices == expected[kind]
        _vote_and_clip(optimizer, engine)
        optimizer.step()
        engine.after_step(stepped=True)
        pieces = {_local_device(value) for value in engine.state_by_name().values()}
        assert pieces == expected[kind]
        assert {"all_gather", "reduce_scatter"} <= {call.name for call in cluster.recorder.calls}


def test_small_collectives_of_host_tensors_run_on_the_gpu_and_land_back_on_the_host():
    with fake_cluster(8, rank=1) as cluster:
        flags = torch.zeros(4)
        result = collectives.all_reduce(flags, op="max")
        assert result is flags and flags.device.type == "cpu"
        state = torch.zeros(16, dtype=torch.uint8)
        collectives.broadcast_tensor(state, source_rank=0)
        assert state.device.type == "cpu"
        assert [call.name for call in cluster.recorder.calls] == ["all_reduce", "broadcast"]


def test_bulk_exchanges_of_host_tensors_are_refused_as_a_placement_bug():
    with fake_cluster(8, rank=1):
        with pytest.raises(RuntimeError, match="placement bug"):
            collectives.reduce_scatter_async(torch.empty(2), torch.empty(16))
        with pytest.raises(RuntimeError, match="placement bug"):
            collectives.all_gather_into_async(torch.empty(16), torch.empty(2))


def test_rank_zero_random_state_reaches_every_rank_through_the_gpu_group():
    with fake_cluster(8, rank=6) as cluster:
        start_from_rank_zero_random_state(cluster.device)
        broadcasts = [call for call in cluster.recorder.calls if call.name == "broadcast"]
        assert len(broadcasts) == 2, broadcasts  # the host's state and the device's


def test_checkpoint_piece_of_a_host_tensor_is_that_tensor_on_a_gpu_mesh():
    with fake_cluster(8, rank=2):
        mesh = DeviceMesh("cuda", list(range(8)))
        master = torch.empty(4, 3)
        piece = piece_of_whole(master, mesh, [Shard(0)], (32, 3))
        assert piece.to_local().device.type == "cpu"
        assert torch._C._is_alias_of(piece.to_local(), master), "a copy: DCP would load into it, not into the master"
        assert piece.shape == (32, 3) and piece.device_mesh is mesh


def test_fsdp_clipping_of_host_shards_reduces_one_scalar_on_the_gpu():
    with fake_cluster(8, rank=3) as cluster:
        mesh = DeviceMesh("cuda", list(range(8)))
        parameters = []
        for _ in range(3):
            parameter = nn.Parameter(piece_of_whole(torch.empty(4, 3), mesh, [Shard(0)], (32, 3)))
            parameter.grad = piece_of_whole(torch.empty(4, 3), mesh, [Shard(0)], (32, 3))
            parameters.append(parameter)
        optimizer = torch.optim.SGD(parameters, lr=0.1)
        norm = LocalGradientClipper().clip_by_norm(optimizer, 1.0)
        assert norm.device.type == "cpu"
        assert [call.name for call in cluster.recorder.calls] == ["all_reduce"]
        assert cluster.recorder.calls[0].shapes == ((),)


def test_the_recorder_catches_a_host_tensor_handed_to_the_group():
    """The tier's own check can fail: a raw torch.distributed call with a host tensor is refused as NCCL would."""
    import torch.distributed as dist

    with fake_cluster(8, rank=0):
        with pytest.raises(WrongDevice, match="No backend type associated with device type cpu"):
            dist.all_reduce(torch.zeros(2))


def test_unscaling_gradients_on_two_devices_gives_each_device_its_own_flag(monkeypatch):
    """Gemini's mixed placement: the fused unscale kernel needs its flag and scale on its gradients' device (row 8;
    the fake kernel does not check, so a spy does what the CUDA kernel's check would)."""
    from lightning_colossal import precision

    kernel = torch._amp_foreach_non_finite_check_and_unscale_
    seen: list[set[str]] = []

    def checking_kernel(gradients: list[torch.Tensor], found: torch.Tensor, inverse_scale: torch.Tensor) -> None:
        devices_used = {tensor.device.type for tensor in [*gradients, found, inverse_scale]}
        seen.append(devices_used)
        assert len(devices_used) == 1, f"one call mixes devices {devices_used}"
        kernel(gradients, found, inverse_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", checking_kernel)
    with fake_cluster(8, rank=0):
        found = precision._check_and_unscale([torch.empty(3), torch.empty(5, device="cuda")], 0.5)
        # Combined on the GPU, not read: the vote reads it once there.
        assert found.device.type == "cuda" and found.dim() == 0
    assert sorted(min(devices_used) for devices_used in seen) == ["cpu", "cuda"]


def _gemini_step_order(rank: int) -> list[Any]:
    model_on_meta = GPT(SMALL_GPT).to("meta")
    with fake_cluster(8, rank=rank) as cluster:
        mesh = DeviceMesh("cuda", list(range(8)))
        model = materialise(model_on_meta, "cuda")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = GeminiEngine(model, optimizer, GeminiConfig(chunk_numel=8192), mesh, cluster.device)
        for chunk in engine.manager.chunks:
            engine.manager.gather(chunk)
        for chunk in reversed(engine.manager.chunks):
            chunk.full_gradient = engine.manager.allocate_full_gradient(chunk)
            engine.manager.reduce(chunk)
        engine.manager.complete_reductions(block=True)
        # Group identities are per process: name the two groups by their role instead.
        roles = {id(engine.process_group): "gathers", id(engine.reduce_group): "reductions"}
        return [(roles.get(call.group_id, "other"), call.name, call.shapes) for call in cluster.recorder.calls]


def test_gemini_issues_the_same_collectives_in_the_same_order_on_every_rank():
    """NCCL matches collectives by their order on each communicator: every rank must issue the same sequence on both
    of Gemini's groups (ranks that run different modules: ``tests/distributed/test_native_route.py``)."""
    first, other = _gemini_step_order(1), _gemini_step_order(6)
    assert first == other
    assert {role for role, _, _ in first} >= {"gathers", "reductions"}


def test_gathering_host_shards_whole_hands_the_gpu_group_gpu_tensors(monkeypatch):
    """Giving an FSDP module back under CPU offload: the shards' sizes and values reach the (NCCL) group as GPU
    tensors, in one all-gather each per bucket, and the whole tensors land where asked ([Note: gathering many shards
    at once] in ``fsdp/whole.py``)."""
    from torch.utils._python_dispatch import _disable_current_modes

    from lightning_colossal.fsdp import full_tensors

    gather_sizes = collectives.all_gather_tensor

    def sizes_with_values(tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        gathered = gather_sizes(tensor, group)  # recorded and checked like any collective
        with _disable_current_modes():  # the values the fake group cannot give: every rank holds 4 rows
            return torch.full(tuple(gathered.shape), 4, dtype=torch.int64)

    monkeypatch.setattr(collectives, "all_gather_tensor", sizes_with_values)
    with fake_cluster(8, rank=5) as cluster:
        mesh = DeviceMesh("cuda", list(range(8)))
        shards = [piece_of_whole(torch.empty(4, 3), mesh, [Shard(0)], (32, 3)) for _ in range(3)]
        wholes = full_tensors([*shards, torch.tensor(1.0)], torch.device("cpu"))
        assert [whole.device.type for whole in wholes] == ["cpu"] * 4
        assert [tuple(whole.shape) for whole in wholes] == [(32, 3)] * 3 + [()]
        assert [call.name for call in cluster.recorder.calls] == ["all_gather", "all_gather"]
