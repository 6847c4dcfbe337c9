"""RowsView: one step's decode rows as the attention function reads them (a DecodeStep; see decode_kv).

DecodeRows (decode_rows) keeps the rows across steps; this is what a single step needs of them:
which rows to fill from the pool first (sequences new to their length class), and the native
kernel's plan (decode_native: one call per layer appends the step's K/V and attends every decode).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchgen.engine.attention.decode_kv import QKV, DecodeGroup, Pool
from batchgen.engine.attention.op import LayerCall
from batchgen.engine.cpu.decode_native import ClassRows, NativeStep, fill_row


@dataclass
class RowsView:
    """One step's rows: its decodes' length classes in packed order, and the kernel's plan of them."""

    classes: list[ClassRows]
    native: NativeStep
    groups: list[DecodeGroup] = field(default_factory=list)  # none: the kernel attends every decode
    writes_pool = True  # a decode-only step's K/V are stored in the pool by the kernel (attend)

    def update(self, layer: int, pool: Pool, key: torch.Tensor, value: torch.Tensor) -> None:
        """Never called: attend() attends every decode (the cpu backend takes no soft-capped model)."""
        raise RuntimeError("decode rows are attended by the native kernel alone")

    def kv(self, layer: int, pool: Pool, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("decode rows are attended by the native kernel alone")

    def attend(self, call: LayerCall, pool: Pool, qkv: QKV, out: torch.Tensor, slots: torch.Tensor | None) -> bool:
        """Fill new rows, then append and attend every decode in one call, storing the step's K/V in
        the pool too when given their `slots` (a decode-only step).

        q [H, T, D], key/value [KVH, T, D] (decodes first), out [T, H, D].
        """
        self._fill(call.layer, pool)
        self.native.attend(call.layer, *qkv, out, call.scale, call.window, pool if slots is not None else None, slots)
        return True

    def fill_all(self, pools: list[Pool]) -> None:
        """Copy every layer's new rows out of the pool now, before the forward (one pool per layer).

        Only for a decode-only step: every position a row is filled with was computed in an earlier
        step, so nothing this step writes to the pool is missing (see _fill)."""
        for layer, pool in enumerate(pools):
            self._fill(layer, pool)
        for step in self.classes:
            step.fills = []

    def _fill(self, layer: int, pool: Pool) -> None:
        """Copy new rows' context out of the pool.

        Why per layer, after the layer's K/V went to the pool: a new row's blocks may be matched
        prefix blocks that another sequence computes in this very step.
        """
        for step in self.classes:
            k, v = step.k[layer], step.v[layer]
            for row, length, blocks in step.fills:
                fill_row(self.native.kernels, pool, blocks, length, k[row], v[row])
