"""Parallel sampling (`SamplingParams.n > 1`): one user request fans out into n engine-core child requests.

The frontend validates and tokenizes the parent request once; `ParentRequest.make_child_requests()` builds the
n children that the engine core runs as ordinary independent requests, and the OutputProcessor folds the
children's CompletionOutputs back into RequestOutputs that carry the parent's request id.

Invariants (vLLM v1's behaviour):
- Child i has request id `f"{i}_{parent_id}"`, `n=1`, and `CompletionOutput.index == i`; with a parent seed s it
  samples with seed `s + i` (so child 0 reproduces the single request with seed s); without a seed every child
  draws from the engine's random state.
- FINAL_ONLY: exactly one RequestOutput, once every child has finished, with all n outputs sorted by index.
- CUMULATIVE / DELTA: per engine step one RequestOutput holding only the children with something new in that
  step (sorted by index; each cumulative or delta as asked); `finished` is True only on the output in which the
  last child finishes.
- Aborting the parent aborts every child that is still running.
"""

from __future__ import annotations

import copy
from collections.abc import Container, Iterator
from typing import TYPE_CHECKING, Any

import msgspec

from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import EngineCoreRequest

if TYPE_CHECKING:
    from vllm.v1.engine.output_collector import OutputQueue


def child_request_id(index: int, parent_request_id: str) -> str:
    return f"{index}_{parent_request_id}"


def child_sampling_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parent's params with n=1 and, when the parent is seeded, seed + index; prompt logprobs (the same for
    every child) are computed by child 0 only.

    NOTE: a copy, not `msgspec.structs.replace`, which validates every child again (half the cost of an n=16384
    fan-out); the parent's seed + n - 1 was checked to fit when the parent was validated."""
    child = copy.copy(params)
    child.n = 1
    if params.seed is not None:
        child.seed = params.seed + index
    if index > 0:
        child.prompt_logprobs = None
    return child


class ParentRequest:
    """Frontend state of one n > 1 request: which children still run and what they have produced."""

    def __init__(self, request: EngineCoreRequest, prompt: str | None, queue: OutputQueue | None = None) -> None:
        params = request.sampling_params
        if params.n < 2:
            raise ValueError(f"A parent request needs n >= 2, got n={params.n}.")
        self.request = request
        self.request_id = request.request_id
        self.n = params.n
        self.output_kind = params.output_kind
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        # Where the aggregated RequestOutputs go (AsyncLLM); None: returned from `process_outputs`.
        self.queue = queue
        self.child_request_ids = [child_request_id(i, self.request_id) for i in range(self.n)]
        self.unfinished_children: set[str] = set(self.child_request_ids)
        # FINAL_ONLY: each child's final output, by index.
        self.final_outputs: list[CompletionOutput | None] = [None] * self.n
        # Streaming: this step's new outputs, by index (flushed by `take_request_output`).
        self.pending: dict[int, CompletionOutput] = {}
        self.num_cached_tokens = 0
        # Child 0's prompt logprobs once they arrived (RequestState.set_prompt_logprobs); DELTA: until sent once.
        self.prompt_logprobs: Any = None
        # Some children were never sent (see drop_unregistered): the final output may bring no new completion.
        self.dropped_children = False

    def iter_child_requests(self) -> Iterator[EngineCoreRequest]:
        for i, req_id in enumerate(self.child_request_ids):
            yield msgspec.structs.replace(self.request, request_id=req_id,
                                          sampling_params=child_sampling_params(self.request.sampling_params, i))

    def make_child_requests(self) -> list[EngineCoreRequest]:
        return list(self.iter_child_requests())

    def drop_unregistered(self, registered: Container[str]) -> bool:
        """Forget the children not in `registered` (an abort before all were sent): they never ran and report
        nothing. True if some were dropped."""
        dropped = [c for c in self.unfinished_children if c not in registered]
        self.unfinished_children.difference_update(dropped)
        self.dropped_children = self.dropped_children or bool(dropped)
        return bool(dropped)

    @property
    def finished(self) -> bool:
        return not self.unfinished_children

    def add_child_output(self, child_id: str, completion: CompletionOutput, num_cached_tokens: int = 0) -> None:
        """Record a child's new CompletionOutput (its `index` already set to the child's index)."""
        if child_id not in self.unfinished_children:
            # NOTE: a child finished and reported earlier (e.g. ended by a stop string) is never reported twice.
            return
        self.num_cached_tokens = max(self.num_cached_tokens, num_cached_tokens)
        if completion.finished():
            self.unfinished_children.discard(child_id)
        if self.output_kind == RequestOutputKind.FINAL_ONLY:
            self.final_outputs[completion.index] = completion
        else:
            self.pending[completion.index] = completion

    def take_request_output(self) -> RequestOutput | None:
        """The RequestOutput for what was recorded since the last call, or None when there is nothing to send."""
        if self.output_kind == RequestOutputKind.FINAL_ONLY:
            if not self.finished:
                return None
            outputs = [c for c in self.final_outputs if c is not None]
        else:
            if not self.pending and not (self.finished and self.dropped_children):
                return None
            outputs = [self.pending[i] for i in sorted(self.pending)]
            self.pending = {}
        prompt_logprobs = self.prompt_logprobs
        if self.output_kind == RequestOutputKind.DELTA:
            self.prompt_logprobs = None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
        )
