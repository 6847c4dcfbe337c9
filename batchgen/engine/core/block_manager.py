"""BlockManager: the KV block pool — ref counts, the LRU free list and the prefix hash table.

The block tables live here, by sequence id (a Sequence holds no blocks). A free block (ref 0) may
keep its hash and stay matchable until popped for reuse; the free list is the LRU order (hashless
blocks go first). Forked samples share blocks by reference; a shared partial last block is copied
on write (`take_copies`: the runner makes the copies before the forward).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from batchgen.engine.core.block_hash import chain_block_hashes
from batchgen.engine.core.sequence import Sequence


@dataclass
class _SeqHashes:
    """Per-sequence hash cache: hashes of its full blocks, and how many of its table are registered."""

    hashes: list[bytes] = field(default_factory=list)
    num_registered: int = 0  # block_table[:num_registered] are already hashed or skipped


class BlockManager:
    """Fixed pool of `num_blocks` KV blocks of `block_size` tokens each."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"BlockManager num_blocks must be an integer >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"BlockManager block_size must be an integer >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        # Insertion order = eviction order; O(1) pop-front, append, and removal by id.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._tables: dict[int, list[int]] = {}  # seq id -> its KV blocks, in token order
        self._seq_hashes: dict[int, _SeqHashes] = {}  # seq id -> its hash cache
        self._copies: list[tuple[int, int]] = []  # copy-on-write (source, destination) blocks, not yet made

    # ----------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached-but-unreferenced ones included (they are evictable)."""
        return len(self._free)

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's KV block ids in token order (empty when it holds none). Read only: the
        list is the pool's own; the scheduler snapshots it into each chunk."""
        return self._tables.get(seq_id) or []

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """Longest chain of cached full blocks matching `seq.token_ids` from the start.

        Returns (block ids, tokens they cover), leaving at least one token to compute (for its logits).
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._hashes_upto(seq, max_blocks)
        blocks: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks, len(blocks) * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Whether `allocate_slots` with the same arguments would succeed now (changes nothing)."""
        computed = computed_blocks or []
        needed = self._num_new_blocks(seq, num_new_tokens, computed) + self._shared_tail(seq, num_new_tokens)
        return needed <= self._num_available(computed)

    # --------------------------------------------------------------- mutations

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Extend the sequence's block table to cover its computed tokens plus `num_new_tokens`.

        `computed_blocks` only for a fresh sequence (they head its table); full blocks are registered
        in the hash table. False, changing nothing, when the pool is short.
        """
        if num_new_tokens == 1 and not computed_blocks and self._slot_in_place(seq):
            # why a fast path: a decode is one token, usually into a block the sequence already owns
            # alone, and every running sequence takes this call every step
            if self.enable_prefix_caching:
                self._register_full_blocks(seq, seq.num_computed_tokens + 1)
            return True
        computed = computed_blocks or []
        num_new_blocks = self._num_new_blocks(seq, num_new_tokens, computed)
        cow = self._shared_tail(seq, num_new_tokens)
        if num_new_blocks + cow > self._num_available(computed):
            return False
        if cow:
            self._copy_on_write(seq)
        for block_id in computed:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1
        table = self._tables.setdefault(seq.seq_id, [])
        table.extend(computed)
        table.extend(self._pop_free() for _ in range(num_new_blocks))
        if self.enable_prefix_caching:
            state = self._seq_hashes.setdefault(seq.seq_id, _SeqHashes())
            state.num_registered = max(state.num_registered, len(computed))
            covered = seq.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
            self._register_full_blocks(seq, covered)
        return True

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks and drop its block table (a no-op for one that holds none).

        Blocks reaching ref 0 join the free list chain tail first, so the tail is evicted first.
        """
        for block_id in reversed(self._tables.pop(seq_id, [])):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated (seq {seq_id})")
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None
                if self.block_hashes[block_id] is None:
                    # why: hashless content can never be matched; reuse it before any cached block
                    self._free.move_to_end(block_id, last=False)
        self._seq_hashes.pop(seq_id, None)

    def fork(self, parent_id: int, child_id: int) -> None:
        """`child_id` shares every block of `parent_id` (ref + 1 each); a shared partial block is
        copied when one of them first writes into it (see allocate_slots)."""
        if self._tables.get(child_id):
            raise ValueError(f"seq {child_id} already holds blocks; only a fresh sequence can fork")
        table = self.block_table(parent_id)
        for block_id in table:
            self.ref_counts[block_id] += 1
        self._tables[child_id] = list(table)
        state = self._seq_hashes.get(parent_id)
        if state is not None:
            self._seq_hashes[child_id] = _SeqHashes(list(state.hashes), state.num_registered)

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies decided since the last call; the runner makes them before the forward."""
        copies, self._copies = self._copies, []
        return copies

    def reset(self) -> None:
        """Back to a fresh pool (after an aborted generate, nothing the pool knew can be trusted)."""
        self.ref_counts = [0] * self.num_blocks
        self._free = OrderedDict((b, None) for b in range(self.num_blocks))
        self._tables.clear()
        self.reset_prefix_cache()  # nothing is held now

    def reset_prefix_cache(self) -> None:
        """Forget every hash (after a failed forward, registered blocks may hold poisoned K/V); only
        when no sequence holds a block."""
        held = sum(1 for r in self.ref_counts if r)
        if held:
            raise RuntimeError(f"reset_prefix_cache() with {held} blocks still held by sequences")
        self.block_hashes = [None] * self.num_blocks
        self.hash_to_block.clear()
        self._seq_hashes.clear()
        self._copies.clear()

    # ---------------------------------------------------------------- helpers

    def _num_new_blocks(self, seq: Sequence, num_new_tokens: int, computed: list[int]) -> int:
        """Blocks to take from the pool for `num_new_tokens` more (after checking the arguments)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens} (seq {seq.seq_id})")
        held = len(self.block_table(seq.seq_id))
        if computed and (held or seq.num_computed_tokens):
            raise ValueError(
                f"computed_blocks may only be given for a fresh sequence; seq {seq.seq_id} has "
                f"{held} blocks and {seq.num_computed_tokens} computed tokens"
            )
        covered = seq.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        return max(0, self.blocks_needed(covered) - held - len(computed))

    def _slot_in_place(self, seq: Sequence) -> bool:
        """The next token's slot is in a block of seq's table that no other sequence holds (or that
        it starts): no block to allocate and none to copy, as the general path would find."""
        pos = seq.num_computed_tokens
        index = pos // self.block_size
        table = self._tables.get(seq.seq_id)
        return (
            table is not None
            and index < len(table)
            and (pos % self.block_size == 0 or self.ref_counts[table[index]] == 1)
        )

    def _shared_tail(self, seq: Sequence, num_new_tokens: int) -> int:
        """1 when the next token would be written into a block another sequence also holds, else 0."""
        first = seq.num_computed_tokens
        index = first // self.block_size
        table = self.block_table(seq.seq_id)
        if not num_new_tokens or first % self.block_size == 0 or index >= len(table):
            return 0
        return 1 if self.ref_counts[table[index]] > 1 else 0

    def _copy_on_write(self, seq: Sequence) -> None:
        index = seq.num_computed_tokens // self.block_size
        table = self._tables[seq.seq_id]
        shared = table[index]
        self.ref_counts[shared] -= 1  # still > 0: another sequence holds it
        fresh = self._pop_free()
        table[index] = fresh
        self._copies.append((shared, fresh))

    def _num_available(self, computed: list[int]) -> int:
        # why: a matched block with ref 0 sits in the free list; taking it shrinks what is left
        return len(self._free) - sum(1 for b in computed if self.ref_counts[b] == 0)

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            # Eviction: the content is about to be overwritten, so it must no longer match.
            if self.hash_to_block.get(block_hash) == block_id:
                del self.hash_to_block[block_hash]
            self.block_hashes[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def _hashes_upto(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The sequence's chained block hashes for its first `num_blocks` full blocks (cached)."""
        state = self._seq_hashes.setdefault(seq.seq_id, _SeqHashes())
        return chain_block_hashes(seq.token_ids, self.block_size, num_blocks, state.hashes, seq.extras)

    def _register_full_blocks(self, seq: Sequence, num_covered_tokens: int) -> None:
        """Hash every block of the table that is full of known tokens and not yet registered."""
        num_full = min(num_covered_tokens, seq.num_tokens) // self.block_size
        state = self._seq_hashes.get(seq.seq_id)
        if state is None:  # why not setdefault: it would build a _SeqHashes every decode step of every sequence
            state = self._seq_hashes[seq.seq_id] = _SeqHashes()
        if num_full <= state.num_registered:
            return
        hashes = self._hashes_upto(seq, num_full)
        table = self._tables[seq.seq_id]
        for i in range(state.num_registered, num_full):
            block_id = table[i]
            # why: an equal hash already registered means identical K/V exists in another block;
            # keep the first (it may be shared) and leave this one hashless.
            if self.block_hashes[block_id] is None and hashes[i] not in self.hash_to_block:
                self.block_hashes[block_id] = hashes[i]
                self.hash_to_block[hashes[i]] = block_id
        state.num_registered = num_full
