"""The engine's process groups, with vLLM's names: the world of one engine's workers and its tensor-parallel group.

A worker process joins with `init_distributed_environment(world_size, rank, distributed_init_method, local_rank,
backend)` (torch.distributed's default group: NCCL on CUDA, gloo on CPU) and then
`initialize_model_parallel(tensor_model_parallel_size)`. The model's parallel layers read the tensor-parallel
group through `get_tp_group()` / `get_tensor_model_parallel_rank()` / `..._world_size()` and reduce through
`tensor_model_parallel_all_reduce` / `..._all_gather` / `..._gather`.

Invariants:
- Before `initialize_model_parallel` (a single-process engine, tests of one layer) the tensor-parallel group is
  one rank: rank 0 of world size 1, and every collective returns its input unchanged, so the layers' one-rank
  path needs no process group at all.
- Every group has a device group (the backend the tensors travel on) and a gloo CPU group for Python objects
  (`broadcast_object`), so step inputs are broadcast without touching the device.
- The groups are per process; each engine (data-parallel rank) has its own world, made with its own init method.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class GroupCoordinator:
    """One process group seen from one member: its ranks, this member's place, and the collectives."""

    ranks: list[int]
    rank: int
    local_rank: int
    device_group: Any = None
    cpu_group: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank_in_group(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the group (in place when the group has several ranks); x itself on one rank."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along dim, in rank order, on every rank."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Every rank's x concatenated along dim on the rank dst of the group; None on the others."""
        if self.world_size == 1:
            return x
        # NOTE: all_gather rather than gather: NCCL has no gather, and the step's logits are small next to it.
        out = self.all_gather(x, dim)
        return out if self.rank_in_group == dst else None

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """x of the group's rank src, in place on every rank."""
        if self.world_size > 1:
            dist.broadcast(x, src=self.ranks[src], group=self.device_group)
        return x

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """A picklable object of the group's rank src, returned on every rank (over the CPU group)."""
        if self.world_size == 1:
            return obj
        box = [pickle.dumps(obj) if self.rank_in_group == src else None]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        return obj if self.rank_in_group == src else pickle.loads(box[0])

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)


_SINGLE = GroupCoordinator(ranks=[0], rank=0, local_rank=0)
_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None


def init_distributed_environment(world_size: int = 1, rank: int = 0, distributed_init_method: str = "env://",
                                 local_rank: int = -1, backend: str | None = None) -> None:
    """Join torch.distributed's default group (once per process) and make the world group of this engine."""
    global _WORLD
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=distributed_init_method, world_size=world_size,
                                rank=rank)
    if local_rank == -1:
        local_rank = rank
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    ranks = list(range(dist.get_world_size()))
    cpu_group = dist.new_group(ranks, backend="gloo") if backend != "gloo" else dist.group.WORLD
    _WORLD = GroupCoordinator(ranks=ranks, rank=dist.get_rank(), local_rank=local_rank,
                              device_group=dist.group.WORLD, cpu_group=cpu_group, device=device)


def initialize_model_parallel(tensor_model_parallel_size: int = 1, backend: str | None = None) -> None:
    """Split the world into tensor-parallel groups of consecutive ranks (every rank must call it)."""
    global _TP
    world = get_world_group()
    if world.world_size % tensor_model_parallel_size != 0:
        raise ValueError(f"world size {world.world_size} is not a multiple of "
                         f"tensor_parallel_size={tensor_model_parallel_size}.")
    device_backend = backend or dist.get_backend(world.device_group)
    for start in range(0, world.world_size, tensor_model_parallel_size):
        ranks = list(range(start, start + tensor_model_parallel_size))
        # NOTE: new_group is collective over the whole world: every rank makes every group, keeps its own.
        device_group = dist.new_group(ranks, backend=device_backend)
        cpu_group = dist.new_group(ranks, backend="gloo") if device_backend != "gloo" else device_group
        if world.rank in ranks:
            _TP = GroupCoordinator(ranks=ranks, rank=world.rank, local_rank=world.local_rank,
                                   device_group=device_group, cpu_group=cpu_group, device=world.device)


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def get_world_group() -> GroupCoordinator:
    if _WORLD is None:
        raise RuntimeError("init_distributed_environment() was not called in this process.")
    return _WORLD


def get_tp_group() -> GroupCoordinator:
    """This process's tensor-parallel group; one rank when none was initialised."""
    return _TP if _TP is not None else _SINGLE


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return get_tp_group().all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return get_tp_group().all_gather(x, dim)


def tensor_model_parallel_gather(x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
    return get_tp_group().gather(x, dst, dim)


def destroy_model_parallel() -> None:
    global _TP
    _TP = None


def destroy_distributed_environment() -> None:
    """Leave the groups and torch.distributed's default group (a no-op when none was joined)."""
    global _WORLD
    destroy_model_parallel()
    _WORLD = None
    if dist.is_initialized():
        dist.destroy_process_group()
