"""The nccl backend: the trainer (rank 0) broadcasts every tensor to all workers over a group of their own.

init_info `{"master_address", "master_port", "rank_offset", "world_size"}`: the trainer hosts the rendezvous
at master_address:master_port; this worker is rank `rank_offset + rank` of `world_size` (the trainer plus
every worker). The group is a `WeightTransferGroup` (stateless_group.py): NCCL on CUDA, gloo on CPU, never the
caller's default process group.

update_info `{"names", "dtype_names", "shapes", "packed"=False, "packed_buffer_size_bytes"=1 GiB,
"packed_num_buffers"=2}`. Unpacked, each tensor is one broadcast; packed, tensors travel in buffers laid out
by packed_tensor.plan_batches. The trainer must call `trainer_send_weights` with the same tensors in the same
order, the same `packed` and `packed_buffer_size_bytes`, while the workers run `receive_weights` (the trainer
typically posts /update_weights from a thread, then sends).

Trainer side, as in vLLM:
    group = NCCLWeightTransferEngine.trainer_init({"master_address": ..., "master_port": ..., "world_size": n})
    NCCLWeightTransferEngine.trainer_send_weights(model.named_parameters(), {"group": group, "packed": True})
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, fields
from typing import Any

import torch

from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo, check_int)
from vllm.distributed.weight_transfer.packed_tensor import (DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                                                            DEFAULT_PACKED_NUM_BUFFERS, packed_broadcast_consumer,
                                                            packed_nccl_broadcast_producer)
from vllm.distributed.weight_transfer.stateless_group import DEFAULT_TIMEOUT_S, WeightTransferGroup


def _check_address(address: Any, what: str) -> str:
    if not isinstance(address, str) or not address:
        raise ValueError(f"{what} must be a non-empty host name or IP address string, got {address!r}.")
    return address


def _check_packing(packed: Any, buffer_size_bytes: Any, num_buffers: Any, what: str) -> None:
    if not isinstance(packed, bool):
        raise ValueError(f"{what}.packed must be true or false, got {packed!r}.")
    check_int(buffer_size_bytes, f"{what}.packed_buffer_size_bytes", 1)
    check_int(num_buffers, f"{what}.packed_num_buffers", 1)


@dataclass
class NCCLWeightTransferInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int

    def __post_init__(self) -> None:
        _check_address(self.master_address, "init_info.master_address")
        check_int(self.master_port, "init_info.master_port", 1, 65535)
        check_int(self.rank_offset, "init_info.rank_offset", 1)  # rank 0 is the trainer
        check_int(self.world_size, "init_info.world_size", 2)


@dataclass
class NCCLWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    """The trainer must use the same value: the layout depends on it."""
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    """Batches in flight on this side. NOTE: vLLM asks both sides to agree; here each side's value only sets
    its own pipelining depth, so a mismatch is harmless."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_packing(self.packed, self.packed_buffer_size_bytes, self.packed_num_buffers, "update_info")


@dataclass
class NCCLTrainerSendWeightsArgs:
    group: Any
    """The WeightTransferGroup returned by `NCCLWeightTransferEngine.trainer_init`."""
    src: int = 0
    """The sending rank: the trainer, 0 (the only value the workers accept)."""
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor] | None = None
    """Maps each (name, tensor) item to the tensor to send; default: the tensor."""
    packed: bool = False
    stream: torch.cuda.Stream | None = None
    """CUDA stream whose work the broadcasts are ordered after (default: the current stream)."""
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS

    def __post_init__(self) -> None:
        if not isinstance(self.group, WeightTransferGroup):
            raise ValueError("trainer_args.group must be the group returned by NCCLWeightTransferEngine.trainer_init, "
                             f"got {type(self.group).__name__}.")
        if self.src != 0:
            raise ValueError(f"trainer_args.src must be 0 (the workers receive from rank 0), got {self.src!r}.")
        _check_packing(self.packed, self.packed_buffer_size_bytes, self.packed_num_buffers, "trainer_args")


class NCCLWeightTransferEngine(WeightTransferEngine):
    backend = "nccl"
    init_info_cls = NCCLWeightTransferInitInfo
    update_info_cls = NCCLWeightTransferUpdateInfo

    def __init__(self, config, device: torch.device | str, rank: int = 0) -> None:
        super().__init__(config, device, rank)
        self.model_update_group: WeightTransferGroup | None = None

    def parse_init_info(self, init_info: dict[str, Any]) -> NCCLWeightTransferInitInfo:
        """The typed init_info, this worker's place in the group checked too (so a check alone finds it)."""
        info = super().parse_init_info(init_info)
        self._group_rank(info)  # type: ignore[arg-type]
        return info  # type: ignore[return-value]

    def _group_rank(self, init_info: NCCLWeightTransferInitInfo) -> int:
        rank = init_info.rank_offset + self.rank
        if rank >= init_info.world_size:
            raise ValueError(f"init_info.rank_offset ({init_info.rank_offset}) + this worker's rank ({self.rank}) "
                             f"must be below init_info.world_size ({init_info.world_size}).")
        return rank

    def _init_transfer(self, init_info: NCCLWeightTransferInitInfo) -> None:
        rank = self._group_rank(init_info)
        self.shutdown()
        self.model_update_group = WeightTransferGroup(init_info.master_address, init_info.master_port, rank,
                                                      init_info.world_size, self.device)

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> Iterator[tuple[str, torch.Tensor]]:
        """Receive the broadcasts of one update. Unpacked, each yielded tensor is its own; packed, it is a view
        of a buffer that is refilled after the caller asks for the next tensor. Stopped early, the iterator
        still receives (and drops) the rest when closed, so the group stays in step with the trainer. On CUDA,
        the tensors are ready in the current stream's order: synchronise before relying on them elsewhere."""
        self._check_update_info(update_info)
        if self.model_update_group is None:
            raise RuntimeError("the nccl weight transfer is not initialised: call init_transfer_engine first.")
        buffer_size_bytes, num_buffers = (update_info.packed_buffer_size_bytes, update_info.packed_num_buffers) \
            if update_info.packed else (0, 1)
        return packed_broadcast_consumer(update_info.names, update_info.dtypes, update_info.shapes,
                                         self.model_update_group, src=0, buffer_size_bytes=buffer_size_bytes,
                                         num_buffers=num_buffers)

    def shutdown(self) -> None:
        if self.model_update_group is not None:
            self.model_update_group.destroy()
            self.model_update_group = None

    @staticmethod
    def trainer_init(init_info: NCCLWeightTransferInitInfo | dict[str, Any]) -> WeightTransferGroup:
        """Host the rendezvous and join as rank 0; blocks until all `world_size - 1` workers have joined (call
        /init_weight_transfer_engine from another thread meanwhile). Reads "master_address", "master_port",
        "world_size" (other keys are ignored, as in vLLM), and optionally "device" (default: the current CUDA
        device, or cpu without CUDA; NCCL on CUDA, gloo on cpu, as the workers' device) and "timeout_s"."""
        if isinstance(init_info, NCCLWeightTransferInitInfo):
            init_info = {f.name: getattr(init_info, f.name) for f in fields(init_info)}
        if not isinstance(init_info, dict):
            raise ValueError(f"trainer_init takes a dict, got {type(init_info).__name__}.")
        missing = [k for k in ("master_address", "master_port", "world_size") if k not in init_info]
        if missing:
            raise ValueError(f"trainer_init's init_info is missing key(s) {missing}.")
        address = _check_address(init_info["master_address"], "init_info.master_address")
        port = check_int(init_info["master_port"], "init_info.master_port", 1, 65535)
        world_size = check_int(init_info["world_size"], "init_info.world_size", 2)
        device = init_info.get("device")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        timeout_s = init_info.get("timeout_s", DEFAULT_TIMEOUT_S)
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s <= 0:
            raise ValueError(f"init_info.timeout_s must be a positive number of seconds, got {timeout_s!r}.")
        return WeightTransferGroup(address, port, 0, world_size, device, timeout_s=timeout_s)

    @staticmethod
    def trainer_send_weights(iterator: Iterator[tuple[str, torch.Tensor]],
                             trainer_args: NCCLTrainerSendWeightsArgs | dict[str, Any]) -> None:
        """Broadcast every (name, tensor) of `iterator`, in order, to the workers; returns when all bytes have
        left, so the trainer may then change its tensors. The workers' update_info must list the same tensors
        in the same order with the same packed / packed_buffer_size_bytes."""
        if isinstance(trainer_args, dict):
            known = {f.name for f in fields(NCCLTrainerSendWeightsArgs)}
            unknown = sorted(str(k) for k in trainer_args if k not in known)
            if unknown:
                raise ValueError(f"trainer_args has unknown key(s) {unknown}; the known keys are {sorted(known)}.")
            if "group" not in trainer_args:
                raise ValueError("trainer_args is missing key 'group' (the group from trainer_init).")
            trainer_args = NCCLTrainerSendWeightsArgs(**trainer_args)
        args = trainer_args
        post_iter_func = args.post_iter_func or (lambda item: item[1])
        buffer_size_bytes, num_buffers = (args.packed_buffer_size_bytes, args.packed_num_buffers) if args.packed \
            else (0, 1)  # unpacked: every non-empty tensor is a broadcast of its own (packed_tensor.py)
        with torch.no_grad(), torch.cuda.stream(args.stream) if args.stream is not None else nullcontext():
            packed_nccl_broadcast_producer(iter(iterator), args.group, args.src, post_iter_func,
                                           buffer_size_bytes=buffer_size_bytes, num_buffers=num_buffers)
