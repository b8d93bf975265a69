"""The pre-change sampling-mask path (benchmarks only: Sampler(legacy_sampling_mask=True)): isfinite() of the
processed logits packed into a [num_reqs, ceil(V/8)] bitmask on the device, the whole bitmask copied to the host
every step and unpacked there with np.unpackbits + np.nonzero, as upstream did before the support was compacted
on the device. `legacy_pack_sampling_mask` (and `pack_bool_mask`) also give the compaction's torch fallback its
bitmask (sampling_mask.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from vllm.v1.cuda_events import host_event
from vllm.v1.host_staging import HostStagingSlot, copy_stream, pinned_copy
from vllm.v1.outputs import SamplingMaskLists


def legacy_pack_sampling_mask(logits: torch.Tensor, num_sampled: torch.Tensor | None) -> torch.Tensor:
    """Pre-change device half: isfinite(logits) packed to [num_reqs, ceil(V/8)] uint8 (little bit order)."""
    keep = torch.isfinite(logits)  # [num_reqs, V] bool
    if num_sampled is not None:
        keep &= (num_sampled.to(logits.device) > 0)[:, None]
    return pack_bool_mask(keep)


def pack_bool_mask(keep: torch.Tensor) -> torch.Tensor:
    """[num_reqs, V] bool -> [num_reqs, ceil(V/8)] uint8, bit j of byte b is token 8b+j (little bit order)."""
    num_reqs, vocab_size = keep.shape
    pad = (-vocab_size) % 8
    if pad:
        keep = torch.nn.functional.pad(keep, (0, pad))
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=keep.device)
    return (keep.reshape(num_reqs, -1, 8).to(torch.uint8) * weights).sum(-1, dtype=torch.uint8)


def legacy_unpack_sampling_mask(packed_mask: np.ndarray, vocab_size: int) -> SamplingMaskLists:
    """Pre-change host half: np.unpackbits + np.nonzero over the whole [num_reqs, V] bitmask."""
    bits = np.unpackbits(packed_mask, axis=1, count=vocab_size, bitorder="little")  # [num_reqs, V] uint8
    rows, cols = np.nonzero(bits)
    offsets = np.zeros(packed_mask.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=packed_mask.shape[0]), out=offsets[1:])
    return SamplingMaskLists(cols.astype(np.int32), offsets, None)


def legacy_sampling_mask_lists(logits: torch.Tensor, num_sampled: torch.Tensor | None) -> SamplingMaskLists:
    """The whole pre-change path, synchronously: pack on the device, copy the full bitmask, unpack on host."""
    return LegacySamplingMask.from_logits(logits, num_sampled).tolists()


class LegacySamplingMask(NamedTuple):
    """The pre-change path as the sampler's mask output (benchmarks only): the full bitmask stays on the
    device until `to_cpu_nonblocking().tolists()` copies all of it and unpacks it on the host."""

    # [num_reqs, ceil(V/8)] uint8
    packed_mask: torch.Tensor
    vocab_size: int

    @classmethod
    def from_logits(cls, logits: torch.Tensor, num_sampled: torch.Tensor | None) -> LegacySamplingMask:
        return cls(legacy_pack_sampling_mask(logits, num_sampled), logits.shape[1])

    def to_cpu_nonblocking(self, with_text: bool = False, staging: HostStagingSlot | None = None,
                           with_ids: bool = True, stream: Any = None) -> LegacySamplingMaskCopy:
        """Copy the whole bitmask to pinned memory on the side stream (as upstream's pre-change path did).
        `with_text`, `staging`, `with_ids` and `stream` are ignored: the pre-change path never formats the masks'
        JSON text, always unpacks the ids, allocates its copy per step and copies on its own stream (made to wait
        for the current one)."""
        if not self.packed_mask.is_cuda:
            return LegacySamplingMaskCopy(self.packed_mask, None, self.vocab_size)
        device = self.packed_mask.device
        stream = copy_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            host = pinned_copy(self.packed_mask)
            event = host_event()
            event.record(stream)
        self.packed_mask.record_stream(stream)
        return LegacySamplingMaskCopy(host, event, self.vocab_size)

    def tolists(self) -> SamplingMaskLists:
        return self.to_cpu_nonblocking().tolists()


@dataclass(slots=True)
class LegacySamplingMaskCopy:
    # [num_reqs, ceil(V/8)] uint8, on the host once `ready` fires.
    packed_mask: torch.Tensor
    ready: torch.cuda.Event | None
    vocab_size: int

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()

    def tolists(self) -> SamplingMaskLists:
        self.wait()
        return legacy_unpack_sampling_mask(self.packed_mask.numpy(), self.vocab_size)

    def text_lists(self, lists: SamplingMaskLists) -> None:
        return None
