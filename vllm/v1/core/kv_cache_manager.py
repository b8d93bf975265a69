"""KVCacheManager: each request's block table, grown on demand from the BlockPool, and automatic prefix caching.

With prefix caching (on by default, `enable_prefix_caching`), a request being admitted first looks up its longest
run of cached full blocks (`get_computed_blocks`), chained digests of its tokens (kv_cache_utils), and starts
computing after them; the hit stops one token short of the request's tokens, so the last one is always computed
and the step has logits. The blocks a request fills are indexed as soon as they are allocated for tokens whose
ids are known (vLLM's timing: a block allocated in a step is computed by that step, before any later step, and
within a step every layer writes all KV before any attention reads it), and at the latest when the request frees
them.

Invariants:
- A request holding blocks has exactly `cdiv(n, block_size)` of them, where n is the largest
  `num_computed_tokens + num_new_tokens` it was allocated for (hit blocks included); `allocate_slots` either
  allocates every block a step needs or none (a failed call leaves the pool and the table untouched).
- `free` returns all of a request's blocks (tail first, so its head blocks stay cached longest); a request that
  holds none is a no-op. After every request is freed, no block is in use (`check_invariants`).
- A block is indexed only if the request that fills it was admitted in the current cache epoch: a weight update
  (`invalidate_prefix_cache`) forgets every digest and starts a new epoch, so KV computed with old weights, or
  computed after the update on top of KV from old weights, is never found again.
- Requests with `prompt_logprobs` get no hits (their prompt positions must be computed), as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import hash_request_blocks
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}.")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[int]] = {}
        # Per request holding blocks: how many of its leading blocks were indexed (or skipped) already.
        self.num_cached_blocks: dict[str, int] = {}
        # Bumped by invalidate_prefix_cache; a request's blocks are indexed only in the epoch it was admitted in.
        self.epoch = 0
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_block_ids(self, req_id: str) -> list[int]:
        """A copy of the request's block table (empty when it holds no blocks)."""
        return list(self.req_to_blocks.get(req_id, ()))

    # ------------------------------------------------------------------ prefix cache

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The request's longest run of cached leading full blocks, at most `num_tokens - 1` tokens' worth (none
        without caching or with prompt_logprobs). Nothing is taken yet: pass them to `allocate_slots`."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        get = self.block_pool.cached_blocks.get
        hits: list[int] = []
        for block_hash in hash_request_blocks(request, self.block_size, max_blocks)[:max_blocks]:
            block_id = get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (vLLM's PrefixCacheStats: its tokens queried, its hit tokens)."""
        if self.enable_caching and not request.skip_reading_prefix_cache:
            self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens, request.num_preemptions > 0)

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The lookups since the last call (and start counting anew)."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, only while no request holds blocks (vLLM's rule); False otherwise."""
        return self.block_pool.reset_prefix_cache()

    def invalidate_prefix_cache(self) -> None:
        """The weights changed: forget every digest now, also of blocks in use, and let no request admitted before
        now index the blocks it fills later (their KV attends to KV computed with the old weights)."""
        self.block_pool.invalidate()
        self.epoch += 1

    def _cache_full_blocks(self, request: Request, blocks: list[int], num_computed_tokens: int) -> None:
        """Index the request's full blocks up to `num_computed_tokens` (capped at its known tokens)."""
        req_id = request.request_id
        start = self.num_cached_blocks[req_id]
        num_full = min(num_computed_tokens, len(request.all_token_ids)) // self.block_size
        if num_full <= start:
            return
        self.num_cached_blocks[req_id] = num_full
        if request.kv_epoch != self.epoch:
            return
        hashes = hash_request_blocks(request, self.block_size, num_full)
        cache_block = self.block_pool.cache_block
        for i in range(start, num_full):
            cache_block(blocks[i], hashes[i])

    # ------------------------------------------------------------------ allocation

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[int] = ()) -> list[int] | None:
        """Grow the table to hold `num_computed_tokens + num_new_tokens` tokens.

        `new_computed_blocks` are prefix-cache hits (from `get_computed_blocks`) of a request that holds no blocks
        yet; `request.num_computed_tokens` already counts their tokens. Returns the newly allocated block ids
        (possibly empty; the hit blocks are not among them), or None when the pool has too few free blocks, in
        which case nothing is allocated.
        """
        assert num_new_tokens >= 0
        num_tokens = request.num_computed_tokens + num_new_tokens
        assert num_tokens <= self.max_model_len, f"{num_tokens} tokens exceed max_model_len={self.max_model_len}"
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        num_hits = len(new_computed_blocks)
        assert not num_hits or blocks is None, "cache hits are taken only by a request that holds no blocks"
        num_needed = cdiv(num_tokens, self.block_size) - num_hits - (0 if blocks is None else len(blocks))
        if num_needed <= 0 and not num_hits:
            if self.enable_caching and blocks is not None:
                self._cache_full_blocks(request, blocks, num_tokens)
            return []
        pool = self.block_pool
        # NOTE: a free hit block is counted among the free blocks but leaves the queue when taken.
        num_free = pool.get_num_free_blocks()
        if num_hits:
            ref_cnt = pool.ref_cnt
            num_free -= sum(1 for b in new_computed_blocks if ref_cnt[b] == 0)
        if num_needed > num_free:
            return None
        if blocks is None:
            blocks = self.req_to_blocks[req_id] = []
            self.num_cached_blocks[req_id] = num_hits
            request.kv_epoch = self.epoch
        if num_hits:
            pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        new_blocks = pool.get_new_blocks(num_needed) if num_needed > 0 else []
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_tokens)
        return new_blocks

    def free(self, request: Request) -> None:
        req_id = request.request_id
        blocks = self.req_to_blocks.pop(req_id, None)
        if blocks is None:
            return
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, request.num_computed_tokens)
        del self.num_cached_blocks[req_id]
        self.block_pool.free_blocks(reversed(blocks))

    def check_invariants(self) -> None:
        """Raise AssertionError unless the pool's invariants hold for the current block tables (tests)."""
        self.block_pool.check_invariants(self.req_to_blocks.values())
        assert set(self.num_cached_blocks) == set(self.req_to_blocks)
