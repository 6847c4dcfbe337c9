"""Every host<->device transfer of an engine step goes through one Transfers object.

Why: on a GPU each blocking copy from pageable memory, and each read of a device value, is a
host sync that stalls the next step's launch. Here a step's metadata (input ids, positions, slot
mapping, block tables, decode indices, logits indices) is staged into one reusable host buffer
(pinned on CUDA) and sent in one `non_blocking` copy before the forward; what the host needs back
(the sampled ids and the NaN flag) comes back in one read. Counting happens here too, so a CPU
test can check the goal of one device->host read per decode step, and which features need more.

On CPU there is nothing to copy: staged tensors are used as they are, but counted the same way.
`copy=True` forces the staging path on CPU, so tests exercise the buffer logic without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

INITIAL_CAPACITY = 1 << 14  # int64 values; the buffer grows (and is then kept) when a step needs more


@dataclass
class TransferCounts:
    """Transfers since the object was made: uploads (host->device copies) and reads (device->host)."""

    uploads: int = 0
    reads: int = 0
    read_sites: dict[str, int] = field(default_factory=dict)  # why each read happened

    def snapshot(self) -> tuple[int, int]:
        return self.uploads, self.reads


class _Arena:
    def __init__(self, capacity: int, device: torch.device, pin: bool) -> None:
        self.host = torch.empty(capacity, dtype=torch.int64, pin_memory=pin)
        self.dev = torch.empty(capacity, dtype=torch.int64, device=device)
        self.used = 0


class Transfers:
    """One engine's staging buffer and counters; one step at a time (stage..., upload, read)."""

    def __init__(self, device: torch.device, copy: bool | None = None, capacity: int = INITIAL_CAPACITY) -> None:
        self.device = device
        self.copy = device.type != "cpu" if copy is None else copy
        self.pin = device.type == "cuda"
        self.counts = TransferCounts()
        self._arenas = [_Arena(capacity, device, self.pin)] if self.copy else []
        self._staged = False  # something waits for upload()
        self._done: torch.cuda.Event | None = None  # pragma: no cover - CUDA: the last upload's completion

    def stage(self, values: torch.Tensor) -> torch.Tensor:
        """Host int64 `values` -> a device tensor of the same shape, valid once upload() has run."""
        self._staged = True
        if not self.copy:
            return values.to(torch.int64)
        self._wait_previous_upload()
        n = values.numel()
        arena = self._arenas[-1]
        if arena.used + n > arena.host.numel():
            arena = _Arena(max(2 * arena.host.numel(), n), self.device, self.pin)
            self._arenas.append(arena)
        a, arena.used = arena.used, arena.used + n
        arena.host[a : arena.used].copy_(values.reshape(-1))
        return arena.dev[a : arena.used].view(values.shape)

    def upload(self) -> None:
        """Send everything staged since the last upload: one non-blocking copy (one per arena if it grew)."""
        if not self._staged:
            return
        self._staged = False
        if not self.copy:
            self.counts.uploads += 1
            return
        for arena in self._arenas:
            if arena.used:
                arena.dev[: arena.used].copy_(arena.host[: arena.used], non_blocking=True)
                self.counts.uploads += 1
        if len(self._arenas) > 1:  # why: the next steps get one buffer big enough for this one
            self._arenas = [_Arena(sum(a.host.numel() for a in self._arenas), self.device, self.pin)]
        for arena in self._arenas:
            arena.used = 0
        if self.device.type == "cuda":  # pragma: no cover - needs CUDA
            self._done = torch.cuda.Event()
            self._done.record()

    def read(self, site: str, *tensors: torch.Tensor) -> list[list[int]]:
        """Device integer/bool tensors -> their values as flat lists, in ONE device->host copy
        (on the CPU, where nothing is copied, each tensor's own values: bools stay bools)."""
        self.counts.reads += 1
        self.counts.read_sites[site] = self.counts.read_sites.get(site, 0) + 1
        if not self.copy:  # why: host tensors are read where they are, no concatenation (~40 us a step)
            return [t.reshape(-1).tolist() for t in tensors]
        flat = [t.reshape(-1).to(torch.int64) for t in tensors]
        values = (flat[0] if len(flat) == 1 else torch.cat(flat)).tolist()
        out, a = [], 0
        for t in flat:
            out.append(values[a : a + t.numel()])
            a += t.numel()
        self._done = None  # why: a read waits for all earlier work, the last upload included
        return out

    def to_device(self, values: torch.Tensor) -> torch.Tensor:
        """A one-off upload outside the step's staging (counted): for features that need more than one."""
        self.counts.uploads += 1
        if not self.copy:
            return values
        host = values.pin_memory() if self.pin else values
        return host.to(self.device, non_blocking=self.pin)

    def _wait_previous_upload(self) -> None:
        """Before rewriting the host buffer: the previous step's copy out of it must have finished.

        Why: a step that samples nothing has no read, so nothing else has waited for that copy.
        """
        if self._done is not None:  # pragma: no cover - CUDA only
            self._done.synchronize()
            self._done = None
