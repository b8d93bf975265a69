"""prime-rl's NCCL weight broadcast, received in the worker (its trainer's wire format, so that prime-rl's
`/init_broadcaster` + `/update_weights {"weight_dir": null}` work against `vllm serve`).

The trainer is rank 0 of a StatelessProcessGroup + PyNcclCommunicator (vllm.distributed); the inference workers
are ranks 1..inference_world_size (a worker's rank: rank_offset + its rank + 1). One update is, all broadcast
from rank 0:
- an int64 [1]: the number of state dicts (e.g. one per layer);
- per state dict: an int64 [1] byte count, then that many uint8 bytes: a pickle of {torch dtype: [(name, shape,
  numel), ...]}, then for each dtype in that order one flat tensor of that dtype holding the named tensors one
  after the other.

Invariants:
- The metadata is unpickled by an allow-list unpickler (containers, numbers, strings, torch dtypes and Size).
- Each state dict is checked against the model (`check`, names / shapes / dtypes) before its tensors are
  received; a state dict that fails is still received (and dropped) to the end of the update, so the group stays
  in step with the trainer, and the update then fails: refused (ValueError) when it was the first, else as
  partial (RuntimeError: earlier state dicts were copied).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
from vllm.distributed.utils import StatelessProcessGroup
from vllm.distributed.weight_transfer.base import WEIGHT_DTYPES, dtype_name

_ALLOWED = {("torch", name): dtype for name, dtype in WEIGHT_DTYPES.items()}
_ALLOWED[("torch", "Size")] = torch.Size
_ALLOWED[("builtins", "tuple")] = tuple
_ALLOWED[("builtins", "list")] = list


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise ValueError(f"the broadcast's metadata refers to {module}.{name}; refusing to unpickle it.")
        return _ALLOWED[(module, name)]


class BroadcastReceiver:
    def __init__(self, host: str, port: int, rank_offset: int, inference_world_size: int, timeout: float,
                 device: torch.device, worker_rank: int = 0) -> None:
        for name, value in (("rank_offset", rank_offset), ("inference_world_size", inference_world_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}.")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
        rank = rank_offset + worker_rank + 1
        if rank > inference_world_size:
            raise ValueError(f"rank_offset {rank_offset} puts this worker outside inference_world_size "
                             f"{inference_world_size}.")
        group = StatelessProcessGroup.create(host, port, rank, inference_world_size + 1, store_timeout=int(timeout))
        self.communicator = PyNcclCommunicator(group, device, timeout_s=float(timeout))
        self.device = self.communicator.device

    def _integer(self) -> int:
        value = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.communicator.broadcast(value, src=0)
        return int(value.item())

    def receive(self, load: Callable[[Iterator[tuple[str, torch.Tensor]]], None],
                check: Callable[[list[str], list[str], list[tuple[int, ...]]], None]) -> None:
        """Receive one update: each state dict is checked, then its tensors handed to `load` one by one."""
        failure: Exception | None = None
        loaded = False
        for _ in range(self._integer()):
            raw = torch.empty(self._integer(), dtype=torch.uint8, device=self.device)
            self.communicator.broadcast(raw, src=0)
            metadata = _MetadataUnpickler(io.BytesIO(raw.cpu().numpy().tobytes())).load()
            if failure is None:
                try:
                    entries = [(n, tuple(s)) for infos in metadata.values() for n, s, _ in infos]
                    dtypes = [dtype_name(d) for d, infos in metadata.items() for _ in infos]
                    check([n for n, _ in entries], dtypes, [s for _, s in entries])
                except ValueError as e:
                    failure = e
            tensors = self._tensors(metadata)
            if failure is None:
                loaded = True
                load(tensors)
            for _ in tensors:  # NOTE: whatever `load` left, and every tensor after a failure: kept in step
                pass
        if failure is not None and not loaded:
            raise ValueError(f"The broadcast update was refused, no weight was changed: {failure}")
        if failure is not None:
            raise RuntimeError(f"The broadcast update was refused ({failure}); state dicts before the refused one "
                               "were copied: the weights are partly updated.")

    def _tensors(self, metadata: dict[torch.dtype, list[tuple[str, Any, int]]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        for dtype, infos in metadata.items():
            flat = torch.empty(sum(numel for _, _, numel in infos), dtype=dtype, device=self.device)
            self.communicator.broadcast(flat, src=0)
            offset = 0
            for name, shape, numel in infos:
                yield name, flat[offset:offset + numel].view(tuple(shape))
                offset += numel


def send_state_dicts(communicator: PyNcclCommunicator, state_dicts: list[dict[str, torch.Tensor]]) -> None:
    """The trainer's side of one update (what prime-rl's broadcaster sends), for tests and scripts."""
    device = communicator.device

    def integer(value: int) -> None:
        communicator.broadcast(torch.tensor([value], dtype=torch.int64, device=device), src=0)

    integer(len(state_dicts))
    for state_dict in state_dicts:
        by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for name, tensor in state_dict.items():
            by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
        metadata = {d: [(n, tuple(t.shape), t.numel()) for n, t in items] for d, items in by_dtype.items()}
        raw = torch.frombuffer(bytearray(pickle.dumps(metadata)), dtype=torch.uint8).to(device)
        integer(raw.numel())
        communicator.broadcast(raw, src=0)
        for items in by_dtype.values():
            communicator.broadcast(torch.cat([t.reshape(-1) for _, t in items]).to(device), src=0)
