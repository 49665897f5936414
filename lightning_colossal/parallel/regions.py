"""Which whole parameters run inside a tensor-parallel region, told from the order the model's modules run.

[Note: regions by the order modules run]
A tensor-parallel region is what runs between a column-parallel layer (its output holds this rank's features) and
the row-parallel layer that sums them back (see [Note: replicated parameters in tensor-parallel regions] in
``policy.py`` for why a whole parameter in there needs a word on its gradient). Module nesting does not say what
runs there: in torch's own tutorial plan, ``nn.Sequential(Linear, LayerNorm, ReLU, Linear [colwise], ReLU, Linear
[rowwise])``, the Sequential holds both split layers, yet the first Linear and the LayerNorm run before the split and
get complete gradients. So nesting only names the *candidates* (whole, undeclared parameters of a module that holds
a row-parallel layer and a column-parallel one below it; a model without any is settled at once), and the order the
modules actually run decides:

- the model's first forward is watched with forward hooks (``attached.py``): a column-parallel layer's return
  opens a region, a row-parallel layer's call closes it; a candidate's module called while a region is open, or
  still running when one opens (its own parameters may be read anywhere in its forward), is inside;
- a candidate found inside is refused at once, with the policy's message, before its module runs on split
  features (where a whole norm would often fail with a bare shape error);
- the engine settles the trace after the first backward (``HybridEngine.after_backward``), before the first
  optimizer step: candidates whose module never ran are refused too (the order says nothing about a parameter read
  by another module's code); the others train, and the hooks come off.

Why the first forward and not a trace at set-up: the engine splits the model in Lightning's ``setup``, before any
batch exists, and a model's inputs cannot be made up in general (token ids, images, keyword arguments, a
LightningModule whose ``training_step`` calls a submodule). The first training step's own forward has the real
input, costs nothing extra, and nothing has changed the weights before the refusal. Pipeline stages run the layers
without the model's forward, so there the candidates are refused at set-up as before (nesting alone); plan policies
have no pipeline stages anyway. A model that a region check refuses is refused the same on every rank: the order is
the same code on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_colossal.parallel.attached import AttachedTechniques
from lightning_colossal.parallel.tensor_parallel import ColumnParallelLinear, LocalColumnsLinear, RowParallelLinear

if TYPE_CHECKING:
    from lightning_colossal.parallel.policy import ParallelPlan

COLUMN_LAYERS = (ColumnParallelLinear, LocalColumnsLinear)


def nested_candidates(model: nn.Module, plan: ParallelPlan) -> dict[int, tuple[str, str]]:
    """Whole parameters, declared neither partial nor replicated, of a module that holds a row-parallel layer as a
    child and a column-parallel layer anywhere below it: ``id(parameter) -> (name, that module's name)``."""
    # Split parameters (placements) hold only this rank's heads/features: their gradients are complete.
    accounted = {id(parameter) for parameter in [*plan.partial_gradients, *plan.replicated]} | set(plan.placements)
    for module in model.modules():
        if isinstance(module, (*COLUMN_LAYERS, RowParallelLinear)):
            # Split weights, and a row-parallel bias, which is added once after the sum (replicated input).
            accounted.update(id(parameter) for parameter in module.parameters())
    candidates: dict[int, tuple[str, str]] = {}
    for region_name, region in model.named_modules():
        if not any(isinstance(child, RowParallelLinear) for child in region.children()):
            continue
        if not any(isinstance(module, COLUMN_LAYERS) for module in region.modules()):
            continue
        for name, parameter in region.named_parameters():
            if id(parameter) not in accounted:
                candidates.setdefault(id(parameter), (f"{region_name}.{name}" if region_name else name, region_name))
    return candidates


class RegionTrace:
    """Watches the model's first forward(s) to tell which ``candidates`` run inside a region (see [Note: regions by
    the order modules run]); ``refusal(names, why)`` builds the error for the ones that do."""

    def __init__(
        self,
        model: nn.Module,
        candidates: dict[int, tuple[str, str]],
        refusal: Callable[[list[str], str], ValueError],
    ) -> None:
        self.candidates = candidates
        self.refusal = refusal
        self.ran: set[int] = set()
        self._open = False  # a column-parallel layer returned and no row-parallel layer has been called since
        self._running: list[nn.Module] = []  # candidates' modules between their call and their return
        self._owned: dict[int, list[int]] = {}  # id(module) -> the candidates it holds directly
        self.attached = AttachedTechniques()
        # A forward that ends on a column-parallel layer (its output read by the loss) leaves a region open: the
        # model's next forward starts outside (when the model itself is called, not only its parts).
        self.attached.before_forward(model, "region check: a forward starts", self._region_closes, shown=False)
        for module in model.modules():
            if isinstance(module, COLUMN_LAYERS):
                self.attached.after_forward(module, "region check: a region opens", self._region_opens, shown=False)
            elif isinstance(module, RowParallelLinear):
                self.attached.before_forward(module, "region check: a region closes", self._region_closes, shown=False)
            owned = [id(parameter) for parameter in module.parameters(recurse=False) if id(parameter) in candidates]
            if owned:
                self._owned[id(module)] = owned
                self.attached.before_forward(
                    module, "region check: a candidate runs", self._candidate_called, shown=False
                )
                self.attached.after_forward(
                    module, "region check: a candidate returns", self._candidate_returned, shown=False
                )

    def _region_opens(self, module: nn.Module, args: Any, output: Any) -> None:
        self._open = True
        for running in self._running:  # its own parameters may be read after this point of its forward
            self._found_inside(self._owned[id(running)])

    def _region_closes(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._open = False

    def _candidate_called(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        owned = self._owned[id(module)]
        self.ran.update(owned)
        if self._open:
            self._found_inside(owned)
        self._running.append(module)

    def _candidate_returned(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._running and self._running[-1] is module:
            self._running.pop()

    def _found_inside(self, keys: list[int]) -> None:
        """Refuse at once, before the module runs on split features (a whole norm over them often cannot even
        run, and would fail with a shape error instead of this message). Candidates of the same nesting module that
        have not run yet are named too (Qwen3's ``k_norm`` after its ``q_norm``), so one fix covers them all."""
        self.remove()
        found = [self.candidates[key][0] for key in keys]
        regions = {self.candidates[key][1] for key in keys}
        waiting = [
            name
            for key, (name, region) in self.candidates.items()
            if region in regions and key not in self.ran and name not in found
        ]
        why = (
            f"The first forward runs {found} after a column-parallel layer and before the row-parallel layer that sums"
            " its output"
        )
        why += f"; {waiting} sit in the same module and had not run yet." if waiting else "."
        raise self.refusal(found + waiting, why)

    def settle(self) -> None:
        """After the first backward: take the hooks off, and refuse the candidates whose module never ran."""
        self.remove()
        unseen = [name for key, (name, _) in self.candidates.items() if key not in self.ran]
        if unseen:
            raise self.refusal(
                unseen,
                "They sit in a module holding column- and row-parallel layers, and their module did not run in the"
                " first forward, so the order modules run cannot show they stay outside the tensor-parallel region.",
            )

    def refuse_without_trace(self, why: str) -> None:
        """Refuse every candidate now (nesting alone), when no forward of the whole model will run (``why``)."""
        self.remove()
        raise self.refusal([name for name, _ in self.candidates.values()], why)

    def remove(self) -> None:
        self.attached.remove()
        self._running.clear()
