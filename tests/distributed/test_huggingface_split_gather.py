"""Split-gather sequence parallelism on the Hugging Face zoo: each family with a layout
(``parallel/huggingface/split_gather.py``) trains under ``colossal_hybrid(tp_size=2, sequence_parallel="split_gather")``
like single-process PyTorch on the same global batch; the others are refused before training, naming why.

The families, their tiny configs, batches, loss and oracle are the zoo's (``test_huggingface_zoo.py``: SGD, lr 0.1, no
momentum, so a wrong gradient scale shows in the weights). The sequence (8 tokens) splits into 4-token shards.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from tests.distributed import test_huggingface_zoo as zoo
from tests.distributed.oracle import quiet_trainer

transformers = pytest.importorskip("transformers")

SPLIT_GATHER = {"tp_size": 2, "sequence_parallel": "split_gather"}

#: Families split-gather trains. Fast rows: one plain decoder newly supported (Gemma: tied head, scaled embedding),
#: one family plan (OPT: fc1/fc2 in the layer itself, biases on shards), one mixture (Mixtral: the MoE block on the
#: whole sequence). Llama/Mistral/Qwen2/Qwen3 keep their rows in test_hybrid_oracle.py.
FAST = ("gemma", "opt", "mixtral")
SLOW = ("gpt2", "phi3", "gpt_neox", "falcon", "bloom", "qwen2_moe", "qwen2", "gemma2")

#: Families the zoo does not train (no data-parallel rows needed), built here the zoo's way. Under AdamW Gemma2's
#: softcapped logits leave a few near-zero gradients whose normalised steps differ by ~1e-4 from one process's; SGD
#: shows the split exact (~1e-8).
EXTRA_FAMILIES = {
    "gemma2": lambda: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**zoo.decoder_settings(head_dim=8, tie_word_embeddings=True))
    ),
}


def register_extra_families() -> None:
    """Let the zoo's builders (``zoo.new_model``) build ``EXTRA_FAMILIES`` too, in this process (the zoo's own rows
    were fixed when it was imported)."""
    for family, build in EXTRA_FAMILIES.items():
        zoo.FAMILIES.setdefault(family, build)


#: Families refused, and a phrase of the reason their refusal names.
REFUSED = {
    "bert": "bidirectional encoder",
    "t5": "cross-attention",
    "switch_transformers": "cross-attention",
    "vit": "[CLS]",
    # Tensor parallelism itself refuses OLMoE (its plan's styles): that refusal comes first.
    "olmoe": "are not applied here",
}


class PipelineZooModule(zoo.ZooModule):
    """The zoo's module with the loss a pipeline schedule asks for (the refused rows below never reach it)."""

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a pipeline refused at set-up ran a step")


def split_gather_body(family: str, strategy_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Train ``family`` for the zoo's steps on the global batch (tp2: one data-parallel rank); the whole weights, or
    the refusal's message."""
    from lightning_colossal import HybridParallelStrategy
    from tests.distributed.hybrid_bodies import full_weights

    register_extra_families()
    module = PipelineZooModule(family) if "pp_size" in strategy_kwargs else zoo.ZooModule(family)
    loader = DataLoader(zoo.step_batches(family, list(range(zoo.WORLD_SIZE))), batch_size=None)
    strategy = HybridParallelStrategy(**strategy_kwargs)
    trainer = quiet_trainer(
        strategy=strategy, devices=zoo.WORLD_SIZE, max_steps=zoo.STEPS, use_distributed_sampler=False
    )
    try:
        trainer.fit(module, train_dataloaders=loader)
    except ValueError as error:
        assert module.steps_run == 0, "refused only after training had started"
        return {"refused": str(error)}
    return {"weights": full_weights(module, strategy), "steps_run": module.steps_run}


def _assert_matches_oracle(family: str, results: list[dict[str, Any]]) -> None:
    register_extra_families()
    expected = zoo.oracle(family)
    for rank, result in enumerate(results):
        assert "refused" not in result, result.get("refused")
        assert result["steps_run"] == zoo.STEPS
        torch.testing.assert_close(
            result["weights"],
            expected,
            **zoo.HYBRID,
            msg=lambda message, rank=rank: f"{family} under split-gather, rank {rank}: {message}",
        )


@pytest.mark.parametrize("family", FAST)
def test_family_trains_under_split_gather_like_one_process(rank_pool_2, family):
    _assert_matches_oracle(family, rank_pool_2.run(split_gather_body, family, SPLIT_GATHER, timeout=120))


@pytest.mark.slow
@pytest.mark.parametrize("family", SLOW)
def test_more_families_train_under_split_gather_like_one_process(rank_pool_2, family):
    _assert_matches_oracle(family, rank_pool_2.run(split_gather_body, family, SPLIT_GATHER, timeout=120))


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_families_without_a_layout_are_refused_naming_why(rank_pool_2, family):
    for result in rank_pool_2.run(split_gather_body, family, SPLIT_GATHER, timeout=120):
        assert "refused" in result, "trained instead of being refused"
        assert REFUSED[family] in result["refused"], result["refused"]


#: Families with tensor parallelism but no built-in pipeline stages, and a phrase of the reason their refusal names.
PIPELINE_REFUSED = {"opt": "learned positions", "bloom": "ALiBi", "gpt_neox": "embed_in"}


@pytest.mark.parametrize("family", sorted(PIPELINE_REFUSED))
def test_pipelines_of_families_without_stages_are_refused_naming_why(rank_pool_2, family):
    strategy_kwargs = {"pp_size": 2, "num_microbatches": 2}
    for result in rank_pool_2.run(split_gather_body, family, strategy_kwargs, timeout=120):
        assert "refused" in result, "trained instead of being refused"
        assert PIPELINE_REFUSED[family] in result["refused"] and "pp_size=1" in result["refused"], result["refused"]
