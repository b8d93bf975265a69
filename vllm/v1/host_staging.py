"""Host memory for a step's device-to-host copies: the side copy stream, fresh pinned copies, and reusable pinned
staging slots (HostStagingSlot) that either copy their contents out or lend them as numpy views.

Used by the async output copier (vllm/v1/worker/async_output.py) for every output of a step, and by the sampling
masks' copies (vllm/v1/sample/sampling_mask.py).
"""

from __future__ import annotations

import sys

import numpy as np
import torch

_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of `device` that a sampling mask's device-to-host copies run on when not given one (one
    per device; the engine's async output copier gives its own stream, see SamplingMaskTensors.to_cpu_nonblocking)."""
    if device not in _copy_streams:
        _copy_streams[device] = torch.cuda.Stream(device=device)
    return _copy_streams[device]


def pinned_copy(src: torch.Tensor) -> torch.Tensor:
    """A non-blocking copy of `src` into fresh pinned host memory (CUDA's caching host allocator)."""
    dst = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=True)
    dst.copy_(src, non_blocking=True)
    return dst


class HostStagingSlot:
    """Host buffers (pinned unless `pin=False`), one per name, reused from step to step and grown when a step
    needs more; the async output copier's staging for everything a step copies to the host.

    NOTE: a fresh pinned tensor per step and per buffer (several MB at 1024 rows) goes through CUDA's caching
    host allocator on the engine's main thread, and pins new memory whenever no cached block is free yet.

    Two ways to use a slot (`lends`):
    - copy-out (the default): the owner (AsyncOutputCopier) keeps one such slot per step in flight and reuses it
      only after the step that used it has been turned into lists, which copy out of it;
    - lending: the lists are numpy views of the slot (`array`), handed out with the step's outputs, so nothing
      is copied on the host; the slot is reused only once no such view is left (`in_use`: every view derives
      from the slot's own array of its buffer, whose reference count tells). A consumer that keeps its outputs
      (the offline LLM keeps a request's masks until it finishes) keeps the slot; the owner then takes another.
    """

    def __init__(self, pin: bool = True, lends: bool = False) -> None:
        self.pin = pin
        self.lends = lends
        self._buffers: dict[str, torch.Tensor] = {}
        # One numpy array over each buffer; lent views derive from it (their numpy base).
        self._arrays: dict[str, np.ndarray] = {}
        # The typed view of each buffer's start from its last copy, by name: (dtype, shape, view). Three torch view
        # calls (~3 us) per copy otherwise, several copies per step; steady decode copies the same shapes step
        # after step. NOTE: one per name, not one per shape seen: the row count changes as requests come and go,
        # and a view per (name, dtype, shape) would pile up over a server's life (~1 KB each).
        self._views: dict[str, tuple[torch.dtype, torch.Size, torch.Tensor]] = {}
        # A step's copies into this slot are in flight or not yet turned into lists (set and cleared by the owner).
        self.pending = False

    def copy(self, src: torch.Tensor, name: str) -> torch.Tensor:
        """Non-blocking copy of `src` into this slot's buffer `name`; returns the host view (src's dtype, shape)."""
        last = self._views.get(name)
        if last is not None and last[0] == src.dtype and last[1] == src.shape:
            dst = last[2]
        else:
            nbytes = src.numel() * src.element_size()
            buf = self._buffers.get(name)
            if buf is None or buf.numel() < nbytes:
                buf = torch.empty(max(nbytes, 1 << 16) * 5 // 4, dtype=torch.uint8, pin_memory=self.pin)
                self._buffers[name] = buf
                self._arrays[name] = buf.numpy()
            dst = buf[:nbytes].view(src.dtype).view(src.shape)
            self._views[name] = (src.dtype, src.shape, dst)
        dst.copy_(src, non_blocking=True)
        return dst

    def array(self, name: str, host: torch.Tensor) -> np.ndarray:
        """`host` (what `copy(..., name)` returned) as a numpy view that counts as a use of this slot (`in_use`);
        a plain `host.numpy()` would not."""
        nbytes = host.numel() * host.element_size()
        return self._arrays[name][:nbytes].view(_NUMPY_DTYPES[host.dtype]).reshape(host.shape)

    def in_use(self) -> bool:
        """Whether a step's copies are pending here or a view from `array` (or any array derived from one) is
        still alive."""
        if self.pending:
            return True
        for name in self._arrays:
            # NOTE: the dict's reference and getrefcount's argument are the two that are always there.
            if sys.getrefcount(self._arrays[name]) > 2:
                return True
        return False


_NUMPY_DTYPES = {torch.int32: np.int32, torch.int64: np.int64, torch.uint8: np.uint8, torch.float32: np.float32}
