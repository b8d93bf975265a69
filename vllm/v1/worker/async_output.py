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
- With `defer_mask_lists` (VLLM_ENGINE_DEFER_MASK_LISTS, on in the engine by default) a lending slot's masks
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
import time
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
        # core needs (VLLM_SAMPLING_MASK_COPY_IDS=0).
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
        # The engine core's StepTimer (vllm/v1/metrics/step_timing.py), when it has one.
        self.timer: Any = None
        # VLLM_ENGINE_DEFER_MASK_LISTS: a step's mask lists are built on the engine's main thread when its outputs
        # are sent (DeferredMasks), not by the output thread before the step's update; only for masks in a lending
        # slot (or on CPU), whose memory no later step takes while they are pending.
        self.defer_mask_lists = False
        # VLLM_ENGINE_STEP_TIMING on CUDA: each step's device time and the compute stream's idle time before it,
        # from timing events around the step's device work (`step_started` to `submit`), into the timer.
        self.device_timing = False
        self._step_start: torch.cuda.Event | None = None
        self._prev_end: torch.cuda.Event | None = None

    def step_started(self) -> None:
        """Mark the start of a step's device work on the current stream (with `device_timing` on CUDA); the
        runner calls it once the step's inputs are prepared, right before its forward, and `submit` after its
        last device operation."""
        if self.device_timing and self.copy_stream is not None:
            self._step_start = torch.cuda.Event(enable_timing=True)
            self._step_start.record()

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
        device_events = None
        mask_copy = lent = None
        if self.copy_stream is not None:
            slot, event = self._slots[self._next_slot], self._events[self._next_slot]
            self._next_slot ^= 1
            compute = torch.cuda.current_stream(self.device)
            if self._step_start is not None:
                # NOTE: recorded before the copy stream waits for the compute stream, so `event` implies it.
                end = torch.cuda.Event(enable_timing=True)
                end.record(compute)
                device_events = (self._prev_end, self._step_start, end)
                self._prev_end, self._step_start = end, None
            self.copy_stream.wait_stream(compute)
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
        # NOTE: not the pre-change path's copies (LegacySamplingMaskCopy): a benchmark arm, left as it was.
        if isinstance(mask_copy, SamplingMaskCopy) and self.defer_mask_lists and (lent is not None or slot is None):
            # NOTE: the output thread still waits for the mask's copies (a later step's sampler graph rewrites the
            # device buffers they read once the engine has this output), but leaves the lists and the slot.
            deferred, lent = DeferredMasks(mask_copy, lent, self.timer), None
        # What the lists are built from.
        args = (req_ids, samples, host_sampled, host_logprobs, mask_copy, lent, row_settings, device_events, deferred)
        keep_alive = (sampled, logprobs, sampling_mask)
        if self._executor is None:
            output, sampled_np = _build_output(event, *args, self.timer)
            on_ready(sampled_np)
            return AsyncModelRunnerOutput.ready(output)
        future = self._executor.submit(_build_output, event, *args, self.timer)
        return AsyncModelRunnerOutput(future, None, on_ready, keep_alive)

    def _copy_mask(self, sampling_mask: Any, slot: HostStagingSlot | None, stream: torch.cuda.Stream | None
                   ) -> tuple[Any, HostStagingSlot | None]:
        """Start the sampling mask's host copy (on `stream`, the current copy stream, on CUDA) into a free lending
        slot, else into the step's `slot`; returns the copy and the lending slot it took (pending until the step's
        mask lists are built: by the output thread, or deferred, by the engine core; see the module docstring)."""
        t0 = time.perf_counter()
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
        if self.timer is not None:
            self.timer.add("launch.mask", time.perf_counter() - t0)
            if lent is None and slot is not None:
                self.timer.count("mask.copied")
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

    def __init__(self, copy: Any, lent: HostStagingSlot | None, timer: Any) -> None:
        self.copy, self.lent, self.timer = copy, lent, timer
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
        t0 = time.perf_counter()
        try:
            if self._built is not None:
                return self._built
            lists = self.copy.tolists()
            return lists, self.copy.text_lists(lists)
        finally:
            self.release()
            if self.timer is not None:
                self.timer.add("send.masks", time.perf_counter() - t0)

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
                  row_settings: StepRowSettings | None = None, device_events: Any = None,
                  deferred: DeferredMasks | None = None, timer: Any = None) -> tuple[ModelRunnerOutput, np.ndarray]:
    """The output thread's job (or the caller's without one): wait for the copies, then build the lists (the
    masks' only when they are not `deferred`)."""
    try:
        output = _build_lists(event, req_ids, samples, sampled, logprobs, mask_copy, deferred, row_settings, timer)
        if device_events is not None and timer is not None:
            _add_device_times(timer, *device_events)
        return output
    except BaseException:
        if deferred is not None:
            with contextlib.suppress(Exception):  # the original error is the one to report
                deferred.release()  # nobody gets this output, so nobody would
        raise
    finally:
        if lent is not None:
            lent.pending = False  # from now on the views of its masks (if any) keep it in use


# NOTE: a longer idle compute stream before a step is the engine waiting for requests, not a step's cost.
_MAX_DEVICE_GAP_S = 1.0


def _add_device_times(timer: Any, prev_end: torch.cuda.Event | None, start: torch.cuda.Event,
                      end: torch.cuda.Event) -> None:
    """`dev.step`: the step's device work from its forward to its sampler's last operation (compute stream);
    `dev.gap`: the compute stream idle between the previous step's last operation and this step's forward, i.e.
    the device waiting for the host (and the step's input copies). Called once the step's copies are done (so
    `end` has completed)."""
    timer.add("dev.step", start.elapsed_time(end) / 1e3)
    if prev_end is not None:
        gap = prev_end.elapsed_time(start) / 1e3
        if gap < _MAX_DEVICE_GAP_S:
            timer.add("dev.gap", max(gap, 0.0))


def _build_lists(event: torch.cuda.Event | None, req_ids: list[str], samples: np.ndarray, sampled: torch.Tensor,
                 logprobs: Any, mask_copy: Any, deferred: DeferredMasks | None,
                 row_settings: StepRowSettings | None, timer: Any) -> tuple[ModelRunnerOutput, np.ndarray]:
    t0 = time.perf_counter()
    if event is not None:
        event.synchronize()
    if mask_copy is not None:
        mask_copy.wait()
    t1 = time.perf_counter()
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
    if timer is not None:
        timer.add("out.event", t1 - t0)
        timer.add("out.lists", time.perf_counter() - t1)
    return output, sampled_np
