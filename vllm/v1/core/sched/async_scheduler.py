"""AsyncScheduler: schedules step N+1 before step N's sampled tokens are known (async scheduling).

A request that samples in a scheduled step gets an output placeholder: a token that exists on the device
(the runner feeds it into the next step's input ids) but not yet here. The next step already schedules it,
as if the request had `num_tokens + placeholders` tokens. When the step's output arrives, its tokens replace
the placeholders.

Invariants (on top of Scheduler's):
- `num_output_placeholders(req) == ` the number of scheduled steps not yet processed in which the request
  samples; with the engine's two-deep batch queue it is 0, 1 or 2.
- A request that stopped in step N was computed once more in N+1; that token is discarded (the request is
  gone from `requests` when N+1's output arrives).
- A request preempted while one of its steps is in flight gets that step's token when it arrives (possibly
  finishing it while it waits); it is resumed only after that (preemption blocks admission in its own step).
- A request whose in-flight tokens reach max_tokens or max_model_len is not scheduled again: they finish it.
"""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus


class AsyncScheduler(Scheduler):
    def __init__(self, vllm_config: VllmConfig, num_gpu_blocks: int) -> None:
        super().__init__(vllm_config, num_gpu_blocks)
        self._num_output_placeholders: dict[str, int] = {}

    def num_output_placeholders(self, request: Request) -> int:
        return self._num_output_placeholders.get(request.request_id, 0)

    def _num_new_tokens(self, request: Request, token_budget: int) -> int:
        placeholders = self.num_output_placeholders(request)
        if placeholders and (request.num_output_tokens + placeholders >= request.max_tokens
                             or request.num_tokens + placeholders >= self.max_model_len):
            return 0
        return min(request.num_tokens + placeholders - request.num_computed_tokens, token_budget,
                   self.max_model_len - request.num_computed_tokens)

    def _update_after_schedule(self, scheduled: list[Request], num_scheduled_tokens: dict[str, int]) -> None:
        super()._update_after_schedule(scheduled, num_scheduled_tokens)
        for request in scheduled:
            placeholders = self.num_output_placeholders(request)
            if request.num_computed_tokens == request.num_tokens + placeholders:
                self._num_output_placeholders[request.request_id] = placeholders + 1

    def _accept_sampled(self, request: Request, sampled: list[int]) -> bool:
        if not sampled:
            return False
        placeholders = self.num_output_placeholders(request) - len(sampled)
        assert placeholders >= 0, f"request {request.request_id!r} sampled in a step it was not expected to"
        if placeholders:
            self._num_output_placeholders[request.request_id] = placeholders
        else:
            self._num_output_placeholders.pop(request.request_id, None)
        return request.status in (RequestStatus.RUNNING, RequestStatus.PREEMPTED)

    def _free_request(self, request: Request) -> None:
        self._num_output_placeholders.pop(request.request_id, None)
        super()._free_request(request)
