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

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from lightning_colossal.distributed import collectives
from lightning_colossal.distributed import device as devices


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


def placeholder_in_place(tensor: Tensor) -> None:
    """Swap a meta tensor for a real one of the same shape that owns one element (stride 0), keeping its identity,
    so ``.data`` can later point it at real buffers without allocating the whole tensor."""
    placeholder = torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)
    if isinstance(tensor, nn.Parameter):
        placeholder = nn.Parameter(placeholder, requires_grad=tensor.requires_grad)
    torch.utils.swap_tensors(tensor, placeholder)


def start_from_rank_zero_random_state(device: torch.device) -> None:
    """Give every rank rank 0's random state (CPU, and ``device``'s when it is a GPU): ranks that each draw a whole
    model to keep their own pieces of it must draw the same values (a collective over the world)."""
    state = torch.get_rng_state()
    collectives.broadcast_tensor(state, source_rank=0)  # a host tensor, moved to the group's device for the call
    torch.set_rng_state(state)
    device_state = devices.get_rng_state(device)
    if device_state is not None:
        collectives.broadcast_tensor(device_state, source_rank=0)
        devices.set_rng_state(device_state, device)


def plan_windows(sizes: Sequence[int], window_bytes: int) -> list[list[int]]:
    """Consecutive indices of ``sizes`` (bytes) grouped into windows of at most ``window_bytes`` (a larger item gets a
    window of its own); no items, no windows."""
    windows: list[list[int]] = []
    filled = 0
    for index, size in enumerate(sizes):
        if not windows or (windows[-1] and filled + size > window_bytes):
            windows.append([])
            filled = 0
        windows[-1].append(index)
        filled += size
    return windows


class InitialiserReplay:
    """Runs a model's initialisers again and again from the random state they had when this was made.

    Every pass then draws the same values in the same order, which is what makes one pass per window add up to one
    initialisation of the whole model.
    """

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module = module
        self.initialisers = required_initialisers(module)
        self.device = device
        self.cpu_state = torch.get_rng_state()
        self.device_state = devices.get_rng_state(device)

    def run(self) -> None:
        torch.set_rng_state(self.cpu_state)
        if self.device_state is not None:
            devices.set_rng_state(self.device_state, self.device)
        for submodule in self.module.modules():
            if getattr(submodule, "_is_hf_initialized", False):
                submodule.__dict__["_is_hf_initialized"] = False  # HF skips modules it believes initialised
        for initialiser in self.initialisers:
            initialiser()

    def describe(self) -> str:
        """The initialisers' owners, for messages."""
        return ", ".join(
            type(getattr(initialiser, "__self__", initialiser)).__name__ for initialiser in self.initialisers
        )


class Scratch:
    """One buffer per dtype, as large as the largest tensor, that soaks up the writes to tensors outside a window."""

    def __init__(self, numel: int, device: torch.device) -> None:
        self.numel = numel
        self.device = device
        self._buffers: dict[torch.dtype, Tensor] = {}

    def view(self, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        buffer = self._buffers.get(dtype)
        if buffer is None:
            buffer = self._buffers[dtype] = torch.empty(self.numel, dtype=dtype, device=self.device)
        return buffer[: math.prod(shape)].view(shape)


NamedTensor = tuple[list[str], Tensor]


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
    replay = InitialiserReplay(template, device)
    tensors = _named_tensors(template)
    for _, tensor in tensors:
        if tensor.is_meta:
            placeholder_in_place(tensor)
    candidates = [(names, tensor) for names, tensor in tensors if wanted(names)]
    sizes = [tensor.numel() * tensor.element_size() for _, tensor in candidates]
    # Even with nothing wanted, one pass runs: the random stream must advance as on the ranks that want something.
    windows = [[candidates[index] for index in window] for window in plan_windows(sizes, window_bytes)] or [[]]
    scratch = Scratch(max((tensor.numel() for _, tensor in tensors), default=0), device)
    with torch.no_grad():
        for window in windows:
            _point_at_window(tensors, window, scratch, device)
            replay.run()
            for names, tensor in window:
                _check_written(names, tensor, replay)
                keep(names, tensor)
            for _, tensor in window:
                tensor.data = torch.zeros((), dtype=tensor.dtype, device=device).expand(tensor.shape)


def _named_tensors(template: nn.Module) -> list[NamedTensor]:
    """Every parameter and buffer once, with all its names (tied tensors have several)."""
    named: dict[int, NamedTensor] = {}
    for name, tensor in [
        *template.named_parameters(remove_duplicate=False),
        *template.named_buffers(remove_duplicate=False),
    ]:
        named.setdefault(id(tensor), ([], tensor))[0].append(name)
    return list(named.values())


def _point_at_window(
    tensors: list[NamedTensor], window: list[NamedTensor], scratch: Scratch, device: torch.device
) -> None:
    """Window tensors get fresh buffers (NaN, so an unwritten one shows); every other tensor writes into scratch."""
    in_window = {id(tensor) for _, tensor in window}
    for _, tensor in tensors:
        if id(tensor) in in_window:
            fill = float("nan") if tensor.is_floating_point() else 0
            tensor.data = torch.full(tensor.shape, fill, dtype=tensor.dtype, device=device)
        else:
            tensor.data = scratch.view(tensor.shape, tensor.dtype)


def _check_written(names: list[str], tensor: Tensor, replay: InitialiserReplay) -> None:
    if tensor.is_floating_point() and bool(tensor.isnan().any()):
        raise ValueError(
            f"{names[0]!r} was built on the meta device and the model's initialiser ({replay.describe()}) does not set"
            " it (a buffer computed in __init__, or a parameter the initialiser skips), so it has no value: make"
            " `reset_parameters()`/`init_weights()` set it, or build the model on a real device."
        )
