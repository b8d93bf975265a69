"""Async output: a step's sampler outputs go to the host behind the device, and become lists in a thread.

`AsyncOutputCopier.submit` runs right after the sampler is launched: on CUDA it queues the device-to-host
copies (sampled ids, logprobs, then the sampling mask's) on a side stream that first waits for the compute
stream, records an event after them, and hands the list building to a one-thread executor. The caller gets an
AsyncModelRunnerOutput at once; `get_output()` blocks until the lists are ready.

Invariants:
- Host buffers are pinned and reused (HostStagingSlot, grown on demand), in two slots used alternately: a slot
  is reused two steps later, after the engine has called `get_output()` of the step that used it (the batch
  queue is two deep), and the lists built from such a slot are copies, never views of it.
- The sampling masks (their JSON text and counts for an API server's engine, else their ids; MBs per step at
  1024 rows) go to a lending slot instead when one is free: their lists are views of it, handed out with the
  outputs, and the slot is taken again only once no view is left (HostStagingSlot.in_use). In serving the views
  live until the engine core's ZMQ frames are sent, so a few slots go round; a consumer that keeps its outputs
  keeps its slots, and when all _MAX_LENDING_SLOTS are kept the masks go to the step's alternating slot and are
  copied out as above.
- With `defer_mask_lists` (set by the engine core; off for a runner used alone) a lending slot's masks
  (on CPU: any step's) are not turned into lists by the output thread: the output carries them as
  DeferredMasks, built by the engine core when it sends the step (in process: when the caller takes the
  outputs), after launching the next ones; the slot stays pending until then. The output thread still waits for their
  copies, and builds at once a step whose rows overflow K (their bitmask rows are read from the device).
- The device tensors stay referenced until `get_output()` returned, so the allocator cannot reuse their memory
  before the side-stream copies read it.
- On CPU there are no streams: the lists are built from the tensors themselves, in the thread when asked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from vllm.v1.cuda_events import host_event
from vllm.v1.host_staging import HostStagingSlot
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput, SamplingMaskLists, StepRowSettings
from vllm.v1.sample.sampling_mask import SamplingMaskCopy

# Lending staging slots for the sampling masks (module docstring); ~8 MB of pinned memory each at 1024 rows.
_MAX_LENDING_SLOTS = 6


class AsyncModelRunnerOutput:
    """A ModelRunnerOutput that may still be on its way to the host."""

    def __init__(self, future: Future[tuple[ModelRunnerOutput, np.ndarray]] | None,
                 output: ModelRunnerOutput | None = None, on_ready: Callable[[np.ndarray], None] | None = None,
                 keep_alive: Any = None) -> None:
        self._future = future
        self._output = output
        self._on_ready = on_ready
        self._keep_alive = keep_alive

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> AsyncModelRunnerOutput:
        return cls(None, output)

    def get_output(self) -> ModelRunnerOutput:
        if self._output is None:
            assert self._future is not None
            self._output, sampled = self._future.result()
            self._future = None
            self._keep_alive = None
            if self._on_ready is not None:
                self._on_ready(sampled)
                self._on_ready = None
        return self._output


class AsyncOutputCopier:
    def __init__(self, device: torch.device, use_thread: bool, mask_text: bool = False,
                 mask_ids: bool = True) -> None:
        self.device = device
        # Also turn the sampling masks into JSON text (on the copy stream), for the API server.
        self.mask_text = mask_text
        # Copy the masks' ids to the host; False (with mask_text only): the text and the counts alone, the lists
        # then carry each row's size and no ids (SamplingMaskLists.token_ids None), all an API server's engine
        # core needs (the default there: mask_ids_needed in vllm/v1/sample/sampling_mask.py).
        if not (mask_ids or mask_text):
            raise ValueError("mask_ids=False needs mask_text=True.")
        self.mask_ids = mask_ids
        on_cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device=device) if on_cuda else None
        # Two pinned staging slots (sampled ids, logprobs; sampling masks when no lending slot is free) and their
        # copies' events, alternating; and the lending slots of the masks (module docstring).
        self._slots = [HostStagingSlot() for _ in range(2)] if on_cuda else []
        self._events = [host_event() for _ in range(2)] if on_cuda else []
        self._lending: list[HostStagingSlot] = []
        self._next_slot = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-output") if use_thread else None
        # Set by the engine core (vllm/v1/engine/core.py): a step's mask lists are built on the engine's main
        # thread when its outputs are sent (DeferredMasks), not by the output thread before the step's update; only
        # for masks in a lending slot (or on CPU), whose memory no later step takes while they are pending.
        self.defer_mask_lists = False

    def submit(self, req_ids: list[str], samples: np.ndarray, sampled: torch.Tensor, logprobs: Any,
               sampling_mask: Any, on_ready: Callable[[np.ndarray], None],
               row_settings: StepRowSettings | None = None) -> AsyncModelRunnerOutput:
        """Start moving one step's outputs to the host. `sampled` is [num_reqs] int64 on the device, `logprobs`
        a LogprobsTensors or None, `sampling_mask` the sampler's mask (with `to_cpu_nonblocking`) or None.
        `on_ready(sampled_np)` runs in the caller's thread when `get_output()` first returns; `row_settings`
        becomes the output's (ModelRunnerOutput.row_settings)."""
        event = None
        host_sampled, host_logprobs = sampled, logprobs
        slot = None
        mask_copy = lent = None
        if self.copy_stream is not None:
            slot, event = self._slots[self._next_slot], self._events[self._next_slot]
            self._next_slot ^= 1
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                host_sampled = slot.copy(sampled, "sampled")
                if logprobs is not None:
                    host_logprobs = type(logprobs)(*(slot.copy(t, name) for t, name in
                                                     zip(logprobs, ("lp_token_ids", "lp_values", "lp_ranks"))))
                if sampling_mask is not None:
                    # NOTE: on this stream, which waits for the compute stream already: no second wait or switch.
                    mask_copy, lent = self._copy_mask(sampling_mask, slot, self.copy_stream)
                event.record(self.copy_stream)
        elif sampling_mask is not None:
            mask_copy, lent = self._copy_mask(sampling_mask, None, None)
        deferred = None
        if isinstance(mask_copy, SamplingMaskCopy) and self.defer_mask_lists and (lent is not None or slot is None):
            # NOTE: the output thread still waits for the mask's copies (a later step's sampler graph rewrites the
            # device buffers they read once the engine has this output), but leaves the lists and the slot.
            deferred, lent = DeferredMasks(mask_copy, lent), None
        # What the lists are built from.
        args = (req_ids, samples, host_sampled, host_logprobs, mask_copy, lent, row_settings, deferred)
        keep_alive = (sampled, logprobs, sampling_mask)
        if self._executor is None:
            output, sampled_np = _build_output(event, *args)
            on_ready(sampled_np)
            return AsyncModelRunnerOutput.ready(output)
        future = self._executor.submit(_build_output, event, *args)
        return AsyncModelRunnerOutput(future, None, on_ready, keep_alive)

    def _copy_mask(self, sampling_mask: Any, slot: HostStagingSlot | None, stream: torch.cuda.Stream | None
                   ) -> tuple[Any, HostStagingSlot | None]:
        """Start the sampling mask's host copy (on `stream`, the current copy stream, on CUDA) into a free lending
        slot, else into the step's `slot`; returns the copy and the lending slot it took (pending until the step's
        mask lists are built: by the output thread, or deferred, by the engine core; see the module docstring)."""
        lent = self._lending_slot() if slot is not None else None
        if lent is not None:
            lent.pending = True  # until this step's mask lists are built (or given up)
        try:
            mask_copy = sampling_mask.to_cpu_nonblocking(with_text=self.mask_text, staging=lent or slot,
                                                         with_ids=self.mask_ids, stream=stream)
        except BaseException:
            if lent is not None:
                lent.pending = False  # any copy it queued runs before the next step's on the copy stream
            raise
        return mask_copy, lent

    def _lending_slot(self) -> HostStagingSlot | None:
        """A lending slot that no step uses and no output views (a new one while there are fewer than
        _MAX_LENDING_SLOTS), or None."""
        for slot in self._lending:
            if not slot.in_use():
                return slot
        if len(self._lending) < _MAX_LENDING_SLOTS:
            self._lending.append(HostStagingSlot(pin=self.copy_stream is not None, lends=True))
            return self._lending[-1]
        return None

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


class DeferredMasks:
    """A step's sampling masks left in their host staging memory (AsyncOutputCopier.defer_mask_lists): `build()`
    turns them into lists (SamplingMaskLists, SamplingMaskText or None) on the caller's thread, `release()`
    gives up on them; either one, once, frees the lending slot for reuse by later steps (until then it is
    pending, so no step copies into it)."""

    def __init__(self, copy: Any, lent: HostStagingSlot | None) -> None:
        self.copy, self.lent = copy, lent
        # Built or released: the slot is no longer pending.
        self.done = False
        # The lists when the output thread had to build them anyway (`build_now_if_overflow`).
        self._built: tuple[SamplingMaskLists, Any] | None = None

    def build_now_if_overflow(self) -> None:
        """The output thread's part, once the copies are done: a step with rows past K gathers those rows from the
        device bitmask, which a later step's sampler graph rewrites once the engine has this output, so its lists
        are built now rather than deferred."""
        counts = self.copy.tensors.counts.numpy()
        if bool((counts > self.copy.tensors.token_ids.shape[1]).any()):
            lists = self.copy.tolists()
            self._built = lists, self.copy.text_lists(lists)

    def build(self) -> tuple[SamplingMaskLists, Any]:
        assert not self.done, "deferred masks are built once"
        try:
            if self._built is not None:
                return self._built
            lists = self.copy.tolists()
            return lists, self.copy.text_lists(lists)
        finally:
            self.release()

    def release(self) -> None:
        if self.done:
            return
        self.done = True
        if self.lent is not None:
            try:
                # NOTE: the copies first: the slot must not be taken while they still write into it.
                self.copy.wait()
            finally:
                self.lent.pending = False

    def __del__(self) -> None:
        # NOTE: a safety net for outputs dropped unresolved (e.g. a caller of EngineCore.step() that never calls
        # resolve_step_rows): their slot would otherwise stay pending for good.
        try:
            self.release()
        except Exception:  # noqa: BLE001 (nothing to report to from a finalizer)
            pass


def _build_output(event: torch.cuda.Event | None, req_ids: list[str], samples: np.ndarray, sampled: torch.Tensor,
                  logprobs: Any, mask_copy: Any, lent: HostStagingSlot | None,
                  row_settings: StepRowSettings | None = None,
                  deferred: DeferredMasks | None = None) -> tuple[ModelRunnerOutput, np.ndarray]:
    """The output thread's job (or the caller's without one): wait for the copies, then build the lists (the
    masks' only when they are not `deferred`)."""
    try:
        return _build_lists(event, req_ids, samples, sampled, logprobs, mask_copy, deferred, row_settings)
    except BaseException:
        if deferred is not None:
            with contextlib.suppress(Exception):  # the original error is the one to report
                deferred.release()  # nobody gets this output, so nobody would
        raise
    finally:
        if lent is not None:
            lent.pending = False  # from now on the views of its masks (if any) keep it in use


def _build_lists(event: torch.cuda.Event | None, req_ids: list[str], samples: np.ndarray, sampled: torch.Tensor,
                 logprobs: Any, mask_copy: Any, deferred: DeferredMasks | None,
                 row_settings: StepRowSettings | None) -> tuple[ModelRunnerOutput, np.ndarray]:
    if event is not None:
        event.synchronize()
    if mask_copy is not None:
        mask_copy.wait()
    sampled_np = sampled.numpy()
    sampled_token_ids = [[t] if s else [] for t, s in zip(sampled_np.tolist(), samples.tolist())]
    logprobs_lists: LogprobsLists | None = None
    if logprobs is not None:
        # NOTE: copied out of the pinned slot, which the step after next overwrites.
        lists = logprobs.tolists()
        logprobs_lists = LogprobsLists(*(np.array(a) for a in lists[:3]), lists.cu_num_generated_tokens)
    masks: SamplingMaskLists | None = None
    text = None
    if deferred is not None:
        deferred.build_now_if_overflow()
    elif mask_copy is not None:
        masks = mask_copy.tolists()
        text = mask_copy.text_lists(masks)
    output = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                               sampled_token_ids=sampled_token_ids, logprobs=logprobs_lists, sampling_masks=masks,
                               sampling_mask_text=text, pending_masks=deferred, row_settings=row_settings)
    return output, sampled_np
