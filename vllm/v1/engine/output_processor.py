"""OutputProcessor: EngineCoreOutputs -> RequestOutputs (detokenize, stop strings, logprobs, sampling masks).

Runs in the frontend process. Per request it keeps the output token ids (in the detokenizer), the logprob dicts
and the sampling masks, and builds a RequestOutput per step according to `SamplingParams.output_kind`
(CUMULATIVE: everything so far; DELTA: only what is new; FINAL_ONLY: one output when the request finishes).

Invariants:
- Token ids, logprob dicts and masks stay aligned 1:1: `len(masks) == len(token_ids)` (and the same for logprobs
  when requested), also when a stop string ends a request in the middle of a multi-token step.
- Masks are appended from each step's `SamplingMaskLists` / `SamplingMaskText` slice to the request's
  MaskAccumulator (the id rows as the views they came in, the texts written into a few blocks) and handed over as
  a SamplingMask (lists per token only when `SamplingMask.token_ids` is read); a request returns masks when its
  engine-core outputs carry them (the engine flag is on and the request did not opt out).
- A request finished by a stop string in the frontend (the engine core still runs it) is listed in
  `reqs_to_abort`; a finished request's state is dropped at once, later outputs for it are ignored.
- An n > 1 request is tracked as n child states (engine-core ids `f"{i}_{request_id}"`) plus one ParentRequest
  (vllm/v1/engine/parallel_sampling.py) that folds the children's outputs of a step into one RequestOutput under
  the user's request id.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm.outputs import CompletionOutput, RequestOutput, SamplingMask
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.transformers_utils.tokenizer import Tokenizer
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.detokenizer import IncrementalDetokenizer
from vllm.v1.engine.logprobs import LogprobsProcessor, make_prompt_logprobs
from vllm.v1.engine.mask_accumulator import MaskAccumulator
from vllm.v1.engine.output_collector import OutputQueue, RequestOutputCollector
from vllm.v1.engine.parallel_sampling import ParentRequest


_STOP = FinishReason.STOP  # a module constant: no enum attribute lookup per output


@dataclass(slots=True)
class RequestStateStats:
    """Per-request timings, kept when log_stats is on (seconds; arrival is wall clock, the rest monotonic)."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0


@dataclass(slots=True)
class OutputProcessorOutput:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Requests finished here by a stop string that the engine core still runs and must abort.
    reqs_to_abort: list[str] = field(default_factory=list)


class RequestState:
    """Everything the frontend keeps for one running request."""

    def __init__(self, request: EngineCoreRequest, prompt: str | None, tokenizer: Tokenizer | None,
                 queue: OutputQueue | None, log_stats: bool, parent: ParentRequest | None = None,
                 index: int = 0, sibling: RequestState | None = None) -> None:
        self.request_id = request.request_id
        # The n > 1 request this one is child `index` of (None for an ordinary request).
        self.parent = parent
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.params: SamplingParams = request.sampling_params
        self.output_kind = self.params.output_kind
        # NOTE: the kind's tests once, not an enum lookup and comparison per step.
        self.delta = self.output_kind == RequestOutputKind.DELTA
        self.final_only = self.output_kind == RequestOutputKind.FINAL_ONLY
        # NOTE: an n > 1 request's children share their prompt's decoding start (`sibling`: one made before).
        self.detokenizer = IncrementalDetokenizer.from_new_request(
            tokenizer, request, None if sibling is None else sibling.detokenizer)
        self.logprobs_processor = LogprobsProcessor.from_new_request(tokenizer, self.params)
        # The output tokens' masks not handed out yet (DELTA: those of the tokens since the last output).
        self.masks = MaskAccumulator(self.request_id)
        self.queue = queue
        # A streamed request of its own into a collector: its steps go to the queue unbuilt (put_step).
        self.steps_to_queue = (self.delta and parent is None
                               and isinstance(queue, RequestOutputCollector))
        self.num_cached_tokens = 0
        # [weight version, first output token, end] spans: which weights computed which output tokens; kept only
        # once the engine's weights were named (EngineCoreOutputs.weight_version), empty until then.
        self.weight_spans: list[list[Any]] = []
        self.stats = RequestStateStats(arrival_time=request.arrival_time) if log_stats else None
        self.tokenizer = tokenizer if self.params.detokenize else None
        # RequestOutput.prompt_logprobs once the engine core sent them (DELTA: until handed out once).
        self.prompt_logprobs: Any = None

    def make_completion_output(self, new_token_ids: list[int], finish_reason: FinishReason | None,
                               stop_reason: int | str | None) -> CompletionOutput | None:
        """This step's CompletionOutput (None for FINAL_ONLY until the request finishes)."""
        finished = finish_reason is not None
        if self.final_only and not finished:
            return None
        delta = self.delta
        num_new = len(new_token_ids)
        text = self.detokenizer.get_next_output_text(finished, delta)
        lp = self.logprobs_processor
        if delta:
            token_ids = list(new_token_ids)
            logprobs = lp.last(num_new)
        else:
            token_ids = list(self.detokenizer.output_token_ids)
            logprobs = None if lp.logprobs is None else lp.logprobs[:]  # a copy (a list, or a FlatLogprobs)
        sampling_mask: SamplingMask | None = None
        masks = self.masks
        if masks.started:
            # DELTA: the masks not handed out yet are this output's tokens'. A request's last output takes its
            # buffers as they are; a cumulative output before it shares them (vllm/v1/engine/mask_accumulator.py).
            assert not delta or masks.num == num_new
            sampling_mask = masks.take(keep=not (delta or finished))
        spans = self.weight_spans or None
        if spans is not None:
            first = self.detokenizer.num_output_tokens - num_new if delta else 0  # this output's tokens from first
            spans = [[v, max(s, first), e] for v, s, e in spans if e > first]
        # NOTE: positional (index, text, token_ids, cumulative_logprob, logprobs, finish_reason, stop_reason,
        # sampling_mask, weight_versions): half the cost of keywords, once per streamed chunk.
        return CompletionOutput(self.index, text, token_ids, lp.cumulative_logprob, logprobs,
                                str(finish_reason) if finished else None, stop_reason if finished else None,
                                sampling_mask, spans)

    def make_request_output(self, new_token_ids: list[int], finish_reason: FinishReason | None,
                            stop_reason: int | str | None) -> RequestOutput | None:
        """This step's RequestOutput of a request without a parent (None when there is nothing to send)."""
        completion = self.make_completion_output(new_token_ids, finish_reason, stop_reason)
        if completion is None:
            return None
        # NOTE: positional (request_id, prompt, prompt_token_ids, prompt_logprobs, outputs, finished,
        # num_cached_tokens, metrics), as CompletionOutput above.
        prompt_logprobs = self.prompt_logprobs
        if self.delta:
            self.prompt_logprobs = None  # DELTA: sent with the first output after they arrive (vLLM)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, prompt_logprobs, [completion],
                             finish_reason is not None, self.num_cached_tokens, self.stats)

    def set_prompt_logprobs(self, plp: Any) -> None:
        """The engine core's PromptLogprobs as vLLM's RequestOutput.prompt_logprobs (the parent's for a child)."""
        self.prompt_logprobs = make_prompt_logprobs(plp, self.tokenizer, self.params.flat_logprobs)
        if self.parent is not None:
            self.parent.prompt_logprobs = self.prompt_logprobs

    def update_stats(self, num_new: int) -> None:
        if self.stats is None or num_new == 0:
            return
        now = time.monotonic()
        if self.stats.first_token_time is None:
            self.stats.first_token_time = now
        self.stats.last_token_time = now
        self.stats.num_generation_tokens += num_new


class OutputProcessor:
    """Turns engine-core outputs into RequestOutputs for every request the frontend tracks.

    `request_states` is keyed by engine-core request id (a child's id for n > 1); `parent_requests` by the
    user's request id of each running n > 1 request.
    """

    def __init__(self, tokenizer: Tokenizer | None, log_stats: bool) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}

    def get_num_unfinished_requests(self) -> int:
        """Running user requests (an n > 1 request counts once)."""
        return sum(1 for state in self.request_states.values() if state.parent is None) + len(self.parent_requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(self, request: EngineCoreRequest, prompt: str | None,
                    queue: OutputQueue | None = None) -> Iterator[EngineCoreRequest]:
        """Track a request; returns the engine-core requests to send: itself, or its n children when n > 1.

        With n > 1 every child shares `queue`, which gets the parent's aggregated RequestOutputs. The children are
        made and registered as the iterator is consumed (a caller can yield between them); an abort of the parent
        before the iterator is exhausted drops the children not made yet.
        """
        request_id = request.request_id
        if request_id in self.request_states or request_id in self.parent_requests:
            raise ValueError(f"Request id {request_id!r} is already running; request ids must be unique.")
        if request.sampling_params.n == 1:
            self.request_states[request_id] = RequestState(request, prompt, self.tokenizer, queue, self.log_stats)
            return iter((request,))
        parent = ParentRequest(request, prompt, queue)
        taken = [c for c in parent.child_request_ids if c in self.request_states]
        if taken:
            raise ValueError(f"Request id {taken[0]!r} (a child of {request_id!r}) is already running; request ids "
                             "must be unique.")
        self.parent_requests[request_id] = parent
        return self._register_children(parent, prompt, queue)

    def _register_children(self, parent: ParentRequest, prompt: str | None,
                           queue: OutputQueue | None) -> Iterator[EngineCoreRequest]:
        first: RequestState | None = None
        for index, child in enumerate(parent.iter_child_requests()):
            if parent.finished:
                return  # aborted while the children were being sent
            state = RequestState(child, prompt, self.tokenizer, queue, self.log_stats, parent, index, first)
            first = first or state
            self.request_states[child.request_id] = state
            yield child

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget these requests; returns the engine-core ids that were running (to abort in the engine core).

        A user request id of an n > 1 request aborts all its running children. A request with a queue gets a
        final output (finish_reason "abort") so that its consumer stops waiting.
        """
        engine_ids: list[str] = []
        touched: dict[str, ParentRequest] = {}
        for request_id in request_ids:
            parent = self.parent_requests.get(request_id)
            if parent is not None:
                engine_ids.extend(c for c in parent.child_request_ids if c in parent.unfinished_children)
                if parent.drop_unregistered(self.request_states):
                    touched[parent.request_id] = parent
            else:
                engine_ids.append(request_id)
        aborted: list[str] = []
        for request_id in engine_ids:
            state = self.request_states.pop(request_id, None)
            if state is None:
                continue
            aborted.append(request_id)
            if state.parent is not None:
                completion = state.make_completion_output([], FinishReason.ABORT, None)
                assert completion is not None
                state.parent.add_child_output(request_id, completion)
                touched[state.parent.request_id] = state.parent
            elif state.steps_to_queue:
                state.queue.put_step(state, [], FinishReason.ABORT, None)  # type: ignore[union-attr]
            elif state.queue is not None:
                output = state.make_request_output([], FinishReason.ABORT, None)
                if output is not None:
                    state.queue.put_nowait(output)
        for parent in touched.values():
            output = self._take_parent_output(parent)
            if output is not None and parent.queue is not None:
                parent.queue.put_nowait(output)
        return aborted

    def _take_parent_output(self, parent: ParentRequest) -> RequestOutput | None:
        output = parent.take_request_output()
        if parent.finished:
            self.parent_requests.pop(parent.request_id, None)
        return output

    def process_outputs(self, engine_core_outputs: list[EngineCoreOutput],
                        weight_version: str | None = None) -> OutputProcessorOutput:
        """One engine step's outputs, computed by the weights named `weight_version`."""
        result = OutputProcessorOutput()
        touched: dict[str, ParentRequest] = {}
        for eco in engine_core_outputs:
            state = self.request_states.get(eco.request_id)
            if state is None:
                # Aborted or already finished by a stop string.
                continue
            finish_reason = eco.finish_reason
            stop_reason = eco.stop_reason
            if eco.num_cached_tokens:
                state.num_cached_tokens = eco.num_cached_tokens
            if eco.new_prompt_logprobs is not None:
                state.set_prompt_logprobs(eco.new_prompt_logprobs)

            # NOTE: the step's own list, not copied: nothing below changes it (the detokenizer, the collector and
            # the outputs copy what they keep).
            new_token_ids = eco.new_token_ids
            detokenizer = state.detokenizer
            num_before = detokenizer.num_output_tokens
            stop_string = detokenizer.update(new_token_ids, finish_reason == _STOP,
                                             finish_reason is not None)
            if stop_string is not None:
                finish_reason = FinishReason.STOP
                stop_reason = stop_string
            num_kept = detokenizer.num_output_tokens - num_before
            # NOTE: spans only once the engine's weights are named (a weight update): none on the serving path.
            if num_kept and (weight_version is not None or state.weight_spans):
                spans = state.weight_spans
                if spans and spans[-1][0] == weight_version:
                    spans[-1][2] += num_kept
                else:
                    if not spans and num_before:
                        spans.append([None, 0, num_before])  # the tokens of the weights never named
                    spans.append([weight_version, num_before, num_before + num_kept])
            kept_token_ids = new_token_ids if num_kept == len(new_token_ids) else new_token_ids[:num_kept]
            state.logprobs_processor.update(eco.new_logprobs, num_kept)
            masks = state.masks
            if masks.started or eco.new_sampling_mask is not None or eco.new_sampling_mask_text is not None:
                # NOTE: a request without masks skips the call (every request, every step)
                masks.append(eco.new_sampling_mask, eco.new_sampling_mask_text, len(new_token_ids), num_kept,
                             num_before)
            state.update_stats(num_kept)

            if state.parent is not None:
                completion = state.make_completion_output(kept_token_ids, finish_reason, stop_reason)
                if completion is not None:
                    state.parent.add_child_output(eco.request_id, completion, state.num_cached_tokens)
                    touched[state.parent.request_id] = state.parent
            elif state.steps_to_queue:
                state.queue.put_step(state, kept_token_ids, finish_reason, stop_reason)  # type: ignore[union-attr]
            else:
                output = state.make_request_output(kept_token_ids, finish_reason, stop_reason)
                if output is not None:
                    self._deliver(output, state.queue, result)
            if finish_reason is not None:
                del self.request_states[eco.request_id]
                if not eco.finished:
                    result.reqs_to_abort.append(eco.request_id)
        for parent in touched.values():
            output = self._take_parent_output(parent)
            if output is not None:
                self._deliver(output, parent.queue, result)
        return result

    @staticmethod
    def _deliver(output: RequestOutput, queue: OutputQueue | None, result: OutputProcessorOutput) -> None:
        if queue is not None:
            queue.put_nowait(output)
        else:
            result.request_outputs.append(output)
