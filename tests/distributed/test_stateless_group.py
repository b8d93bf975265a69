"""vLLM's StatelessProcessGroup and PyNcclCommunicator names (RL weight-sync code builds its group with them):
two spawned processes over gloo exchange objects and tensors, and neither initialises torch.distributed."""

from __future__ import annotations

import multiprocessing as mp
import socket
from typing import Any

import torch

from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
from vllm.distributed.utils import StatelessProcessGroup


def _member(port: int, rank: int, results: Any) -> None:
    import torch.distributed as dist
    group = StatelessProcessGroup.create("127.0.0.1", port, rank=rank, world_size=2, store_timeout=30)
    got: dict[str, Any] = {"broadcast": group.broadcast_obj({"from": 0} if rank == 0 else None, src=0)}
    if rank == 0:
        group.send_obj(["to one", 1], dst=1)
    else:
        got["recv"] = group.recv_obj(src=0)
    got["gather"] = group.all_gather_obj(rank * 10)
    group.barrier()
    communicator = PyNcclCommunicator(group, device="cpu")
    tensor = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) if rank == 0 else torch.zeros(2, 3,
                                                                                              dtype=torch.bfloat16)
    communicator.broadcast(tensor, src=0)
    got["tensor"] = tensor.float().tolist()
    got["sum"] = communicator.all_reduce(torch.tensor([rank + 1.0])).tolist()
    got["default_group"] = dist.is_initialized()
    results.put((rank, got))


def test_objects_and_tensors_between_two_processes() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(port, rank, results)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    got = dict(results.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    assert got[1]["recv"] == ["to one", 1]
    for rank in (0, 1):
        assert got[rank]["broadcast"] == {"from": 0}
        assert got[rank]["gather"] == [0, 10]
        assert got[rank]["tensor"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        assert got[rank]["sum"] == [3.0]
        assert got[rank]["default_group"] is False
