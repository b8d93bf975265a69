"""SchedulerOutput: what the scheduler tells the model runner to compute in one step.

A request first appears in `scheduled_new_reqs` (also when it resumes after preemption: its block table and
token ids are sent whole again); later steps list it in `scheduled_cached_reqs` with only the blocks added.
`finished_req_ids` are requests the runner must drop from its persistent batch (finished or preempted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    # Output tokens generated before a preemption (recomputed like the prompt); empty for a new request.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # The API server that sent it (EngineCoreRequest.client_index).
    client_index: int = 0
    # The request's EOS token (banned before min_tokens output tokens, with its stop token ids).
    eos_token_id: int | None = None


@dataclass(slots=True)
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    # Blocks appended to each request's table this step (possibly empty).
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> number of tokens computed for it this step.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
