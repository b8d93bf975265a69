"""BlockPool: ids are handed out once, come back on free, and the counts and usage follow."""

import pytest

from vllm.v1.core.block_pool import BlockPool


def test_alloc_free_roundtrip() -> None:
    pool = BlockPool(10)
    assert pool.get_num_free_blocks() == 10 and pool.usage == 0.0
    a = pool.get_new_blocks(3)
    b = pool.get_new_blocks(4)
    assert len(set(a) | set(b)) == 7 and set(a) | set(b) <= set(range(10))
    assert pool.get_num_free_blocks() == 3
    assert pool.usage == pytest.approx(0.7)
    pool.free_blocks(a)
    assert pool.get_num_free_blocks() == 6
    c = pool.get_new_blocks(6)
    assert not set(c) & set(b)
    assert set(b) | set(c) == set(range(10))
    assert pool.get_num_free_blocks() == 0 and pool.usage == 1.0
    pool.free_blocks(b)
    pool.free_blocks(c)
    assert pool.get_num_free_blocks() == 10 and pool.usage == 0.0


def test_zero_blocks_request() -> None:
    pool = BlockPool(2)
    assert pool.get_new_blocks(0) == []
    assert pool.get_num_free_blocks() == 2


def test_over_allocation_fails_without_side_effects() -> None:
    pool = BlockPool(4)
    held = pool.get_new_blocks(3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.get_num_free_blocks() == 1
    assert pool.get_new_blocks(1)[0] not in held


def test_double_free_is_caught() -> None:
    pool = BlockPool(4)
    ids = pool.get_new_blocks(2)
    pool.free_blocks(ids)
    with pytest.raises(RuntimeError):
        pool.free_blocks(ids[:1])
    assert pool.get_num_free_blocks() == 4


def test_needs_a_block() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)
