"""A process group of one trainer (rank 0) and the inference workers, apart from torch.distributed's world.

vLLM builds this group with its `StatelessProcessGroup` and a `PyNcclCommunicator`. Here it is a
`torch.distributed.TCPStore` (the trainer, rank 0, hosts it at master_address:master_port) and a c10d backend
constructed directly on that store: `ProcessGroupNCCL` when the group's device is CUDA, `ProcessGroupGloo` on
CPU. Nothing is registered with torch.distributed: `init_process_group` is never called, the caller's default
group (if any) is neither needed nor touched, and `torch.distributed.is_initialized()` does not change.

Invariants:
- Every member runs the same sequence of `broadcast` calls; one whose tensor has no element is skipped by all
  members alike (so a trainer that broadcasts an empty tensor itself stays in step).
- A broadcast moves the tensor's bytes (a uint8 view), so any dtype works on either backend.
- Rendezvous: the trainer writes its backend name and the world size into the store; a worker that would
  use another backend, or sees another world size, or a rank already taken, fails with ValueError before
  the c10d group is built. Then one warm-up broadcast from rank 0 (which also makes NCCL connect now).
- `timeout_s` bounds the rendezvous and every collective. NOTE: a ProcessGroupNCCL collective that outlives it
  is aborted by torch's NCCL watchdog, which by default ends the process (TORCH_NCCL_ASYNC_ERROR_HANDLING).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0
_KEY = "vllm_weight_transfer"


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    # [num_bytes] uint8 view of a contiguous tensor (a 0-dim tensor becomes its itemsize bytes)
    return tensor.reshape(-1).view(torch.uint8)


def c10d_group(store: dist.Store, rank: int, world_size: int, device: torch.device,
               timeout: datetime.timedelta, name: str) -> dist.ProcessGroup:
    """A c10d backend built directly on `store` (never registered with torch.distributed): NCCL for a CUDA
    device, gloo for the CPU."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()  # as torch.distributed's own NCCL groups are built
        options.is_high_priority_stream = False
        options._timeout = timeout
        options.group_name = name
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


class WeightTransferGroup:
    """What `NCCLWeightTransferEngine.trainer_init` returns; `broadcast(tensor, src=0, stream=None)` has the
    signature of vLLM's PyNcclCommunicator, so trainer code that broadcasts on it directly keeps working."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 device: torch.device | str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the weight-transfer group of world_size {world_size}.")
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"the weight-transfer group runs on cuda or cpu devices, got {self.device}.")
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                                    timeout=timeout, wait_for_workers=False)
        self._check_peers()
        self._pg = c10d_group(dist.PrefixStore(f"{_KEY}/pg", self._store), rank, world_size, self.device,
                              timeout, _KEY)
        hello = torch.tensor([world_size], dtype=torch.int64, device=self.device)
        self.broadcast(hello, src=0)
        if hello.item() != world_size:
            raise RuntimeError(f"weight-transfer warm-up broadcast gave {hello.item()}, expected {world_size}.")

    def _check_peers(self) -> None:
        if self.rank == 0:
            self._store.set(f"{_KEY}/backend", self.backend)
            self._store.set(f"{_KEY}/world_size", str(self.world_size))
            return
        backend = self._store.get(f"{_KEY}/backend").decode()
        world_size = int(self._store.get(f"{_KEY}/world_size").decode())
        if backend != self.backend:
            raise ValueError(f"the trainer built a {backend} weight-transfer group but this worker's device "
                             f"{self.device} needs {self.backend}: trainer and workers must both be on CUDA (nccl) "
                             "or both on CPU (gloo).")
        if world_size != self.world_size:
            raise ValueError(f"init_info.world_size is {self.world_size} but the trainer's group has world_size "
                             f"{world_size}.")
        if self._store.add(f"{_KEY}/rank/{self.rank}", 1) != 1:
            raise ValueError(f"rank {self.rank} of the weight-transfer group is already taken: check rank_offset "
                             "(the trainer is rank 0; workers are rank_offset + their rank).")

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> dist.Work | None:
        """Start broadcasting the bytes of the contiguous `tensor` (on this group's device) from `src`; None
        for an empty tensor. On CUDA the collective is ordered after the current stream's work, and
        `Work.wait()` makes the current stream wait for it; on CPU `Work.wait()` blocks."""
        if tensor.numel() == 0:
            return None
        options = dist.BroadcastOptions()
        options.rootRank = src
        return self._pg.broadcast([_as_bytes(tensor)], options)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: torch.cuda.Stream | None = None) -> None:
        """Broadcast `tensor` in place from `src` (on CUDA, in stream order on `stream` or the current one)."""
        if stream is not None:
            with torch.cuda.stream(stream):
                return self.broadcast(tensor, src)
        if tensor.device != self.device:
            raise ValueError(f"broadcast got a tensor on {tensor.device}; this weight-transfer group is on "
                             f"{self.device}.")
        buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
        work = self.broadcast_async(buffer, src)
        if work is not None:
            work.wait()
        if buffer is not tensor and self.rank != src:
            tensor.copy_(buffer)

    def destroy(self) -> None:
        """Tear the group down (idempotent). Members should call it together, after their last broadcast."""
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None and hasattr(pg, "shutdown"):
            pg.shutdown()
        self._store = None
