"""Techniques attached to a model's own modules as forward hooks, kept so that they can be taken off again.

[Note: techniques attach as hooks]
Sequence parallelism and activation checkpointing change what happens around a module's forward, never the
forward itself. Policies attach them as forward pre-hooks and hooks on the modules concerned (and activation
checkpointing as torch's composable ``checkpoint``, which is such a pair of hooks), as torchtitan and FSDP2 do. An
assigned ``module.forward`` hid the change from ``print(model)``, could not be undone, and made a model run our copy
of a library's forward after a library upgrade instead of the library's own. With hooks, every class, forward and
parameter name stays the model's, and ``AttachedTechniques.remove()`` gives back the module as it was.
``tests/unit/test_layering.py`` refuses any assignment to an attribute named ``forward`` in the package.

Hooks alone are invisible in ``print(model)``, so every technique is listed there too
(``engine_parts/shown_techniques.py`` [Note: attached techniques show in print(model)]).

One consequence shapes the hooks: the composable checkpoint recomputes a layer in backward by calling the layer
again, with the arguments its own pre-hook received, so every other forward pre-hook on that layer runs a second
time, and one attached before the checkpoint sees the arguments it already transformed. A pre-hook on a layer that
may be checkpointed must therefore leave such arguments alone (``huggingface/decoders.py``'s split of the sequence
before the first decoder layer). Hooks on modules inside the layer (the attention's gathers, Ulysses' exchanges) run
again during the recomputation as they should, as the layer's first forward ran them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY

from lightning_colossal.engine_parts.shown_techniques import ACTIVATION_CHECKPOINTING, show, unshow


class AttachedTechniques:
    """The hooks attached to a model's modules, each under the technique it belongs to.

    ``repr`` lists them by module; ``remove()`` takes every one off, leaving each module as it was before (the
    tensor-parallel splits a policy made are replacements of whole submodules, not attachments, and stay).
    """

    def __init__(self) -> None:
        self._attached: list[tuple[nn.Module, str, Callable[[], None]]] = []

    def before_forward(self, module: nn.Module, technique: str, hook: Callable[..., Any], shown: bool = True) -> None:
        """Run ``hook(module, args, kwargs)`` before ``module``'s forward; it may return new ``(args, kwargs)``.
        ``shown=False``: a passing check's hook, not a technique, left out of ``print(model)``."""
        handle = module.register_forward_pre_hook(hook, with_kwargs=True)
        self._add(module, technique, handle.remove, shown)

    def after_forward(self, module: nn.Module, technique: str, hook: Callable[..., Any], shown: bool = True) -> None:
        """Run ``hook(module, args, output)`` after ``module``'s forward; it may return a new output."""
        handle = module.register_forward_hook(hook)
        self._add(module, technique, handle.remove, shown)

    def changed(self, module: nn.Module, technique: str, undo: Callable[[], None]) -> None:
        """A change to ``module`` that is no hook (a setting swapped, e.g. ``config._attn_implementation`` for
        sequence parallelism of Hugging Face models), listed with the hooks; ``undo()`` restores it on removal."""
        self._add(module, technique, undo, shown=True)

    def _add(self, module: nn.Module, technique: str, undo: Callable[[], None], shown: bool) -> None:
        if not shown:
            self._attached.append((module, technique, undo))
            return
        show(module, technique)

        def remove() -> None:
            undo()
            unshow(module, technique)

        self._attached.append((module, technique, remove))

    def recompute_in_backward(self, module: nn.Module) -> None:
        """Activation checkpointing of ``module`` with torch's composable ``checkpoint``: its activations are
        recomputed in backward instead of kept, and its class and parameter names are unchanged (torch's
        ``checkpoint_wrapper`` would put ``_checkpoint_wrapped_module.`` into every name checkpoints and policies
        address parameters by)."""
        pre_hooks_before, hooks_before = set(module._forward_pre_hooks), set(module._forward_hooks)
        checkpoint(module)
        # The composable API returns no handles: the hooks it registered are the ones that were not there before,
        # removed from the same tables torch's own handles would remove them from.
        pre_hook_ids = [key for key in module._forward_pre_hooks if key not in pre_hooks_before]
        hook_ids = [key for key in module._forward_hooks if key not in hooks_before]

        def remove() -> None:
            for key in pre_hook_ids:
                module._forward_pre_hooks.pop(key, None)
                module._forward_pre_hooks_with_kwargs.pop(key, None)
            for key in hook_ids:
                module._forward_hooks.pop(key, None)
                module._forward_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_always_called.pop(key, None)
            _forget_checkpoint(module)

        self._add(module, ACTIVATION_CHECKPOINTING, remove, shown=True)

    def extend(self, other: AttachedTechniques | None) -> None:
        """Take over ``other``'s hooks (removing ``self`` then removes them too). ``None``: nothing to take over
        (a user's ``ModelPolicy.wrap_layers_for_recomputation`` written before it returned its hooks)."""
        if other is not None:
            self._attached.extend(other._attached)
            other._attached = []

    def techniques_on(self, module: nn.Module) -> list[str]:
        """The techniques attached to ``module`` itself, in the order they were attached."""
        return [technique for owner, technique, _ in self._attached if owner is module]

    def remove(self) -> None:
        """Take every hook off, the last attached first."""
        while self._attached:
            _, _, remove = self._attached.pop()
            remove()

    def __len__(self) -> int:
        return len(self._attached)

    def __repr__(self) -> str:
        lines = [f"  {type(module).__name__}: {technique}" for module, technique, _ in self._attached]
        return "AttachedTechniques(\n" + "\n".join(lines) + "\n)" if lines else "AttachedTechniques()"


def _forget_checkpoint(module: nn.Module) -> None:
    """Drop the registry entry and state the composable ``checkpoint`` (via torch's ``contract``) stored on the
    module, so that it can be checkpointed again and holds nothing it did not hold before."""
    state = checkpoint.state(module)
    registry = module.__dict__.get(REGISTRY_KEY) or {}
    registry.pop("checkpoint", None)
    states = module.__dict__.get(STATE_KEY) or {}
    for key in [key for key, value in states.items() if value is state]:
        del states[key]
    for attribute in (REGISTRY_KEY, STATE_KEY):
        if module.__dict__.get(attribute) == {}:
            del module.__dict__[attribute]
