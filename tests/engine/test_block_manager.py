"""BlockManager: exact block ids, ref counts, the prefix cap, LRU eviction and hash cleanup."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen.engine.api.params import SamplingParams
from batchgen.engine.core.block_hash import hash_block_tokens
from batchgen.engine.core.block_manager import BlockManager
from batchgen.engine.core.sequence import Sequence


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(max_tokens=4))


def admit(bm: BlockManager, seq: Sequence, num_new: int | None = None) -> tuple[list[int], int]:
    """What the scheduler does on admission: match, then allocate the rest of the chunk."""
    computed, num_cached = bm.get_computed_blocks(seq)
    n = seq.num_tokens - num_cached if num_new is None else num_new
    assert bm.allocate_slots(seq, n, computed)
    seq.num_computed_tokens = num_cached  # the scheduler's part
    return computed, num_cached


def snapshot(bm: BlockManager, *seqs: Sequence) -> tuple:
    return (
        list(bm.ref_counts),
        list(bm.block_hashes),
        dict(bm.hash_to_block),
        list(bm._free),
        [(list(bm.block_table(s.seq_id)), s.num_computed_tokens) for s in seqs],
    )


def test_allocate_hands_out_block_ids_in_order_and_registers_full_blocks() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = make_seq(0, list(range(10)))
    assert bm.allocate_slots(seq, 10)
    assert bm.block_table(seq.seq_id) == [0, 1, 2]
    assert seq.num_computed_tokens == 0  # the scheduler's business, never the block manager's
    assert bm.num_free_blocks == 7
    assert bm.ref_counts[:4] == [1, 1, 1, 0]
    h0 = hash_block_tokens(b"batchgen-prefix-v1", [0, 1, 2, 3])
    h1 = hash_block_tokens(h0, [4, 5, 6, 7])
    assert bm.block_hashes[:3] == [h0, h1, None]  # the partial block has no hash
    assert bm.hash_to_block == {h0: 0, h1: 1}


def test_decode_fills_a_block_then_takes_a_new_one() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(0, [1, 2, 3])
    assert bm.allocate_slots(seq, 3)
    seq.num_computed_tokens = 3
    seq.token_ids.append(4)
    assert bm.allocate_slots(seq, 1)  # the decode fills block 0: it gets a hash now
    assert bm.block_table(seq.seq_id) == [0] and bm.block_hashes[0] is not None
    seq.num_computed_tokens = 4
    seq.token_ids.append(5)
    assert bm.allocate_slots(seq, 1)
    assert bm.block_table(seq.seq_id) == [0, 1] and bm.block_hashes[1] is None


def test_two_sequences_share_a_prefix_with_ref_counts() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_seq(0, list(range(10)))
    admit(bm, a)
    b = make_seq(1, list(range(8)) + [99, 98, 97])
    computed, num_cached = bm.get_computed_blocks(b)
    assert (computed, num_cached) == ([0, 1], 8)
    assert bm.ref_counts[:2] == [1, 1]  # matching alone changes nothing
    assert bm.allocate_slots(b, 3, computed)
    assert bm.block_table(b.seq_id) == [0, 1, 3]
    assert b.num_computed_tokens == 0  # the scheduler sets it to num_cached, not allocate_slots
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    bm.free(a.seq_id)
    assert bm.ref_counts[:4] == [1, 1, 0, 1]
    assert next(iter(bm._free)) == 2  # a's hashless tail is reused first
    bm.free(b.seq_id)
    assert bm.ref_counts == [0] * 10 and bm.num_free_blocks == 10
    assert bm.block_table(a.seq_id) == [] and bm.block_table(b.seq_id) == []


def test_match_leaves_at_least_one_token_to_compute() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    admit(bm, make_seq(0, list(range(12))))
    assert bm.get_computed_blocks(make_seq(1, list(range(12)))) == ([0, 1], 8)
    assert bm.get_computed_blocks(make_seq(2, list(range(13)))) == ([0, 1, 2], 12)
    assert bm.get_computed_blocks(make_seq(3, list(range(4)))) == ([], 0)
    assert bm.get_computed_blocks(make_seq(4, [0, 1, 2, 9, 4, 5, 6, 7, 8])) == ([], 0)  # chain broken at 0


def test_matched_free_block_leaves_the_free_list() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_seq(0, [1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a.seq_id)
    assert bm.num_free_blocks == 6
    b = make_seq(1, [1, 2, 3, 4, 7])
    computed, _ = admit(bm, b)
    assert computed == [0, 1] and bm.block_table(b.seq_id) == [0, 1, 2]
    assert bm.num_free_blocks == 3 and 0 not in list(bm._free)


def test_free_order_is_tail_first_with_hashless_blocks_in_front() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_seq(0, [1, 2, 3, 4, 5])  # blocks 0, 1 full; block 2 partial
    admit(bm, a)
    bm.free(a.seq_id)
    assert list(bm._free) == [2, 3, 4, 5, 1, 0]


def test_eviction_is_lru_chain_tail_first_and_cleans_the_hash_table() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_seq(0, [1, 2, 3, 4, 5, 6])  # three full blocks 0, 1, 2
    admit(bm, a)
    hashes = list(bm.block_hashes[:3])
    bm.free(a.seq_id)
    assert list(bm._free) == [3, 4, 5, 2, 1, 0]
    admit(bm, make_seq(1, [7, 7, 8, 8, 9, 9, 10]))  # needs 4 blocks: 3, 4, 5, then evicts 2
    assert list(bm._free) == [1, 0]
    assert bm.block_hashes[2] is None and hashes[2] not in bm.hash_to_block
    assert bm.hash_to_block[hashes[0]] == 0 and bm.hash_to_block[hashes[1]] == 1
    # The head of a's chain is still intact and matchable.
    assert bm.get_computed_blocks(make_seq(2, [1, 2, 3, 4, 5, 6, 0])) == ([0, 1], 4)


def test_least_recently_freed_sequence_is_evicted_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_seq(0, [1, 2, 3, 4]), make_seq(1, [5, 6, 7, 8])
    admit(bm, a, 4)
    admit(bm, b, 4)
    bm.free(a.seq_id)
    bm.free(b.seq_id)
    assert list(bm._free) == [1, 0, 3, 2]
    admit(bm, make_seq(2, [9, 9, 9, 9]), 4)  # evicts a's blocks, keeps b's
    assert bm.get_computed_blocks(make_seq(3, [1, 2, 3, 4, 0])) == ([], 0)
    assert bm.get_computed_blocks(make_seq(4, [5, 6, 7, 8, 0])) == ([2, 3], 4)


def test_failed_allocation_changes_nothing() -> None:
    bm = BlockManager(num_blocks=5, block_size=2)
    a = make_seq(0, [1, 2, 3, 4])
    admit(bm, a, 4)
    bm.free(a.seq_id)  # blocks 0, 1 cached with ref 0, in the free list
    b = make_seq(1, [1, 2, 3, 4] + list(range(100, 108)))  # matches 2 blocks, needs 4 more
    computed, _ = bm.get_computed_blocks(b)
    assert computed == [0, 1]
    before = snapshot(bm, b)
    # why: 5 free blocks, but taking the 2 matched ones leaves 3 < 4 needed
    assert not bm.can_allocate(b, 8, computed)
    assert not bm.allocate_slots(b, 8, computed)
    assert snapshot(bm, b) == before
    assert bm.allocate_slots(b, 6, computed)


def test_computed_blocks_only_for_a_fresh_sequence() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    admit(bm, make_seq(0, [1, 2, 3, 4]), 4)
    b = make_seq(1, [1, 2, 3, 4, 5])
    computed, _ = bm.get_computed_blocks(b)
    assert bm.allocate_slots(b, 1, computed)
    with pytest.raises(ValueError, match="fresh sequence"):
        bm.allocate_slots(b, 1, computed)
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.allocate_slots(b, -1)


def test_identical_content_computed_twice_is_registered_once() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = make_seq(0, [1, 2, 3]), make_seq(1, [1, 2, 3])
    assert bm.allocate_slots(a, 3) and bm.allocate_slots(b, 3)  # no matching: both compute
    assert bm.block_table(a.seq_id) == [0, 1] and bm.block_table(b.seq_id) == [2, 3]
    assert bm.block_hashes[0] is not None and bm.block_hashes[2] is None
    assert len(bm.hash_to_block) == 1


def test_prefix_caching_off_matches_nothing_and_hashes_nothing() -> None:
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=False)
    a = make_seq(0, [1, 2, 3, 4, 5])
    admit(bm, a)
    assert bm.block_hashes == [None] * 6 and bm.hash_to_block == {}
    assert bm.get_computed_blocks(make_seq(1, [1, 2, 3, 4, 5])) == ([], 0)
    bm.free(a.seq_id)
    assert bm.num_free_blocks == 6


def test_invalid_pool_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def test_hashes_are_equal_across_processes() -> None:
    code = (
        "from batchgen.engine.core.block_hash import hash_block_tokens as h;"
        "print(h(h(b'batchgen-prefix-v1', [1, 2, 3, 4]), [5, 6, 2**40, 0]).hex())"
    )
    outs = []
    for seed in ("1", "2"):
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=path)
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        outs.append(result.stdout.strip())
    expected = hash_block_tokens(hash_block_tokens(b"batchgen-prefix-v1", [1, 2, 3, 4]), [5, 6, 2**40, 0]).hex()
    assert outs == [expected, expected]
