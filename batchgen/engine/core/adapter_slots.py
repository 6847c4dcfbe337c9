"""SlotTable: which adapter occupies which device slot, decided by the scheduler (no tensors here).

Why in core/ and not in engine/lora with the slots' tensors: it is the scheduler's policy, as the
block manager is its memory; the runner only carries out the loads it is handed (lora/slots).

The rules (issue 43): at most `max_loras` distinct adapters run in a step, because every admitted
sequence (running, or preempted and waiting to be recomputed) pins its adapter's slot; a pinned
slot is never given to another adapter. An adapter not resident takes a free slot, else the least
recently released unpinned one (LRU), and the step carries the load for the runner to make. A
sequence whose adapter finds no slot waits, and so, in order, does everyone behind it.
"""

from __future__ import annotations

from collections import OrderedDict


class SlotTable:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.reset()

    def reset(self) -> None:
        """Forget every slot (an aborted run: the runner's slot contents are then reloaded as needed)."""
        self._slot: dict[bytes, int] = {}  # resident adapter -> its slot
        self._pins: dict[bytes, int] = {}  # resident adapter -> admitted sequences using it
        self._idle: OrderedDict[bytes, None] = OrderedDict()  # unpinned resident adapters, least recent first
        self._free = list(range(self.max_loras - 1, -1, -1))  # popped from the end: slot 0 first

    def slot_of(self, adapter: bytes) -> int:
        """The slot of a resident adapter."""
        return self._slot[adapter]

    def can_pin(self, adapter: bytes) -> bool:
        """Whether `adapter` is resident or can be made so now."""
        return adapter in self._slot or bool(self._free) or bool(self._idle)

    def pin(self, adapter: bytes) -> tuple[int, bool]:
        """One more admitted sequence of `adapter`: -> (its slot, whether it must be loaded there).
        Call only when can_pin says so."""
        slot = self._slot.get(adapter)
        load = slot is None
        if slot is None:
            if self._free:
                slot = self._free.pop()
            else:
                evicted, _ = self._idle.popitem(last=False)
                slot = self._slot.pop(evicted)
                del self._pins[evicted]
            self._slot[adapter] = slot
            self._pins[adapter] = 0
        self._idle.pop(adapter, None)
        self._pins[adapter] += 1
        return slot, load

    def unpin(self, adapter: bytes) -> None:
        """An admitted sequence of `adapter` finished: at no pins its slot may be given away (LRU)."""
        self._pins[adapter] -= 1
        if self._pins[adapter] == 0:
            self._idle[adapter] = None

    @property
    def pinned(self) -> dict[bytes, int]:
        """Resident adapters with their pin counts (tests)."""
        return {a: n for a, n in self._pins.items() if n}
