"""KVCacheManager: each request's block table, grown on demand from the BlockPool.

Invariant: a request holding blocks has exactly `cdiv(n, block_size)` of them, where n is the largest
`num_computed_tokens + num_new_tokens` it was allocated for; `allocate_slots` either allocates every block a
step needs or none (so a failed call leaves the pool and the table untouched). `free` returns all of a
request's blocks; a request that holds none is a no-op.
"""

from __future__ import annotations

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.request import Request


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}.")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[int]] = {}

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

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Grow the table to hold `num_computed_tokens + num_new_tokens` tokens.

        Returns the newly appended block ids (possibly empty), or None when the pool has too few free blocks,
        in which case nothing is allocated.
        """
        assert num_new_tokens >= 0
        num_tokens = request.num_computed_tokens + num_new_tokens
        assert num_tokens <= self.max_model_len, f"{num_tokens} tokens exceed max_model_len={self.max_model_len}"
        blocks = self.req_to_blocks.get(request.request_id)
        num_held = 0 if blocks is None else len(blocks)
        num_needed = cdiv(num_tokens, self.block_size) - num_held
        if num_needed <= 0:
            return []
        if num_needed > self.block_pool.get_num_free_blocks():
            return None
        new_blocks = self.block_pool.get_new_blocks(num_needed)
        if blocks is None:
            self.req_to_blocks[request.request_id] = list(new_blocks)
        else:
            blocks.extend(new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(blocks)
