"""Request: the engine core's record of one request (token ids, progress, status).

Invariants: `all_token_ids == prompt_token_ids + output_token_ids`;
`num_computed_tokens <= num_tokens + num_output_placeholders`; a request samples in a step when the step's
tokens bring `num_computed_tokens` up to `num_tokens + num_output_placeholders`. The flags
derived from the sampling params (`min_tokens`, `stop_check_token_ids`, `wants_logprobs`,
`wants_sampling_mask`) are fixed at construction: the params of a request never change.
`num_output_placeholders` is the number of scheduled steps, not yet processed, in which the request samples
(AsyncScheduler's output placeholders); it stays 0 under the synchronous Scheduler, which never changes it.
"""

from __future__ import annotations

import enum
import time

from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreRequest, FinishReason


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASON_MAP.get(status)


_FINISHED_REASON_MAP = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        client_index: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        # The frontend (API server) that sent it: the model runner packs each client's mask texts together.
        self.client_index = client_index
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        assert sampling_params.max_tokens is not None, "max_tokens is resolved by the input processor"
        self.max_tokens: int = sampling_params.max_tokens
        # The token count (prompt and outputs) at which max_tokens finishes the request.
        self.max_num_tokens: int = len(prompt_token_ids) + self.max_tokens
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        # NOTE: plain attributes rather than read-only properties: the scheduler reads (and extends) them for
        # every running request in every step. Only append_output_token_ids and sched.utils.append_sampled
        # extend them, always both together.
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # NOTE: an attribute of the request rather than a dict in AsyncScheduler: schedule() and
        # update_from_output() read and write it for every scheduled request in every step.
        self.num_output_placeholders = 0
        self.num_preemptions = 0
        # Prefix caching (kv_cache_utils, kv_cache_manager): the salt of its first block, the digests of its full
        # blocks (computed as needed, kept across preemptions), the prompt tokens found cached when it was first
        # admitted (-1 until then), and the cache epoch it was last admitted in.
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = -1
        self.kv_epoch = 0
        # Per-request constants the scheduler's per-step loops read instead of the sampling params.
        self.min_tokens: int = sampling_params.min_tokens
        # The tokens that stop the request once it has `min_tokens` outputs: stop_token_ids, and EOS unless
        # ignore_eos (check_stop tells the two apart for stop_reason).
        stop_ids = set(sampling_params.all_stop_token_ids)
        if eos_token_id is not None and not sampling_params.ignore_eos:
            stop_ids.add(eos_token_id)
        self.stop_check_token_ids: frozenset[int] = frozenset(stop_ids)
        self.wants_logprobs: bool = sampling_params.logprobs is not None
        self.wants_sampling_mask: bool = sampling_params.return_sampling_mask is not False
        # vLLM's name: a request with prompt logprobs needs the logits of every prompt position, so a prefix cache
        # must not serve it cached blocks (vllm/v1/worker/prompt_logprobs.py refuses a prompt computed from
        # past position 0). Writing its blocks to the cache for others is fine.
        self.skip_reading_prefix_cache: bool = sampling_params.prompt_logprobs is not None

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest) -> Request:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            client_index=request.client_index,
            cache_salt=request.cache_salt,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)
