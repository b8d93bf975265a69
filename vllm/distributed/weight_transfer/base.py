"""The receiver interface every weight-transfer backend implements, and the checks they share.

One `WeightTransferEngine` lives in each worker process. Its lifecycle, driven by the worker:

1. `init_transfer_engine(init_info)` once: join the trainer (NCCL: a process group; IPC, disk: nothing).
2. per update: `parse_update_info(update_info)` checks the request and returns a typed `UpdateInfo` without
   moving a byte; the worker compares its `names` / `dtype_names` / `shapes` with the model and only then
   calls `receive_weights(info)`, which yields `(name, tensor)` one at a time, in `info.names` order.
3. `shutdown()` at worker exit (or before a second `init_transfer_engine`).

Invariants:
- Every malformed dict (missing, unknown or ill-typed key, lists of different lengths, unknown dtype name,
  a name given twice) is a ValueError naming the field, raised before any data moves.
- A yielded tensor may be a view of a buffer that the next step of the iterator overwrites: the caller
  copies it (into the parameter) before asking for the next one. Tensors arrive on the engine's device with
  exactly the dtype and shape announced in the update info.
- Dtype names are torch's short names (`str(dtype)` without "torch."), plus torch's aliases such as
  "half" and "float", as vLLM resolves them with `getattr(torch, name)`.

The trainer-side halves are static methods on each backend's engine class (`trainer_init`,
`trainer_send_weights`), under vLLM's names, because trainers import them from vllm.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

import torch

from vllm.config.weight_transfer import WeightTransferConfig

_DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                "float8_e5m2fnuz", "float8_e8m0fnu", "int64", "int32", "int16", "int8", "uint64", "uint32",
                "uint16", "uint8", "bool", "complex64", "complex128",
                # torch's aliases of the above
                "double", "float", "half", "long", "int", "short")
WEIGHT_DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}


def dtype_name(dtype: torch.dtype) -> str:
    """torch's short name of a dtype: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str, what: str = "dtype_names") -> torch.dtype:
    if not isinstance(name, str) or name not in WEIGHT_DTYPES:
        raise ValueError(f"{what}: unknown dtype name {name!r}; use torch's short names, e.g. 'bfloat16', "
                         "'float32', 'int64'.")
    return WEIGHT_DTYPES[name]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value: Any, what: str, minimum: int, maximum: int | None = None) -> int:
    if not _is_int(value) or value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{what} must be an integer {bound}, got {value!r}.")
    return value


def check_keys(info: Any, cls: type, what: str) -> None:
    """`info` must be a dict holding every field of the dataclass `cls` without a default, and no key that
    is not one of its init fields."""
    if not isinstance(info, dict):
        raise ValueError(f"{what} must be a JSON object (dict), got {type(info).__name__}.")
    allowed = [f.name for f in fields(cls) if f.init]
    required = [f.name for f in fields(cls) if f.init and f.default is MISSING and f.default_factory is MISSING]
    missing = [k for k in required if k not in info]
    if missing:
        raise ValueError(f"{what} is missing key(s) {missing} (the {cls.__name__} keys are {allowed}).")
    unknown = sorted(str(k) for k in info if k not in allowed)
    if unknown:
        raise ValueError(f"{what} has unknown key(s) {unknown} (the {cls.__name__} keys are {allowed}).")


@dataclass
class WeightTransferInitInfo:
    """A backend's `init_info`; the base holds no field (IPC and disk need none)."""

    @classmethod
    def from_dict(cls, info: dict[str, Any]):
        check_keys(info, cls, "init_info")
        return cls(**info)


@dataclass
class WeightTransferUpdateInfo:
    """What one update carries: per tensor, its name, torch dtype name and shape (lists of one length).
    JSON lists of shapes become tuples."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for key in ("names", "dtype_names", "shapes"):
            if not isinstance(getattr(self, key), (list, tuple)):
                raise ValueError(f"update_info.{key} must be a list, got {type(getattr(self, key)).__name__}.")
        num = len(self.names)
        for key in ("dtype_names", "shapes"):
            if len(getattr(self, key)) != num:
                raise ValueError(f"update_info.{key} has {len(getattr(self, key))} entries but names has {num}: "
                                 "the three lists must have one entry per tensor.")
        seen: set[str] = set()
        for name in self.names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"update_info.names must hold non-empty strings, got {name!r}.")
            if name in seen:
                raise ValueError(f"update_info.names has {name!r} twice.")
            seen.add(name)
        self.names = list(self.names)
        self.dtype_names = list(self.dtype_names)
        self.dtypes = [to_dtype(d, f"update_info.dtype_names[{i}]") for i, d in enumerate(self.dtype_names)]
        shapes = []
        for i, shape in enumerate(self.shapes):
            if not isinstance(shape, (list, tuple)) or not all(_is_int(s) and s >= 0 for s in shape):
                raise ValueError(f"update_info.shapes[{i}] (for {self.names[i]!r}) must be a list of non-negative "
                                 f"integers, got {shape!r}.")
            shapes.append(tuple(shape))
        self.shapes = shapes

    @classmethod
    def from_dict(cls, info: dict[str, Any]):
        check_keys(info, cls, "update_info")
        return cls(**info)

    def num_bytes(self, i: int) -> int:
        return math.prod(self.shapes[i]) * self.dtypes[i].itemsize


def update_info_from_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], **extra: Any) -> dict[str, Any]:
    """Trainer-side: the `update_info` dict (names, dtype_names, shapes, plus `extra`, e.g. packed=True) that
    announces these tensors, in this order. Reads only metadata (a DTensor's global shape, no gather)."""
    names, dtype_names, shapes = [], [], []
    for name, tensor in named_tensors:
        names.append(name)
        dtype_names.append(dtype_name(tensor.dtype))
        shapes.append(list(tensor.shape))
    return {"names": names, "dtype_names": dtype_names, "shapes": shapes, **extra}


@dataclass
class WeightTransferInitRequest:
    """vLLM's API-level request: `llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={...}))`."""

    init_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class WeightTransferUpdateRequest:
    """vLLM's API-level request: `llm.update_weights(WeightTransferUpdateRequest(update_info={...}))`."""

    update_info: dict[str, Any] = field(default_factory=dict)


class WeightTransferEngine(ABC):
    """The receiver of one worker. `rank` is the worker's global rank among the inference workers (0 for a
    single worker); backends that form a group with the trainer place it after the trainer's ranks."""

    backend: ClassVar[str]
    init_info_cls: ClassVar[type[WeightTransferInitInfo]] = WeightTransferInitInfo
    update_info_cls: ClassVar[type[WeightTransferUpdateInfo]] = WeightTransferUpdateInfo

    def __init__(self, config: WeightTransferConfig, device: torch.device | str, rank: int = 0) -> None:
        if config.backend != self.backend:
            raise ValueError(f"{type(self).__name__} serves backend {self.backend!r}, the config asks for "
                             f"{config.backend!r}.")
        self.config = config
        self.device = torch.device(device)
        self.rank = check_int(rank, "rank", 0)

    def parse_init_info(self, init_info: dict[str, Any]) -> WeightTransferInitInfo:
        return self.init_info_cls.from_dict(init_info)

    def init_transfer_engine(self, init_info: dict[str, Any] | WeightTransferInitInfo) -> None:
        """Validate `init_info` (ValueError) and join the trainer; blocks until the rendezvous is done."""
        if not isinstance(init_info, self.init_info_cls):
            init_info = self.parse_init_info(init_info)
        self._init_transfer(init_info)

    @abstractmethod
    def _init_transfer(self, init_info: WeightTransferInitInfo) -> None:
        raise NotImplementedError

    def parse_update_info(self, update_info: dict[str, Any]) -> WeightTransferUpdateInfo:
        """Validate one update (ValueError) and return its typed form; moves no data."""
        return self.update_info_cls.from_dict(update_info)

    @abstractmethod
    def receive_weights(self, update_info: WeightTransferUpdateInfo) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(name, tensor)` in `update_info.names` order, on `self.device`; a tensor may be a view of a
        buffer reused after the caller asks for the next one."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Release what `init_transfer_engine` built; the engine may be initialised again afterwards."""

    def _check_update_info(self, update_info: WeightTransferUpdateInfo) -> None:
        if not isinstance(update_info, self.update_info_cls):
            raise ValueError(f"{type(self).__name__}.receive_weights takes the {self.update_info_cls.__name__} "
                             f"returned by parse_update_info, got {type(update_info).__name__}.")

    @staticmethod
    def trainer_send_weights(iterator: Iterator[tuple[str, torch.Tensor]], trainer_args: Any) -> None:
        """Trainer-side: send `(name, tensor)` pairs to the workers; backend-specific `trainer_args`."""
        raise NotImplementedError
