"""The ipc backend: a trainer on the same GPU lends its tensors through CUDA IPC handles; nothing is copied
until the worker copies each tensor into its parameter.

init_info `{}`. update_info `{"names", "dtype_names", "shapes"}` plus exactly one of
- "ipc_handles": one dict per tensor, {physical GPU UUID: (rebuild function, args)} as produced by
  `torch.multiprocessing.reductions.reduce_tensor` (in-process and Ray callers pass these objects), or
- "ipc_handles_pickled": that list pickled and base64-encoded (HTTP JSON bodies, as vLLM's trainer sends).

Invariants:
- CUDA only: on another device, init_info and update_info are refused with ValueError.
- The pickled form is read by an unpickler that resolves only the globals such a handle holds (torch's
  rebuild_cuda_tensor, torch.Tensor / Parameter, torch.Size, storage classes, dtypes); anything else is a
  ValueError. NOTE: vLLM unpickles it in full behind VLLM_ALLOW_INSECURE_SERIALIZATION; the allow-list makes
  that switch unnecessary here.
- Every handle is checked against its announced dtype and shape, and must hold an entry for this worker's
  GPU, before any tensor is opened.
- A yielded tensor is the trainer's memory: the caller copies it before asking for the next one, and the
  trainer keeps its tensors alive until the update returns (`trainer_send_weights` does).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import pickle
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from vllm.distributed.weight_transfer.base import (WEIGHT_DTYPES, WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo, dtype_name)

# NOTE: positions in rebuild_cuda_tensor's arguments (torch/multiprocessing/reductions.py), as vLLM uses them.
_ARG_SIZE, _ARG_DTYPE, _ARG_DEVICE, _NUM_ARGS = 1, 5, 6, 15

_ALLOWED_GLOBALS = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): rebuild_cuda_tensor,
    ("torch", "Tensor"): torch.Tensor,
    ("torch._tensor", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch", "Size"): torch.Size,
    ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "TypedStorage"): torch.storage.TypedStorage,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    **{("torch", name): dtype for name, dtype in WEIGHT_DTYPES.items()},
}


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise ValueError(f"update_info.ipc_handles_pickled refers to {module}.{name}, which a CUDA IPC handle "
                             "never holds; refusing to unpickle it.")
        return _ALLOWED_GLOBALS[(module, name)]


def encode_ipc_handles(ipc_handles: list[dict[str, tuple]]) -> str:
    """The "ipc_handles_pickled" string of vLLM's HTTP form: base64 of the pickled list."""
    return base64.b64encode(pickle.dumps(ipc_handles)).decode("ascii")


def decode_ipc_handles(pickled: str) -> list[dict[str, tuple]]:
    if not isinstance(pickled, str):
        raise ValueError(f"update_info.ipc_handles_pickled must be a base64 string, got {type(pickled).__name__}.")
    try:
        return _HandleUnpickler(io.BytesIO(base64.b64decode(pickled, validate=True))).load()
    except (binascii.Error, pickle.UnpicklingError, EOFError, TypeError, AttributeError, IndexError) as e:
        raise ValueError(f"update_info.ipc_handles_pickled is not a base64 pickle of IPC handles ({e}).") from None


@dataclass
class IPCWeightTransferInitInfo(WeightTransferInitInfo):
    """No field: the trainer and the worker share the GPU, there is nothing to join."""


@dataclass
class IPCWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    ipc_handles: list[dict[str, tuple[Callable, tuple]]] | None = None
    ipc_handles_pickled: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.ipc_handles is None) == (self.ipc_handles_pickled is None):
            raise ValueError("update_info needs exactly one of ipc_handles and ipc_handles_pickled.")
        if self.ipc_handles_pickled is not None:
            self.ipc_handles, self.ipc_handles_pickled = decode_ipc_handles(self.ipc_handles_pickled), None
        if not isinstance(self.ipc_handles, list) or len(self.ipc_handles) != len(self.names):
            num = len(self.ipc_handles) if isinstance(self.ipc_handles, list) else type(self.ipc_handles).__name__
            raise ValueError(f"update_info.ipc_handles must be a list of one entry per name: got {num} for "
                             f"{len(self.names)} names.")
        for i, per_gpu in enumerate(self.ipc_handles):
            what = f"update_info.ipc_handles[{i}] (for {self.names[i]!r})"
            if not isinstance(per_gpu, dict) or not per_gpu:
                raise ValueError(f"{what} must map GPU UUID strings to handles, got {per_gpu!r}.")
            for uuid, handle in per_gpu.items():
                if not isinstance(uuid, str) or not isinstance(handle, (tuple, list)) or len(handle) != 2:
                    raise ValueError(f"{what} must map GPU UUID strings to (function, args) pairs.")
                func, args = handle
                if func is not rebuild_cuda_tensor or not isinstance(args, (tuple, list)) or len(args) != _NUM_ARGS:
                    raise ValueError(f"{what} is not a CUDA tensor handle from "
                                     "torch.multiprocessing.reductions.reduce_tensor.")
                if args[_ARG_DTYPE] != self.dtypes[i] or tuple(args[_ARG_SIZE]) != self.shapes[i]:
                    raise ValueError(f"{what} holds a {args[_ARG_DTYPE]} tensor of shape {tuple(args[_ARG_SIZE])}, "
                                     f"but update_info announces {self.dtype_names[i]} {self.shapes[i]}.")


class IPCWeightTransferEngine(WeightTransferEngine):
    backend = "ipc"
    init_info_cls = IPCWeightTransferInitInfo
    update_info_cls = IPCWeightTransferUpdateInfo

    def _require_cuda(self) -> None:
        if self.device.type != "cuda":
            raise ValueError(f"the ipc backend needs CUDA (a trainer sharing this worker's GPU); this worker runs on "
                             f"{self.device}. Use the nccl or disk backend.")

    def parse_init_info(self, init_info: dict[str, Any]) -> IPCWeightTransferInitInfo:
        self._require_cuda()
        return super().parse_init_info(init_info)

    def parse_update_info(self, update_info: dict[str, Any]) -> IPCWeightTransferUpdateInfo:
        self._require_cuda()
        return super().parse_update_info(update_info)

    def _init_transfer(self, init_info: IPCWeightTransferInitInfo) -> None:
        self._require_cuda()

    def receive_weights(self, update_info: IPCWeightTransferUpdateInfo) -> Iterator[tuple[str, torch.Tensor]]:
        """Open each handle on this worker's GPU and yield the trainer's tensor (zero-copy)."""
        self._check_update_info(update_info)
        self._require_cuda()
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        for name, per_gpu in zip(update_info.names, update_info.ipc_handles):
            if uuid not in per_gpu:
                raise ValueError(f"update_info.ipc_handles for {name!r} has no handle for this worker's GPU {uuid} "
                                 f"(it has {sorted(per_gpu)}): the ipc backend needs the trainer on the same GPU.")
        return self._open(update_info, uuid, index)

    @staticmethod
    def _open(update_info: IPCWeightTransferUpdateInfo, uuid: str,
              index: int) -> Iterator[tuple[str, torch.Tensor]]:
        for name, per_gpu in zip(update_info.names, update_info.ipc_handles):
            func, args = per_gpu[uuid]
            args = list(args)
            args[_ARG_DEVICE] = index  # NOTE: the trainer's device index can differ from ours (CUDA_VISIBLE_DEVICES)
            tensor = func(*args)
            yield name, tensor
            del tensor

    @staticmethod
    def trainer_update_info(iterator: Iterator[tuple[str, torch.Tensor]],
                            ) -> tuple[IPCWeightTransferUpdateInfo, list[torch.Tensor]]:
        """Trainer-side: the update info that lends these CUDA tensors, and the tensors that must stay alive
        (unchanged) until the worker has copied them."""
        index = torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        names, dtype_names, shapes, handles, keep_alive = [], [], [], [], []
        for name, tensor in iterator:
            if tensor.device.type != "cuda":
                raise ValueError(f"the ipc backend lends CUDA tensors; {name!r} is on {tensor.device}.")
            tensor = tensor.detach().contiguous()
            names.append(name)
            dtype_names.append(dtype_name(tensor.dtype))
            shapes.append(list(tensor.shape))
            handles.append({uuid: reduce_tensor(tensor)})
            keep_alive.append(tensor)
        return IPCWeightTransferUpdateInfo(names, dtype_names, shapes, ipc_handles=handles), keep_alive

    @staticmethod
    def trainer_send_weights(iterator: Iterator[tuple[str, torch.Tensor]],
                             trainer_args: IPCTrainerSendWeightsArgs | dict[str, Any]) -> None:
        """Lend every tensor of `iterator` to the engine and return once it has copied them: "http" posts
        {"update_info": {..., "ipc_handles_pickled"}} to `url` + "/update_weights"; "ray" calls
        `llm_handle.update_weights.remote({"update_info": {..., "ipc_handles"}})` (on each handle of a list);
        a callable receives the update_info dict (with "ipc_handles")."""
        if isinstance(trainer_args, dict):
            trainer_args = IPCTrainerSendWeightsArgs(**trainer_args)
        args = trainer_args
        info, keep_alive = IPCWeightTransferEngine.trainer_update_info(iterator)
        torch.cuda.current_stream().synchronize()  # the lent bytes are final before the engine reads them
        update_info = {"names": info.names, "dtype_names": info.dtype_names,
                       "shapes": [list(s) for s in info.shapes]}
        if callable(args.send_mode):
            args.send_mode({**update_info, "ipc_handles": info.ipc_handles})
        elif args.send_mode == "ray":
            import ray
            handles = args.llm_handle if isinstance(args.llm_handle, list) else [args.llm_handle]
            ray.get([h.update_weights.remote({"update_info": {**update_info, "ipc_handles": info.ipc_handles}})
                     for h in handles])
        else:
            body = {"update_info": {**update_info, "ipc_handles_pickled": encode_ipc_handles(info.ipc_handles)}}
            request = urllib.request.Request(f"{args.url.rstrip('/')}/update_weights", method="POST",
                                             data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=args.timeout_s):
                pass  # NOTE: urlopen raises HTTPError on a 4xx/5xx answer
        del keep_alive
        torch.cuda.ipc_collect()


@dataclass
class IPCTrainerSendWeightsArgs:
    send_mode: str | Callable[[dict[str, Any]], None] | None = None
    """"http", "ray", or a callable given the update_info dict. vLLM's older name for it is `mode`."""
    llm_handle: Any = None
    """Ray actor handle, or a list of them (send_mode "ray")."""
    url: str | None = None
    """Base URL of the server (send_mode "http")."""
    mode: str | None = None
    timeout_s: float = 300.0
    """HTTP timeout, as vLLM's."""

    def __post_init__(self) -> None:
        if self.send_mode is None:
            self.send_mode = self.mode
        if callable(self.send_mode):
            return
        if self.send_mode not in ("http", "ray"):
            raise ValueError(f"trainer_args.send_mode must be 'http', 'ray' or a callable, got {self.send_mode!r}.")
        if self.send_mode == "http" and not self.url:
            raise ValueError("trainer_args.url is required for send_mode 'http'.")
        if self.send_mode == "ray" and self.llm_handle is None:
            raise ValueError("trainer_args.llm_handle is required for send_mode 'ray'.")

