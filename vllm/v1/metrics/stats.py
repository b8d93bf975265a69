"""Per-request timing bookkeeping in the frontend, fed from engine-core outputs as they arrive.

Times are `time.monotonic()` seconds taken when the frontend receives an output, so time to first token and
end-to-end latency include queueing, the engine step and the transport back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm.v1.engine import EngineCoreOutput


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the last report (vLLM's): `queries` counts the tokens of the requests looked
    up at admission, `hits` the tokens found cached; requests resumed after a preemption are counted apart."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


@dataclass(slots=True)
class RequestTimes:
    arrival_time: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0


@dataclass(slots=True)
class FinishedRequestStats:
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float
    time_to_first_token: float | None
    # Mean time between output tokens after the first (None with fewer than two tokens).
    time_per_output_token: float | None


@dataclass(slots=True)
class IterationStats:
    """What one batch of engine-core outputs changed: new tokens and finished requests."""

    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class RequestStatsTracker:
    def __init__(self) -> None:
        self.requests: dict[str, RequestTimes] = {}

    def add_request(self, request_id: str, num_prompt_tokens: int, now: float | None = None) -> None:
        self.requests[request_id] = RequestTimes(now if now is not None else time.monotonic(), num_prompt_tokens)

    def update(self, outputs: list[EngineCoreOutput], frontend_finished: list[str],
               now: float | None = None) -> IterationStats:
        """Account the outputs; `frontend_finished` are requests a stop string ended in the frontend."""
        now = now if now is not None else time.monotonic()
        stats = IterationStats()
        for output in outputs:
            times = self.requests.get(output.request_id)
            if times is None:
                continue
            num_new = len(output.new_token_ids)
            if num_new:
                if times.first_token_time is None:
                    times.first_token_time = now
                    stats.num_prompt_tokens += times.num_prompt_tokens
                    stats.time_to_first_tokens.append(now - times.arrival_time)
                times.last_token_time = now
                times.num_generation_tokens += num_new
                stats.num_generation_tokens += num_new
            if output.finish_reason is not None:
                stats.finished.append(self._finish(output.request_id, str(output.finish_reason), now))
        for request_id in frontend_finished:
            if request_id in self.requests:
                stats.finished.append(self._finish(request_id, "stop", now))
        return stats

    def abort(self, request_ids: list[str], now: float | None = None) -> list[FinishedRequestStats]:
        now = now if now is not None else time.monotonic()
        return [self._finish(r, "abort", now) for r in request_ids if r in self.requests]

    def _finish(self, request_id: str, reason: str, now: float) -> FinishedRequestStats:
        times = self.requests.pop(request_id)
        ttft = None if times.first_token_time is None else times.first_token_time - times.arrival_time
        tpot = None
        if times.num_generation_tokens > 1 and times.first_token_time is not None:
            assert times.last_token_time is not None
            tpot = (times.last_token_time - times.first_token_time) / (times.num_generation_tokens - 1)
        return FinishedRequestStats(reason, times.num_prompt_tokens, times.num_generation_tokens,
                                    now - times.arrival_time, ttft, tpot)
