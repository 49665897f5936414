"""What a lightning_colossal checkpoint holds, composed and decoded in one place (``layout`` says where it lies).

Two things make up the format, and this module is the only one that spells their keys:

The checkpoint file's ``FORMAT_KEY`` entry, a small dict describing the save (``CheckpointDescription``):
``format_version``, ``strategy`` (the class name), ``world_size``, ``num_optimizers``, ``parallel_dims`` (axis sizes),
``huggingface`` (where a Hugging Face model sits and its configuration, if the module held one), ``torch_version``
(of the writer), ``shards`` (the id of its shards directory; format 2 only) and ``fabric`` (a save through Lightning
Fabric: the user's keys of its module and optimizers, ``FabricObjects``; the file then holds the full weights under
the module's key as well as under ``state_dict``, one object named twice, so tools that read ``checkpoint["model"]``
find them). Format 1 wrote the same entry, less
``shards`` and ``torch_version``, into ``meta.pt``. Readers take what is there: a field an older writer did not record
reads as unknown (``None``; ``num_optimizers`` as 0, as it always has), and a field a newer writer added is ignored.

The tensor state inside the shards (``TrainingTensors``), a nested dict that DCP flattens into items keyed by name,
never by position:

- ``model.<name>``: model weights by the LightningModule's own parameter/buffer names (fp32 masters where the
  strategy keeps them); the file's ``state_dict`` is read back from exactly these items;
- ``optimizer_<i>.state.<name>.<state key>`` and ``optimizer_<i>.param_groups``: the i-th optimizer, its
  state keyed by parameter name (torch's distributed state-dict format);
- ``rng.rank_<r>.*``: random-number-generator state of each rank, restored when the world size matches;
- ``current_model.<name>``: only when a weight-averaging callback trained the run: the weights being trained, while
  ``model.<name>`` holds their average (Lightning's convention: the checkpoint's ``state_dict`` is the average and
  ``current_model_state`` the weights the run resumes from); the file holds both whole.

``SavedItems`` answers questions about those flattened items from DCP's index alone (which weights, which shapes,
whose random state), before any tensor is read.

To change the format: change the description or the tensor layout here, and bump ``FORMAT_VERSION`` only if older
readers would misread the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

FORMAT_KEY = "lightning_colossal"
FORMAT_VERSION = 2

MODEL_KEY = "model"
CURRENT_MODEL_KEY = "current_model"
#: Lightning's key, in a checkpoint dict and in the checkpoint file, of the weights being trained when ``state_dict``
#: holds their average (``WeightAveraging.on_save_checkpoint``).
CURRENT_MODEL_STATE = "current_model_state"
RNG_KEY = "rng"
_OPTIMIZER_PREFIX = "optimizer_"
_RANK_PREFIX = "rank_"


def optimizer_key(index: int) -> str:
    """The top-level key of the ``index``-th optimizer's state."""
    return f"{_OPTIMIZER_PREFIX}{index}"


def rng_key(rank: int) -> str:
    """The key of ``rank``'s random state under ``RNG_KEY``."""
    return f"{_RANK_PREFIX}{rank}"


def model_item(name: str) -> str:
    """The flattened DCP key of the model tensor ``name``."""
    return f"{MODEL_KEY}.{name}"


def model_name(item: str) -> str | None:
    """The model tensor's name of the flattened DCP key ``item``, or ``None`` when ``item`` is not a model item."""
    prefix = f"{MODEL_KEY}."
    return item[len(prefix) :] if item.startswith(prefix) else None


# ------------------------------------------------------------------------------------------ the checkpoint file's entry
@dataclass(frozen=True)
class FabricObjects:
    """Which keys of a ``fabric.save(path, state)`` held the module and the optimizers (in the saved order)."""

    module: str
    optimizers: tuple[str, ...] = ()

    def to_entry(self) -> dict[str, Any]:
        return {"module": self.module, "optimizers": list(self.optimizers)}

    @classmethod
    def from_entry(cls, entry: Any) -> FabricObjects | None:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("module"), str):
            return None
        return cls(module=entry["module"], optimizers=tuple(str(key) for key in entry.get("optimizers") or ()))


@dataclass(frozen=True)
class CheckpointDescription:
    """The file's ``FORMAT_KEY`` entry: who wrote the checkpoint, how, and where its shards are.

    ``None`` means the writer did not record the field (older formats, or ``save_sharded`` called without a
    strategy).
    """

    format_version: int = FORMAT_VERSION
    strategy: str | None = None
    world_size: int | None = None
    num_optimizers: int = 0
    parallel_dims: dict[str, int] | None = None
    huggingface: dict[str, Any] | None = None
    torch_version: str | None = None
    shards: str | None = None
    fabric: FabricObjects | None = None

    def weights_keys(self) -> tuple[str, ...]:
        """The file's keys that hold the full weights: Lightning's ``state_dict``, and a Fabric save's module key."""
        return ("state_dict",) if self.fabric is None else ("state_dict", self.fabric.module)

    def committed(self, shards: str) -> CheckpointDescription:
        """This description as a save commits it: the current format, the shards directory ``shards``, and the torch
        that wrote them (DCP's files are torch's own format: whoever reads them with another torch should know).

        The version is written as a plain ``str``: ``torch.__version__`` is a ``TorchVersion``, which
        ``torch.load(weights_only=True)`` refuses, and ``load_from_checkpoint`` must open the file that way.
        """
        return replace(self, format_version=FORMAT_VERSION, shards=shards, torch_version=str(torch.__version__))

    def provenance(self) -> str:
        """Who wrote the checkpoint, in words, from the fields it recorded (empty when it recorded none)."""
        parts = [
            f"{label} {value}"
            for label, value in (
                ("saved by", self.strategy),
                ("at world size", self.world_size),
                ("with torch", self.torch_version),
            )
            if value is not None
        ]
        return " ".join(parts)

    def to_entry(self) -> dict[str, Any]:
        """The ``FORMAT_KEY`` entry to write; fields left unknown are left out."""
        return {
            name: value
            for name, value in (
                ("format_version", self.format_version),
                ("strategy", self.strategy),
                ("world_size", self.world_size),
                ("num_optimizers", self.num_optimizers),
                ("parallel_dims", self.parallel_dims),
                ("huggingface", self.huggingface),
                ("torch_version", self.torch_version),
                ("shards", self.shards),
                ("fabric", None if self.fabric is None else self.fabric.to_entry()),
            )
            if value is not None
        }

    @classmethod
    def from_contents(cls, contents: Any) -> CheckpointDescription | None:
        """The description in a loaded checkpoint file (or format 1's ``meta.pt``), or ``None`` for a file without
        one (Lightning's own strategies, the consolidate command)."""
        if not isinstance(contents, Mapping) or not isinstance(contents.get(FORMAT_KEY), Mapping):
            return None
        entry = contents[FORMAT_KEY]
        shards = entry.get("shards")
        return cls(
            # Every writer so far recorded the version; 1 is the oldest.
            format_version=int(entry.get("format_version", 1)),
            strategy=entry.get("strategy"),
            world_size=entry.get("world_size"),
            num_optimizers=int(entry.get("num_optimizers") or 0),
            parallel_dims=entry.get("parallel_dims"),
            huggingface=entry.get("huggingface"),
            torch_version=entry.get("torch_version"),
            shards=None if shards is None else str(shards),
            fabric=FabricObjects.from_entry(entry.get("fabric")),
        )

    def add_to(self, contents: dict[str, Any]) -> None:
        """Put this description into the checkpoint file's ``contents``, replacing any there."""
        contents[FORMAT_KEY] = self.to_entry()

    @classmethod
    def remove_from(cls, contents: dict[str, Any]) -> CheckpointDescription | None:
        """Take the description out of ``contents`` (what is left is a plain Lightning checkpoint); returns it."""
        description = cls.from_contents(contents)
        contents.pop(FORMAT_KEY, None)
        return description


# ------------------------------------------------------------------------------------------ the tensor state in DCP
@dataclass
class TrainingTensors:
    """The tensor state one rank saves, or the destinations it loads into, as the parts of the format.

    On save the tensors are this rank's (whole or sharded; see ``sharded``); on load they alias the live state, which
    DCP fills in place, while non-tensor values (param groups, random state) are replaced in the dict that
    ``to_state`` made: read them back with ``from_state`` of that dict.
    """

    model: dict[str, Any]
    optimizers: list[dict[str, Any]] = field(default_factory=list)
    rng_by_rank: dict[int, Any] = field(default_factory=dict)
    #: The weights being trained when ``model`` holds their average; ``None`` without weight averaging.
    current_model: dict[str, Any] | None = None

    def to_state(self) -> dict[str, Any]:
        """The nested dict DCP saves or loads (its keys flattened into items, see the module docstring)."""
        state: dict[str, Any] = {MODEL_KEY: self.model}
        if self.current_model is not None:
            state[CURRENT_MODEL_KEY] = self.current_model
        for index, optimizer in enumerate(self.optimizers):
            state[optimizer_key(index)] = optimizer
        if self.rng_by_rank:
            state[RNG_KEY] = {rng_key(rank): value for rank, value in self.rng_by_rank.items()}
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> TrainingTensors:
        """The parts of a nested dict DCP filled (or read whole, ``sharded.read_sharded``); parts it lacks are empty.

        Optimizers are counted from 0 up to the first missing index, as they were saved.
        """
        optimizers = []
        while optimizer_key(len(optimizers)) in state:
            optimizers.append(state[optimizer_key(len(optimizers))])
        rng_by_rank = {
            int(key[len(_RANK_PREFIX) :]): value
            for key, value in state.get(RNG_KEY, {}).items()
            if key.startswith(_RANK_PREFIX) and key[len(_RANK_PREFIX) :].isdigit()
        }
        return cls(
            model=state.get(MODEL_KEY, {}),
            optimizers=optimizers,
            rng_by_rank=rng_by_rank,
            current_model=state.get(CURRENT_MODEL_KEY),
        )


class SavedItems:
    """The flattened items stored in a checkpoint's shards, by key, with their whole shapes (``None`` for items saved
    as bytes): DCP's index (``sharded.saved_shapes``), read without any tensor."""

    def __init__(self, shapes: Mapping[str, torch.Size | None]) -> None:
        self._shapes = dict(shapes)

    def model_names(self) -> set[str]:
        """Names of the model tensors saved."""
        return {name for name in map(model_name, self._shapes) if name is not None}

    def model_shape(self, name: str) -> torch.Size | None:
        """The whole shape of the saved model tensor ``name`` (``None`` when it is not saved, or not a tensor)."""
        return self._shapes.get(model_item(name))

    def holds_optimizer_group(self, optimizer: int, group: int) -> bool:
        """Whether any setting of param group ``group`` of optimizer ``optimizer`` is saved."""
        prefix = _optimizer_group_prefix(optimizer, group)
        return any(key.startswith(prefix) for key in self._shapes)

    def holds_optimizer_setting(self, optimizer: int, group: int, setting: str) -> bool:
        """Whether ``setting`` (``lr``, ``initial_lr``, ...) of that param group is saved."""
        return f"{_optimizer_group_prefix(optimizer, group)}{setting}" in self._shapes

    def holds_optimizer_state_of(self, optimizer: int, name: str) -> bool:
        """Whether any state tensor or value of parameter ``name`` in optimizer ``optimizer`` is saved (an optimizer
        keeps none for a parameter no gradient has reached yet)."""
        prefix = f"{optimizer_key(optimizer)}.state.{name}."
        return any(key.startswith(prefix) for key in self._shapes)

    def holds_current_model(self) -> bool:
        """Whether the weights being trained are saved apart from ``model`` (a weight-averaging run)."""
        prefix = f"{CURRENT_MODEL_KEY}."
        return any(key.startswith(prefix) for key in self._shapes)

    def holds_rng_of(self, rank: int) -> bool:
        """Whether ``rank``'s random state is saved (a save at a smaller world size has none for higher ranks)."""
        prefix = f"{RNG_KEY}.{rng_key(rank)}."
        return any(key.startswith(prefix) for key in self._shapes)


def _optimizer_group_prefix(optimizer: int, group: int) -> str:
    return f"{optimizer_key(optimizer)}.param_groups.{group}."
