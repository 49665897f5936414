"""Errors and warnings users meet before training starts (issue 12): misspelt strategy names, DDP's deprecated
``broadcast_buffers``. Nothing here starts a process group."""

from __future__ import annotations

import warnings

import pytest
from lightning.pytorch import Trainer

import lightning_colossal
from lightning_colossal import ColossalDDPStrategy, GeminiStrategy, closest_strategy_names, strategy_from_name


def test_misspelt_name_names_the_closest_strategies():
    with pytest.raises(
        ValueError, match=r"'colossal_gemeni' is not a lightning_colossal.*Did you mean 'colossal_gemini'"
    ):
        Trainer(strategy=strategy_from_name("colossal_gemeni"), accelerator="cpu", devices=1, logger=False)
    assert closest_strategy_names("colossal_zero_2")[0] == "colossal_zero2"
    assert closest_strategy_names("deepspeed") == []


def test_strategy_from_name_applies_the_name_and_the_arguments():
    strategy = strategy_from_name("colossal_gemini_offload", chunk_numel=4096)
    assert isinstance(strategy, GeminiStrategy)
    assert strategy.gemini_config.chunk_numel == 4096
    assert strategy.gemini_config.placement.offload_optim_frac == 1.0  # implied by the name
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False)
    assert trainer.strategy is strategy
    assert set(lightning_colossal.strategy_names()) >= {"colossal_ddp", "colossal_gemini_notebook", "colossal_hybrid"}


def test_deprecated_broadcast_buffers_warns_once_and_only_when_passed():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails
        assert ColossalDDPStrategy().ddp_config.forward_sync_buffers
        assert not ColossalDDPStrategy(forward_sync_buffers=False).ddp_config.forward_sync_buffers
    with pytest.warns(
        FutureWarning, match=r"broadcast_buffers=False\) is deprecated.*forward_sync_buffers=False"
    ) as caught:
        strategy = ColossalDDPStrategy(broadcast_buffers=False)
    assert len(caught) == 1
    assert strategy.ddp_config.broadcast_buffers is False
    with pytest.raises(ValueError, match="pass only forward_sync_buffers"):
        ColossalDDPStrategy(broadcast_buffers=True, forward_sync_buffers=True)
