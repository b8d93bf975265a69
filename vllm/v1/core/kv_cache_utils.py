"""Block hashes of automatic prefix caching: the identity of a full KV block.

A full block of `block_size` tokens is named by a SHA-256 digest chained over its parent (the digest of the block
before it; a fixed root for the first block), its token ids, and its extra keys. The only extra key here is the
request's `cache_salt`, which goes into the first block alone (as in vLLM): through the chain it changes every
later digest too, so requests with different salts (or one salted, one not) never share a block.

Invariants:
- Two blocks have the same digest iff they hold the same token ids at the same positions after the same prefix
  and the same salt (up to SHA-256 collisions); the digest does not depend on the request, its sampling params or
  the time it was computed. Weights are not part of it: the KV cache manager invalidates every digest when the
  weights change (`KVCacheManager.invalidate_prefix_cache`).
- `Request.block_hashes[i]` is the digest of the request's block i (tokens `i * block_size` to
  `(i + 1) * block_size` of `all_token_ids`); the list only grows, by `hash_request_blocks`, and holds at most
  `len(all_token_ids) // block_size` digests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from vllm.v1.request import Request

BlockHash = bytes
# The parent of a request's first block. NOTE: fixed rather than random per process (vLLM seeds it from
# PYTHONHASHSEED or os.urandom): the digests are SHA-256, so a fixed root gives nobody a way to forge a collision,
# and digests stay comparable across processes (tests, --api-server-count).
ROOT_HASH: BlockHash = hashlib.sha256(b"vllm prefix cache root").digest()


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int] | np.ndarray,
                      extra_keys: bytes = b"") -> BlockHash:
    """The digest of one full block: sha256(parent, token ids as little-endian int32, extra keys).

    NOTE: every block of an engine holds the same number of tokens, so the token bytes have a fixed length and
    the extra keys after them cannot be confused with tokens."""
    h = hashlib.sha256(ROOT_HASH if parent is None else parent)
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    h.update(extra_keys)
    return h.digest()


def block_extra_keys(cache_salt: str | None, block_index: int) -> bytes:
    """The extra keys of block `block_index`: the salt (UTF-8) in the first block only."""
    if block_index == 0 and cache_salt:
        return cache_salt.encode("utf-8")
    return b""


def hash_request_blocks(request: Request, block_size: int, num_blocks: int) -> list[BlockHash]:
    """Extend `request.block_hashes` to its first `num_blocks` full blocks (fewer if it has fewer full blocks) and
    return the list."""
    hashes = request.block_hashes
    start = len(hashes)
    num_blocks = min(num_blocks, len(request.all_token_ids) // block_size)
    if start >= num_blocks:
        return hashes
    # NOTE: the new blocks' tokens as bytes in one conversion (a list-to-array conversion per block costs more
    # than its digest), each block's digest over a slice of them: the digests of hash_block_tokens.
    data = memoryview(np.asarray(request.all_token_ids[start * block_size:num_blocks * block_size],
                                 dtype="<i4").tobytes())
    width = 4 * block_size
    parent = hashes[-1] if hashes else ROOT_HASH
    sha256 = hashlib.sha256
    salt = request.cache_salt
    for i in range(num_blocks - start):
        h = sha256(parent)
        h.update(data[i * width:(i + 1) * width])
        if salt and start + i == 0:
            h.update(block_extra_keys(salt, 0))
        parent = h.digest()
        hashes.append(parent)
    return hashes
