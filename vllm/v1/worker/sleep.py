"""Sleep mode's memory (`enable_sleep_mode`): the model's weights and the KV cache, each in one region whose
memory can be handed back and taken again without moving, so a colocated trainer can use the device between
rollouts.

The worker builds a `Sleeper` when sleep mode is on: it moves every parameter and buffer of the model into one
region (the "weights" tag; each tensor a view at a 256-byte aligned offset) and the runner's KV cache is made
in a second one (the "kv_cache" tag, one view per layer). On CUDA a region is a `CudaRegion`
(vllm/device_allocator/cumem.py: the driver's virtual memory API, same addresses after a wake, so every
captured CUDA graph stays valid); on other devices a `HostRegion`, whose storage is resized to 0 and back
(`untyped_storage().resize_()`), so the views the model and the runner hold see the new memory.

- The weights' host backup (`host_backup`, [weight_bytes] uint8; on CUDA page-locked memory of exactly that
  size, vllm/device_allocator/cumem.py) is allocated once, here, at start-up: a sleep then only copies, and the
  first sleep is as fast as the later ones. The cost is host memory equal to the weights, held (pinned, on CUDA)
  for the engine's life whether it ever sleeps or not (docs/serving.md, "Sleep mode").
- `sleep(1)`: the weights are copied into the host backup, then both regions are released.
  `sleep(2)`: the weights are discarded (a weight update or reload follows); the model's buffers (rotary
  tables, not in a checkpoint) are kept in the host backup at their offsets, as vLLM keeps them.
- `wake_up(tags)`: the regions of `tags` (None: both) get memory again; the weights are copied back from the
  host backup (level 1; or the buffers only, level 2: the parameters are then undefined until updated), the KV
  cache is zeroed (as a new cache is).

Invariants:
- Nothing reads or writes a released region: the engine core halts scheduling and drains the steps in flight
  before `sleep`, and resumes only once every tag is awake; weight updates refuse to run while the weights
  sleep (`check_awake`).
- Sleeping or waking a tag twice is a no-op; a deeper sleep (2 after 1) keeps only the buffers of the host copy.
- Sleep and wake allocate no host memory: the host backup is the only host copy, and its address never changes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from vllm.v1.engine.sleep_mode import SLEEP_TAGS

logger = logging.getLogger(__name__)

_ALIGN = 256
# NOTE: while moving weights into their region, torch's cache is emptied after each such amount, so the move
# needs about this much more than the weights, not twice their size.
_EMPTY_CACHE_EVERY = 1 << 30


class Region(Protocol):
    nbytes: int
    flat: torch.Tensor  # [nbytes] uint8; its address never changes

    @property
    def resident(self) -> bool: ...

    def release(self) -> None: ...

    def restore(self) -> None: ...


class HostRegion:
    """A region of any device but CUDA (no graphs there): a tensor whose storage is freed and re-allocated in
    place; views of it follow the storage."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.flat = torch.empty(nbytes, dtype=torch.uint8, device=device)

    @property
    def resident(self) -> bool:
        return self.flat.untyped_storage().nbytes() > 0 or self.nbytes == 0

    def release(self) -> None:
        self.flat.untyped_storage().resize_(0)

    def restore(self) -> None:
        if not self.resident:
            self.flat.untyped_storage().resize_(self.nbytes)


def make_region(nbytes: int, device: torch.device) -> Region:
    if device.type == "cuda":
        from vllm.device_allocator.cumem import CudaRegion
        return CudaRegion(nbytes, device)
    return HostRegion(nbytes, device)


def make_host_backup(nbytes: int, device: torch.device) -> torch.Tensor:
    """[nbytes] uint8 on the host for the weights of a region on `device`: page-locked on CUDA (asynchronous
    copies at full speed), plain host memory elsewhere."""
    if device.type == "cuda":
        from vllm.device_allocator.cumem import pinned_host_buffer
        return pinned_host_buffer(nbytes, device)
    return torch.empty(nbytes, dtype=torch.uint8)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _view(flat: torch.Tensor, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    nbytes = shape.numel() * dtype.itemsize
    return flat[offset:offset + nbytes].view(dtype).view(shape)


class Sleeper:
    """The weights' and the KV cache's regions of one worker, and which of them sleep (module docstring)."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device = device
        self.asleep: set[str] = set()
        self.kv_cache: Region | None = None
        self.weights, self._buffer_spans = self._pack_model(model)
        t0 = time.perf_counter()
        # [weight_bytes] uint8: the weights' host copy while they sleep (module docstring).
        self.host_backup = make_host_backup(self.weights.nbytes, device)
        # What host_backup holds now: "weights" (all of the region, level 1), "buffers" (the model buffers'
        # spans only, level 2), or None (nothing: the weights are awake).
        self.host_holds: str | None = None
        logger.info("Sleep mode: %.2f GiB of host memory for the weights' backup%s in %.3f s",
                    self.weights.nbytes / (1 << 30), " (pinned)" if device.type == "cuda" else "",
                    time.perf_counter() - t0)

    # ---- building the regions

    def _pack_model(self, model: nn.Module) -> tuple[Region, list[tuple[int, int]]]:
        """Move every parameter and buffer of `model` into one region; returns it and the buffers' (offset,
        nbytes) spans. A tensor shared by several modules (tied weights) is moved once."""
        entries: list[tuple[nn.Module, str, torch.Tensor, bool]] = []
        for module in model.modules():
            entries += [(module, n, p, True) for n, p in module._parameters.items() if p is not None]
            entries += [(module, n, b, False) for n, b in module._buffers.items() if b is not None]
        offsets: dict[int, int] = {}
        total = 0
        for _, _, tensor, _ in entries:
            if id(tensor) not in offsets:
                offsets[id(tensor)] = total
                total += _aligned(tensor.numel() * tensor.element_size())
        region = make_region(total, self.device)
        moved: dict[int, torch.Tensor] = {}
        buffer_spans: list[tuple[int, int]] = []
        since_empty = 0
        for module, name, tensor, is_param in entries:
            key = id(tensor)
            view = moved.get(key)
            if view is None:
                view = _view(region.flat, offsets[key], tensor.shape, tensor.dtype)
                view.copy_(tensor)
                moved[key] = view
                if not is_param:
                    buffer_spans.append((offsets[key], tensor.numel() * tensor.element_size()))
                since_empty += tensor.numel() * tensor.element_size()
            if is_param:
                tensor.data = view  # NOTE: the same Parameter object: whoever holds it (tied weights too) follows
            else:
                module._buffers[name] = view
            if since_empty >= _EMPTY_CACHE_EVERY and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
                since_empty = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        logger.info("Sleep mode: %.2f GiB of weights in their own region", total / (1 << 30))
        return region, buffer_spans

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, num_layers: int) -> list[torch.Tensor]:
        """The KV cache, one zeroed tensor of `shape` per layer, in the kv_cache region (made once; a second call
        replaces it)."""
        per_layer = _aligned(torch.Size(shape).numel() * dtype.itemsize)
        if self.kv_cache is not None:
            self.kv_cache.release()
        self.kv_cache = make_region(per_layer * num_layers, self.device)
        self.kv_cache.flat.zero_()
        return [_view(self.kv_cache.flat, i * per_layer, torch.Size(shape), dtype) for i in range(num_layers)]

    # ---- sleep and wake

    @property
    def weight_bytes(self) -> int:
        return self.weights.nbytes

    def _regions(self) -> dict[str, Region]:
        regions: dict[str, Region] = {"weights": self.weights}
        if self.kv_cache is not None:
            regions["kv_cache"] = self.kv_cache
        return regions

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def sleep(self, level: int) -> int:
        """Release both regions (the weights kept on the host at level 1); returns the bytes released now."""
        if level not in (1, 2):
            raise ValueError(f"Sleep level must be 1 or 2 here, got {level!r}.")
        t0 = time.perf_counter()
        self._sync()
        released = 0
        flat, host = self.weights.flat, self.host_backup
        non_blocking = self.device.type == "cuda"
        if "weights" not in self.asleep:
            if level == 1:
                host.copy_(flat, non_blocking=non_blocking)
                self.host_holds = "weights"
            else:
                for o, n in self._buffer_spans:
                    host[o:o + n].copy_(flat[o:o + n], non_blocking=non_blocking)
                self.host_holds = "buffers"
        elif level == 2:  # deeper: the buffers are already at their offsets in the host copy
            self.host_holds = "buffers"
        self._sync()
        for tag, region in self._regions().items():
            if tag not in self.asleep:
                region.release()
                released += region.nbytes
                self.asleep.add(tag)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        logger.info("Sleep level %d: released %.2f GiB in %.3f s", level, released / (1 << 30),
                    time.perf_counter() - t0)
        return released

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Memory back for `tags` (None: all); the weights' contents from their host copy (module docstring)."""
        t0 = time.perf_counter()
        wanted = SLEEP_TAGS if tags is None else tuple(tags)
        regions = self._regions()
        woken = [tag for tag in wanted if tag in self.asleep and tag in regions]
        for tag in woken:
            region = regions[tag]
            region.restore()
            if tag == "weights":
                flat, host = region.flat, self.host_backup
                non_blocking = self.device.type == "cuda"
                if self.host_holds == "weights":
                    flat.copy_(host, non_blocking=non_blocking)
                elif self.host_holds == "buffers":
                    for o, n in self._buffer_spans:
                        flat[o:o + n].copy_(host[o:o + n], non_blocking=non_blocking)
            else:
                region.flat.zero_()
            self._sync()
            if tag == "weights":
                self.host_holds = None
            self.asleep.discard(tag)
        if woken:
            logger.info("Woke %s in %.3f s", ", ".join(woken), time.perf_counter() - t0)

    def check_awake(self, tag: str, what: str) -> None:
        if tag in self.asleep:
            raise ValueError(f"Cannot {what}: the engine's {tag} are asleep (sleep mode); call "
                             f"wake_up(tags=[{tag!r}]) first.")
