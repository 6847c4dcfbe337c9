"""SyncCounter: every device->host read and host->device upload an engine step makes outside Transfers.

Why a counter of its own: Transfers counts what goes through it, and a feature that reads a value
with `.tolist()` or sends an index with `torch.tensor(rows, device=...)` bypasses it. On a GPU each
of those is a host sync; on this CPU-only machine nothing is copied, so the counter decides what
"device" means by provenance, as a GPU run would place things:
  * device tensors are those made with an explicit `device=` (torch.zeros(..., device=d)), staged
    by Transfers.stage (the sanctioned upload), returned by the model's forward (the logits),
    marked up front (the KV pool), and every result of an op that reads one of them;
  * everything else is host memory: torch.tensor(list), arrays, what a read returns. That is
    where such a tensor would live on a GPU, where torch's default device is the CPU.
Counted as a read of a device tensor: .item(), bool()/int()/float() (aten._local_scalar_dense),
.tolist(), .numpy(), .cpu(), .to("cpu"), a copy into a host tensor, and ops whose output size
depends on the values (nonzero, masked_select, unique, a boolean index, repeat_interleave).
Counted as an upload: torch.tensor/as_tensor/asarray(data, device=...), x.new_tensor(data),
host.to(device) / .cuda(), and a host tensor (not a 0-d scalar, which a kernel takes by value) as
an input of an op over device tensors: an index, a copy's source, an operand.
Not counted: what runs inside the sanctioned calls (Transfers.stage, the upload's copy, read),
the model's forward and the attention backend's plan (their transfers are the backend's own
concern, staged through the same Transfers). Known gap: `.to(d)` of a device tensor to a device
object that is the CPU looks like a move on the device, since on this machine it is the same.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_VALUE_SIZED = {  # outputs sized by the values: the host must read them first
    aten.nonzero,
    aten.masked_select,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.repeat_interleave,
}
_READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}
_UPLOADS = {torch.tensor, torch.as_tensor, torch.asarray}


@dataclass(frozen=True)
class Event:
    kind: str  # "read" or "upload"
    what: str  # the call
    where: str  # the innermost batchgen frame that made it

    def __str__(self) -> str:
        return f"{self.kind} by {self.what} at {self.where}"


class SyncCounter:
    """Enter it around engine steps; `events` lists what it saw. Wire the sanctioned calls with `sanction`."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._storages: dict[int, Any] = {}  # why strong references: a freed storage's address is reused
        self._paused = 0
        self._modes = (_FunctionMode(self), _DispatchMode(self))

    # ------------------------------------------------------------ marks

    def mark(self, value: Any) -> Any:
        """Every tensor in `value` (nested tuples, lists, dicts) is device memory from now on."""
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self._storages[storage._cdata] = storage
        return value

    def is_device(self, t: torch.Tensor) -> bool:
        return t.untyped_storage()._cdata in self._storages

    # -------------------------------------------------------- sanctions

    def sanction(self, fn: Callable[..., Any], mark: bool = False) -> Callable[..., Any]:
        """`fn` with counting paused inside; `mark`: its result is device memory."""

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            with self.paused():
                out = fn(*args, **kwargs)
            return self.mark(out) if mark else out

        return call

    @contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @property
    def counting(self) -> bool:
        return self._paused == 0

    # ------------------------------------------------------------ modes

    def __enter__(self) -> SyncCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def record(self, kind: str, what: str) -> None:
        where = "?"
        for frame in reversed(traceback.extract_stack()[:-2]):
            if "/batchgen/" in frame.filename:
                where = f"{frame.filename.split('/batchgen/', 1)[1]}:{frame.lineno} {frame.name}"
                break
        self.events.append(Event(kind, what, where))


def _device_target(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | str | None:
    """The device a Tensor.to call names (positionally or by keyword), or None."""
    for value in (*args[1:], kwargs.get("device")):
        if isinstance(value, (torch.device, str)):
            return value
    return None


class _FunctionMode(TorchFunctionMode):
    """Python-level calls: reads that never reach the dispatcher on a CPU (tolist), uploads by
    creation (torch.tensor(data, device=d)), explicit-device factories (which mark their result)."""

    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        c = self.counter
        if not c.counting:
            return func(*args, **kwargs)
        name = getattr(func, "__qualname__", str(func))
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func in _READS and first is not None and c.is_device(first):
            c.record("read", name)
            with c.paused():
                return func(*args, **kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cuda) and first is not None:
            target = _device_target(args, kwargs) if func is torch.Tensor.to else "cuda"
            if target is not None:
                if c.is_device(first) and target == "cpu":
                    c.record("read", f"{name}('cpu')")
                    with c.paused():
                        return func(*args, **kwargs)
                if not c.is_device(first):
                    c.record("upload", f"{name}(device={target!r})")
                    with c.paused():
                        return c.mark(func(*args, **kwargs))
        if func is torch.Tensor.new_tensor and first is not None and c.is_device(first):
            c.record("upload", name)
        out = func(*args, **kwargs)
        if kwargs.get("device") is not None:
            if func in _UPLOADS:
                c.record("upload", f"{name}(..., device=)")
            c.mark(out)
        return out


class _DispatchMode(TorchDispatchMode):
    """aten ops: device-ness flows from inputs to outputs; scalar reads, value-sized outputs, host
    tensors mixed into device ops."""

    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        c = self.counter
        if not c.counting:
            return out
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not any(c.is_device(t) for t in inputs):
            return out
        name = str(func)
        host = [t for t in inputs if not c.is_device(t) and t.dim() > 0 and t.numel() > 0]
        writes_self = bool(func._schema.arguments) and _writes(func._schema.arguments[0])
        if func is aten._local_scalar_dense.default or func.overloadpacket in _VALUE_SIZED:
            c.record("read", name)
        elif func.overloadpacket in (aten.index, aten.index_put, aten.index_put_) and _bool_index(args):
            c.record("read", f"{name} with a boolean index")
        if writes_self and not c.is_device(args[0]):
            c.record("read", f"{name} into a host tensor")  # a device value copied into host memory
            return out
        if host:
            c.record("upload", f"{name} with host tensor(s) {[tuple(t.shape) for t in host]}")
        c.mark(out)
        return out


def _writes(argument: Any) -> bool:
    info = argument.alias_info
    return info is not None and info.is_write


def _bool_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
