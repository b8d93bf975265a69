"""Scheduler: decides which requests compute how many tokens each step, and turns sampled tokens into outputs.

There are no prefill/decode phases. Each step, every running request (in arrival order) is given
`num_tokens - num_computed_tokens` tokens, capped by the remaining token budget, so chunked prefill and decode
are the same thing. When the KV cache cannot hold a running request's new tokens, the last running request is
preempted (its blocks freed, recomputed from scratch later) until it fits. Waiting requests are admitted only
in steps without a preemption, first come first served.

Invariants:
- `running` holds RUNNING requests, `waiting` holds WAITING or PREEMPTED ones; a finished request is in neither
  and no longer in `requests`.
- Per step: `len(running) <= max_num_seqs`, `total_num_scheduled_tokens <= max_num_batched_tokens`, and for
  every request `num_computed_tokens + num_scheduled <= max_model_len`.
- The runner is told (through `finished_req_ids`) about every request it holds that finished, was aborted or
  was preempted, in the next SchedulerOutput; it is never told about a request it never saw.
- `num_computed_tokens` is advanced in `schedule()`; the runner receives the value from before the step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_manager import KVCacheManager, cdiv
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.core.sched.utils import check_stop
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from vllm.v1.outputs import ModelRunnerOutput, StepLogprobs, StepMasks
from vllm.v1.request import Request, RequestStatus


class Scheduler:
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
        self.kv_cache_manager = KVCacheManager(num_gpu_blocks, self.block_size, self.max_model_len)

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests the runner holds that must be dropped at the next step.
        self.finished_req_ids: set[str] = set()
        # Aborted requests reported in the next EngineCoreOutputs.finished_requests.
        self._aborted_req_ids: set[str] = set()
        self._step_num_preemptions = 0

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id!r}"
        assert request.num_prompt_tokens + 1 <= self.max_model_len, "checked by the input processor"
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

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
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        """Whether some finished request ids still have to reach the runner."""
        return bool(self.finished_req_ids)

    def has_requests(self) -> bool:
        return self.has_unfinished_requests() or self.has_finished_requests()

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        token_budget = self.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        cached_reqs = CachedRequestData()
        new_reqs: list[NewRequestData] = []
        scheduled: list[Request] = []
        num_preempted = 0

        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = self._num_new_tokens(request, token_budget)
            if num_new_tokens <= 0:
                req_index += 1
                continue
            while True:
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
                if new_block_ids is not None:
                    break
                preempted = self.running.pop()
                self._preempt(preempted)
                num_preempted += 1
                if preempted is request:
                    break
            if new_block_ids is None:
                break
            scheduled.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            cached_reqs.req_ids.append(request.request_id)
            cached_reqs.new_block_ids.append(new_block_ids)
            cached_reqs.num_computed_tokens.append(request.num_computed_tokens)
            token_budget -= num_new_tokens
            req_index += 1

        if num_preempted == 0:
            while self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                num_new_tokens = self._num_new_tokens(request, token_budget)
                assert num_new_tokens > 0
                if self.kv_cache_manager.allocate_slots(request, num_new_tokens) is None:
                    break
                self.waiting.popleft()
                self.running.append(request)
                request.status = RequestStatus.RUNNING
                scheduled.append(request)
                num_scheduled_tokens[request.request_id] = num_new_tokens
                new_reqs.append(NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                    num_computed_tokens=request.num_computed_tokens,
                ))
                token_budget -= num_new_tokens

        total_num_scheduled_tokens = self.max_num_batched_tokens - token_budget
        assert len(self.running) <= self.max_num_seqs
        assert total_num_scheduled_tokens == sum(num_scheduled_tokens.values())
        self._update_after_schedule(scheduled, num_scheduled_tokens)
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
        """Tokens to compute for `request` this step (<= 0: none)."""
        return min(request.num_tokens - request.num_computed_tokens, token_budget,
                   self.max_model_len - request.num_computed_tokens)

    def _update_after_schedule(self, scheduled: list[Request], num_scheduled_tokens: dict[str, int]) -> None:
        for request in scheduled:
            request.num_computed_tokens += num_scheduled_tokens[request.request_id]

    def _accept_sampled(self, request: Request, sampled: list[int]) -> bool:
        """Whether a step's sampled tokens for `request` become its output tokens."""
        # NOTE: a partial prefill has num_computed_tokens < num_tokens; anything it sampled is discarded.
        return (request.status == RequestStatus.RUNNING and bool(sampled)
                and request.num_computed_tokens >= request.num_tokens)

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
        mask_text = model_runner_output.sampling_mask_text
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        # NOTE: no per-request slices of logprobs or masks: the rows stay in the step's arrays (StepLogprobs,
        # StepMasks), with per output its index, its first position in the step and its position count.
        lp_out: list[int] = []
        lp_first: list[int] = []
        lp_num: list[int] = []
        mask_out: list[int] = []
        mask_first: list[int] = []
        mask_num: list[int] = []
        mask_top_k: list[int] = []
        lp_cu = logprobs.cu_num_generated_tokens if logprobs is not None else None
        cu = sampling_masks.cu_num_generated_tokens if sampling_masks is not None else None

        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                # Aborted (or otherwise finished) after this step was scheduled.
                continue
            req_idx = model_runner_output.req_id_to_index[req_id]
            sampled = model_runner_output.sampled_token_ids[req_idx]
            was_running = request.status == RequestStatus.RUNNING
            if not self._accept_sampled(request, sampled):
                continue

            new_token_ids: list[int] = []
            for token_id in sampled:
                request.append_output_token_ids(token_id)
                new_token_ids.append(token_id)
                if check_stop(request, self.max_model_len):
                    break
            num_new = len(new_token_ids)
            params = request.sampling_params

            if logprobs is not None and params.logprobs is not None:
                lp_out.append(len(outputs))
                lp_first.append(lp_cu[req_idx] if lp_cu is not None else req_idx)
                lp_num.append(num_new)
            if sampling_masks is not None and params.return_sampling_mask is not False:
                mask_out.append(len(outputs))
                mask_first.append(cu[req_idx] if cu is not None else req_idx)
                mask_num.append(num_new)
                mask_top_k.append(params.top_k)

            if request.is_finished():
                stopped.append(request)
                if not was_running:
                    self.waiting.remove(request)
            outputs.append(EngineCoreOutput(
                request_id=req_id,
                new_token_ids=new_token_ids,
                finish_reason=request.get_finished_reason(),
                stop_reason=request.stop_reason,
                num_cached_tokens=0,
            ))

        if stopped:
            for request in stopped:
                self.finished_req_ids.add(request.request_id)
                self._free_request(request)
            gone = {id(r) for r in stopped}
            self.running = [r for r in self.running if id(r) not in gone]

        step_logprobs = None
        if lp_out:
            assert logprobs is not None
            step_logprobs = StepLogprobs(logprobs, np.array(lp_out, dtype=np.int64),
                                         np.array(lp_first, dtype=np.int64), np.array(lp_num, dtype=np.int64))
        step_masks = None
        mask_sizes: list[int] = []
        num_overflow_rows = 0
        if mask_out:
            assert sampling_masks is not None
            step_masks = StepMasks(sampling_masks, mask_text, np.array(mask_out, dtype=np.int64),
                                   np.array(mask_first, dtype=np.int64), np.array(mask_num, dtype=np.int64))
            sizes = step_masks.sizes()
            top_k = np.repeat(np.array(mask_top_k, dtype=np.int64), step_masks.num_pos)
            num_overflow_rows = int(((top_k > 0) & (sizes > top_k)).sum())
            mask_sizes = sizes.tolist()
        aborted = self._aborted_req_ids or None
        self._aborted_req_ids = set()
        return EngineCoreOutputs(
            outputs=outputs,
            scheduler_stats=self.make_stats(mask_sizes, num_overflow_rows),
            finished_requests=aborted,
            step_logprobs=step_logprobs,
            step_masks=step_masks,
        )

    def make_stats(self, sampling_mask_sizes: list[int] | None = None,
                   num_sampling_mask_overflow_rows: int = 0) -> SchedulerStats:
        """Current queue sizes and KV usage; `num_preemptions` counts the preemptions of the last step."""
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=self._step_num_preemptions,
            sampling_mask_sizes=sampling_mask_sizes if sampling_mask_sizes is not None else [],
            num_sampling_mask_overflow_rows=num_sampling_mask_overflow_rows,
        )
