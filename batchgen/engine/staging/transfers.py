"""Every host<->device transfer of an engine step goes through one Transfers object.

Why: on a GPU every blocking copy and every read is a sync. All a step sends is staged in one
reusable (pinned) buffer and sent in one `non_blocking` copy (`on_upload` work runs right behind
it); all it needs back comes in one read. Counted here (tests/engine/test_one_sync.py). On CPU
staged tensors are used as they are; `copy=True` forces the staging path for tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

INITIAL_CAPACITY = 1 << 14  # 8-byte words; the buffer grows (and is then kept) when a step needs more
_ALIGN = 8  # every staged tensor starts on an 8-byte boundary, so any dtype can view its bytes


@dataclass
class TransferCounts:
    """Transfers since the object was made: uploads (host->device copies) and reads (device->host)."""

    uploads: int = 0
    reads: int = 0
    read_sites: dict[str, int] = field(default_factory=dict)  # why each read happened


class _Arena:
    def __init__(self, nbytes: int, device: torch.device, pin: bool) -> None:
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.used = 0  # bytes staged in this step
        self.sent = 0  # of which uploaded


class Transfers:
    """One engine's staging buffer and counters; one step at a time (begin_step, stage..., upload, read).

    A staged view stays valid until the next `begin_step`, even when a step uploads twice (a CUDA
    graph that turns out not to fit, then the general path): the second upload sends only what
    was staged after the first.
    """

    def __init__(self, device: torch.device, copy: bool | None = None, capacity: int = INITIAL_CAPACITY) -> None:
        self.device = device
        self.copy = device.type != "cpu" if copy is None else copy
        self.pin = device.type == "cuda"
        self.counts = TransferCounts()
        self._arenas = [_Arena(capacity * _ALIGN, device, self.pin)] if self.copy else []
        self._staged = False  # something waits for upload()
        self._after: list[Callable[[], object]] = []  # device work queued behind the next upload
        self._done: torch.cuda.Event | None = None  # pragma: no cover - CUDA: the last upload's completion

    def stage(self, values: torch.Tensor, keep: bool = False) -> torch.Tensor:
        """Host `values` -> a device tensor of the same shape, valid once upload() has run.

        Integer values arrive as int64 (the step's metadata); floating and bool ones keep their
        dtype. `keep`: the result is a tensor of its own that outlives the step (a plain staged
        tensor is a view of the buffer, which the next step's upload overwrites); on the CPU
        `values` itself, so pass a tensor nobody writes later.
        """
        self._staged = True
        if not (values.is_floating_point() or values.dtype == torch.bool):
            values = values.to(torch.int64)
        if not self.copy:
            return values
        if self._done is not None:  # pragma: no cover - CUDA only
            # why: the previous step's copy out of the buffer must finish before it is rewritten, and
            # a step that samples nothing has no read, so nothing else has waited for it
            self._done.synchronize()
            self._done = None
        view = self._place(values)
        if not keep:
            return view
        kept = torch.empty(values.shape, dtype=values.dtype, device=self.device)
        self._after.append(lambda: kept.copy_(view))
        return kept

    def begin_step(self) -> None:
        """A new step: the buffer is written from its start again (the last step's views die), and
        whatever a failed step left unsent is dropped."""
        self._staged = False
        self._after = []
        if not self.copy:
            return
        if len(self._arenas) > 1:  # why: the next steps get one buffer big enough for the last one
            self._arenas = [_Arena(sum(a.host.numel() for a in self._arenas), self.device, self.pin)]
        for arena in self._arenas:
            arena.used = arena.sent = 0

    def on_upload(self, action: Callable[[], object]) -> None:
        """Run `action` (device work on staged values) right after the next upload, in staging order."""
        self._after.append(action)

    def upload(self) -> None:
        """Send everything staged since the last upload: one non-blocking copy (one per buffer if it
        grew in this step), then the device work queued behind it."""
        if self._staged:
            self._staged = False
            self._send()
        after, self._after = self._after, []
        for action in after:
            action()

    def read(self, site: str, *tensors: torch.Tensor) -> list[list[int] | list[float]]:
        """Device tensors -> their values as flat lists, in ONE device->host copy: integer and bool
        tensors give ints (bools on the CPU), floating ones floats (float32 values exactly).
        On the CPU, where nothing is copied, each tensor's own values."""
        self.counts.reads += 1
        self.counts.read_sites[site] = self.counts.read_sites.get(site, 0) + 1
        if not self.copy:  # why: host tensors are read where they are, no concatenation (~40 us a step)
            return [t.reshape(-1).tolist() for t in tensors]
        flat = [t.reshape(-1) for t in tensors]
        # why 8-byte words: one dtype for one concatenated copy; float64 holds any float32 exactly
        words = [f.to(torch.float64).view(torch.int64) if f.is_floating_point() else f.to(torch.int64) for f in flat]
        host = (words[0] if len(words) == 1 else torch.cat(words)).cpu()
        out: list[list[int] | list[float]] = []
        a = 0
        for f in flat:
            part = host[a : a + f.numel()]
            out.append((part.view(torch.float64) if f.is_floating_point() else part).tolist())
            a += f.numel()
        self._done = None  # why: a read waits for all earlier work, the last upload included
        return out

    def _place(self, values: torch.Tensor) -> torch.Tensor:
        """Copy `values` into the host buffer; its device twin's view, of `values`' dtype and shape."""
        data = values.reshape(-1).view(torch.uint8)
        n = data.numel()
        arena = self._arenas[-1]
        a = -(-arena.used // _ALIGN) * _ALIGN
        if a + n > arena.host.numel():
            arena = _Arena(max(2 * arena.host.numel(), n), self.device, self.pin)
            self._arenas.append(arena)
            a = 0
        arena.used = a + n
        arena.host[a : a + n].copy_(data)
        return arena.dev[a : a + n].view(values.dtype).view(values.shape)

    def _send(self) -> None:
        """The staged bytes to the device (the one sanctioned upload of a step)."""
        if not self.copy:
            self.counts.uploads += 1
            return
        for arena in self._arenas:
            if arena.used > arena.sent:
                a, b = arena.sent, arena.used
                arena.dev[a:b].copy_(arena.host[a:b], non_blocking=True)
                arena.sent = b
                self.counts.uploads += 1
        if self.device.type == "cuda":  # pragma: no cover - needs CUDA
            self._done = torch.cuda.Event()
            self._done.record()


def put_scalar(target: torch.Tensor, indices: tuple[torch.Tensor, ...], value: float | bool) -> None:
    """`target[indices] = value` without a hidden sync: with a Python number, torch's index_put_
    makes it a CPU tensor and copies that to the device with a blocking copy (a stream sync on
    CUDA, every call: the H200 run's profiler counted one per decode step with penalties). A value
    made on the target's device is a fill kernel."""
    target.index_put_(indices, target.new_full((), value))
