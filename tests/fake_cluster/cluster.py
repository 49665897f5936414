"""A fake GPU cluster inside one CPU process: fake CUDA tensors, a fake process group of any size, and a device
runtime that answers without hardware.

What it is made of, and why each piece:

- torch's ``"fake"`` process-group backend (``FakeStore``) at world sizes 8 to 64: groups, device meshes and ranks
  exist, nothing is sent. This process plays one rank.
- ``FakeTensorMode``: tensors created inside carry a device (``cuda``) and a shape but no data, so a model of any
  size costs nothing, and an operation mixing a host tensor with a device tensor raises, as on a GPU.
- ``Scalars``: reading a value (``.item()``, ``.tolist()``, ``bool(tensor)``) answers 0 (``True`` for booleans):
  "no overflow", "every parameter got a gradient", so the engines go down their ordinary path. It also counts, in
  ``DeviceWork``, what each operation would make a real GPU's host wait for and the kernels it would launch.
- ``FakeRuntime`` replaces the real device runtime in ``lightning_colossal.distributed.device``: the engines' one
  door to ``torch.cuda`` ([Note: copies between host and device] there). This build cannot pin host memory, so the
  tier remembers which host tensors a real GPU's runtime would have pinned (``PinnedOnAGpu``): what
  ``device.host_buffer`` hands out beside a GPU, and what ``device.to_host`` returns.
- ``CollectiveRecorder`` replaces torch.distributed's collectives: torch's own functions ask the CUDA driver about
  the device (``broadcast`` reads the compute capability), which this build has not got, and the fake backend
  accepts tensors of any device. The recorder checks what NCCL checks, that every tensor handed to a group is on
  the group's device type (CUDA), and records each call (name, group, shape, dtype) so tests can compare the order of
  collectives across ranks and groups. Values are not computed: that is what the native-route oracle tests on gloo
  are for (``tests/distributed/test_native_route.py``).

What it cannot reach, measured: torch's FSDP2 (its first forward aborts in C++ without CUDA), anything that needs a
tensor's values, CUDA streams and events, and NCCL's own ordering rules across communicators.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from lightning_colossal.distributed import collectives
from lightning_colossal.distributed import device as devices

GPU_BYTES = 80 * 2**30


@dataclass
class DeviceWork:
    """What the operations run so far would make a real GPU's host wait for, and the kernels they would launch.

    Counted as the fake tier runs them, so a test can say, per optimizer step, what a GPU would pay that a CPU step
    never shows (there, a copy is free and a scalar read costs nothing):

    - ``scalar_reads``: ``.item()``, ``.tolist()``, ``bool()``, ``float()`` of a device tensor: the host waits for the
      queue to drain, then copies the value back.
    - ``scalar_writes``: a Python number (or host tensor) written into elements of a device tensor
      (``flags[i] = 1.0``): torch makes the number a host tensor and copies it over synchronously.
    - ``host_to_device_copies``: copies from host memory onto the device that the host waits for: from pageable
      memory (CUDA synchronises the stream before the copy starts), or blocking (``non_blocking=False``).
    - ``pinned_host_to_device_copies``: asynchronous copies from host memory a GPU would have pinned
      (``PinnedOnAGpu``): no wait, but a transfer launched each.
    - ``device_to_host_copies``: copies the other way (their wait is the synchronisation that follows them, below).
    - ``synchronizations``: waits for the device through ``distributed/device.py``.
    - ``data_dependent_shapes``: operations whose output shape depends on values (``nonzero``, boolean masks): the
      host must read the values to allocate the output.
    - ``kernels``: device operations that are not views (a foreach operation over many tensors counts once).
    """

    scalar_reads: int = 0
    scalar_writes: int = 0
    host_to_device_copies: int = 0
    pinned_host_to_device_copies: int = 0
    device_to_host_copies: int = 0
    synchronizations: int = 0
    data_dependent_shapes: int = 0
    kernels: int = 0

    @property
    def waits(self) -> int:
        """Every time the host would wait for the device."""
        return (
            self.scalar_reads
            + self.scalar_writes
            + self.host_to_device_copies
            + self.synchronizations
            + self.data_dependent_shapes
        )

    def snapshot(self) -> DeviceWork:
        return dataclasses.replace(self)

    def since(self, earlier: DeviceWork) -> DeviceWork:
        """The work done after ``earlier`` (a ``snapshot``)."""
        return DeviceWork(
            **{item.name: getattr(self, item.name) - getattr(earlier, item.name) for item in dataclasses.fields(self)}
        )


_DATA_DEPENDENT = {
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.unique_dim.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.repeat_interleave.Tensor,
}


def _on_device(value: Any) -> bool:
    return isinstance(value, FakeTensor) and value.device.type == "cuda"


class Scalars(TorchDispatchMode):
    """Values read from fake tensors (0, or ``True`` for booleans), and every device operation counted in ``work``."""

    def __init__(self, work: DeviceWork) -> None:
        super().__init__()
        self.work = work

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            if args[0].device.type == "cuda":
                self.work.scalar_reads += 1
            return True if args[0].dtype == torch.bool else 0
        # Foreach operations take lists of tensors.
        flat = [
            item
            for value in (*args, *kwargs.values())
            for item in (value if isinstance(value, list | tuple) else (value,))
            if isinstance(item, torch.Tensor)
        ]
        if any(_on_device(value) for value in flat):
            if func in _DATA_DEPENDENT:
                self.work.data_dependent_shapes += 1
            if func is torch.ops.aten.copy_.default and not _on_device(args[0]):
                self.work.device_to_host_copies += 1
            elif func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None:
                if torch.device(kwargs["device"]).type == "cpu":
                    self.work.device_to_host_copies += 1
            # Views launch nothing, nor do queries of a tensor's metadata (``prim.device``: ``tensor.device`` on a fake
            # tensor reaches this mode).
            if not func.is_view and func.namespace != "prim":
                self.work.kernels += 1
        return func(*args, **kwargs)


class FakeRuntime:
    """The device runtime of ``lightning_colossal.distributed.device``, for GPUs that are not there."""

    def __init__(self, device_count: int = 8) -> None:
        self.count = device_count
        self.synchronized: list[torch.device] = []

    def available(self) -> bool:
        return True

    def accelerator_type(self) -> str:
        return "cuda"

    def device_count(self, device_type: str) -> int:
        return self.count

    def current_device(self, device_type: str) -> torch.device:
        return torch.device(device_type, 0)

    def synchronize(self, device: torch.device) -> None:
        self.synchronized.append(device)

    def max_memory_allocated(self, device: torch.device) -> int:
        return 0

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        pass

    def memory_allocated(self, device: torch.device) -> int:
        return 0

    def total_memory(self, device: torch.device) -> int:
        return GPU_BYTES

    def get_rng_state(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(16, dtype=torch.uint8)

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        assert state.device.type == "cpu", "a device's random state is set from a host tensor"

    def can_pin(self) -> bool:
        return False  # this build cannot pin host memory


class DoneWork:
    """The handle of a recorded asynchronous collective: already complete."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@dataclass(frozen=True)
class Call:
    name: str
    group_ranks: tuple[int, ...]
    group_id: int
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype | None


class WrongDevice(AssertionError):
    """A tensor handed to a process group whose backend (as NCCL) cannot take its device."""


@dataclass
class CollectiveRecorder:
    """Stands in for torch.distributed's collectives (see the module docstring)."""

    device_type: str = "cuda"
    calls: list[Call] = field(default_factory=list)

    def _record(self, name: str, group: Any, *tensors: Any) -> None:
        group = group if group is not None else dist.group.WORLD
        real = [tensor for tensor in tensors if isinstance(tensor, torch.Tensor)]
        # A group made as a host group (gloo beside NCCL) takes host tensors only; every other group device tensors.
        takes = "cpu" if collectives.group_device_types(group) == ("cpu",) else self.device_type
        for tensor in real:
            if tensor.device.type != takes:
                raise WrongDevice(
                    f"{name} of a {tensor.device.type} tensor {tuple(tensor.shape)} on a group that takes"
                    f" {takes} tensors only (NCCL: 'No backend type associated with device type"
                    f" {tensor.device.type}')"
                )
        self.calls.append(
            Call(
                name,
                tuple(dist.get_process_group_ranks(group)),
                id(group),
                tuple(tuple(tensor.shape) for tensor in real),
                real[0].dtype if real else None,
            )
        )

    def replacements(self) -> dict[str, Callable[..., Any]]:
        def collective(name: str, tensor_positions: tuple[int, ...]) -> Callable[..., Any]:
            def call(*args: Any, group: Any = None, async_op: bool = False, **kwargs: Any) -> Any:
                handed = [args[position] for position in tensor_positions if position < len(args)]
                # List forms (``all_gather(outputs, input)``) hand the group every tensor of the list.
                flat = [item for value in handed for item in (value if isinstance(value, list | tuple) else [value])]
                self._record(name, group, *flat)
                return DoneWork() if async_op else None

            return call

        return {
            "all_reduce": collective("all_reduce", (0,)),
            "broadcast": collective("broadcast", (0,)),
            "all_gather": collective("all_gather", (0, 1)),
            "all_gather_into_tensor": collective("all_gather", (0, 1)),
            "all_gather_single": collective("all_gather", (0, 1)),
            "reduce_scatter_tensor": collective("reduce_scatter", (0, 1)),
            "reduce_scatter_single": collective("reduce_scatter", (0, 1)),
            "all_to_all_single": collective("all_to_all", (0, 1)),
            "send": collective("send", (0,)),
            "recv": collective("recv", (0,)),
            "barrier": collective("barrier", ()),
        }

    def order(
        self, group_ids: set[int] | None = None
    ) -> list[tuple[str, tuple[int, ...], tuple[tuple[int, ...], ...]]]:
        """The recorded calls as comparable values (group ids are process-local), optionally only some groups'."""
        return [
            (call.name, call.group_ranks, call.shapes)
            for call in self.calls
            if group_ids is None or call.group_id in group_ids
        ]


class PinnedOnAGpu:
    """The host tensors a real GPU's runtime would have pinned, and their views: this build cannot pin (``FakeRuntime``),
    so ``device.host_buffer`` (beside a GPU) and ``device.to_host`` are wrapped to remember what they hand out."""

    def __init__(self) -> None:
        self._roots: dict[int, weakref.ref[torch.Tensor]] = {}

    def add(self, tensor: torch.Tensor) -> torch.Tensor:
        self._roots[id(tensor)] = weakref.ref(tensor)
        return tensor

    def __contains__(self, tensor: torch.Tensor) -> bool:
        root = tensor._base if tensor._base is not None else tensor
        known = self._roots.get(id(root))
        return known is not None and known() is root

    @contextmanager
    def recording(self) -> Iterator[None]:
        host_buffer, to_host = devices.host_buffer, devices.to_host

        def pinned_host_buffer(numel: int, dtype: torch.dtype, beside: torch.device, zeroed: bool = False) -> Any:
            buffer = host_buffer(numel, dtype, beside, zeroed)
            return self.add(buffer) if devices.is_accelerator(beside) else buffer

        def pinned_to_host(tensor: torch.Tensor) -> torch.Tensor:
            moved = to_host(tensor)
            return self.add(moved) if moved is not tensor else moved

        devices.host_buffer, devices.to_host = pinned_host_buffer, pinned_to_host  # type: ignore[assignment]
        try:
            yield
        finally:
            devices.host_buffer, devices.to_host = host_buffer, to_host  # type: ignore[assignment]


def _basic_view(tensor: torch.Tensor, index: Any) -> torch.Tensor | None:
    """``tensor[index]`` through ``narrow``/``select`` for ints, unit-step slices and ``...``; ``None`` otherwise."""
    items = index if isinstance(index, tuple) else (index,)
    if any(item is Ellipsis for item in items):
        if sum(item is Ellipsis for item in items) > 1:
            return None
        at = next(position for position, item in enumerate(items) if item is Ellipsis)
        fill = (slice(None),) * (tensor.dim() - (len(items) - 1))
        items = items[:at] + fill + items[at + 1 :]
    view, dim = tensor, 0
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, slice)):
            return None
        if isinstance(item, int):
            view = view.select(dim, item)
            continue
        start, stop, step = item.indices(view.shape[dim])
        if step != 1:
            return None
        view = view.narrow(dim, start, max(stop - start, 0))
        dim += 1
    return view


@contextmanager
def _cuda_tensor_methods(work: DeviceWork, pinned: PinnedOnAGpu) -> Iterator[None]:
    """What this CPU build cannot do with fake CUDA tensors, done at the Python level: basic indexing (``__getitem__``
    asks for CUDA support; the same view through ``narrow``/``select`` is a plain view op), and copies into or onto
    the device (``copy_``, ``to``), which become shape-checked allocations, counted as a wait or, asynchronous from
    memory a GPU would have pinned, as a pinned copy."""
    get_item, set_item = torch.Tensor.__getitem__, torch.Tensor.__setitem__

    def getitem(tensor: torch.Tensor, index: Any) -> Any:
        if isinstance(tensor, FakeTensor) and tensor.device.type == "cuda":
            view = _basic_view(tensor, index)
            if view is not None:
                return view
        return get_item(tensor, index)

    def setitem(tensor: torch.Tensor, index: Any, value: Any) -> None:
        if isinstance(tensor, FakeTensor) and tensor.device.type == "cuda":
            if not _on_device(value):  # a Python number or a host tensor: copied over synchronously
                work.scalar_writes += 1
            view = _basic_view(tensor, index)
            if view is not None:
                view.copy_(value) if isinstance(value, torch.Tensor) else view.fill_(value)
                return
        set_item(tensor, index, value)

    copy, to, tolist = torch.Tensor.copy_, torch.Tensor.to, FakeTensor.tolist

    def count_host_to_device(source: torch.Tensor, non_blocking: bool) -> None:
        if non_blocking and source in pinned:
            work.pinned_host_to_device_copies += 1
        else:
            work.host_to_device_copies += 1

    def tolist_(tensor: torch.Tensor) -> Any:
        # One read, as on a GPU (one copy back, one wait), where fake tensors would read element by element.
        if tensor.device.type == "cuda":
            work.scalar_reads += 1
            with _disable_current_modes():
                value = torch.ones if tensor.dtype == torch.bool else torch.zeros
                return value(tensor.shape, dtype=tensor.dtype).tolist()
        return tolist(tensor)

    def copy_(target: torch.Tensor, source: Any, non_blocking: bool = False) -> torch.Tensor:
        # Into a fake CUDA tensor this build's copy asks for CUDA support: check what a copy checks (the shapes
        # broadcast), move no values (there are none).
        if isinstance(target, FakeTensor) and target.device.type == "cuda" and isinstance(source, torch.Tensor):
            torch.broadcast_shapes(target.shape, source.shape)
            work.kernels += 1
            if not _on_device(source):
                count_host_to_device(source, non_blocking)
            return target
        return copy(target, source, non_blocking=non_blocking)

    def to_(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        device = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
        if isinstance(tensor, FakeTensor) and device is not None and torch.device(device).type == "cuda":
            dtype = kwargs.get("dtype", next((arg for arg in args if isinstance(arg, torch.dtype)), tensor.dtype))
            if tensor.device.type == "cuda" and dtype == tensor.dtype:
                return tensor
            work.kernels += 1
            if tensor.device.type != "cuda":
                positional = next((arg for arg in args if isinstance(arg, bool)), False)
                count_host_to_device(tensor, bool(kwargs.get("non_blocking", positional)))
            return torch.empty(tensor.shape, dtype=dtype, device="cuda")
        return to(tensor, *args, **kwargs)

    torch.Tensor.__getitem__, torch.Tensor.__setitem__ = getitem, setitem  # type: ignore[method-assign]
    torch.Tensor.copy_, torch.Tensor.to = copy_, to_  # type: ignore[method-assign,assignment]
    FakeTensor.tolist = tolist_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.__getitem__, torch.Tensor.__setitem__ = get_item, set_item  # type: ignore[method-assign]
        torch.Tensor.copy_, torch.Tensor.to = copy, to  # type: ignore[method-assign]
        FakeTensor.tolist = tolist  # type: ignore[method-assign]


@dataclass
class FakeCluster:
    world_size: int
    rank: int
    recorder: CollectiveRecorder
    runtime: FakeRuntime
    work: DeviceWork
    device: torch.device = torch.device("cuda", 0)

    def device_work(self) -> DeviceWork:
        """What ran so far, the runtime's synchronisations included (a ``snapshot`` to subtract later)."""
        self.work.synchronizations = len(self.runtime.synchronized)
        return self.work.snapshot()


@contextmanager
def fake_cluster(world_size: int, rank: int = 0) -> Iterator[FakeCluster]:
    """This process as ``rank`` of ``world_size`` fake GPUs (see the module docstring); everything is undone on exit.

    Models must be built outside (on the meta device) and given fake storage with ``materialise`` inside.
    """
    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process: the fake cluster needs its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    recorder = CollectiveRecorder()
    runtime = FakeRuntime()
    saved = {name: getattr(dist, name) for name in recorder.replacements() if hasattr(dist, name)}
    mesh_init = DeviceMesh.__init__
    new_group = dist.new_group

    def fake_host_group(*args: Any, backend: Any = None, **kwargs: Any) -> Any:
        # A gloo group beside the devices' groups (collectives.host_group_like) would connect to peers that are not
        # there: it is a fake group too, which the recorder lets take host tensors.
        return new_group(*args, backend="fake" if backend == "gloo" else backend, **kwargs)

    def mesh_outside_fake_mode(mesh: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        # A mesh holds a real tensor of ranks and reads it (coordinates): built with the fake modes set aside.
        with _disable_current_modes():
            mesh_init(mesh, *args, **kwargs)

    try:
        DeviceMesh.__init__ = mesh_outside_fake_mode  # type: ignore[method-assign]
        dist.new_group = fake_host_group
        for name, replacement in recorder.replacements().items():
            setattr(dist, name, replacement)
        with ExitStack() as stack:
            stack.enter_context(collectives.declared_backend_devices("fake", ("cuda",)))
            stack.enter_context(devices.substituted(runtime))
            work = DeviceWork()
            pinned = PinnedOnAGpu()
            stack.enter_context(pinned.recording())
            stack.enter_context(_cuda_tensor_methods(work, pinned))
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(Scalars(work))
            yield FakeCluster(world_size, rank, recorder, runtime, work)
    finally:
        DeviceMesh.__init__ = mesh_init  # type: ignore[method-assign]
        dist.new_group = new_group
        for name in recorder.replacements():
            if name in saved:
                setattr(dist, name, saved[name])
            elif hasattr(dist, name):
                delattr(dist, name)
        dist.destroy_process_group()


def run_backward_hooks(module: nn.Module) -> None:
    """Stand in for a backward pass (autograd on fake CUDA tensors needs CUDA): inside a real backward of a host
    scalar (so hooks may queue end-of-backward callbacks, as the engines do), give every trainable parameter a
    gradient and run its post-accumulate-grad hooks, last parameter first, as autograd reaches them."""

    def during_backward(gradient: torch.Tensor) -> torch.Tensor:
        for parameter in reversed(list(module.parameters())):
            if not parameter.requires_grad:
                continue
            parameter.grad = torch.empty(parameter.shape, dtype=parameter.dtype, device=parameter.device)
            for hook in list((getattr(parameter, "_post_accumulate_grad_hooks", None) or {}).values()):
                hook(parameter)
        return gradient

    anchor = torch.zeros((), requires_grad=True)
    anchor.register_hook(during_backward)
    (anchor * 1.0).backward()


def materialise(module: nn.Module, device: torch.device | str) -> nn.Module:
    """Give a meta-device ``module`` fake storage on ``device`` (inside ``fake_cluster``), keeping ties.

    ``Module.to_empty`` cannot do it: it swaps tensors, which fake tensors do not allow.
    """
    made: dict[int, Any] = {}
    for submodule in module.modules():
        for name, parameter in list(submodule._parameters.items()):
            if parameter is None:
                continue
            if id(parameter) not in made:
                storage = torch.empty(parameter.shape, dtype=parameter.dtype, device=device)
                made[id(parameter)] = nn.Parameter(storage, requires_grad=parameter.requires_grad)
            submodule._parameters[name] = made[id(parameter)]
        for name, buffer in list(submodule._buffers.items()):
            if buffer is not None:
                submodule._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
    return module
