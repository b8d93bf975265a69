"""The disk backend: the trainer writes a Hugging Face safetensors folder, the engine reads it.

init_info `{}`. update_info `{"path": absolute folder}` holding `model.safetensors`, or shards named by
`model.safetensors.index.json`, or any `*.safetensors` (the file choice of model_loader.get_safetensors_files,
which this reuses, as it reuses safetensors_weights_iterator for the reading).

Invariants:
- `parse_update_info` reads only the safetensors headers of every file: the update's names, dtypes and
  shapes come from them, in the order `receive_weights` yields the tensors. A missing folder, a folder
  without .safetensors, an unreadable header or index, an unknown dtype or a name in two files is a ValueError
  naming the path.
- `receive_weights` holds about one tensor at a time (read to CPU, then moved to the engine's device); a
  file that no longer matches its header (rewritten since the parse) is a ValueError at that tensor.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open

from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo, check_keys)
from vllm.model_executor.model_loader import get_safetensors_files, safetensors_weights_iterator

# safetensors header dtype -> torch's short name
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
                      "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64",
                      "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool", "C64": "complex64"}


@dataclass
class DiskWeightTransferInitInfo(WeightTransferInitInfo):
    """No field: the folder arrives with each update."""


@dataclass
class _PathOnly:
    path: str  # the keys a disk update_info dict may hold


@dataclass
class DiskWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    path: str = ""
    files: list[str] = field(default_factory=list)  # read in this order

    @classmethod
    def from_dict(cls, info: dict[str, Any]) -> DiskWeightTransferUpdateInfo:
        check_keys(info, _PathOnly, "update_info")
        path = info["path"]
        if not isinstance(path, str) or not os.path.isabs(path):
            raise ValueError(f"update_info.path must be an absolute folder path (as the engine's workers see it), "
                             f"got {path!r}.")
        if not os.path.isdir(path):
            raise ValueError(f"update_info.path {path!r} is not a folder.")
        if not any(name.endswith(".safetensors") for name in os.listdir(path)):
            raise ValueError(f"update_info.path {path!r} holds no .safetensors file.")
        try:
            files = get_safetensors_files(path)
        except (ValueError, KeyError, TypeError, OSError) as e:
            raise ValueError(f"update_info.path {path!r}: unreadable model.safetensors.index.json ({e!r}).") from None
        names, dtype_names, shapes, file_of = [], [], [], {}
        for file in files:
            try:
                with safe_open(file, framework="pt", device="cpu") as f:
                    header = [(name, f.get_slice(name).get_dtype(), f.get_slice(name).get_shape())
                              for name in f.keys()]
            except Exception as e:  # NOTE: safetensors raises its own SafetensorError besides OSError
                raise ValueError(f"update_info.path {path!r}: cannot read the safetensors header of "
                                 f"{os.path.basename(file)} ({e}).") from None
            for name, st_dtype, shape in header:
                if name in file_of:
                    raise ValueError(f"update_info.path {path!r}: tensor {name!r} is in both "
                                     f"{os.path.basename(file_of[name])} and {os.path.basename(file)}.")
                if st_dtype not in SAFETENSORS_DTYPES:
                    raise ValueError(f"update_info.path {path!r}: tensor {name!r} in {os.path.basename(file)} has "
                                     f"dtype {st_dtype}, which the engine does not load.")
                file_of[name] = file
                names.append(name)
                dtype_names.append(SAFETENSORS_DTYPES[st_dtype])
                shapes.append(tuple(shape))
        return cls(names, dtype_names, shapes, path=path, files=files)


class DiskWeightTransferEngine(WeightTransferEngine):
    backend = "disk"
    init_info_cls = DiskWeightTransferInitInfo
    update_info_cls = DiskWeightTransferUpdateInfo

    def _init_transfer(self, init_info: DiskWeightTransferInitInfo) -> None:
        pass

    def receive_weights(self, update_info: DiskWeightTransferUpdateInfo) -> Iterator[tuple[str, torch.Tensor]]:
        """Read the tensors one by one, each a tensor of its own on the engine's device."""
        self._check_update_info(update_info)
        return self._read(update_info)

    def _read(self, info: DiskWeightTransferUpdateInfo) -> Iterator[tuple[str, torch.Tensor]]:
        i = 0
        for name, tensor in safetensors_weights_iterator(info.files):
            if i >= len(info.names) or (name, tensor.dtype, tuple(tensor.shape)) != (
                    info.names[i], info.dtypes[i], info.shapes[i]):
                raise ValueError(f"update_info.path {info.path!r} changed after its headers were read: found "
                                 f"{name!r} {tensor.dtype} {tuple(tensor.shape)} at position {i}.")
            i += 1
            yield name, tensor.to(self.device)
        if i != len(info.names):
            raise ValueError(f"update_info.path {info.path!r} changed after its headers were read: "
                             f"{len(info.names) - i} tensor(s) are gone.")
