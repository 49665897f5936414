"""Giving a model built on the meta device its values, piece by piece, without ever holding the whole model.

The engines share the idea of Gemini's [Note: initialisation in windows] (``gemini/initialise.py``): a model's own
initialiser (the outermost ``reset_parameters`` or Hugging Face ``init_weights``) draws every tensor from the random
stream in a fixed order, so it is run once per *window* of tensors from the same random state, with the window's
tensors pointing into real buffers and every other tensor into a shared scratch buffer that soaks up its writes.
After each pass the caller keeps what it needs of the window (a row shard, a tensor-parallel piece). The result is
identical whatever the layout, and for a model whose constructor draws nothing itself (the demo GPT builds its layers
on meta and then calls ``reset_parameters``) bit-identical to building it eagerly from the same seed. Hugging Face
models are the values their ``init_weights`` draws from the seed: their eager constructors draw through the torch
layers' own initialisers first, so an eagerly built copy differs (same distribution, another stream position).

Window buffers start as NaN, so a tensor the initialiser never writes (a buffer computed in ``__init__``, a
parameter a custom initialiser skips) is caught and named instead of training on garbage.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (shapes only, no values yet)."""
    return any(tensor.is_meta for tensor in [*module.parameters(), *module.buffers()])


def materialise_in_place(tensor: Tensor, device: torch.device) -> None:
    """Give a meta tensor real (uninitialised) storage without changing its identity (optimizers and modules hold
    it; tied names stay tied)."""
    replacement = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    if isinstance(tensor, nn.Parameter):
        replacement = nn.Parameter(replacement, requires_grad=tensor.requires_grad)
    torch.utils.swap_tensors(tensor, replacement)


def outermost_initialisers(module: nn.Module) -> list[Callable[[], None]]:
    """The initialisers that together cover ``module``: its own, or else those of its children, recursively."""
    for attribute in ("reset_parameters", "init_weights"):
        initialiser = getattr(module, attribute, None)
        if callable(initialiser):
            return [initialiser]
    found: list[Callable[[], None]] = []
    for child in module.children():
        found.extend(outermost_initialisers(child))
    return found


def required_initialisers(module: nn.Module) -> list[Callable[[], None]]:
    """``outermost_initialisers``, or a clear error when the model has none."""
    initialisers = outermost_initialisers(module)
    if not initialisers:
        raise ValueError(
            f"{type(module).__name__} was built on the meta device but neither it nor its submodules define"
            " `reset_parameters()` or `init_weights()`, so there is no way to give its parameters values. Add a"
            " `reset_parameters()` that initialises every parameter, or build the model on a real device."
        )
    return initialisers


def _placeholder_in_place(tensor: Tensor) -> None:
    """Swap a meta tensor for a real one of the same shape that owns one element (stride 0), keeping its identity,
    so ``.data`` can later point it at real buffers without allocating the whole tensor."""
    placeholder = torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)
    if isinstance(tensor, nn.Parameter):
        placeholder = nn.Parameter(placeholder, requires_grad=tensor.requires_grad)
    torch.utils.swap_tensors(tensor, placeholder)


def initialise_in_windows(
    template: nn.Module,
    wanted: Callable[[list[str]], bool],
    keep: Callable[[list[str], Tensor], None],
    device: torch.device,
    window_bytes: int,
) -> None:
    """Run ``template``'s initialiser window by window and hand each wanted tensor's whole value to ``keep``.

    Args:
        template: a meta-device model (consumed: its tensors end up pointing at freed buffers).
        wanted: whether this rank needs the tensor with these names (every name of a tied tensor); the others are
            still drawn, into scratch, so the random stream advances as in a whole-model initialisation.
        keep: receives ``(names, whole value)`` once per wanted tensor; copy what is needed, the value is reused.
        device: where the window buffers live.
        window_bytes: bytes of wanted tensors materialised per pass.

    Raises:
        ValueError: no initialiser, or a wanted floating-point tensor the initialiser did not write.
    """
    initialisers = required_initialisers(template)
    named: dict[int, tuple[list[str], Tensor]] = {}
    for name, tensor in [
        *template.named_parameters(remove_duplicate=False),
        *template.named_buffers(remove_duplicate=False),
    ]:
        named.setdefault(id(tensor), ([], tensor))[0].append(name)
    tensors = list(named.values())
    for _, tensor in tensors:
        if tensor.is_meta:
            _placeholder_in_place(tensor)
    largest = max((tensor.numel() for _, tensor in tensors), default=0)
    windows: list[list[tuple[list[str], Tensor]]] = [[]]
    filled = 0
    for names, tensor in tensors:
        if not wanted(names):
            continue
        size = tensor.numel() * tensor.element_size()
        if windows[-1] and filled + size > window_bytes:
            windows.append([])
            filled = 0
        windows[-1].append((names, tensor))
        filled += size
    scratch: dict[torch.dtype, Tensor] = {}
    start_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    with torch.no_grad():
        for window in windows:
            torch.set_rng_state(start_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, device)
            in_window = {id(tensor) for _, tensor in window}
            for _, tensor in tensors:
                if id(tensor) in in_window:
                    fill = float("nan") if tensor.is_floating_point() else 0
                    tensor.data = torch.full(tensor.shape, fill, dtype=tensor.dtype, device=device)
                else:
                    pool = scratch.get(tensor.dtype)
                    if pool is None:
                        pool = scratch[tensor.dtype] = torch.empty(largest, dtype=tensor.dtype, device=device)
                    tensor.data = pool[: tensor.numel()].view(tensor.shape)
            for submodule in template.modules():
                if getattr(submodule, "_is_hf_initialized", False):
                    submodule.__dict__["_is_hf_initialized"] = False  # HF skips modules it believes initialised
            for initialiser in initialisers:
                initialiser()
            for names, tensor in window:
                if tensor.is_floating_point() and bool(tensor.isnan().any()):
                    raise ValueError(
                        f"{names[0]!r} was built on the meta device and the model's initialiser "
                        f"({', '.join(type(getattr(i, '__self__', i)).__name__ for i in initialisers)}) does not set it"
                        " (a buffer computed in __init__, or a parameter the initialiser skips), so it has no value:"
                        " make `reset_parameters()`/`init_weights()` set it, or build the model on a real device."
                    )
                keep(names, tensor)
            for _, tensor in window:
                tensor.data = torch.zeros((), dtype=tensor.dtype, device=device).expand(tensor.shape)
