"""What ``print(model)`` shows of the techniques attached to a model's modules (no Lightning, no engine here).

[Note: attached techniques show in print(model)]
Hooks alone are invisible in ``print(model)``. So a module carrying a technique is moved, as torch's FSDP2
``fully_shard`` moves the modules it shards, into a subclass of its own class made once per class
(``_ShowsAttached``) that only adds an ``attached: ...`` line to the module's ``extra_repr``. The subclass keeps the
class's ``__name__``, ``__qualname__`` and ``__module__``, so code that picks a layout, a wrap policy or a family by
class name sees the model's own class, and ``isinstance`` holds. The listing lives on the module
(``_attached_techniques``); removing the last technique gives the module its class back, unless something else (FSDP2)
moved it into a class of its own meanwhile, when only the listing empties.
"""

from __future__ import annotations

import copyreg
from typing import Any

from torch import nn

#: How activation checkpointing is listed, by every engine that applies it.
ACTIVATION_CHECKPOINTING = "activation checkpointing"
#: Attribute holding the techniques ``print(model)`` lists for a module, in the order they were attached.
_LISTING = "_attached_techniques"


class _ShowsAttached:
    """Mixed in first by ``_showing_class``: the module's own ``extra_repr`` and one line naming what is attached."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickled (and deep-copied) as the module's own class: the subclass only changes what is printed, and pickle
        # could not find it by its name, which is the original class's.
        reduced = super().__reduce_ex__(protocol)
        if isinstance(reduced, tuple) and reduced[0] is copyreg.__newobj__ and reduced[1][0] is type(self):
            original = type(self).__dict__["_shown_original"]
            state, *rest = reduced[2:] or (None,)
            if isinstance(state, dict):  # the copy carries no listing: it is its own class again
                state = {key: value for key, value in state.items() if key != _LISTING}
            return (_new_object, (original, *reduced[1][1:]), state, *rest)
        return reduced

    def extra_repr(self) -> str:
        own = super().extra_repr()  # type: ignore[misc]
        techniques = list(dict.fromkeys(getattr(self, _LISTING, ())))
        if not techniques:
            return own
        line = "attached: " + ", ".join(techniques)
        return f"{line}\n{own}" if own else line


def _new_object(cls: type, *arguments: Any) -> Any:
    """``copyreg.__newobj__`` for a class other than the pickled object's own (pickle refuses that one there)."""
    return cls.__new__(cls, *arguments)


_showing_classes: dict[type, type] = {}


def _showing_class(cls: type) -> type:
    """``cls`` with ``_ShowsAttached`` in front, made once per class and named as ``cls`` ([Note: attached techniques
    show in print(model)])."""
    if issubclass(cls, _ShowsAttached):
        return cls
    if cls not in _showing_classes:
        names = {
            "__name__": cls.__name__,
            "__qualname__": cls.__qualname__,
            "__module__": cls.__module__,
            "_shown_original": cls,
        }
        _showing_classes[cls] = type(cls.__name__, (_ShowsAttached, cls), names)
    return _showing_classes[cls]


def show(module: nn.Module, technique: str) -> None:
    """List ``technique`` in ``print(module)`` (after those listed before)."""
    module.__dict__.setdefault(_LISTING, []).append(technique)
    module.__class__ = _showing_class(type(module))


def unshow(module: nn.Module, technique: str) -> None:
    """Take ``technique`` (its last listing) off ``print(module)``; the module's own class back when none is left."""
    listing = module.__dict__.get(_LISTING, [])
    if technique in listing:
        # The last one of that name: ``remove()`` takes techniques off in reverse order.
        del listing[len(listing) - 1 - listing[::-1].index(technique)]
    if listing:
        return
    module.__dict__.pop(_LISTING, None)
    # Read from the class itself, not inherited: a class FSDP2 made from ours inherits the attribute.
    original = type(module).__dict__.get("_shown_original")
    if original is not None:  # otherwise something moved it into a class of its own since (FSDP2): left as it is
        module.__class__ = original
