"""Packed broadcast: many small tensors travel as a few large uint8 buffers, several in flight.

Layout (`plan_batches`), a pure function of the tensors' byte sizes and `buffer_size_bytes`, so the trainer
(which sees tensors) and the workers (which see names, dtypes and shapes) derive the same one:
- Tensors are taken in order. Each starts at an offset rounded up to `ALIGN` bytes in the open batch; it
  joins the batch if it ends within `buffer_size_bytes`, else the batch is closed and it opens the next.
- A tensor larger than `buffer_size_bytes` is a batch of its own that is not packed: it is broadcast from
  the trainer's tensor itself into a tensor of its own on the worker (no copy through a buffer, and the
  buffers never grow past `buffer_size_bytes`).
- A batch of zero bytes (only empty tensors) is not broadcast at all.
With `buffer_size_bytes=0` every non-empty tensor is its own unpacked batch: that is the unpacked mode.

Pipelining: up to `num_buffers` batches are in flight. A packed batch uses buffer `k % num_buffers` (k
counts packed batches). The trainer waits for a buffer's previous broadcast before refilling it; the worker
posts the receive of batch i + num_buffers only once the caller has taken every tensor of batch i. Each
side's `num_buffers` is its own: the collectives are the batches in order whatever the depth.

vLLM packs with torch.cat and closes a batch after the tensor that crosses the size (so a batch can exceed
it); this layout is this project's own, shared by this package's trainer and worker sides.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from vllm.distributed.weight_transfer.stateless_group import WeightTransferGroup

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024  # vLLM's default, 1 GiB
DEFAULT_PACKED_NUM_BUFFERS = 2  # vLLM's default
ALIGN = 16  # bytes: a tensor's offset in a buffer; covers every itemsize, so `.view(dtype)` is always legal


@dataclass(frozen=True, slots=True)
class Batch:
    start: int  # first tensor index
    stop: int  # one past the last tensor index
    offsets: tuple[int, ...]  # byte offset of each tensor in the buffer
    num_bytes: int  # bytes broadcast
    packed: bool  # False: one tensor larger than the buffer, broadcast in place


class _Planner:
    def __init__(self, buffer_size_bytes: int) -> None:
        self.buffer_size_bytes = buffer_size_bytes
        self.index = 0  # tensors placed so far
        self.start = 0  # first tensor of the open batch
        self.offsets: list[int] = []  # the open batch's offsets
        self.end = 0  # the open batch's bytes

    def add(self, num_bytes: int) -> list[Batch]:
        """Place the next tensor; return the batches this closes (the tensor's own, if it is unpacked)."""
        i = self.index
        self.index += 1
        if num_bytes > self.buffer_size_bytes:
            return self.finish() + [Batch(i, i + 1, (0,), num_bytes, packed=False)]
        closed: list[Batch] = []
        offset = -(-self.end // ALIGN) * ALIGN
        if offset + num_bytes > self.buffer_size_bytes:
            closed, offset = self.finish(), 0
        if not self.offsets:
            self.start = i
        self.offsets.append(offset)
        self.end = offset + num_bytes
        return closed

    def finish(self) -> list[Batch]:
        """Close the open batch, if it holds a tensor."""
        if not self.offsets:
            return []
        batch = Batch(self.start, self.start + len(self.offsets), tuple(self.offsets), self.end, packed=True)
        self.offsets, self.end = [], 0
        return [batch]


def plan_batches(num_bytes: Iterable[int], buffer_size_bytes: int) -> list[Batch]:
    planner = _Planner(buffer_size_bytes)
    batches = [b for n in num_bytes for b in planner.add(n)]
    return batches + planner.finish()


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor.reshape(-1).view(torch.uint8)  # [num_bytes] uint8


def packed_nccl_broadcast_producer(iterator: Iterator[tuple[str, torch.Tensor]], group: WeightTransferGroup,
                                   src: int, post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
                                   buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                                   num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS) -> None:
    """Trainer side: broadcast `post_iter_func(item)` of every item, laid out by `plan_batches`. Returns once
    every byte has left (the caller may then change its tensors)."""
    planner = _Planner(buffer_size_bytes)
    buffers: list[torch.Tensor | None] = [None] * num_buffers
    works: list[object] = [None] * num_buffers  # the broadcast last started from each buffer
    in_flight: deque[tuple[object, torch.Tensor | None]] = deque()  # unpacked broadcasts and their tensors
    pending: list[torch.Tensor] = []  # the open batch's tensors, as flat bytes
    num_packed = 0

    def send(batch: Batch, tensor: torch.Tensor | None) -> None:
        nonlocal num_packed, pending
        if not batch.packed:
            tensor = tensor.to(group.device)
            in_flight.append((group.broadcast_async(tensor, src), tensor))
            return
        slot = num_packed % num_buffers
        num_packed += 1
        if works[slot] is not None:
            works[slot].wait()
        if buffers[slot] is None or buffers[slot].numel() < batch.num_bytes:
            buffers[slot] = None
            buffers[slot] = torch.empty(batch.num_bytes, dtype=torch.uint8, device=group.device)
        buffer = buffers[slot]
        for offset, part in zip(batch.offsets, pending, strict=True):
            buffer[offset:offset + part.numel()].copy_(part)
        pending = []
        works[slot] = group.broadcast_async(buffer[:batch.num_bytes], src)

    for item in iterator:
        tensor = _flat_bytes(post_iter_func(item))
        closed = planner.add(tensor.numel())
        for batch in closed:
            send(batch, tensor)
        if not closed or closed[-1].packed:
            pending.append(tensor)
        while len(in_flight) > num_buffers:
            work, _ = in_flight.popleft()
            if work is not None:
                work.wait()
    for batch in planner.finish():
        send(batch, None)
    for work in [w for w, _ in in_flight] + works:
        if work is not None:
            work.wait()
    if group.device.type == "cuda":
        torch.cuda.current_stream(group.device).synchronize()


def packed_broadcast_consumer(names: list[str], dtypes: list[torch.dtype], shapes: list[tuple[int, ...]],
                              group: WeightTransferGroup, src: int = 0,
                              buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                              num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS) -> Iterator[tuple[str, torch.Tensor]]:
    """Worker side: yield `(name, tensor)` in order; a packed tensor is a view of a reused buffer, valid until
    the caller asks for the next one. Closed early (the caller stopped), it still receives the rest, so the
    group stays in step with the trainer; a failed broadcast ends it without that."""
    sizes = [math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes)]
    batches = plan_batches(sizes, buffer_size_bytes)
    capacity = max((b.num_bytes for b in batches if b.packed), default=0)
    buffers: list[torch.Tensor | None] = [None] * num_buffers

    def receive() -> Iterator[tuple[Batch, torch.Tensor]]:
        in_flight: deque[tuple[Batch, torch.Tensor, object]] = deque()
        todo = iter(batches)
        num_packed = 0

        def post() -> None:
            nonlocal num_packed
            batch = next(todo, None)
            if batch is None:
                return
            if batch.packed:
                slot = num_packed % num_buffers
                num_packed += 1
                if buffers[slot] is None:
                    buffers[slot] = torch.empty(capacity, dtype=torch.uint8, device=group.device)
                buffer = buffers[slot][:batch.num_bytes]
            else:
                buffer = torch.empty(batch.num_bytes, dtype=torch.uint8, device=group.device)
            in_flight.append((batch, buffer, group.broadcast_async(buffer, src)))

        for _ in range(num_buffers):
            post()
        while in_flight:
            batch, buffer, work = in_flight.popleft()
            if work is not None:
                work.wait()
            yield batch, buffer
            post()

    batch_stream = receive()
    finished = False
    try:
        for batch, buffer in batch_stream:
            for i, offset in zip(range(batch.start, batch.stop), batch.offsets):
                tensor = buffer[offset:offset + sizes[i]].view(dtypes[i]).view(shapes[i])
                yield names[i], tensor
        finished = True
    finally:
        if not finished:
            for _ in batch_stream:  # NOTE: drain, so the trainer's broadcasts complete and the group stays usable
                pass
