"""In-place weight updates: a trainer's new weights copied into the model's existing parameters.

vLLM's four steps, run by the worker between engine steps (EngineCore halts scheduling and drains the steps in
flight first): `init_transfer_engine(init_info)` (once per transfer group), `start(is_checkpoint_format)`,
`update(update_info)` (any number of times) and `finish()`. The transport is a WeightTransferEngine of the
configured backend (vllm/distributed/weight_transfer: nccl, ipc, disk); `load_from_disk(path)` is a disk update
whatever the backend (prime-rl's `/update_weights {"weight_dir"}`), `receive_broadcast()` one from prime-rl's
NCCL broadcaster (`init_broadcaster` first).

Invariants:
- An update is checked whole before any byte moves: every name must route to a parameter (checkpoint names,
  Hugging Face's, with q/k/v and gate/up going into their fused parameters; or, with is_checkpoint_format=False,
  the model's own parameter names), with the shape that parameter (or its shard) has at one tensor-parallel rank
  (the whole tensor: each rank's weight_loader keeps its own shard) and a floating-point dtype.
  A refused update changes no weight and raises ValueError; the engine keeps its weights and keeps serving.
  Any other error may come after some copies (RuntimeError). With several ranks the engine core judges the
  ranks' outcomes together (vllm/v1/engine/weight_sync.py): every rank runs `check_update` (the same check,
  nothing moved) before any rank runs `update`, and a refused update is received and dropped by every rank
  (`discard`) so a trainer's broadcast completes.
- Tensors are copied one by one into the parameters' storage (`copy_`, casting to the model's dtype), so their
  addresses, and the CUDA graphs captured over them, stay valid, and memory stays about one tensor. On CUDA the
  update waits for its copies before it returns (an IPC sender may free its tensors then).
- A transfer that fails midway (a broken connection) can leave the weights partly updated; its error says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.model_executor.utils import full_shape, load_full_parameter


def _dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Unknown dtype name {name!r} in the weight update.")
    return dtype


class WeightUpdater:
    def __init__(self, model: nn.Module, vllm_config: VllmConfig, device: torch.device, rank: int = 0) -> None:
        self.model = model
        self.vllm_config = vllm_config
        self.device = device
        self.rank = rank
        self.transfer_engine: Any = None
        self.is_checkpoint_format = True
        self.broadcaster: Any = None

    def _make_engine(self, backend: str | None = None) -> Any:
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer import make_weight_transfer_engine
        config = self.vllm_config.weight_transfer_config or WeightTransferConfig()
        if backend is not None:
            config = WeightTransferConfig(backend=backend)
        return make_weight_transfer_engine(config, self.device, rank=self.rank)

    def init_transfer_engine(self, init_info: dict[str, Any]) -> None:
        if not isinstance(init_info, dict):
            raise ValueError(f"init_info must be an object, got {type(init_info).__name__}.")
        engine = self._make_engine()
        engine.init_transfer_engine(init_info)
        if self.transfer_engine is not None:
            self.transfer_engine.shutdown()
        self.transfer_engine = engine

    def check_init(self, init_info: dict[str, Any]) -> None:
        """init_transfer_engine's checks alone (ValueError): joins nothing."""
        if not isinstance(init_info, dict):
            raise ValueError(f"init_info must be an object, got {type(init_info).__name__}.")
        self._make_engine().parse_init_info(init_info)

    def start(self, is_checkpoint_format: bool = True) -> None:
        if not isinstance(is_checkpoint_format, bool):
            raise ValueError(f"is_checkpoint_format must be a boolean, got {is_checkpoint_format!r}.")
        self.is_checkpoint_format = is_checkpoint_format

    def _update_engine(self, update_info: Any) -> Any:
        """The transfer engine an `update(update_info)` goes through (ValueError when there is none)."""
        if not isinstance(update_info, dict):
            raise ValueError(f"update_info must be an object, got {type(update_info).__name__}.")
        engine = self.transfer_engine
        if engine is None:
            backend = (self.vllm_config.weight_transfer_config.backend
                       if self.vllm_config.weight_transfer_config is not None else "nccl")
            if backend == "nccl":
                raise ValueError("The nccl weight transfer engine is not initialised: call "
                                 "init_weight_transfer_engine with its init_info first.")
            # NOTE: ipc and disk need no set-up (their init_info is {}).
            engine = self.transfer_engine = self._make_engine()
            engine.init_transfer_engine({})
        return engine

    def update(self, update_info: dict[str, Any]) -> None:
        engine = self._update_engine(update_info)
        self._apply(engine, engine.parse_update_info(update_info))

    def check_update(self, update_info: dict[str, Any]) -> tuple[str | None, bool]:
        """`update`'s whole check alone; moves no byte and changes no weight. Returns (the refusal's text, or
        None when this rank would take the update; whether this rank can receive the update's bytes from the
        trainer's group and drop them, `discard`: a joined nccl group and an update_info whose layout parses)."""
        try:
            engine = self._update_engine(update_info)
            info = engine.parse_update_info(update_info)
        except ValueError as e:
            return f"Weight update refused, no weight was changed: {e}", False
        receivable = getattr(engine, "model_update_group", None) is not None
        try:
            self._check_info(info)
        except ValueError as e:
            return str(e), receivable
        return None, receivable

    def discard(self, update_info: dict[str, Any]) -> None:
        """Receive a refused update's bytes from the trainer's group and drop them, so that the trainer's send
        completes and the group stays in step for the next update; no weight changes. RuntimeError when the
        transfer fails (the group may then be out of step: initialise it again)."""
        engine = self._update_engine(update_info)
        info = engine.parse_update_info(update_info)
        if getattr(engine, "model_update_group", None) is None:
            raise ValueError("This weight transfer backend has no trainer group to receive from.")
        try:
            with torch.no_grad():
                for _ in engine.receive_weights(info):
                    pass
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
        except Exception as e:
            raise RuntimeError(f"Receiving the refused update to drop it failed ({type(e).__name__}: {e}); no "
                               "weight was changed, but the transfer group may be out of step with the trainer: "
                               "initialise it again (init_weight_transfer_engine).") from e

    def load_from_disk(self, path: str) -> None:
        """A whole checkpoint-format update from a folder of safetensors, whatever the configured backend."""
        with self._from_disk(path) as (engine, info):
            self._apply(engine, info)

    def check_disk(self, path: str) -> None:
        """load_from_disk's whole-update check alone (ValueError when refused); no weight changes."""
        with self._from_disk(path) as (_, info):
            self._check_info(info)

    @contextlib.contextmanager
    def _from_disk(self, path: str) -> Iterator[tuple[Any, Any]]:
        """A disk transfer engine and the parsed update of the folder `path`, read as checkpoint names while the
        block runs (the configured format again, and the engine shut down, after it)."""
        engine = self._make_engine("disk")
        engine.init_transfer_engine({})
        previous, self.is_checkpoint_format = self.is_checkpoint_format, True
        try:
            yield engine, engine.parse_update_info({"path": path})
        finally:
            self.is_checkpoint_format = previous
            engine.shutdown()

    def init_broadcaster(self, host: str, port: int, rank_offset: int, inference_world_size: int,
                         timeout: float) -> None:
        """Join prime-rl's NCCL weight broadcast (vllm/distributed/weight_transfer/broadcast_receiver.py)."""
        from vllm.distributed.weight_transfer.broadcast_receiver import BroadcastReceiver
        self.broadcaster = BroadcastReceiver(host, port, rank_offset, inference_world_size, timeout, self.device,
                                             self.rank)

    def receive_broadcast(self) -> None:
        """One whole checkpoint-format update from prime-rl's broadcast, checked state dict by state dict."""
        if getattr(self, "broadcaster", None) is None:
            raise ValueError("No weight broadcast to receive from: call /init_broadcaster first (or send "
                             "{\"weight_dir\": \"/folder\"} to load a folder).")
        with torch.no_grad():
            self.broadcaster.receive(self.model.load_weights, self.check)  # type: ignore[union-attr]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def finish(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _check_info(self, info: Any) -> None:
        """`check` of a parsed update's names, dtypes and shapes (ValueError when refused)."""
        self.check(list(info.names), list(info.dtype_names), [tuple(s) for s in info.shapes])

    def _apply(self, engine: Any, info: Any) -> None:
        self._check_info(info)
        # NOTE: from here on every error, a ValueError too (a file changed since its header was read), may come
        # after some copies: never "refused, nothing changed".
        try:
            with torch.no_grad():
                if self.is_checkpoint_format:
                    self.model.load_weights(engine.receive_weights(info))  # type: ignore[operator]
                else:
                    params = dict(self.model.named_parameters())
                    for name, tensor in engine.receive_weights(info):
                        load_full_parameter(params[name], tensor)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
        except Exception as e:
            raise RuntimeError(f"The weight transfer failed midway ({type(e).__name__}: {e}); the weights may be "
                               "partly updated: send the whole update again.") from e

    def check(self, names: list[str], dtype_names: list[str], shapes: list[tuple[int, ...]]) -> None:
        """Refuse (ValueError) an update any tensor of which matches no parameter by name, shape or dtype."""
        if not (len(names) == len(dtype_names) == len(shapes)):
            raise ValueError(f"names, dtype_names and shapes must have the same length, got {len(names)}, "
                             f"{len(dtype_names)} and {len(shapes)}.")
        params = dict(self.model.named_parameters())
        problems: list[str] = []
        for name, dtype_name, shape in zip(names, dtype_names, shapes):
            try:
                dtype = _dtype_of(dtype_name)
                if self.is_checkpoint_format:
                    expected = self.model.checkpoint_weight_shape(name)  # type: ignore[operator]
                else:
                    if name not in params:
                        raise ValueError(f"weight {name!r} matches no parameter of {type(self.model).__name__} "
                                         "(is_checkpoint_format=False takes the model's own parameter names)")
                    expected = full_shape(params[name])
                if expected is None:
                    continue
                if tuple(shape) != expected:
                    raise ValueError(f"weight {name!r} has shape {list(shape)}, the parameter needs "
                                     f"{list(expected)}")
                if not dtype.is_floating_point:
                    raise ValueError(f"weight {name!r} has dtype {dtype_name}, not a floating-point dtype")
            except ValueError as e:
                problems.append(str(e))
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise ValueError("Weight update refused, no weight was changed: " + "; ".join(problems[:3]) + more)

    def weight_info(self) -> dict[str, dict[str, Any]]:
        return {name: {"shape": list(full_shape(p)), "dtype": str(p.dtype).removeprefix("torch.")}
                for name, p in self.model.named_parameters()}

    def shutdown(self) -> None:
        if self.transfer_engine is not None:
            self.transfer_engine.shutdown()
            self.transfer_engine = None
