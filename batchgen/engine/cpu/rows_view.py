"""RowsView: one step's decode rows as the attention function reads them (a DecodeStep; see decode_kv).

DecodeRows (decode_rows) keeps the rows across steps; this is what a single step needs of them:
which rows to fill from the pool first (sequences new to their length class), and then either
the native kernel's plan (decode_native: one call per layer appends the step's K/V and attends
every decode) or, without the kernel, one decode group per class whose K/V the torch attention
reads as views after `update` has appended the step's token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchgen.engine.attention.decode_kv import QKV, DecodeGroup, Pool
from batchgen.engine.attention.op import LayerCall
from batchgen.engine.cpu.decode_native import ClassRows, NativeStep, fill_row


@dataclass
class RowsView:
    """One step's rows: a class per decode group, in packed order (on the torch path its decodes
    are rows 0..n-1 of the class)."""

    classes: list[ClassRows]
    groups: list[DecodeGroup] = field(default_factory=list)  # the torch path: one per class
    native: NativeStep | None = None  # set: the native kernel attends (see attend)

    def kv(self, layer: int, pool: Pool, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the group's rows: keys [B, KVH, D, L], values [B, KVH, L, D], L its longest context."""
        step, g = self.classes[group], self.groups[group]
        return step.k[layer][: g.num_seqs, ..., : g.kv_len], step.v[layer][: g.num_seqs, :, : g.kv_len]

    def update(self, layer: int, pool: Pool, key: torch.Tensor, value: torch.Tensor) -> None:
        """Fill new rows from the pool, then append this step's K/V ([KVH, T, D], decodes first)."""
        self._fill(layer, pool)
        first = 0
        for step in self.classes:
            if step.index is None or step.positions is None:
                raise RuntimeError("update() on a step planned for the native kernel")
            k, v = step.k[layer], step.v[layer]
            n = step.num_rows
            k[step.index, ..., step.positions] = key[:, first : first + n].transpose(0, 1)  # [n, KVH, D]
            v[step.index, :, step.positions] = value[:, first : first + n].transpose(0, 1)
            first += n

    def attend(self, call: LayerCall, pool: Pool, qkv: QKV, out: torch.Tensor, slots: torch.Tensor | None) -> bool:
        """With the native kernel: fill new rows, then append and attend every decode in one call,
        storing the step's K/V in the pool too when given their `slots` (a decode-only step).

        q [H, T, D], key/value [KVH, T, D] (decodes first), out [T, H, D]; False: planned for the
        torch path, so the caller runs update() and attends group by group.
        """
        if self.native is None:
            return False
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

    @property
    def writes_pool(self) -> bool:
        return self.native is not None

    def _fill(self, layer: int, pool: Pool) -> None:
        """Copy new rows' context out of the pool.

        Why per layer, after the layer's K/V went to the pool: a new row's blocks may be matched
        prefix blocks that another sequence computes in this very step.
        """
        for step in self.classes:
            if not step.fills:
                continue
            k, v = step.k[layer], step.v[layer]
            for row, length, blocks in step.fills:
                if k.dim() == 5:  # the kernel's tiles (row_pack.RowPack._keys), only ever made for the kernel
                    if self.native is None:
                        raise RuntimeError("decode rows in the native kernel's tiles, but no native step to fill them")
                    fill_row(self.native.kernels, pool, blocks, length, k[row], v[row])
                    continue
                keys = pool[0].index_select(0, blocks).flatten(0, 1)  # [blocks * block_size, KVH, D]
                k[row, ..., :length] = keys[:length].permute(1, 2, 0)  # [length, KVH, D] -> keys [KVH, D, length]
                # values [KVH, length, D]
                v[row, :, :length] = pool[1].index_select(0, blocks).flatten(0, 1)[:length].transpose(0, 1)
