"""``ShardedWeightAverage`` computes what torch's ``AveragedModel`` computes, bit for bit, on the same weights: the
default SWA average, an ``avg_fn`` (EMA), a ``multi_avg_fn``, buffers averaged or copied, tied weights averaged once;
and its swap and write put exactly the average into the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn

from lightning_colossal.engine_parts.weight_average import ShardedWeightAverage


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(6, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embedding.weight  # tied: one parameter under two names

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embedding(tokens)))


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 6, (8,), generator=generator)
    optimizer.zero_grad()
    model(tokens).logsumexp(dim=-1).mean().backward()
    optimizer.step()


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"avg_fn": get_ema_avg_fn(0.7)},
        {"multi_avg_fn": get_ema_multi_avg_fn(0.6)},
        {"use_buffers": False},
    ],
    ids=["swa", "ema", "ema_multi", "parameters_only"],
)
def test_equals_torch_averaged_model_bit_for_bit(settings):
    torch.manual_seed(0)
    model = Tied()
    use_buffers = settings.get("use_buffers", True)
    functions = {key: value for key, value in settings.items() if key != "use_buffers"}
    reference = AveragedModel(model, use_buffers=use_buffers, **functions)
    average = ShardedWeightAverage(
        live_state=model.state_dict,
        after_written=lambda: None,
        buffer_names=[name for name, _ in model.named_buffers()],
        use_buffers=use_buffers,
        **functions,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    for step in range(4):
        _train_step(model, optimizer, step)
        reference.update_parameters(model)
        average.update_parameters(model)
    assert int(average.n_averaged) == int(reference.n_averaged) == 4
    expected = reference.module.state_dict()
    for name, value in average.state_for_checkpoint().items():
        assert torch.equal(value, expected[name]), name
    # The tied weight has one average under both names, averaged once.
    assert average.state["head.weight"] is average.state["embedding.weight"]
    # The average moved away from the last weights: there was something to average.
    assert not torch.equal(average.state["embedding.weight"], model.embedding.weight)


def test_swap_twice_restores_both_and_write_puts_the_average_in():
    torch.manual_seed(0)
    model = Tied()
    written = []
    average = ShardedWeightAverage(
        model.state_dict, lambda: written.append(True), [name for name, _ in model.named_buffers()]
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    for step in range(3):
        _train_step(model, optimizer, step)
        average.update_parameters(model)
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    averaged = {name: value.clone() for name, value in average.state.items()}
    average.swap_with_model()
    for name, value in model.state_dict().items():
        assert torch.equal(value, averaged[name]), name
    average.swap_with_model()
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
        assert torch.equal(average.state[name], averaged[name]), name
    average.write_into_model()
    for name, value in model.state_dict().items():
        assert torch.equal(value, averaged[name]), name
    assert written == [True, True, True]  # the engine re-syncs after every write


def test_refuses_both_averaging_functions():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="only one of avg_fn and multi_avg_fn"):
        ShardedWeightAverage(
            model.state_dict, lambda: None, [], avg_fn=get_ema_avg_fn(), multi_avg_fn=get_ema_multi_avg_fn()
        )
