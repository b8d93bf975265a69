"""BlockPool: the free list of the paged KV cache's physical blocks.

Block ids are the ints `0 .. num_blocks - 1`; every id is either free (in the queue) or held by exactly one
request. Allocation takes from the front of the queue and freeing appends to the back, both O(1) per block.
There is no prefix caching: a freed block holds nothing anyone will look up again.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"The KV cache needs at least one block, got num_blocks={num_blocks}.")
        self.num_blocks = num_blocks
        self._free_queue: deque[int] = deque(range(num_blocks))
        # NOTE: one flag per block so that a double free is caught in O(1) instead of corrupting the queue.
        self._is_free = bytearray(b"\x01" * num_blocks)

    def get_num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of the blocks held by requests, in [0, 1]."""
        return 1.0 - len(self._free_queue) / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free_queue):
            raise ValueError(f"Cannot get {num_blocks} blocks: only {len(self._free_queue)} are free.")
        queue, is_free = self._free_queue, self._is_free
        block_ids = [queue.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            is_free[block_id] = 0
        return block_ids

    def free_blocks(self, block_ids: list[int]) -> None:
        queue, is_free = self._free_queue, self._is_free
        for block_id in block_ids:
            if is_free[block_id]:
                raise RuntimeError(f"Block {block_id} is freed twice.")
            is_free[block_id] = 1
            queue.append(block_id)
