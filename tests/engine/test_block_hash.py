"""The one rule for what a block hash covers: tokens, then the request's adapter and images."""

from __future__ import annotations

from batchgen.engine.api.params import SamplingParams
from batchgen.engine.core.block_hash import ROOT_HASH, block_extra_key, chain_block_hashes, hash_block_tokens
from batchgen.engine.core.block_manager import BlockManager
from batchgen.engine.core.sequence import NO_EXTRAS, RequestExtras, Sequence

TOKENS = list(range(100, 112))  # three blocks of 4


def chain(extras: RequestExtras = NO_EXTRAS) -> list[bytes]:
    return chain_block_hashes(TOKENS, 4, 3, [], extras)


def test_a_request_without_extras_hashes_as_its_tokens_alone() -> None:
    h0 = hash_block_tokens(ROOT_HASH, TOKENS[:4])
    assert chain()[0] == h0
    assert chain(RequestExtras()) == chain()  # an empty extras object is no extras


def test_an_adapter_changes_every_block_and_only_its_content_hash_counts() -> None:
    a, b = chain(RequestExtras(adapter_hash=b"A" * 32)), chain(RequestExtras(adapter_hash=b"B" * 32))
    assert all(x != y for x, y in zip(a, chain(), strict=True))
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert chain(RequestExtras(adapter_hash=b"A" * 32)) == a


def test_an_image_changes_the_blocks_it_overlaps_and_every_block_after() -> None:
    def at(image: bytes, start: int) -> list[bytes]:
        return chain(RequestExtras(image_hashes=(image,), image_positions=((start, 3),)))

    plain, x, y = chain(), at(b"X" * 32, 5), at(b"Y" * 32, 5)
    assert x[0] == plain[0] == y[0]  # positions 0-3: before the image
    assert x[1] != y[1] and x[2] != y[2]  # 5-7 holds the image; the chain carries it on
    assert at(b"X" * 32, 5) == x  # identical bytes at the same place: identical K/V, one key
    assert at(b"X" * 32, 4)[1] != x[1]  # the same image one position earlier is other K/V


def test_the_extra_key_lists_only_overlapping_images_with_their_offsets() -> None:
    extras = RequestExtras(image_hashes=(b"p", b"q"), image_positions=((0, 2), (6, 4)))
    assert block_extra_key(extras, 0, 4) != b""
    assert block_extra_key(extras, 2, 6) == b""  # between the two images
    assert block_extra_key(extras, 8, 12) != block_extra_key(extras, 4, 8)  # q starts at -2 vs +2


def test_the_pool_never_serves_one_adapters_blocks_to_another_or_to_the_base() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    first = Sequence(0, list(TOKENS), SamplingParams(max_tokens=4), extras=RequestExtras(adapter_hash=b"A" * 32))
    assert bm.allocate_slots(first, len(TOKENS))
    for seq_id, extras, expected in [(1, NO_EXTRAS, 0), (2, RequestExtras(adapter_hash=b"B" * 32), 0)]:
        _, cached = bm.get_computed_blocks(Sequence(seq_id, list(TOKENS), SamplingParams(max_tokens=4), extras=extras))
        assert cached == expected
    same = Sequence(3, list(TOKENS), SamplingParams(max_tokens=4), extras=RequestExtras(adapter_hash=b"A" * 32))
    assert bm.get_computed_blocks(same)[1] == 8  # the last block is never served (one token is always computed)
