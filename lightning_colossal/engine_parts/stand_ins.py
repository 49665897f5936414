"""Stand-ins: tensors a checkpoint reads or fills one at a time, from where they live, instead of all at once in host
memory (the registry; DCP's planners that use it are ``checkpoint/deferred.py``).

[Note: deferred tensors]
The disk tier keeps optimizer state on disk between steps (``disk/optimizer_state.py``). Reading all of it into host
memory to save a checkpoint, or loading all of it there before writing it back, would undo the tier's point: a rank
whose state fits on disk but not in memory could not checkpoint. So such state enters a checkpoint as a *stand-in*:
a tensor of the right shape and dtype over one element of its own storage (so each stand-in is recognised by its
storage address, which survives the aliases DTensor and DCP make of it), registered here with two callables:
``read`` returns the whole value, ``write`` takes the whole value. DCP resolves the tensors it writes one at a time
(one file per rank, written item by item; ``DeferredSavePlanner`` says how the value of one is let go before the
next is read), and fills the tensors it loads item by item; the planners in ``checkpoint/deferred.py`` ask the
registry at those moments, so a save holds one stand-in's value at a time, and a load one value per stand-in being
assembled (several only when a resharded piece spans files).

The stand-ins hold NaN (float dtypes), not zeros: code that reads one outside these planners (a callback looking at
``checkpoint["optimizer_states"]`` in ``on_save_checkpoint``) gets values that cannot pass for real ones.
Background saves read every stand-in while staging (``resolve``): their copy must not change while training goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class Deferred:
    """Where a stand-in's value lives: ``read()`` returns it whole, ``write(value)`` stores it whole."""

    shape: torch.Size
    dtype: torch.dtype
    read: Callable[[], Tensor]
    write: Callable[[Tensor], None]
    # While a load assembles the value: the tensor being filled and how many of its elements arrived.
    pending: Tensor | None = field(default=None, repr=False)
    arrived: int = 0


_REGISTRY: dict[int, Deferred] = {}  # by the stand-in's storage address


def _storage_address(tensor: Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def stand_in(
    shape: Sequence[int], dtype: torch.dtype, read: Callable[[], Tensor], write: Callable[[Tensor], None]
) -> Tensor:
    """A registered stand-in for a value of ``shape`` and ``dtype`` that ``read``/``write`` reach."""
    fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
    single = torch.full((), fill, dtype=dtype)
    _REGISTRY[_storage_address(single)] = Deferred(torch.Size(shape), dtype, read, write)
    return single.expand(tuple(shape))


def deferred_of(tensor: Any) -> Deferred | None:
    """The registration behind ``tensor`` if it is (a view of) a stand-in."""
    if not isinstance(tensor, Tensor) or tensor.device.type != "cpu" or tensor.is_meta:
        return None
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return _REGISTRY.get(_storage_address(local))


def withdraw(tensor: Tensor) -> None:
    """Forget ``tensor``'s registration (its holder put the real value or another placeholder back)."""
    _REGISTRY.pop(_storage_address(tensor), None)


def resolve(tensor: Tensor) -> Tensor:
    """``tensor``'s value: read from where it lives for a stand-in, ``tensor`` itself otherwise."""
    deferred = deferred_of(tensor)
    return tensor if deferred is None else deferred.read()


def has_stand_ins() -> bool:
    """Whether any stand-in is registered (a checkpoint being saved or loaded holds deferred tensors)."""
    return bool(_REGISTRY)


def pending_values() -> list[Deferred]:
    """The registrations a load is assembling a value for."""
    return [deferred for deferred in _REGISTRY.values() if deferred.pending is not None]
