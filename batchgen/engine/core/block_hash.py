"""Block hashes: the one rule for what a prefix-cache key covers.

A full block's hash chains its parent's hash, its own tokens and its *extra key*: everything
besides the tokens that changes the K/V the block holds. Two inputs join it:
  - the request's adapter (LoRA): its content hash, on every block of the request. Never its
    name or integer id, which a caller may reuse for other weights;
  - the request's images: for each image whose embedding positions overlap the block, its
    content hash and where it starts relative to the block's first position.
A request with neither hashes exactly as its tokens alone, so text-only keys (the job's prefix
groups, a cache written before adapters or images existed) keep their meaning. Anything added
later that changes K/V for the same tokens (a soft prompt, a cache salt) joins the extra key here
and nowhere else; the pool's lookups and the job's prefix grouping both chain through this module.

Deterministic across processes and machines (blake2b, not Python's salted `hash()`), so a hash
means the same K/V content everywhere. Chaining makes a block's hash identify the whole prefix
up to and including it, not just its own tokens.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array

from batchgen.engine.core.sequence import NO_EXTRAS, RequestExtras

ROOT_HASH = b"batchgen-prefix-v1"  # parent of a sequence's first block
_EXTRA_TAG = b"\x00extra-v1"  # separates the tokens from the extra key (none: nothing is added)


def hash_block_tokens(parent_hash: bytes, token_ids: list[int], extra_key: bytes = b"") -> bytes:
    """Chained hash of one full block: digest(parent digest + tokens as little-endian int64
    [+ tag + extra key])."""
    packed = array("q", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    h = hashlib.blake2b(parent_hash, digest_size=32)
    h.update(packed.tobytes())
    if extra_key:
        h.update(_EXTRA_TAG)
        h.update(extra_key)
    return h.digest()


def block_extra_key(extras: RequestExtras, first: int, end: int) -> bytes:
    """The extra key of the block covering positions [first, end): the adapter's content hash,
    then each overlapping image's content hash and its start relative to `first`."""
    if extras is NO_EXTRAS:
        return b""
    parts = [extras.adapter_hash] if extras.adapter_hash else []
    for image_hash, (start, count) in zip(extras.image_hashes, extras.image_positions, strict=True):
        if start < end and start + count > first:
            parts.append(image_hash + struct.pack("<q", start - first))
    if not parts:
        return b""
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)  # length-prefixed: no two lists join alike


def chain_block_hashes(
    token_ids: list[int], block_size: int, num_blocks: int, done: list[bytes], extras: RequestExtras = NO_EXTRAS
) -> list[bytes]:
    """`done` (the chained hashes of the first len(done) full blocks of `token_ids`) extended to
    the first `num_blocks`, in place; returned. The one chain every prefix-cache key is made of:
    the pool's own lookups and the job's prefix grouping (batchgen.inputs.grouping) both call it."""
    while len(done) < num_blocks:
        i = len(done)
        parent = done[-1] if done else ROOT_HASH
        first, end = i * block_size, (i + 1) * block_size
        done.append(hash_block_tokens(parent, token_ids[first:end], block_extra_key(extras, first, end)))
    return done
