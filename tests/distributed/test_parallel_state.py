"""vllm/distributed/parallel_state.py over gloo: the collectives against sums and concatenations worked by hand."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from vllm.distributed import parallel_state as ps
from vllm.utils import get_open_port


def _member(rank: int, world_size: int, tp: int, port: int, results: dict) -> None:
    ps.init_distributed_environment(world_size, rank, f"tcp://127.0.0.1:{port}", backend="gloo")
    ps.initialize_model_parallel(tp)
    try:
        group = ps.get_tp_group()
        x = torch.full((2, 3), float(rank + 1))
        reduced = ps.tensor_model_parallel_all_reduce(x.clone())
        gathered = ps.tensor_model_parallel_all_gather(torch.tensor([[float(rank)]]), dim=-1)
        gathered0 = ps.tensor_model_parallel_gather(torch.tensor([float(rank)]), dst=0, dim=0)
        obj = group.broadcast_object({"from": rank} if group.is_first_rank else None)
        group.barrier()
        results[rank] = (group.ranks, group.rank_in_group, reduced.tolist(), gathered.tolist(),
                         None if gathered0 is None else gathered0.tolist(), obj)
    finally:
        ps.destroy_distributed_environment()


def _run(world_size: int, tp: int) -> dict:
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_member, args=(world_size, tp, get_open_port(), results), nprocs=world_size, join=True)
    return dict(results)


def test_single_rank_without_initialisation_is_identity() -> None:
    x = torch.randn(3, 4)
    assert ps.get_tensor_model_parallel_world_size() == 1 and ps.get_tensor_model_parallel_rank() == 0
    assert ps.tensor_model_parallel_all_reduce(x) is x
    assert ps.tensor_model_parallel_all_gather(x) is x
    assert ps.get_tp_group().broadcast_object("a") == "a"


def test_two_tp_groups_of_two_in_a_world_of_four() -> None:
    results = _run(4, 2)
    for rank in range(4):
        ranks, in_group, reduced, gathered, gathered0, obj = results[rank]
        first = rank - rank % 2
        assert ranks == [first, first + 1] and in_group == rank % 2
        # Worked by hand: the members hold rank + 1, so the group's sum is (first + 1) + (first + 2).
        assert reduced == [[float(2 * first + 3)] * 3] * 2
        assert gathered == [[float(first), float(first + 1)]]
        assert gathered0 == ([float(first), float(first + 1)] if in_group == 0 else None)
        assert obj == {"from": first}
