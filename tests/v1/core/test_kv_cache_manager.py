"""KVCacheManager: a request holds ceil(tokens / block_size) blocks; allocation is all or nothing."""

from collections.abc import Callable

import pytest

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.request import Request


@pytest.mark.parametrize("num_tokens,expected_blocks", [(1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_block_count_at_boundaries(request_factory: Callable[..., Request], num_tokens: int,
                                   expected_blocks: int) -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, max_model_len=64)
    req = request_factory("r", num_tokens)
    new = kv.allocate_slots(req, num_tokens)
    assert new is not None and len(new) == expected_blocks
    assert kv.get_block_ids("r") == new
    assert kv.get_num_free_blocks() == 8 - expected_blocks


def test_incremental_growth_crosses_boundaries(request_factory: Callable[..., Request]) -> None:
    block_size = 4
    kv = KVCacheManager(num_blocks=16, block_size=block_size, max_model_len=64)
    req = request_factory("r", 6)
    table: list[int] = []
    # Prefill 6 in chunks of 3, then decode one token at a time up to 13 tokens.
    for num_new in [3, 3, 1, 1, 1, 1, 1, 1, 1]:
        new = kv.allocate_slots(req, num_new)
        assert new is not None
        table += new
        req.num_computed_tokens += num_new
        assert len(table) == (req.num_computed_tokens + block_size - 1) // block_size
        assert kv.get_block_ids("r") == table
    assert len(set(table)) == len(table) == 4
    kv.free(req)
    assert kv.get_block_ids("r") == [] and kv.get_num_free_blocks() == 16 and kv.usage == 0.0


def test_allocation_failure_allocates_nothing(request_factory: Callable[..., Request]) -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4, max_model_len=64)
    a, b = request_factory("a", 8), request_factory("b", 5)
    assert kv.allocate_slots(a, 8) is not None
    assert kv.allocate_slots(b, 5) is None
    assert kv.get_block_ids("b") == [] and kv.get_num_free_blocks() == 1
    b.num_computed_tokens = 0
    assert kv.allocate_slots(b, 4) is not None and kv.get_num_free_blocks() == 0
    # Within the held block: no new block needed even with an empty pool.
    assert kv.allocate_slots(a, 0) == []
    kv.free(a)
    kv.free(b)
    kv.free(b)  # freeing a request that holds nothing is a no-op
    assert kv.get_num_free_blocks() == 3
