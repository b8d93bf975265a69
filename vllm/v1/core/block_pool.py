"""BlockPool: the paged KV cache's physical blocks, their reference counts and the prefix cache's index.

Block ids are the ints `0 .. num_blocks - 1`. A block held by requests has `ref_cnt > 0` (one per request whose
table holds it: prefix-cache hits share blocks). A block with `ref_cnt == 0` is free and sits in `free_queue`,
in eviction order: allocation takes from the front, freeing appends to the back (a request frees its blocks
tail first, so its prompt's head blocks are the last of them to be evicted).

With prefix caching a full block gets a digest (kv_cache_utils) once its tokens are known, and `cached_blocks`
maps the digest to the block. A cached block stays findable after its last request let go of it: it is free
(in the queue) but keeps its KV and its digest until it is allocated again, which evicts it (LRU order).

Invariants (`check_invariants`):
- every block is in `free_queue` exactly once iff its `ref_cnt` is 0; `ref_cnt` never goes negative (a double
  free raises);
- `cached_blocks[h] == b` iff `block_hash[b] == h`: one block per digest (a second block that fills up with the
  same tokens is left uncached, so block tables never change once handed out);
- `get_num_free_blocks()` counts free blocks, cached or not: each can be allocated (evicting its digest).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from vllm.v1.core.kv_cache_utils import BlockHash


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"The KV cache needs at least one block, got num_blocks={num_blocks}.")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # NOTE: an OrderedDict as the doubly linked free list: O(1) popleft (popitem(last=False)), append, and
        # removal from the middle when a free cached block is hit (touch), all in C.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[BlockHash, int] = {}

    def get_num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of the blocks held by requests, in [0, 1] (free cached blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks from the front of the queue (evicting their digests); each gets
        ref_cnt 1."""
        if num_blocks > len(self.free_queue):
            raise ValueError(f"Cannot get {num_blocks} blocks: only {len(self.free_queue)} are free.")
        popitem, ref_cnt, block_hash = self.free_queue.popitem, self.ref_cnt, self.block_hash
        block_ids = [popitem(last=False)[0] for _ in range(num_blocks)]
        for block_id in block_ids:
            ref_cnt[block_id] = 1
            h = block_hash[block_id]
            if h is not None:
                block_hash[block_id] = None
                del self.cached_blocks[h]
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """A request takes cached blocks it hit: one reference more each; a free one leaves the queue."""
        ref_cnt, queue = self.ref_cnt, self.free_queue
        for block_id in block_ids:
            if ref_cnt[block_id] == 0:
                del queue[block_id]
            ref_cnt[block_id] += 1

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference of each block; blocks left unreferenced join the queue's back in the given order
        (the first given is evicted first)."""
        ref_cnt, queue = self.ref_cnt, self.free_queue
        for block_id in block_ids:
            n = ref_cnt[block_id] - 1
            if n < 0:
                raise RuntimeError(f"Block {block_id} is freed twice.")
            ref_cnt[block_id] = n
            if n == 0:
                queue[block_id] = None

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Make a full block findable by its digest; False (nothing changes) when another block already is."""
        if block_hash in self.cached_blocks:
            return False
        assert self.block_hash[block_id] is None, f"block {block_id} is cached already"
        self.cached_blocks[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        return True

    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def reset_prefix_cache(self) -> bool:
        """Forget every digest, only while no block is held; False (nothing changes) otherwise."""
        if len(self.free_queue) != self.num_blocks:
            return False
        self.invalidate()
        return True

    def invalidate(self) -> None:
        """Forget every digest now, also those of held blocks (their requests keep their KV, which no later
        request will find). Queue order and references are unchanged."""
        self.cached_blocks.clear()
        self.block_hash = [None] * self.num_blocks

    def check_invariants(self, tables: Iterable[list[int]]) -> None:
        """Raise AssertionError unless the module docstring's invariants hold for these block tables (every
        request's)."""
        counts = [0] * self.num_blocks
        for table in tables:
            for block_id in table:
                counts[block_id] += 1
        assert counts == self.ref_cnt, "reference counts differ from the block tables"
        assert len(self.free_queue) == self.ref_cnt.count(0), "the free queue does not hold the free blocks"
        assert all(self.ref_cnt[b] == 0 for b in self.free_queue), "a held block is in the free queue"
        for h, block_id in self.cached_blocks.items():
            assert self.block_hash[block_id] == h, f"block {block_id} is indexed under a digest it does not have"
        assert sum(h is not None for h in self.block_hash) == len(self.cached_blocks), "an unindexed digest"
