"""Scheduler: decides which requests compute how many tokens each step, and turns sampled tokens into outputs.

There are no prefill/decode phases. Each step, every running request (in arrival order) is given
`num_tokens - num_computed_tokens` tokens, capped by the remaining token budget, so chunked prefill and decode
are the same thing. When the KV cache cannot hold a running request's new tokens, the last running request is
preempted (its blocks freed, recomputed from scratch later) until it fits. Waiting requests are admitted only
in steps without a preemption, first come first served; with prefix caching a request is admitted with its
cached leading blocks and its `num_computed_tokens` after them (kv_cache_manager.py), also when it resumes.

Invariants:
- `running` holds RUNNING requests, `waiting` holds WAITING or PREEMPTED ones, `held` WAITING ones added while
  paused (`hold_new`); a finished request is in none of them and no longer in `requests`.
- While `halted`, `schedule()` schedules no token (it still hands the runner the finished ids).
- Per step: `len(running) <= max_num_seqs`, `total_num_scheduled_tokens <= max_num_batched_tokens`, and for
  every request `num_computed_tokens + num_scheduled <= max_model_len`.
- The runner is told (through `finished_req_ids`) about every request it holds that finished, was aborted or
  was preempted, in the next SchedulerOutput; it is never told about a request it never saw.
- `num_computed_tokens` is advanced in `schedule()`; the runner receives the value from before the step.

Output placeholders (async scheduling) are handled here too, under the class flag `tracks_output_placeholders`
(AsyncScheduler sets it; its module docstring states their invariants): with it, schedule() counts a request's
placeholders as tokens and adds one for each step in which the request samples, and update_from_output() takes
them back as the sampled tokens arrive. Without it every request's `num_output_placeholders` stays 0.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_manager import KVCacheManager, cdiv
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.core.sched.utils import append_sampled
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from vllm.v1.outputs import (ModelRunnerOutput, PendingStepMasks, StepLogprobs, StepMasks, StepRowSettings,
                              step_mask_stats)
from vllm.v1.request import Request, RequestStatus

# NOTE: module constants because an enum member looked up on its class costs ~60 ns, in loops over requests.
_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
# Statuses above this one are finished (RequestStatus.is_finished, inlined in update_from_output's loop).
_LAST_UNFINISHED = RequestStatus.PREEMPTED


class Scheduler:
    # NOTE: a class-level flag rather than per-request hooks that AsyncScheduler overrides: the placeholder
    # accounting is inlined in the per-request loops, so it costs no method call per request.
    tracks_output_placeholders = False

    def __init__(self, vllm_config: VllmConfig, num_gpu_blocks: int) -> None:
        scheduler_config = vllm_config.scheduler_config
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = vllm_config.cache_config.block_size
        if num_gpu_blocks * self.block_size < self.max_model_len:
            # NOTE: otherwise one request of max_model_len tokens could never fit and would be preempted forever.
            raise ValueError(
                f"The KV cache holds {num_gpu_blocks} blocks of {self.block_size} tokens "
                f"({num_gpu_blocks * self.block_size} tokens), fewer than max_model_len={self.max_model_len}: "
                f"lower --max-model-len to at most that, or give the KV cache more memory "
                f"(at least {cdiv(self.max_model_len, self.block_size)} blocks).")
        self.kv_cache_manager = KVCacheManager(num_gpu_blocks, self.block_size, self.max_model_len,
                                               enable_caching=bool(vllm_config.cache_config.enable_prefix_caching))

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests the runner holds that must be dropped at the next step.
        self.finished_req_ids: set[str] = set()
        # Aborted requests reported in the next EngineCoreOutputs.finished_requests.
        self._aborted_req_ids: set[str] = set()
        self._step_num_preemptions = 0
        # Pause (set by EngineCore): `halted` schedules nothing, the requests keep their blocks and places (pause
        # mode "keep", or a weight update in progress); `hold_new` keeps requests added meanwhile in `held`, out
        # of `waiting`, until `release_held()` (every pause mode).
        self.halted = False
        self.hold_new = False
        self.held: deque[Request] = deque()

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id!r}"
        assert request.num_prompt_tokens + 1 <= self.max_model_len, "checked by the input processor"
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        (self.held if self.hold_new else self.waiting).append(request)

    def release_held(self) -> None:
        """Resume: the requests held while paused join `waiting`, after those that were there."""
        self.hold_new = False
        self.waiting.extend(self.held)
        self.held.clear()

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish requests from outside the step loop (aborts). Unknown or already finished ids are ignored."""
        assert RequestStatus.is_finished(finished_status)
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        finished: list[Request] = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.finished_req_ids.add(req_id)
                finished.append(request)
            elif request in self.held:
                self.held.remove(request)
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)
            if finished_status == RequestStatus.FINISHED_ABORTED:
                self._aborted_req_ids.add(req_id)
        if finished:
            gone = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in gone]

    def get_num_unfinished_requests(self) -> int:
        """Requests that can be scheduled (running or waiting; not those held while paused)."""
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_work(self) -> bool:
        """Whether `schedule()` would schedule tokens: requests to run and not halted."""
        return not self.halted and self.has_unfinished_requests()

    def has_finished_requests(self) -> bool:
        """Whether some finished request ids still have to reach the runner."""
        return bool(self.finished_req_ids)

    def has_requests(self) -> bool:
        """Whether a step is due: tokens to schedule, or finished ids the runner must drop."""
        return self.has_work() or self.has_finished_requests()

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        if self.halted:
            # Nothing runs; the runner still drops what finished (aborts while paused).
            self._step_num_preemptions = 0
            halted_output = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
                                            num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                                            finished_req_ids=self.finished_req_ids)
            self.finished_req_ids = set()
            return halted_output
        token_budget = self.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        cached_reqs = CachedRequestData()
        new_reqs: list[NewRequestData] = []
        num_preempted = 0

        # NOTE: the running loop runs for every running request in every step, so its lookups are hoisted.
        running = self.running
        tracks_placeholders = self.tracks_output_placeholders
        max_model_len = self.max_model_len
        kv_cache_manager = self.kv_cache_manager
        req_to_blocks = kv_cache_manager.req_to_blocks
        block_size = self.block_size
        append_cached_id = cached_reqs.req_ids.append
        append_cached_blocks = cached_reqs.new_block_ids.append
        append_cached_computed = cached_reqs.num_computed_tokens.append
        req_index = 0
        while req_index < len(running) and token_budget > 0:
            request = running[req_index]
            num_computed_tokens = request.num_computed_tokens
            # The request's tokens as the runner will have them: its own and its placeholders (0 when not tracked).
            num_tokens = len(request.all_token_ids)
            if tracks_placeholders:
                placeholders = request.num_output_placeholders
                if placeholders:
                    num_tokens += placeholders
                    # NOTE: max_num_tokens (prompt + max_tokens) tests num_output_tokens + placeholders >= max_tokens.
                    if num_tokens >= max_model_len or num_tokens >= request.max_num_tokens:
                        # Its in-flight tokens finish it: not scheduled again.
                        req_index += 1
                        continue
            # NOTE: _num_new_tokens inlined (a call less per running request): keep the two the same.
            num_new_tokens = num_tokens - num_computed_tokens
            if num_new_tokens > token_budget:
                num_new_tokens = token_budget
            if num_new_tokens > max_model_len - num_computed_tokens:
                num_new_tokens = max_model_len - num_computed_tokens
            if num_new_tokens <= 0:
                req_index += 1
                continue
            req_id = request.request_id
            blocks = req_to_blocks.get(req_id)
            if blocks is not None and num_computed_tokens + num_new_tokens <= len(blocks) * block_size:
                # NOTE: the decode fast path: the held blocks already have room for the new tokens (a request
                # holds cdiv(n, block_size) blocks), so allocate_slots would allocate nothing and return [].
                new_block_ids: list[int] | None = []
            else:
                while True:
                    new_block_ids = kv_cache_manager.allocate_slots(request, num_new_tokens)
                    if new_block_ids is not None:
                        break
                    preempted = running.pop()
                    self._preempt(preempted)
                    num_preempted += 1
                    if preempted is request:
                        break
                if new_block_ids is None:
                    break
            num_scheduled_tokens[req_id] = num_new_tokens
            append_cached_id(req_id)
            append_cached_blocks(new_block_ids)
            append_cached_computed(num_computed_tokens)
            # NOTE: advanced here, after its old value went into the output; preemption only takes requests
            # after this one in `running`, never one already scheduled.
            num_computed_tokens += num_new_tokens
            request.num_computed_tokens = num_computed_tokens
            if tracks_placeholders and num_computed_tokens == num_tokens:
                # It samples in this step: one more placeholder.
                request.num_output_placeholders += 1
            token_budget -= num_new_tokens
            req_index += 1

        if num_preempted == 0:
            while self.waiting and token_budget > 0 and len(running) < self.max_num_seqs:
                request = self.waiting[0]
                # Prefix caching: start after the longest cached run of its leading full blocks (none: []).
                hit_blocks = kv_cache_manager.get_computed_blocks(request)
                num_hit_tokens = len(hit_blocks) * block_size
                request.num_computed_tokens = num_hit_tokens
                num_new_tokens = self._num_new_tokens(request, token_budget)
                assert num_new_tokens > 0
                if kv_cache_manager.allocate_slots(request, num_new_tokens, hit_blocks) is None:
                    request.num_computed_tokens = 0
                    break
                kv_cache_manager.record_admission(request, num_hit_tokens)
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit_tokens
                self.waiting.popleft()
                running.append(request)
                request.status = RequestStatus.RUNNING
                num_scheduled_tokens[request.request_id] = num_new_tokens
                new_reqs.append(NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=kv_cache_manager.get_block_ids(request.request_id),
                    num_computed_tokens=request.num_computed_tokens,
                    client_index=request.client_index,
                    eos_token_id=request.eos_token_id,
                ))
                request.num_computed_tokens += num_new_tokens
                if tracks_placeholders and (request.num_computed_tokens
                                            == len(request.all_token_ids) + request.num_output_placeholders):
                    request.num_output_placeholders += 1
                token_budget -= num_new_tokens

        total_num_scheduled_tokens = self.max_num_batched_tokens - token_budget
        assert len(running) <= self.max_num_seqs
        assert total_num_scheduled_tokens == sum(num_scheduled_tokens.values())
        self._step_num_preemptions = num_preempted

        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total_num_scheduled_tokens,
            finished_req_ids=self.finished_req_ids,
        )
        self.finished_req_ids = set()
        return scheduler_output

    def _num_new_tokens(self, request: Request, token_budget: int) -> int:
        """Tokens to compute for `request` this step (<= 0: none): its uncomputed tokens (placeholders count as
        tokens), capped by the budget and by max_model_len; none when its placeholders already reach max_tokens or
        max_model_len (they finish it). (Inlined in schedule's running loop: keep the two the same.)"""
        placeholders = request.num_output_placeholders
        if placeholders and (request.num_output_tokens + placeholders >= request.max_tokens
                             or request.num_tokens + placeholders >= self.max_model_len):
            return 0
        return min(request.num_tokens + placeholders - request.num_computed_tokens, token_budget,
                   self.max_model_len - request.num_computed_tokens)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.finished_req_ids.add(request.request_id)

    # ------------------------------------------------------------------ outputs

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        logprobs = model_runner_output.logprobs
        sampling_masks = model_runner_output.sampling_masks
        pending_masks = model_runner_output.pending_masks
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        # NOTE: no per-request slices of logprobs or masks: the rows stay in the step's arrays (StepLogprobs,
        # StepMasks). The loop records per output only its runner row, its token count and its request; which
        # outputs carry logprobs or masks is sorted out with numpy after it (_step_rows).
        track_rows = logprobs is not None or sampling_masks is not None or pending_masks is not None
        out_rows: list[int] = []
        out_nums: list[int] = []
        out_reqs: list[Request] = []

        # NOTE: this loop runs for every scheduled request in every step, so its lookups are hoisted.
        get_request = self.requests.get
        req_id_to_index = model_runner_output.req_id_to_index
        sampled_token_ids = model_runner_output.sampled_token_ids
        tracks_placeholders = self.tracks_output_placeholders
        max_model_len = self.max_model_len
        append_output = outputs.append
        append_row, append_num, append_req = out_rows.append, out_nums.append, out_reqs.append
        for req_id in scheduler_output.num_scheduled_tokens:
            request = get_request(req_id)
            if request is None:
                continue
            status = request.status
            if status > _LAST_UNFINISHED:
                # Aborted (or otherwise finished) after this step was scheduled.
                continue
            req_idx = req_id_to_index[req_id]
            sampled = sampled_token_ids[req_idx]
            was_running = status == _RUNNING
            # Whether the step's sampled tokens become the request's output tokens.
            if tracks_placeholders:
                if not sampled:
                    continue
                placeholders = request.num_output_placeholders - len(sampled)
                assert placeholders >= 0, f"request {req_id!r} sampled in a step it was not expected to"
                request.num_output_placeholders = placeholders
                # NOTE: a request preempted while this step was in flight gets its token too.
                if not (was_running or status == _PREEMPTED):
                    continue
            elif not (was_running and sampled and request.num_computed_tokens >= len(request.all_token_ids)):
                # NOTE: a partial prefill has num_computed_tokens < num_tokens; anything it sampled is discarded.
                continue

            new_token_ids, finished = append_sampled(request, sampled, max_model_len)
            if track_rows:
                append_row(req_idx)
                append_num(len(new_token_ids))
                append_req(request)
            if finished:
                stopped.append(request)
                if not was_running:
                    self.waiting.remove(request)
                append_output(EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_token_ids,
                    finish_reason=request.get_finished_reason(),
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                ))
            elif request.num_cached_tokens > 0 and len(request.output_token_ids) == len(new_token_ids):
                # Its first output carries its prefix-cache hit (the frontend keeps it; the final one repeats it).
                append_output(EngineCoreOutput(req_id, new_token_ids, num_cached_tokens=request.num_cached_tokens))
            else:
                # NOTE: an unfinished request has no finish reason and no stop reason (only check_stop sets one,
                # when it finishes the request); the other fields keep their defaults.
                append_output(EngineCoreOutput(req_id, new_token_ids))

        if stopped:
            for request in stopped:
                self.finished_req_ids.add(request.request_id)
                self._free_request(request)
            gone = {id(r) for r in stopped}
            self.running = [r for r in self.running if id(r) not in gone]

        step_logprobs = step_masks = None
        mask_sizes: list[int] = []
        num_overflow_rows = 0
        prompt_logprobs = model_runner_output.prompt_logprobs_dict
        if prompt_logprobs:
            # A request's prompt logprobs complete in the step where it first samples, which gives it an output.
            for out in outputs:
                out.new_prompt_logprobs = prompt_logprobs.get(out.request_id)
        if out_rows:
            step_logprobs, step_masks, mask_sizes, num_overflow_rows = self._step_rows(
                model_runner_output, out_rows, out_nums, out_reqs)
        if pending_masks is not None and step_masks is None:
            pending_masks.release()  # no output carries them: nothing will build them
        aborted = self._aborted_req_ids or None
        self._aborted_req_ids = set()
        return EngineCoreOutputs(
            outputs=outputs,
            scheduler_stats=self.make_stats(mask_sizes, num_overflow_rows),
            finished_requests=aborted,
            step_logprobs=step_logprobs,
            step_masks=step_masks,
        )

    @staticmethod
    def _step_rows(model_runner_output: ModelRunnerOutput, out_rows: list[int], out_nums: list[int],
                   out_reqs: list[Request]
                   ) -> tuple[StepLogprobs | None, StepMasks | PendingStepMasks | None, list[int], int]:
        """The step's logprobs and masks with the positions each output carries, the mask sizes of the carried
        positions and how many of them overflow their request's top_k.

        Output r (in output order) got `out_nums[r]` tokens from runner row `out_rows[r]`, for request
        `out_reqs[r]`; it carries logprobs when the step has them and its request wants them, and masks
        likewise. Its first position is `cu_num_generated_tokens[row]` (the row itself without it). Deferred masks
        (`pending_masks`, one position per row) give a PendingStepMasks and no sizes yet (its `resolve()` does).
        """
        logprobs = model_runner_output.logprobs
        sampling_masks = model_runner_output.sampling_masks
        pending_masks = model_runner_output.pending_masks
        rows = np.array(out_rows, dtype=np.int64)
        nums = np.array(out_nums, dtype=np.int64)
        # NOTE: the runner's per-row settings (numpy gathers at the outputs' rows); outputs built by hand (tests,
        # tools/profiling/host_step.py) have none, and take each request's, aligned with the outputs.
        settings, at = model_runner_output.row_settings, rows
        if settings is None:
            settings, at = _request_row_settings(out_reqs), np.arange(len(out_reqs))
        step_logprobs = step_masks = None
        if logprobs is not None:
            out_index = np.flatnonzero(settings.wants_logprobs[at])
            out_index = out_index.astype(np.int64, copy=False)
            if len(out_index):
                step_logprobs = StepLogprobs(logprobs, out_index,
                                             _first_positions(logprobs.cu_num_generated_tokens, rows[out_index]),
                                             nums[out_index])
        mask_sizes: list[int] = []
        num_overflow_rows = 0
        if sampling_masks is not None or pending_masks is not None:
            out_index = np.flatnonzero(settings.wants_mask[at])
            out_index = out_index.astype(np.int64, copy=False)
            if len(out_index):
                top_k = settings.top_k[at[out_index]].astype(np.int64)
                cu = None if sampling_masks is None else sampling_masks.cu_num_generated_tokens
                positions = (out_index, _first_positions(cu, rows[out_index]), nums[out_index])
                if sampling_masks is None:
                    step_masks = PendingStepMasks(pending_masks, *positions, top_k)
                else:
                    step_masks = StepMasks(sampling_masks, model_runner_output.sampling_mask_text, *positions)
                    mask_sizes, num_overflow_rows = step_mask_stats(step_masks, top_k)
        return step_logprobs, step_masks, mask_sizes, num_overflow_rows

    def make_stats(self, sampling_mask_sizes: list[int] | None = None,
                   num_sampling_mask_overflow_rows: int = 0) -> SchedulerStats:
        """Current queue sizes and KV usage; `num_preemptions` counts the preemptions of the last step, the prefix
        cache's queries and hits those since the last stats were made."""
        prefix = self.kv_cache_manager.make_prefix_cache_stats()
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.held),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=self._step_num_preemptions,
            sampling_mask_sizes=sampling_mask_sizes if sampling_mask_sizes is not None else [],
            num_sampling_mask_overflow_rows=num_sampling_mask_overflow_rows,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
        )

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached block (vLLM's semantics): False while requests hold blocks, unless
        `reset_running_requests`, which first preempts every running request (each resumes later, recomputing its
        KV; they keep their places, in order). The caller makes sure no step is in flight."""
        if reset_running_requests:
            self.preempt_running()
        return self.kv_cache_manager.reset_prefix_cache()

    def preempt_running(self) -> None:
        """Preempt every running request (blocks freed; each resumes later, recomputing its KV, in its place). The
        caller makes sure no step is in flight."""
        while self.running:
            self._preempt(self.running.pop())


def _request_row_settings(reqs: list[Request]) -> StepRowSettings:
    """StepRowSettings read from each request (one row per request), for runner outputs built without them."""
    return StepRowSettings(np.array([r.wants_logprobs for r in reqs], dtype=bool),
                           np.array([r.wants_sampling_mask for r in reqs], dtype=bool),
                           np.array([r.sampling_params.top_k for r in reqs], dtype=np.int64))


def _first_positions(cu_num_generated_tokens: list[int] | np.ndarray | None, rows: np.ndarray) -> np.ndarray:
    """[len(rows)] int64: the first position of each runner row (the row itself when each row has one)."""
    if cu_num_generated_tokens is None:
        return rows
    return np.asarray(cu_num_generated_tokens, dtype=np.int64)[rows]
