"""Weight transfer: moves a trainer's new weights into the running engine (vLLM's module of this name).

Each worker builds one receiver with `make_weight_transfer_engine(config, device, rank)`; base.py states the
receiver's contract. Backends (one module each, imported only when chosen): nccl_engine.py (broadcast over a
group of the trainer and the workers, stateless_group.py, packed_tensor.py), ipc_engine.py (CUDA IPC handles
from a trainer on the same GPU), disk_engine.py (a safetensors folder).
"""

from __future__ import annotations

import importlib

import torch

from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferInitRequest, WeightTransferUpdateInfo,
                                                   WeightTransferUpdateRequest, update_info_from_tensors)

_ENGINES = {
    "nccl": ("vllm.distributed.weight_transfer.nccl_engine", "NCCLWeightTransferEngine"),
    "ipc": ("vllm.distributed.weight_transfer.ipc_engine", "IPCWeightTransferEngine"),
    "disk": ("vllm.distributed.weight_transfer.disk_engine", "DiskWeightTransferEngine"),
}


def make_weight_transfer_engine(config: WeightTransferConfig, device: torch.device | str,
                                rank: int = 0) -> WeightTransferEngine:
    """The receiver of `config.backend` for a worker on `device`; `rank` is the worker's global rank among
    the inference workers. Joins nothing yet (see `init_transfer_engine`)."""
    module, name = _ENGINES[config.backend]  # WeightTransferConfig admits only these backends
    return getattr(importlib.import_module(module), name)(config, device, rank)


def __getattr__(name: str):  # the engine classes, imported on first use
    for module, cls_name in _ENGINES.values():
        if name == cls_name:
            return getattr(importlib.import_module(module), name)
    raise AttributeError(name)


__all__ = ["WeightTransferConfig", "WeightTransferEngine", "WeightTransferInitInfo", "WeightTransferInitRequest",
           "WeightTransferUpdateInfo", "WeightTransferUpdateRequest", "make_weight_transfer_engine",
           "update_info_from_tensors", "NCCLWeightTransferEngine", "IPCWeightTransferEngine",
           "DiskWeightTransferEngine"]
