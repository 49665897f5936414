"""Parameters that get no gradient on some or all ranks under FSDP2 (mixture-of-experts, unused branches).

[Note: gradients nobody produced, under FSDP2]
FSDP2 reduce-scatters, per unit, the gradients of the parameters that have one on this rank. When a rank did not
use a parameter (an expert without tokens) the ranks' reduce-scatters differ in size: gloo aborts, NCCL may hang or
mix up gradients. ``fully_shard``'s ``set_reduce_scatter_unused_params(True)`` makes every rank contribute zeros
instead, which is the right contribution to the average. But a parameter *no* rank used then gets a zero gradient,
while single-process torch leaves it ``None`` and optimizers skip it (no weight decay, no momentum, no Adam step
count). ``UnusedGradientTracker`` records, before each backward, which parameters the loss reaches on this rank
(walking the autograd graph from the loss to FSDP's unsharded parameters), combines the records of all ranks at the
micro-batch that synchronises gradients (one small all-reduce), and removes the zero gradients of parameters no rank
reached. Units whose forward runs on some ranks only remain unsupported: their all-gathers are collectives every
rank must issue, so modules that run conditionally must live inside a unit that always runs (the default wrap
policy shards transformer blocks, which hold their experts).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import FSDPModule

from lightning_colossal.engine_parts.autograd_graph import leaves_reached_from
from lightning_colossal.engine_parts.sharded_state import GradientArrivals
from lightning_colossal.fsdp.wrap import parameter_groups


def include_unused_parameters_in_reduction(roots: Sequence[FSDPModule]) -> bool:
    """Every rank reduce-scatters zeros for parameters it gave no gradient (see the Note); whether torch does it.

    torch before ``set_reduce_scatter_unused_params`` (2.11 lacks it) cannot be told to; ``UnusedGradientTracker``
    then makes the loss reach every gathered parameter with a zero term, which gives the same zeros.
    """
    if not all(hasattr(root, "set_reduce_scatter_unused_params") for root in roots):
        return False
    for root in roots:
        root.set_reduce_scatter_unused_params(True, recurse=True)
    return True


class UnusedGradientTracker:
    """Tracks, per optimizer step, which sharded parameters got a gradient on any rank (see the Note)."""

    def __init__(
        self, module: nn.Module, torch_reduces_unused: bool = True, vote_group: ProcessGroup | None = None
    ) -> None:
        # Module order: the same on every rank, so the flags line up in the all-reduce.
        self.parameters = [parameter for parameter in module.parameters() if parameter.requires_grad]
        self._position_of = {id(parameter): position for position, parameter in enumerate(self.parameters)}
        # Host flags (sharded_state.py [Note: gradients nobody produced]): no device write per parameter per step.
        self.reached = GradientArrivals(len(self.parameters))
        self.torch_reduces_unused = torch_reduces_unused
        #: Where the ranks vote on the flags: a host group beside NCCL (collectives.py [Note: votes on the host]), or
        #: the default group.
        self.vote_group = vote_group

    def before_backward(self, loss: Tensor, module: nn.Module) -> Tensor:
        """Record the parameters ``loss`` reaches (in the graph they are FSDP's unsharded parameters); returns the
        loss to run backward on: ``loss`` itself, or, where torch cannot reduce-scatter zeros for the others
        (``include_unused_parameters_in_reduction``), ``loss`` plus a zero term over every gathered parameter it
        does not reach, so each one gets a zero gradient and every rank's reduce-scatter has the same size."""
        reached = leaves_reached_from(loss)
        if reached is None:  # autograd_graph.py [Note: reentrant activation checkpoints hide their parameters]
            self.reached.mark_all()
            return loss
        unreached: list[Tensor] = []
        for sharded, unsharded in _unsharded_parameters(module):
            if id(unsharded) in reached or id(sharded) in reached:
                position = self._position_of.get(id(sharded))
                if position is not None:
                    self.reached.mark(position)
            elif unsharded.requires_grad:
                unreached.append(unsharded)
        if self.torch_reduces_unused or not unreached:
            return loss
        # The sum of an empty slice is 0.0, so the loss keeps its value, and its gradient is a zero tensor of the
        # parameter's shape. Empty, because FSDP2 has freed the storage of the resharded parameters by now: a
        # non-empty view of them would be out of bounds.
        return loss + sum((parameter.reshape(-1)[:0].sum() for parameter in unreached), loss.new_zeros(()))

    def after_synchronising_backward(self) -> None:
        """After the backward that reduced gradients: drop the zero gradients of parameters no rank reached."""
        for parameter, reached in zip(self.parameters, self.reached.on_any_rank(self.vote_group), strict=True):
            if not reached:
                parameter.grad = None
        self.reached.clear()


def _unsharded_parameters(module: nn.Module) -> list[tuple[nn.Parameter, Tensor]]:
    """(sharded parameter, unsharded parameter autograd sees) for every parameter FSDP manages in ``module``."""
    pairs = []
    for unit in module.modules():
        if not isinstance(unit, FSDPModule):
            continue
        state = unit._get_fsdp_state()
        for group in parameter_groups(state):
            for fsdp_parameter in group.fsdp_params:
                unsharded = getattr(fsdp_parameter, "_unsharded_param", None)
                if unsharded is not None:
                    pairs.append((fsdp_parameter.sharded_param, unsharded))
    return pairs
