"""`PyNcclCommunicator` (vLLM's name and API): tensor collectives among the members of a StatelessProcessGroup
(vllm/distributed/utils.py), as RL weight-sync code uses it: `PyNcclCommunicator(pg, device=device)`, then
`broadcast(tensor, src=0, stream=...)` on every member.

Here it is a c10d backend built directly on the group's store (vllm/distributed/weight_transfer/stateless_group
.py): NCCL when `device` is CUDA, gloo on the CPU (so the same code runs in CPU tests); torch.distributed's
default group is neither needed nor touched.
"""

from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist

from vllm.distributed.utils import StatelessProcessGroup
from vllm.distributed.weight_transfer.stateless_group import c10d_group


class PyNcclCommunicator:
    def __init__(self, group: StatelessProcessGroup, device: int | str | torch.device,
                 timeout_s: float = 600.0) -> None:
        if not isinstance(group, StatelessProcessGroup):
            raise ValueError("PyNcclCommunicator takes a vllm.distributed.utils.StatelessProcessGroup.")
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rank, self.world_size = group.rank, group.world_size
        self.available, self.disabled = True, False
        # NOTE: each communicator of a group gets its own key space in the group's store (members create their
        # communicators in the same order, so their numbers agree).
        number = group._next(group._broadcast_counts, -1)
        store = dist.PrefixStore(f"pynccl/{number}", group.store)
        self._pg = c10d_group(store, self.rank, self.world_size, self.device,
                              datetime.timedelta(seconds=timeout_s), f"pynccl{number}")

    @staticmethod
    def _on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def broadcast(self, tensor: torch.Tensor, src: int, stream: torch.cuda.Stream | None = None) -> None:
        """`tensor` (contiguous, on this communicator's device) in place from `src`."""
        if tensor.numel() == 0:
            return
        options = dist.BroadcastOptions()
        options.rootRank = src
        with self._on_stream(stream):
            self._pg.broadcast([tensor.reshape(-1).view(torch.uint8)], options).wait()

    def all_reduce(self, in_tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                   stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        out = in_tensor.clone()
        options = dist.AllreduceOptions()
        options.reduceOp = op
        with self._on_stream(stream):
            self._pg.allreduce([out], options).wait()
        return out

    def send(self, tensor: torch.Tensor, dst: int, stream: torch.cuda.Stream | None = None) -> None:
        with self._on_stream(stream):
            self._pg.send([tensor], dst, 0).wait()

    def recv(self, tensor: torch.Tensor, src: int, stream: torch.cuda.Stream | None = None) -> None:
        with self._on_stream(stream):
            self._pg.recv([tensor], src, 0).wait()
