"""Pretrained safetensors weights as a second source of values for models built on the meta device.

[Note: pretrained weights on the meta device]
A model built on the meta device normally gets its values from its own initialiser, run window by window
(``meta_init.py``). A model that carries a ``PretrainedWeights`` record (``lightning_colossal.huggingface.
pretrained_on_meta`` attaches one) gets them from its safetensors files instead: every engine describes each tensor
it keeps as a ``Piece`` (the tensor's names, which part of the whole tensor it needs, where to put it), and
``fill_from_pretrained`` reads exactly that part, with ``safe_open(...).get_slice(key)[rows]``, so a rank reads and
holds only its own rows or tensor-parallel piece, never the whole model. The pieces are cut with plain slicing, which
a safetensors slice and a whole tensor both support, so the same ``cut`` serves a value read from the file and one
drawn by the initialiser.

Tensors the files lack are drawn by the model's own initialiser, through the same windowed replay as a model
without a record, over a storage-free copy of the model (``template``): non-persistent buffers (rotary ``inv_freq``,
computed by Hugging Face's ``_init_weights``), and parameters the checkpoint does not have (a new head: the record
lists them, and the Hugging Face layer warned when it was built, as ``from_pretrained`` does). A tensor neither in
the files nor written by the initialiser is named by ``meta_init``'s NaN check.

The record lives on the module as a plain attribute, so it survives the ``deepcopy`` every engine takes of the
unsplit model, and names are resolved relative to the module that carries it, whatever the module's prefix in the
LightningModule.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from lightning_colossal.engine_parts.meta_init import initialise_in_windows, start_from_rank_zero_random_state

#: The attribute of a module that holds its ``PretrainedWeights``.
RECORD_ATTRIBUTE = "pretrained_weights"


@dataclass(frozen=True)
class PretrainedWeights:
    """Where the values of a meta-device model's tensors are, by the model's own tensor names.

    Attributes:
        directory: the directory holding the safetensors files.
        locations: tensor name (as ``named_parameters``/``named_buffers`` of the model carrying the record give it,
            every name of a tied tensor) -> (file name inside ``directory``, key in that file).
        absent_parameters: parameters the files do not hold; the model's initialiser draws them.
    """

    directory: str
    locations: Mapping[str, tuple[str, str]]
    absent_parameters: tuple[str, ...] = ()


@dataclass
class ReadCounter:
    """Bytes and tensors read from pretrained files in this process (what ``fill_from_pretrained`` reads, so a test
    or a memory report can check that a rank read only its pieces)."""

    bytes: int = 0
    tensors: int = 0
    files: set[str] = field(default_factory=set)

    def reset(self) -> None:
        self.bytes, self.tensors, self.files = 0, 0, set()


READS = ReadCounter()


class Sliceable(Protocol):
    """A whole tensor, or a safetensors slice: both answer ``[rows]``, ``[:, columns]`` and ``[...]``."""

    def __getitem__(self, index: Any) -> Tensor: ...


def whole(source: Sliceable) -> Tensor:
    """The whole value (the ``cut`` of a tensor a rank keeps whole)."""
    return source[...]


@dataclass
class Piece:
    """One tensor a rank keeps, and which part of its whole value it needs.

    Attributes:
        names: every name of the tensor (tied tensors have several), relative to the module ``fill_from_pretrained``
            is given.
        cut: the needed part of a whole value, by plain slicing only (see [Note: pretrained weights on the meta
            device]).
        store: receives that part (a tensor in the file's dtype or the initialiser's; convert as needed).
    """

    names: list[str]
    cut: Callable[[Sliceable], Tensor]
    store: Callable[[Tensor], None]


def record_pretrained(model: nn.Module, weights: PretrainedWeights) -> None:
    """Mark a meta-device ``model`` as taking its values from ``weights`` when an engine materialises it."""
    # object.__setattr__: a plain attribute, never registered as a submodule, parameter or buffer.
    object.__setattr__(model, RECORD_ATTRIBUTE, weights)


def has_pretrained_weights(module: nn.Module) -> bool:
    """Whether ``module`` or one of its submodules carries a ``PretrainedWeights`` record."""
    return bool(_records(module))


def _records(module: nn.Module) -> list[tuple[str, PretrainedWeights]]:
    """``(name prefix, record)`` of every submodule carrying a record, outermost first."""
    found = []
    for name, submodule in module.named_modules():
        record = submodule.__dict__.get(RECORD_ATTRIBUTE)
        if isinstance(record, PretrainedWeights):
            found.append((f"{name}." if name else "", record))
    return found


class _CountingSlice:
    """A safetensors slice that counts what it reads into ``READS``."""

    def __init__(self, handle: Any, key: str, path: str) -> None:
        self._slice = handle.get_slice(key)
        self._path = path

    def __getitem__(self, index: Any) -> Tensor:
        value = self._slice[index]
        READS.bytes += value.numel() * value.element_size()
        READS.tensors += 1
        READS.files.add(self._path)
        return value


class PretrainedReader:
    """Opens a record's safetensors files lazily and hands out slices of the tensors by the module's names."""

    def __init__(self, module: nn.Module) -> None:
        self.records = _records(module)
        self._handles: dict[str, Any] = {}

    def source(self, names: Iterable[str]) -> Sliceable | None:
        """The stored tensor under any of ``names`` (a tied tensor is stored once), or ``None`` when none is."""
        for name in names:
            for prefix, record in self.records:
                if not name.startswith(prefix):
                    continue
                location = record.locations.get(name[len(prefix) :])
                if location is not None:
                    return self._open(record.directory, *location)
        return None

    def absent_parameters(self) -> list[str]:
        return [prefix + name for prefix, record in self.records for name in record.absent_parameters]

    def _open(self, directory: str, file_name: str, key: str) -> Sliceable:
        from safetensors import safe_open

        path = str(Path(directory) / file_name)
        handle = self._handles.get(path)
        if handle is None:
            if not Path(path).is_file():
                raise FileNotFoundError(
                    f"{path} is missing: the pretrained weights' index names it for {key!r}. Copy the whole"
                    " checkpoint directory (every safetensors file its index lists)."
                )
            handle = self._handles[path] = safe_open(path, framework="pt")
        if key not in handle.keys():
            raise KeyError(
                f"{key!r} is not in {path}, although the pretrained weights' index says it is there: the index and"
                " the files disagree; save the checkpoint again (save_pretrained) or fix its index."
            )
        return _CountingSlice(handle, key, path)


def fill_from_pretrained(
    module: nn.Module, template: nn.Module, pieces: list[Piece], device: torch.device, window_bytes: int
) -> None:
    """Give every piece its value: read from the pretrained files where they hold the tensor, otherwise drawn by the
    model's initialiser over ``template`` (see [Note: pretrained weights on the meta device]).

    Args:
        module: the model (or LightningModule) carrying the record; ``pieces`` name tensors relative to it.
        template: a storage-free meta copy of ``module`` under the same names (consumed when tensors are missing).
        pieces: what this rank keeps.
        device: where the initialiser's windows live.
        window_bytes: bytes of missing tensors the initialiser materialises per pass.
    """
    reader = PretrainedReader(module)
    missing: dict[str, Piece] = {}
    with torch.no_grad():
        for piece in pieces:
            source = reader.source(piece.names)
            if source is None:
                missing.update(dict.fromkeys(piece.names, piece))
            else:
                piece.store(piece.cut(source))
    # Drawn parameters must be the same on every rank: the file, not this rank's pieces, decides (a collective).
    if reader.absent_parameters():
        start_from_rank_zero_random_state(device)
    if not missing:
        return

    def keep(names: list[str], value: Tensor) -> None:
        piece = next(missing[name] for name in names if name in missing)
        piece.store(piece.cut(value))

    initialise_in_windows(template, lambda names: any(name in missing for name in names), keep, device, window_bytes)


def storage_free_copy(module: nn.Module) -> nn.Module:
    """A meta copy of ``module``'s children under their own names (the module itself may refer to a Trainer)."""
    template = nn.Module()
    for name, child in module.named_children():
        template.add_module(name, copy.deepcopy(child))
    return template


def materialise_whole(module: nn.Module, device: torch.device, window_bytes: int = 1 << 30) -> None:
    """Give every meta tensor of ``module`` storage on ``device`` and its whole pretrained value, keeping tensor
    identities (tied weights stay tied): the data-parallel strategies, which hold the whole model on every rank."""
    from lightning_colossal.engine_parts.meta_init import materialise_in_place

    template = storage_free_copy(module)
    named: dict[int, tuple[list[str], Tensor]] = {}
    for name, tensor in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        named.setdefault(id(tensor), ([], tensor))[0].append(name)
    pieces = []
    for names, tensor in named.values():
        if tensor.is_meta:
            materialise_in_place(tensor, device)
            pieces.append(Piece(names, whole, copy_into(tensor)))
    fill_from_pretrained(module, template, pieces, device, window_bytes)


def copy_into(target: Tensor) -> Callable[[Tensor], None]:
    """A ``store`` that copies a whole value into ``target`` (converting its dtype)."""

    def store(value: Tensor) -> None:
        target.data.copy_(value.reshape(target.shape))

    return store


def row_range(source: Sliceable, start: int, stop: int) -> Tensor:
    """Rows ``[start, stop)`` along dimension 0."""
    return source[start:stop]


def ranges_along(source: Sliceable, dimension: int, ranges: list[tuple[int, int]]) -> Tensor:
    """The ``ranges`` of ``dimension``, concatenated in order (a fused tensor-parallel piece is several blocks)."""
    leading = (slice(None),) * dimension
    parts = [source[(*leading, slice(start, stop))] for start, stop in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dimension)
