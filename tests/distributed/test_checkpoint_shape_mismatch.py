"""A checkpoint loaded into a model whose parameter has another shape under the same name: a clear error naming the
parameter and both shapes, before any weight changes, under every strategy."""

from __future__ import annotations

import pytest
import torch

import lightning_colossal  # noqa: F401  (registers the strategy names)
from tests.distributed.oracle import new_module, quiet_trainer

STRATEGIES = ["colossal_ddp", "colossal_zero2", "colossal_gemini", "colossal_fsdp", "colossal_hybrid"]


def shape_mismatch_body(strategy: str, directory: str) -> str:
    world_size = torch.distributed.get_world_size()
    trainer = quiet_trainer(strategy=strategy, devices=world_size, max_steps=1)
    trainer.fit(new_module())
    path = f"{directory}/saved.ckpt"
    trainer.save_checkpoint(path)
    module = new_module()
    module.model.output = torch.nn.Linear(32, 3)  # saved as [1, 32]; same name, another shape
    trainer = quiet_trainer(strategy=strategy, devices=world_size, max_steps=2)
    try:
        trainer.fit(module, ckpt_path=path)
    except Exception as error:  # noqa: BLE001 (the message is what is checked)
        return f"{type(error).__name__}: {error}"
    return "loaded"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_loading_into_another_shape_names_the_parameter_and_both_shapes(rank_pool_2, tmp_path, strategy):
    messages = rank_pool_2.run(shape_mismatch_body, strategy, str(tmp_path))
    for message in messages:
        assert message.startswith("ValueError: ") and "saved.ckpt does not fit this model" in message, message
        assert "model.output.weight: [1, 32] in the checkpoint, [3, 32] in this model" in message, message
