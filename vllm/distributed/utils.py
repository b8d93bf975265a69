"""`StatelessProcessGroup` (vLLM's name and API): a group of processes that exchange Python objects through a
`torch.distributed.TCPStore`, apart from torch.distributed's world (no `init_process_group`).

RL weight-sync code builds one with `StatelessProcessGroup.create(host, port, rank, world_size)` and hands it to
`PyNcclCommunicator` (vllm/distributed/device_communicators/pynccl.py) for tensor collectives. Rank 0 hosts the
store at host:port; every object operation is a store key written once and read by its receivers.

Invariants: members make the same sequence of object calls (as with any collective); keys are numbered per
(sender, receiver) and per broadcasting rank, so calls between different pairs never mix.
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist


@dataclass
class StatelessProcessGroup:
    rank: int
    world_size: int
    store: dist.Store
    data_expiration_seconds: int = 3600
    _send_counts: dict[int, int] = field(default_factory=dict)
    _recv_counts: dict[int, int] = field(default_factory=dict)
    _broadcast_counts: dict[int, int] = field(default_factory=dict)

    @staticmethod
    def create(host: str, port: int, rank: int, world_size: int, data_expiration_seconds: int = 3600,
               store_timeout: int = 300) -> StatelessProcessGroup:
        """Join (rank 0: host) the group at host:port; returns once the store is reachable."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of world_size {world_size}.")
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=store_timeout), wait_for_workers=False)
        return StatelessProcessGroup(rank, world_size, store, data_expiration_seconds)

    def _next(self, counts: dict[int, int], key: int) -> int:
        counts[key] = counts.get(key, 0) + 1
        return counts[key] - 1

    def send_obj(self, obj: Any, dst: int) -> None:
        self.store.set(f"send/{self.rank}/{dst}/{self._next(self._send_counts, dst)}", pickle.dumps(obj))

    def recv_obj(self, src: int) -> Any:
        return pickle.loads(self.store.get(f"send/{src}/{self.rank}/{self._next(self._recv_counts, src)}"))

    def broadcast_obj(self, obj: Any | None, src: int) -> Any:
        key = f"broadcast/{src}/{self._next(self._broadcast_counts, src)}"
        if self.rank == src:
            self.store.set(key, pickle.dumps(obj))
            return obj
        return pickle.loads(self.store.get(key))

    def all_gather_obj(self, obj: Any) -> list[Any]:
        return [self.broadcast_obj(obj if rank == self.rank else None, rank) for rank in range(self.world_size)]

    def barrier(self) -> None:
        self.all_gather_obj(None)
