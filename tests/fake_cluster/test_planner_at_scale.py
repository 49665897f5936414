"""A 7B Llama on 64 fake GPUs: the engines' per-rank bytes against the planner's (``python -m lightning_colossal.plan``).

``tests/distributed/test_plan_against_engines.py`` checks the planner to the byte on 2 CPU ranks, where the compute
device and the host are one and every shard is a few hundred elements. Here the engines run as rank 37 of 64 fake
GPUs on a 6.74B-parameter Llama (built on the meta device from its Hugging Face config, given fake CUDA storage), so
the checks are at the scale and on the device split users plan for: ZeRO-2 and Gemini, with the optimizer on the
GPU and offloaded to the host. One optimizer step runs (SGD with momentum: fake tensors have no values for Adam's
step count to divide by), then the engine's own ``memory_report`` is compared with the planner's model state.

Not here: hybrid tp8 x pp2 x dp4, whose engine splits modules with torch's pipelining and DTensor code that this
build cannot run on fake CUDA tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_colossal.callbacks.memory_accounting import gemini_model_state_bytes, zero_model_state_bytes
from lightning_colossal.config import GeminiConfig, StaticPlacement, ZeroConfig
from lightning_colossal.gemini import GeminiEngine
from lightning_colossal.planning.model_state import OPTIMIZERS, Training, model_state
from lightning_colossal.planning.settings import setting_named
from lightning_colossal.planning.sources import huggingface_model
from lightning_colossal.zero import ZeroEngine
from tests.fake_cluster.cluster import fake_cluster, materialise, run_backward_hooks

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # about 15 s a case: a 6.74B-parameter model laid out at 64 ranks

WORLD_SIZE, RANK = 64, 37
LLAMA_7B = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
}


@pytest.fixture(scope="module")
def llama_config_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("llama7b")
    transformers.LlamaConfig(**LLAMA_7B).save_pretrained(directory)
    return directory


def _llama_on_meta() -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_7B))


def _planned(directory: Path, setting_name: str) -> tuple[int, int, int]:
    shape = huggingface_model(str(directory))
    training = Training("32-true", OPTIMIZERS["sgd-momentum"], device_type="cuda")
    planned = model_state(shape.shapes, setting_named(setting_name), training, WORLD_SIZE, RANK)
    return planned.parameters.total, planned.gradients.total, planned.optimizer_state.total


@pytest.mark.parametrize("setting_name", ["colossal_gemini", "colossal_gemini_offload"])
def test_gemini_bytes_per_rank_on_64_gpus_are_the_planners(llama_config_directory, setting_name):
    model_on_meta = _llama_on_meta()
    placement = StaticPlacement(offload_optim_frac=1.0) if setting_name.endswith("offload") else StaticPlacement()
    with fake_cluster(WORLD_SIZE, rank=RANK) as cluster:
        mesh = DeviceMesh("cuda", list(range(WORLD_SIZE)))
        model = materialise(model_on_meta, "cuda")
        assert sum(parameter.numel() for parameter in model.parameters()) == 6_738_415_616
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        engine = GeminiEngine(model, optimizer, GeminiConfig(placement=placement), mesh, cluster.device)
        manager = engine.manager
        for chunk in manager.chunks:
            manager.gather(chunk)
            manager.release(chunk)
        for chunk in reversed(manager.chunks):
            chunk.full_gradient = manager.allocate_full_gradient(chunk)
            manager.reduce(chunk)
        manager.complete_reductions(block=True)
        manager.attach_master_gradients()
        optimizer.step()
        engine.after_step(stepped=True)
        report = engine.memory_report()
        measured = gemini_model_state_bytes({**report._asdict(), "chunks": report.chunks._asdict()})
    planned = _planned(llama_config_directory, setting_name)
    assert (measured["parameters"], measured["gradients"], measured["optimizer_state"]) == planned
    # 6.74B fp32 parameters over 64 ranks: about 421 MB of shards per rank, twice that with separate host masters.
    assert planned[1] == pytest.approx(6_738_415_616 * 4 / WORLD_SIZE, rel=1e-3)


@pytest.mark.parametrize("setting_name", ["colossal_zero2", "colossal_zero2_offload"])
def test_zero2_bytes_per_rank_on_64_gpus_are_the_planners(llama_config_directory, setting_name):
    model_on_meta = _llama_on_meta()
    offload = setting_name.endswith("offload")
    with fake_cluster(WORLD_SIZE, rank=RANK) as cluster:
        mesh = DeviceMesh("cuda", list(range(WORLD_SIZE)))
        model = materialise(model_on_meta, "cuda")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        engine = ZeroEngine(model, optimizer, ZeroConfig(stage=2, cpu_offload=offload), mesh, cluster.device)
        run_backward_hooks(model)
        engine.step_optimizer(optimizer)  # bucket by bucket, each bucket's exchange overlapped (zero/exchange.py)
        engine.after_step(stepped=True)
        measured = zero_model_state_bytes(engine.memory_report()._asdict())
    planned = _planned(llama_config_directory, setting_name)
    assert (measured["parameters"], measured["gradients"], measured["optimizer_state"]) == planned
